"""Where the host time of one microbatch of bench_e2e's model goes, on CPU (no GPU needed).

bench_e2e's Llama with its real layer count (19 layers + root: 20 FSDP2 units) and tiny
dimensions, so that compute is negligible and a microbatch's wall time is host work: FSDP2's
hooks, the comm calls, ODC's hooks and the model's own Python. Two configurations in one run,
each in its own group of the same two processes: plain FSDP2 over Gloo (the collective path's
stand-in) and FSDP2 + torch_odc.attach. Every microbatch is one short sequence.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node=2 benchmarks/probes/host_profile.py

Per configuration: median host ms per microbatch and per minibatch (the barrier included for
ODC), wall and CPU time of the process (CPU time is what to compare on a loaded machine: other
processes' load inflates wall time, not it), ODC's own host time per minibatch
(``stats()["host_s"]``, unprofiled wall time, the barrier's waits excluded), then one minibatch
under cProfile on rank 0: cumulative ms of ODC's entry points, FSDP2's hooks and the model, and
the top functions by own time. With --entry-cpu, every torch_odc entry point (its comm calls and
hooks) is wrapped in a thread-CPU-time accumulator and reported per call (measurement only; it
adds about a microsecond per call).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_e2e

import torch_odc

# cProfile entries (file fragment, function) whose cumulative time is reported.
ENTRY_POINTS = {
    "odc: unit pre-forward hook": ("torch_odc/_keys.py", "before_forward"),
    "odc: keyed all-gather": ("torch_odc/_comms.py", "__call__"),  # both comm classes
    "odc: root pre-forward (publish)": ("torch_odc/_handle.py", "_pre_forward"),
    "odc: grad hook (drop FSDP2's .grad)": ("torch_odc/_keys.py", "_drop_fsdp_grad"),
    "odc: barrier": ("torch_odc/_handle.py", "barrier"),
    "odc: optimizer step pre-hook": ("torch_odc/_handle.py", "_check_step"),
    "fsdp2: pre_forward (state)": ("_fsdp_state.py", "_pre_forward"),
    "fsdp2: post_forward (state)": ("_fsdp_state.py", "_post_forward"),
    "fsdp2: pre_backward (state)": ("_fsdp_state.py", "_pre_backward"),
    "fsdp2: post_backward (group)": ("_fsdp_param_group.py", "post_backward"),
    "fsdp2: root final callback": ("_fsdp_state.py", "_root_post_backward_final_callback"),
    "fsdp2: unshard (group)": ("_fsdp_param_group.py", "unshard"),
    "fsdp2: wait_for_unshard (group)": ("_fsdp_param_group.py", "wait_for_unshard"),
    "fsdp2: foreach_all_gather": ("_fsdp_collectives.py", "foreach_all_gather"),
    "fsdp2: foreach_reduce": ("_fsdp_collectives.py", "foreach_reduce"),
    "model: Llama.forward": ("bench_e2e.py", "forward"),
    "checkpoint: recompute": ("torch/utils/checkpoint.py", "unpack_hook"),
    "autograd: backward": ("torch/autograd/__init__.py", "backward"),
}


ENTRY_CPU: dict = {}  # label -> [thread CPU seconds, calls] (--entry-cpu)


def wrap_entry_points() -> None:
    """Wraps torch_odc's own entry points (its comm objects and hooks) in thread-CPU-time
    accumulators. Measurement only."""
    from torch_odc._comms import _KeyedAllGather, _KeyedReduceScatter
    from torch_odc._handle import Handle
    from torch_odc._keys import _Key

    def wrap(cls, name):
        inner, label = getattr(cls, name), f"{cls.__name__.lstrip('_')}.{name}"

        def timed(*args, **kwargs):
            t = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                e = ENTRY_CPU.setdefault(label, [0.0, 0])
                e[0] += time.thread_time() - t
                e[1] += 1

        setattr(cls, name, timed)

    for cls, name in [
        (_KeyedAllGather, "__call__"),
        (_KeyedReduceScatter, "__call__"),
        (_Key, "before_forward"),
        (_Key, "_drop_fsdp_grad"),
        (Handle, "_pre_forward"),
        (Handle, "barrier"),
    ]:
        wrap(cls, name)


def cumulative(stats: pstats.Stats, scale: float) -> dict:
    out = {}
    for label, (frag, name) in ENTRY_POINTS.items():
        total, calls = 0.0, 0
        for (file, _, func), (cc, nc, tt, ct, callers) in stats.stats.items():
            if func == name and frag in file:
                # Only the outermost entry of recursive calls counts (cc < nc then).
                total += ct
                calls += cc
        out[label] = (total * scale, calls)
    return out


def by_file(stats: pstats.Stats, scale: float) -> dict:
    """Own time grouped by where the code lives."""
    groups = {}
    for (file, _, func), (cc, nc, tt, ct, callers) in stats.stats.items():
        if "torch_odc" in file:
            g = "torch_odc (Python)"
        elif file == "~" and (
            "_keyed" in func
            or "_publish" in func
            or "_arrive" in func
            or "OdcBackend" in func
            or "_release" in func
        ):
            g = "torch_odc (C++ calls)"
        elif "fsdp/_fully_shard" in file:
            g = "FSDP2 (Python)"
        elif "bench_e2e" in file:
            g = "model (Python)"
        elif "torch/utils/checkpoint" in file:
            g = "checkpoint (Python)"
        elif "torch/distributed" in file:
            g = "torch.distributed (Python)"
        elif file == "~":
            g = "C calls (torch ops, autograd, ...)"
        else:
            g = "other Python (torch, stdlib)"
        groups[g] = groups.get(g, 0.0) + tt * scale
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def run(kind: str, args, group, rank, world):
    bargs = SimpleNamespace(model="host", mesh=None)
    bench_e2e.build.nccl_group = group
    model, handle, _ = bench_e2e.build(bargs, torch.device("cpu"), kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = bench_e2e.MODELS["host"][5]
    gen = torch.Generator().manual_seed(rank)
    micro_ms, mini_ms, odc_ms, odc_wait_ms, micro_cpu_ms = [], [], [], [], []
    prof_out = None
    gc.collect()
    gc.disable()
    for mb in range(args.warmup + args.minibatches + 1):
        profiled = mb == args.warmup + args.minibatches
        measured = mb >= args.warmup and not profiled
        if mb == args.warmup:
            ENTRY_CPU.clear()  # from the first measured minibatch ...
        if profiled:
            entry_cpu = {k: list(v) for k, v in ENTRY_CPU.items()}  # ... to the profiled one
        seqs = [
            torch.randint(0, vocab, (args.tokens + 1,), generator=gen) for _ in range(args.micro)
        ]
        dist.barrier(group=group)
        if handle is not None:
            st0 = handle.stats()
        prof = cProfile.Profile() if profiled and rank == 0 else None
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        for s in seqs:
            tm, cm = time.perf_counter(), time.process_time()
            model([s]).backward()
            if measured:
                micro_ms.append(1e3 * (time.perf_counter() - tm))
                micro_cpu_ms.append(1e3 * (time.process_time() - cm))
        if handle is not None:
            torch_odc.minibatch_barrier()
        wall = time.perf_counter() - t0
        opt.step()
        opt.zero_grad(set_to_none=True)
        if prof:
            prof.disable()
            prof_out = prof
        if measured:
            mini_ms.append(1e3 * wall)
            if handle is not None:
                st = handle.stats()
                wait = st["total"]["barrier_wait_s"] - st0["total"]["barrier_wait_s"]
                odc_ms.append(1e3 * (st["host_s"] - st0["host_s"] - wait))
                odc_wait_ms.append(1e3 * wait)
        gc.collect()
    gc.enable()
    if handle is not None:
        handle.detach()
    out = {
        "micro_ms": float(np.median(micro_ms)),
        "mini_ms": float(np.median(mini_ms)),
        "micro_cpu_ms": float(np.median(micro_cpu_ms)),
        "entry_cpu": entry_cpu,
    }
    if odc_ms:
        out["odc_own_ms"] = float(np.median(odc_ms))
        out["odc_wait_ms"] = float(np.median(odc_wait_ms))
    if prof_out is not None:
        st = pstats.Stats(prof_out)
        if args.dump:
            st.dump_stats(f"{args.dump}.{'odc' if handle is not None else 'fsdp'}")
        scale = 1e3  # s -> ms, one minibatch
        out["cum"] = cumulative(st, scale)
        out["files"] = by_file(st, scale)
        out["total_ms"] = st.total_tt * scale
        out["top"] = sorted(
            (
                (tt * scale, nc, f"{os.path.basename(f)}:{ln}({fn})")
                for (f, ln, fn), (cc, nc, tt, ct, _) in st.stats.items()
            ),
            reverse=True,
        )[: args.top]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=19)
    p.add_argument("--tokens", type=int, default=32, help="tokens per microbatch")
    p.add_argument("--micro", type=int, default=4, help="microbatches per minibatch")
    p.add_argument("--minibatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=["gloo", "odc"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--entry-cpu",
        action="store_true",
        help="thread CPU time per call of each torch_odc entry point",
    )
    p.add_argument("--dump", default=None, help="write rank 0's pstats to DUMP.odc / DUMP.fsdp")
    args = p.parse_args()
    bench_e2e.MODELS["host"] = (64, args.layers, 4, 2, 176, 512)
    torch.set_num_threads(1)
    if args.entry_cpu:
        wrap_entry_points()
    dist.init_process_group("odc")
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    results = {}
    for cfg in args.configs:
        results[cfg] = run("odc" if cfg == "odc" else "nccl", args, gloo, rank, world)
    per_rank = [None] * world
    dist.all_gather_object(
        per_rank,
        {
            c: {
                k: v
                for k, v in r.items()
                if k in ("micro_ms", "mini_ms", "odc_own_ms", "odc_wait_ms", "micro_cpu_ms")
            }
            for c, r in results.items()
        },
        group=gloo,
    )
    if rank == 0:
        print(
            f"\n{args.layers} layers, dim 64, {args.micro} microbatches of {args.tokens} "
            f"tokens per minibatch, {world} ranks, medians of {args.minibatches}; "
            f"torch {torch.__version__}"
        )
        for cfg in args.configs:
            rows = [pr[cfg] for pr in per_rank]
            line = (
                f"{cfg:>5}: ms per microbatch "
                + " / ".join(f"{r['micro_ms']:.1f}" for r in rows)
                + " (CPU "
                + " / ".join(f"{r['micro_cpu_ms']:.1f}" for r in rows)
                + ")"
                + ", per minibatch "
                + " / ".join(f"{r['mini_ms']:.1f}" for r in rows)
            )
            if "odc_own_ms" in rows[0]:
                line += (
                    ", ODC's own host ms per minibatch (unprofiled, waits excluded) "
                    + " / ".join(f"{r['odc_own_ms']:.2f}" for r in rows)
                    + ", barrier waits "
                    + " / ".join(f"{r['odc_wait_ms']:.2f}" for r in rows)
                )
            print(line + "  (rank 0 / 1)")
        for cfg in args.configs:
            r = results[cfg]
            if r["entry_cpu"]:
                n_mb = args.minibatches
                print(
                    f"\n--- {cfg}: torch_odc entry points on rank 0, thread CPU time over the "
                    f"{n_mb} measured minibatches: ms per minibatch, calls per minibatch, us "
                    "per call"
                )
                for label, (sec, n) in sorted(r["entry_cpu"].items(), key=lambda kv: -kv[1][0]):
                    print(
                        f"  {label:<36}{1e3 * sec / n_mb:8.2f}{n / n_mb:7.1f}{1e6 * sec / n:8.1f}"
                    )
            print(
                f"\n--- {cfg}: one minibatch under cProfile on rank 0: {r['total_ms']:.1f} ms "
                "of profiled Python; cumulative ms (calls):"
            )
            for label, (ms, n) in r["cum"].items():
                if n:
                    print(f"  {label:<40}{ms:9.2f}  ({n})")
            print("  own time by place:")
            for g, ms in r["files"].items():
                print(f"  {g:<40}{ms:9.2f}")
            print("  top own time:")
            for ms, n, name in r["top"]:
                print(f"  {ms:9.2f} {n:6d}  {name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
