"""Why does cudaIpcOpenMemHandle of a peer's 1.9 GiB take ~12 ms in benchmarks/probes/probe_ipc_open.py
(and ~25 ms inside training) but ~0.2 ms in benchmarks/probes/probe_vmm_map.cu? The same open, timed
from Python through ctypes on the CUDA runtime (no cupy), with and without torch in each process:
the owner (a spawned process) cudaMallocs N bytes, fills them and exports the handle; the importer
opens it, reads one word (the first access), closes it.

    python3 benchmarks/probes/probe_ipc_context.py [N] [CUDART]   # CUDART: a libcudart.so (default:
                                                           # /usr/local/cuda/lib64/libcudart.so)

Result (benchmarks/results/probes/ipc-open-size_1gpu_h200_2026-11-29.log): not Python, the size. 2055368704 bytes
(980.1 pages of 2 MiB) open in ~15 ms, 2057306112 (981 pages) in ~0.2 ms, here as in C++.
"""

import ctypes
import multiprocessing as mp
import sys
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2055368704
CUDART = sys.argv[2] if len(sys.argv) > 2 else "/usr/local/cuda/lib64/libcudart.so"
ROUNDS = 3


class IpcHandle(ctypes.Structure):  # cudaIpcMemHandle_t, passed by value to the open
    _fields_ = [("reserved", ctypes.c_char * 64)]


def runtime(with_torch: bool):
    if with_torch:
        import torch

        torch.zeros(1, device="cuda")  # torch's context, allocator and streams first
    rt = ctypes.CDLL(CUDART)
    rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle, ctypes.c_uint]
    rt.cudaSetDevice(0)
    rt.cudaFree(None)
    return rt


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def owner(q, back, with_torch):
    rt = runtime(with_torch)
    for _ in range(ROUNDS):
        p = ctypes.c_void_p()
        check(rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(N)), "cudaMalloc")
        check(rt.cudaMemset(p, 7, ctypes.c_size_t(N)), "cudaMemset")
        check(rt.cudaDeviceSynchronize(), "sync")
        handle = IpcHandle()
        check(rt.cudaIpcGetMemHandle(ctypes.byref(handle), p), "cudaIpcGetMemHandle")
        q.put(bytes(handle))
        back.get()
        check(rt.cudaFree(p), "cudaFree")


def importer(q, back, with_torch, out):
    try:
        out.put(import_rounds(q, back, with_torch))
    except Exception as err:  # noqa: BLE001  (reported by the parent)
        out.put(repr(err))


def import_rounds(q, back, with_torch):
    rt = runtime(with_torch)
    rows = []
    for _ in range(ROUNDS):
        handle = IpcHandle.from_buffer_copy(q.get())
        p = ctypes.c_void_p()
        t = time.perf_counter()
        check(rt.cudaIpcOpenMemHandle(ctypes.byref(p), handle, 1), "cudaIpcOpenMemHandle")
        opened = time.perf_counter() - t
        word = ctypes.c_uint64()
        t = time.perf_counter()
        check(rt.cudaMemcpy(ctypes.byref(word), p, ctypes.c_size_t(8), 2), "cudaMemcpy")
        first = time.perf_counter() - t
        t = time.perf_counter()
        check(rt.cudaIpcCloseMemHandle(p), "cudaIpcCloseMemHandle")
        closed = time.perf_counter() - t
        rows.append((opened, first, closed, word.value == 0x0707070707070707))
        back.put("closed")
    return rows


def main():
    ctx = mp.get_context("spawn")
    print(f"# {N} bytes, {CUDART}")
    for owner_torch in (False, True):
        for importer_torch in (False, True):
            q, back, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
            a = ctx.Process(target=owner, args=(q, back, owner_torch))
            b = ctx.Process(target=importer, args=(q, back, importer_torch, out))
            a.start()
            b.start()
            rows = out.get(timeout=120)
            if isinstance(rows, str):
                print(f"owner torch={owner_torch} importer torch={importer_torch}: {rows}")
                a.terminate()
                b.terminate()
                continue
            a.join()
            b.join()
            for opened, first, closed, ok in rows:
                print(
                    f"owner torch={owner_torch!s:5} importer torch={importer_torch!s:5}  "
                    f"open {1e3 * opened:7.2f} ms  first read {1e3 * first:6.2f} ms  "
                    f"close {1e3 * closed:6.2f} ms  data {'ok' if ok else 'WRONG'}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
