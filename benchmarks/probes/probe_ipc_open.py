"""What mapping a peer's gradient accumulators costs: cudaIpcOpenMemHandle of a fresh cudaMalloc
of N bytes (another process's, on GPU 0), alone, while the owner allocates another, and beside
GPU work (40 chained 4096^2 matmuls) in a thread or inline. restore_gradient_memory() opens each
peer's new accumulators this way; the thread case says whether a background open would hide it.

    python3 benchmarks/probes/probe_ipc_open.py [N]     # needs cupy (the GPU image has it)

Result: benchmarks/results/ipc_open_1gpu_h200.log in git history (the open costs the same in a thread: the
main thread's GPU work is delayed by as much)."""

import sys
import threading
import time

import cupy.cuda.runtime as rt
import torch
import torch.multiprocessing as mp

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2 << 30
MODES = ["alone"] * 3 + ["owner_busy"] * 3 + ["thread_beside_work"] * 3 + ["inline_beside_work"] * 3


def owner(q, back, rounds):
    rt.setDevice(0)
    for _ in range(rounds):
        p = rt.malloc(N)
        rt.memset(p, 0, N)
        rt.deviceSynchronize()
        q.put(bytes(rt.ipcGetMemHandle(p)))
        if back.get() == "busy":  # allocate another meanwhile
            p2 = rt.malloc(N)
            rt.memset(p2, 0, N)
            rt.deviceSynchronize()
            rt.free(p2)
        back.get()  # the receiver closed it
        rt.free(p)


def work(a, n):
    for _ in range(n):
        a = a @ a
        a = a / a.norm()


def open_timed(handle, res):
    s = time.perf_counter()
    res["ptr"] = rt.ipcOpenMemHandle(handle)
    res["open"] = time.perf_counter() - s


def main():
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=owner, args=(q, back, len(MODES)))
    p.start()
    torch.cuda.set_device(0)
    rt.setDevice(0)
    a = torch.randn(4096, 4096, device="cuda")
    work(a, 20)
    torch.cuda.synchronize()
    for mode in MODES:
        handle = q.get()
        back.put("busy" if mode == "owner_busy" else "idle")
        res = {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "thread_beside_work":
            th = threading.Thread(target=open_timed, args=(handle, res))
            th.start()
            work(a, 40)
            th.join()
        else:
            open_timed(handle, res)
            if mode == "inline_beside_work":
                work(a, 40)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        s = time.perf_counter()
        rt.ipcCloseMemHandle(res["ptr"])
        close = time.perf_counter() - s
        back.put("closed")
        print(
            f"{mode:20s} open {1e3 * res['open']:7.2f} ms  close {1e3 * close:6.2f} ms  "
            f"total {1e3 * total:7.2f} ms",
            flush=True,
        )
    torch.cuda.synchronize()
    s = time.perf_counter()
    work(a, 40)
    torch.cuda.synchronize()
    print(f"work alone {1e3 * (time.perf_counter() - s):.2f} ms")
    p.join()


if __name__ == "__main__":
    main()
