"""Benchmarks the odc keyed gather and push-accumulate against NCCL on GPUs.

For each message size (bytes per rank of the wire dtype) it times, side by side on the same GPUs:
NCCL all_gather_into_tensor (bf16); the odc keyed gather in steady state (key already published in
this minibatch); the odc publishing gather (the first gather after a minibatch barrier); NCCL
reduce_scatter_tensor (fp32, SUM); the odc keyed push-accumulate (fp32); and the same element count
in bf16: NCCL reduce-scatter in bf16 and the odc push of bf16 into the fp32 accumulator (widened
in registers: the remote reductions move fp32, twice the source bytes). Once per size (untimed) it
checks that the odc gather equals NCCL's bitwise and that k pushes accumulate exactly. Rank 0
writes transport_{N}gpu.json and transport_{N}gpu.png under --out and prints the table last.
With more ranks than GPUs (ranks sharing a GPU: NCCL refuses that) only the odc ops run.

    torchrun --nproc-per-node=2 benchmarks/bench_transport.py --out benchmarks/results
    torchrun --nproc-per-node=4 benchmarks/bench_transport.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # machine policy: never NVLink multicast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20
OPS = (
    "nccl_allgather",
    "odc_gather",
    "odc_publish_gather",
    "odc_publish_gather_aligned",
    "odc_gather_after_publish",
    "nccl_reducescatter",
    "odc_push",
    "nccl_reducescatter_bf16",
    "odc_push_bf16",
    "copy_gather",
    "copy_push",
    "memcpy_gather",
    "memcpy_push",
    "ipc_copy_gather",
    "ipc_add_push",
)
GATHER_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32
PUSHES = 3  # pushes per minibatch in the accumulate check
RATIOS = {  # ratio name: (odc op, NCCL op it is compared with, done-when target or None)
    "gather": ("odc_gather", "nccl_allgather", 1.0),
    "push": ("odc_push", "nccl_reducescatter", 1.0),
    "publish_gather": ("odc_publish_gather", "nccl_allgather", None),
    "push_bf16": ("odc_push_bf16", "nccl_reducescatter_bf16", None),
}
CHECKS = {  # the correctness checks shown next to each odc op
    "odc_gather": ("gather_publish_bitwise", "gather_steady_bitwise"),
    "odc_publish_gather": ("gather_publish_bitwise",),
    "odc_push": ("push_accumulate_exact",),
    "odc_push_bf16": ("push_bf16_accumulate_exact",),
}


# The gathers are in place, as FSDP2 calls them (input = the output's own chunk), so they read
# only the (world-1) peer chunks. The physical reference: a plain device-to-device copy kernel on this rank's GPU (torch's
# vectorized elementwise kernel, y = x * 1 in fp32: reads and writes the bytes once, on the SMs
# like odc's kernels), every rank at once, timed the same way in the same run, of the bytes an odc
# op moves: for the gather, the (world-1) peer chunks it reads; for the push, the world chunks it
# reduces into accumulators. memcpy_* time cudaMemcpyAsync of the same bytes (tensor.copy_; the
# driver may use a copy engine, which runs beside another process's kernels on a shared GPU).
# Ratios are time ratios, odc / copy kernel (done when <= COPY_TARGET).
# ipc_*: the same plain kernels on the memory odc's ops touch, peers' buffers opened through
# CUDA IPC as odc's transport opens them: ipc_copy_gather reads each peer's chunk (y = x * 1);
# ipc_add_push adds a chunk into every rank's fp32 buffer (x += y, no atomics).
VS_COPY = {
    "gather_vs_copy": ("odc_gather", "copy_gather"),
    "push_vs_copy": ("odc_push", "copy_push"),
    "gather_vs_ipc_copy": ("odc_gather", "ipc_copy_gather"),
    "push_vs_ipc_add": ("odc_push", "ipc_add_push"),
}
COPY_TARGET = 1.3


def op_bytes(op: str, size: int) -> int:
    """Bytes per rank an op moves at message size `size` (the bf16 ops: half, same elements)."""
    return size // 2 if op.endswith("_bf16") else size


def ipc_views(world: int, rank: int, nbytes: int, device) -> list[torch.Tensor]:
    """Every rank's fp32 buffer of nbytes: its own, and its peers' opened through CUDA IPC on
    this rank's GPU, as odc's transport opens them (cudaIpcOpenMemHandle with this GPU current),
    so they are tensors of this GPU whose memory lies on the peer's: this GPU's kernels take
    them as operands and reach the peer over NVLink. (Rebuilt as torch does by default, on the
    owner's device index, a peer's buffer is a tensor of the peer's GPU, which no kernel of this
    GPU accepts: "Expected all tensors to be on the same device" on 2 GPUs.)"""
    from torch.multiprocessing.reductions import reduce_tensor

    own = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    rebuild, handle = reduce_tensor(own)
    handles = [None] * world
    dist.all_gather_object(handles, handle)
    views = []
    for r in range(world):
        if r == rank:
            views.append(own)
            continue
        args = list(handles[r])
        args[6] = device.index  # rebuild_cuda_tensor's storage_device: open it on this GPU
        views.append(rebuild(*args))
    return views


def align_ranks(lead_ns: int = 2_000_000) -> None:
    """Returns on every rank at the same CLOCK_MONOTONIC instant (one host): each rank proposes
    now + lead_ns, all take the latest and spin until then (skew: microseconds)."""
    t = torch.tensor([time.monotonic_ns() + lead_ns], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    target = int(t.item())
    while time.monotonic_ns() < target:
        pass


def time_op(fn, iters: int, warmup: int) -> list[float]:
    """Per-iteration times (ms) of fn, each bracketed by CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


class Odc:
    """The odc engine with one key per size; tracks which keys this rank published."""

    def __init__(self, sizes: list[int], world: int, device: torch.device):
        import torch_odc

        self.world, self.device = world, device
        self.backend = torch_odc.odc_backend()
        self.gather_numel = [s // GATHER_DTYPE.itemsize for s in sizes]
        self.accum_numel = [s // REDUCE_DTYPE.itemsize for s in sizes]
        self.published: set[int] = set()
        keys = [
            (f"size{s // MB}MB", g, "bfloat16", [a], "float32")
            for s, g, a in zip(sizes, self.gather_numel, self.accum_numel, strict=True)
        ]
        self.backend._connect_engine(keys, device_index=device.index)

    # The keyed calls as attach's comm objects make them (one call into the backend each).
    def gather(self, k: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.backend._keyed_all_gather(k, out, inp)
        self.published.add(k)

    def publish(self, k: int, inp: torch.Tensor) -> None:
        """Publishes key k's shard without gathering (the eager publish of attach)."""
        self.backend._publish_shards([k], [[inp]])
        self.published.add(k)

    def push(self, k: int, out: torch.Tensor, inp: torch.Tensor) -> None:
        self.backend._keyed_reduce_scatter(k, out, inp, dist.ReduceOp.SUM)

    def arrive(self) -> None:
        """First half of the minibatch barrier: publish what is left, wait for every rank."""
        for k, n in enumerate(self.gather_numel):
            if k not in self.published:
                shard = torch.zeros(n, dtype=GATHER_DTYPE, device=self.device)
                self.gather(k, shard.new_empty(self.world * n), shard)
        torch.cuda.synchronize()
        self.backend._arrive()
        torch.cuda.synchronize()

    def release(self) -> None:
        self.backend._release()
        self.published.clear()

    def barrier(self) -> None:
        self.arrive()
        self.release()

    def close(self) -> None:
        self.backend._disconnect_engine()


def bench_size(k, size, world, rank, odc, nccl, args, device) -> tuple:
    """Times every op at one size; returns {op: [ms]}, {check: bool}, an odc error if any, and
    diagnostics of the publishing gather (per-sample start instants and host call times)."""
    times, checks, error, diag = {}, {}, None, {}
    n_g, n_r = size // GATHER_DTYPE.itemsize, size // REDUCE_DTYPE.itemsize
    gen = torch.Generator(device=device).manual_seed(1000 * rank + k)
    shard = torch.randn(n_g, generator=gen, device=device).to(GATHER_DTYPE)
    out_nccl = torch.empty(world * n_g, dtype=GATHER_DTYPE, device=device)
    # Small integers, exact in fp32 under any summation order: chunk j = (i % 13) + 16 j + rank.
    base = (torch.arange(n_r, dtype=torch.int32, device=device) % 13).to(REDUCE_DTYPE)
    rs_in = (base + 16 * torch.arange(world, device=device)[:, None] + rank).flatten()
    rs_out = torch.zeros(n_r, dtype=REDUCE_DTYPE, device=device)

    # The same small integers in bf16 (exact below 256): a bf16 push of the same elements.
    rs_in16, rs_out16 = rs_in.to(torch.bfloat16), rs_out.to(torch.bfloat16)

    # Both gathers as FSDP2 calls them: the input is the output's own chunk (in place).
    nccl_own = out_nccl.narrow(0, rank * n_g, n_g)
    nccl_own.copy_(shard)

    def ag():
        dist.all_gather_into_tensor(out_nccl, nccl_own, group=nccl)

    def rs():
        dist.reduce_scatter_tensor(rs_out, rs_in, op=dist.ReduceOp.SUM, group=nccl)

    def rs16():
        dist.reduce_scatter_tensor(rs_out16, rs_in16, op=dist.ReduceOp.SUM, group=nccl)

    # Copy references: as many bytes as the odc gather reads and the odc push reduces.
    for name, nbytes in (("gather", (world - 1) * size), ("push", world * size)):
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        times[f"copy_{name}"] = time_op(
            lambda s=src, d=dst: torch.mul(s, 1.0, out=d), args.iters, args.warmup
        )
        times[f"memcpy_{name}"] = time_op(lambda s=src, d=dst: d.copy_(s), args.iters, args.warmup)
        del src, dst
    try:
        views = ipc_views(world, rank, size, device)
        out = torch.empty(size // 4, dtype=torch.float32, device=device)
        peers = [views[(rank + i) % world] for i in range(1, world)]
        if any(v.device != device for v in views):
            raise RuntimeError(f"IPC views on {[str(v.device) for v in views]}, not {device}")

        def ipc_copy():
            for v in peers:
                torch.mul(v, 1.0, out=out)

        def ipc_add():
            for v in views:
                v.add_(out)

        times["ipc_copy_gather"] = time_op(ipc_copy, args.iters, args.warmup)
        times["ipc_add_push"] = time_op(ipc_add, args.iters, args.warmup)
        torch.cuda.synchronize()
        views = peers = out = None
    except Exception as err:  # noqa: BLE001  (a reference only: recorded, the rest runs)
        diag["ipc_reference_error"] = f"{type(err).__name__}: {err}"
        torch.cuda.synchronize()
    dist.barrier()  # peers are done with this rank's buffer
    if nccl is not None:
        times["nccl_allgather"] = time_op(ag, args.iters, args.warmup)
        times["nccl_reducescatter"] = time_op(rs, args.iters, args.warmup)
        times["nccl_reducescatter_bf16"] = time_op(rs16, args.iters, args.warmup)
    if odc is None:
        return times, checks, error, diag
    try:
        out_odc = torch.empty_like(out_nccl)
        # As FSDP2 calls it: the input is the output's own chunk (copied in), so the gather
        # reads only the peers' chunks.
        own = out_odc.narrow(0, rank * n_g, n_g)
        own.copy_(shard)
        odc.barrier()  # a fresh minibatch: the next gather of key k publishes
        odc.gather(k, out_odc, own)
        if nccl is not None:
            ag()
            checks["gather_publish_bitwise"] = torch.equal(
                out_odc.view(torch.int16), out_nccl.view(torch.int16)
            )
        out_odc.zero_()
        own.copy_(shard)
        odc.gather(k, out_odc, own)
        if nccl is not None:
            checks["gather_steady_bitwise"] = torch.equal(
                out_odc.view(torch.int16), out_nccl.view(torch.int16)
            )
        times["odc_gather"] = time_op(lambda: odc.gather(k, out_odc, own), args.iters, args.warmup)
        # Publish + gather: the first gather of a minibatch, one barrier cycle per sample. As the
        # ranks leave the barrier (includes waiting for a peer that leaves it later) and with
        # the ranks aligned to the microsecond first (the operation's own cost).
        pub, aligned, starts, host = [], [], [], []
        for i in range(2 * args.publish_iters):
            odc.barrier()
            if i % 2:
                torch.cuda.synchronize()
                align_ranks()
            starts.append(time.monotonic_ns())
            t0 = time.perf_counter()
            (aligned if i % 2 else pub).extend(time_op(lambda: odc.gather(k, out_odc, own), 1, 0))
            host.append(time.perf_counter() - t0)
        times["odc_publish_gather"], times["odc_publish_gather_aligned"] = pub, aligned
        # The same first gather of a minibatch once every rank's publish has completed on the
        # device: what is left when no wait finds its peer's flag unset.
        after = []
        for _ in range(args.publish_iters):
            odc.barrier()
            odc.publish(k, own)
            torch.cuda.synchronize()
            align_ranks()
            after += time_op(lambda: odc.gather(k, out_odc, own), 1, 0)
        times["odc_gather_after_publish"] = after
        diag["publish_start_ns"] = starts
        diag["publish_call_ms"] = [1e3 * h for h in host]
        # Push-accumulate: PUSHES pushes into zeroed accumulators, then the barrier's first half.
        odc.barrier()
        for _ in range(PUSHES):
            odc.push(k, rs_out.zero_(), rs_in)
        odc.arrive()
        try:
            acc = odc.backend._accumulator(k)
            if acc.device != device:
                raise RuntimeError(f"_accumulator returned a tensor on {acc.device}")
            want = PUSHES * (world * (base + 16 * rank) + world * (world - 1) // 2)
            checks["push_accumulate_exact"] = torch.equal(acc, want)
        finally:
            odc.release()
        times["odc_push"] = time_op(lambda: odc.push(k, rs_out, rs_in), args.iters, args.warmup)
        odc.barrier()  # zero the accumulators again
        for _ in range(PUSHES):
            odc.push(k, rs_out16.zero_(), rs_in16)
        odc.arrive()
        try:
            checks["push_bf16_accumulate_exact"] = torch.equal(odc.backend._accumulator(k), want)
        finally:
            odc.release()
        times["odc_push_bf16"] = time_op(
            lambda: odc.push(k, rs_out16, rs_in16), args.iters, args.warmup
        )
        odc.barrier()
    except Exception as err:  # noqa: BLE001  (recorded; the NCCL numbers still count)
        error = f"{type(err).__name__}: {err}"
    return times, checks, error, diag


def environment(world: int) -> dict:
    def run(*cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=20)
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unavailable"

    nccl = torch.cuda.nccl.version()
    return {
        "gpu": torch.cuda.get_device_name(),
        "gpus_used": world,
        "gpus_visible": torch.cuda.device_count(),
        "driver": run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hostname": socket.gethostname(),
        # ODC_GIT_COMMIT: a tree copied without its .git (device runs of `git archive`).
        "git_commit": os.environ.get("ODC_GIT_COMMIT")
        or run("git", "-C", ROOT, "rev-parse", "HEAD"),
        "command": f"torchrun --nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', world)} "
        + " ".join(sys.argv),
        "argv": sys.argv,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "torch_odc": os.path.dirname(sys.modules["torch_odc"].__file__),
    }


def plot(rows: list[dict], ratios: list[dict], world: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for op in OPS:
        pts = [(r["size_bytes"] / MB, r["busbw_gbps"]) for r in rows if r["op"] == op]
        if pts:
            style = ":" if op == "odc_publish_gather" else "-" if op.startswith("nccl") else "--"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=op)
    ax.set(
        xlabel="message per rank (MiB)",
        ylabel="bus bandwidth (GB/s)",
        title=f"{world} x {torch.cuda.get_device_name()}",
    )
    ax.set_xscale("log", base=2)
    for (key, (odc_op, nccl_op, target)), color in zip(RATIOS.items(), "bgkm", strict=True):
        pts = [(r["size_bytes"] / MB, r[key]) for r in ratios if r[key] is not None]
        if pts:
            style = ":" if target is None else "-"
            label = f"{odc_op} / {nccl_op}"
            rx.plot(*zip(*pts, strict=True), style, color=color, marker="o", label=label)
        if target is not None:
            rx.axhline(target, color=color, linestyle="--", linewidth=0.8, alpha=0.6)
    rx.set(xlabel="message per rank (MiB)", ylabel="busbw ratio (dashed: targets)")
    rx.set_xscale("log", base=2)
    sizes = sorted({r["size_bytes"] // MB for r in rows})
    for a in (ax, rx):
        a.set_xticks(sizes, [str(s) for s in sizes])
        a.grid(True, which="both", alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results"), help="results folder"
    )
    parser.add_argument(
        "--sizes-mb",
        type=int,
        nargs="+",
        default=[1, 4, 16, 64, 256, 1024],
        help="message sizes per rank in MiB of the wire dtype",
    )
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per op and size")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--publish-iters", type=int, default=10, help="barrier cycles timed for odc_publish_gather"
    )
    parser.add_argument("--skip-odc", action="store_true", help="NCCL only")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    import torch_odc  # noqa: F401  (registers "odc")

    dist.init_process_group("odc")
    rank, world = dist.get_rank(), dist.get_world_size()
    # NCCL needs one GPU per rank; control traffic goes over the default group (CPU, Gloo).
    nccl = dist.new_group(backend="nccl") if world <= torch.cuda.device_count() else None
    sizes = [mb * MB for mb in args.sizes_mb]

    def all_ranks(value: float, op=dist.ReduceOp.MAX) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.item()

    def first_error(where: str, error: str | None) -> str | None:
        errors = [None] * world
        dist.all_gather_object(errors, error)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        return f"{where} (rank {bad[0][0]}): {bad[0][1]}" if bad else None

    odc, odc_error = None, None
    if not args.skip_odc:
        try:
            odc = Odc(sizes, world, device)
        except Exception as err:  # noqa: BLE001
            odc_error = f"{type(err).__name__}: {err}"
        # A failure on any rank turns odc off on all of them (avoids one-sided hangs).
        if odc_error := first_error("connect", odc_error):
            odc = None
    rows, ratios, checks, publish, ipc_errors = [], [], [], [], []
    for k, size in enumerate(sizes):
        times, ok, error, diag = bench_size(k, size, world, rank, odc, nccl, args, device)
        if ipc_error := first_error(
            f"IPC references at {size // MB} MiB", diag.get("ipc_reference_error")
        ):
            ipc_errors.append(ipc_error)
        if odc is not None and (error := first_error(f"size {size // MB} MiB", error)):
            odc_error, odc = odc_error or error, None  # NCCL numbers continue without odc
        busbw = {}
        for op in OPS:
            if not all_ranks(op in times, dist.ReduceOp.MIN):
                continue
            ms = all_ranks(statistics.median(times[op]))  # the slowest rank's median
            algbw = world * op_bytes(op, size) / (ms * 1e-3) / 1e9
            busbw[op] = algbw * (world - 1) / world
            rows.append(
                {
                    "op": op,
                    "size_bytes": size,
                    "ms_median": ms,
                    "ms_min": all_ranks(min(times[op])),
                    "samples": len(times[op]),
                    "algbw_gbps": algbw,
                    "busbw_gbps": busbw[op],
                }
            )
        median = {r["op"]: r["ms_median"] for r in rows if r["size_bytes"] == size}
        ratios.append(
            {"size_bytes": size}
            | {
                r: busbw[o] / busbw[n] if o in busbw and n in busbw else None
                for r, (o, n, _) in RATIOS.items()
            }
            | {
                r: median[o] / median[c] if o in median and c in median else None
                for r, (o, c) in VS_COPY.items()
            }
        )
        # The publishing gather: how late the last rank started each sample (barrier exit skew)
        # and the host time of the call, next to the device times.
        if all_ranks(int("publish_start_ns" in diag), dist.ReduceOp.MIN):
            starts = [None] * world
            dist.all_gather_object(starts, diag["publish_start_ns"])
            skew = [(max(s) - min(s)) / 1e6 for s in zip(*starts, strict=True)]
            calls = [None] * world
            dist.all_gather_object(calls, diag["publish_call_ms"])
            publish.append(
                {
                    "size_bytes": size,
                    "start_skew_ms_unaligned": skew[0::2],
                    "start_skew_ms_aligned": skew[1::2],
                    "host_call_ms_per_rank": calls,
                    "device_ms_unaligned": times.get("odc_publish_gather"),
                    "device_ms_aligned": times.get("odc_publish_gather_aligned"),
                }
            )
        # Per check, over all ranks: True, False, or None where some rank did not run it.
        names = sorted({n for c in CHECKS.values() for n in c})
        got = [all_ranks(int(ok[n]) if n in ok else -1, dist.ReduceOp.MIN) for n in names]
        checks.append(
            {"size_bytes": size}
            | {n: None if g < 0 else g > 0 for n, g in zip(names, got, strict=True)}
        )
        torch.cuda.empty_cache()

    if odc is not None:
        try:
            odc.close()
        except Exception as err:  # noqa: BLE001
            odc_error = odc_error or f"disconnect: {type(err).__name__}: {err}"
    big = [r for r in ratios if r["size_bytes"] >= 64 * MB]
    targets = {r: t for r, (_, _, t) in RATIOS.items() if t is not None}
    done = {
        "criterion": "sizes >= 64 MiB: odc gather >= 1.0 x NCCL all-gather busbw and "
        "odc fp32 push >= 1.0 x NCCL fp32 reduce-scatter busbw (issue 30)",
        "sizes_bytes": [r["size_bytes"] for r in big],
        "pass": bool(big)
        and all(r[k] is not None and r[k] >= t for r in big for k, t in targets.items()),
    }
    latency = {r["op"]: r["ms_median"] for r in rows if r["size_bytes"] == MB}
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        gpus = torch.cuda.device_count()
        shared = "" if world <= gpus else f"_{world}ranks_on_{gpus}"  # ranks sharing GPUs
        stem = os.path.join(args.out, f"transport_{min(world, gpus)}gpu{shared}")
        result = {
            "environment": environment(world),
            "config": vars(args),
            "size_unit": "MiB (2^20 bytes) per rank of the wire dtype",
            "bandwidth_unit": "GB/s (1e9 bytes/s); busbw = algbw*(world-1)/world, "
            "algbw = world*bytes_per_rank/time",
            "rows": rows,
            "ratios": ratios,
            "checks": checks,
            "latency_ms_1MiB": latency,
            "publish_gather_diagnostics (rank 0's device times)": publish,
            "vs_copy_target": COPY_TARGET,
            "done_when": done,
            "odc_error": odc_error,
            "ipc_reference_errors": ipc_errors,
        }
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        plot(rows, ratios, world, stem + ".png")
        print(
            f"\n{world} x {torch.cuda.get_device_name()}; torch_odc from "
            f"{result['environment']['torch_odc']}; wrote {stem}.json and .png"
        )
        if odc_error:
            print(f"odc error (full text in the JSON): {odc_error.splitlines()[0]}")
        for e in ipc_errors:
            print(f"IPC reference error: {e.splitlines()[0]}")
        print(f"{'size':>8} {'op':<19} {'ms':>9} {'busbw GB/s':>10} {'ratio':>6}  check")
        for r in rows:
            i = sizes.index(r["size_bytes"])
            key = next((k for k, (o, _, _) in RATIOS.items() if o == r["op"]), None)
            ratio = f"{ratios[i][key]:6.3f}" if key and ratios[i][key] is not None else ""
            verdict = {True: "ok", False: "FAIL", None: "-"}
            check = " ".join(verdict[checks[i][n]] for n in CHECKS.get(r["op"], ()))
            print(
                f"{r['size_bytes'] // MB:>5}MiB {r['op']:<19} {r['ms_median']:9.3f} "
                f"{r['busbw_gbps']:10.1f} {ratio:>6}  {check}"
            )
        print(f"done-when ({done['criterion']}): {'PASS' if done['pass'] else 'FAIL'}")
        print(f"odc time / plain copy time of the same bytes (target <= {COPY_TARGET}):")
        for r in ratios:
            vals = "  ".join(f"{k} {r[k]:.3f}" for k in VS_COPY if r[k] is not None)
            print(f"{r['size_bytes'] // MB:>5}MiB  {vals}")
        for p in publish:
            med = statistics.median
            print(
                f"{p['size_bytes'] // MB:>5}MiB publish gather: start skew median "
                f"{med(p['start_skew_ms_unaligned']):.3f} ms (aligned "
                f"{med(p['start_skew_ms_aligned']):.3f}); host call median "
                f"{med(p['host_call_ms_per_rank'][0]):.3f} ms"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
