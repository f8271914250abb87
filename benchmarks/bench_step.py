"""Training-step benchmark: minibatch time and where the GPU time goes under FSDP2 + ODC.

One GPU, 2 ranks sharing it (only ODC's own flows: NCCL refuses two ranks on one GPU), or one
rank per GPU, with FSDP2 over NCCL beside it (``--baseline auto``, the default, runs it when
every rank has a GPU of its own):

    torchrun --nproc-per-node=2 benchmarks/bench_step.py --out benchmarks/results/step
    torchrun --nproc-per-node=4 benchmarks/bench_step.py --out benchmarks/results/step
    # CPU smoke test of the code path (shared-memory transport, FSDP2 over gloo beside it):
    torchrun --nproc-per-node=2 benchmarks/bench_step.py --device cpu --layers 2 --dim 64 \
        --heads 4 --kv-heads 2 --ffn 176 --vocab 512 --seq 64 --baseline on

The model is bench_e2e's Llama-style decoder (default 16 layers x 2048, 16 heads, 8 kv heads,
SwiGLU 5632, vocabulary 32000; activation checkpointing), per-layer ``fully_shard`` plus root
with bf16 parameters and fp32 reduction (``MixedPrecisionPolicy``), AdamW. A minibatch is
``--microbatches`` forward+backward passes of ``--seq`` tokens per rank, the minibatch barrier
(ODC) and the optimizer step. Reports, per configuration:

* minibatch wall time: slowest rank, median over the measured minibatches (after warmup), and
  its phases on the GPU timeline (microbatches, barrier, optimizer step; CUDA events);
* GPU time by category over one more, profiled minibatch (torch.profiler, summed kernel,
  memcpy and memset durations of the rank's own process): ODC's kernels by name (gather, wait,
  push, publish; ``ODC_KERNELS``), other device work launched inside an ODC call (its shard
  copy into the cache, accumulator zeroing), NCCL, FSDP2's copy-in/copy-out/reduce work and the
  optimizer (by the profiler range its launch was issued in), compute = everything else. The
  headline is ODC's kernels' share of all GPU time (issue 23 target: at most 10%);
* host time inside ODC calls (the ``odc::*`` profiler ranges), per kind and in total;
* the physical reference, in the same run on the same device: the bytes this rank gathered from
  peers and pushed to peers in a minibatch (``torch_odc.stats()``), moved by a plain
  device-to-device ``copy_`` (CUDA events), once as one copy and once in as many pieces as
  there were calls; ranks time it one after another, so a shared GPU is otherwise idle.

Rank 0 prints a table last and writes ``step_<tag>.json`` (every number per rank, the command,
hardware, torch version, git commit) and ``step_<tag>.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import itertools

from bench_e2e import Llama, merged_busy

import torch_odc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
# ODC's kernels by name (csrc/transport/cuda_ipc/kernels.cu): the headline categories.
ODC_KERNELS = (
    ("odcGather", "odc_gather"),
    ("odcWait", "odc_wait"),
    ("odcPush", "odc_push"),
    ("publishKernel", "odc_publish"),
    ("publishFlagsKernel", "odc_publish"),
)
# Host ranges inside ODC's calls in which the host only waits: for its own GPU work (the
# barrier's quiesce) and for the peers' arrival. "Host time outside the waits" excludes them.
WAIT_RANGES = ("odc::wait_device", "odc::wait_peers")
HEADLINE = tuple(dict.fromkeys(cat for _, cat in ODC_KERNELS))
CATEGORIES = HEADLINE + (
    "odc_other",
    "nccl",
    "fsdp2_copy_in",
    "fsdp2_copy_out",
    "fsdp2_reduce",
    "fsdp2_other",
    "optimizer",
    "compute",
)
# Host ranges a launch is attributed to (the innermost one that encloses it, on its thread).
RANGE_PREFIXES = ("odc::", "FSDP::", "Optimizer.")
NOT_KERNELS = RANGE_PREFIXES + ("ProfilerStep",)  # GPU-side copies of host ranges
LAUNCH_CALLS = (
    "cudaLaunch",
    "cuLaunch",
    "cudaMemcpy",
    "cudaMemset",
    "cuMemcpy",
    "cuMemset",
    "cudaGraphLaunch",
)
NOT_DEVICE_WORK = (
    "Stream Sync",
    "Event Sync",
    "Context Sync",
    "Stream Wait Event",
    "Device Synchronize",
)


def category(kernel: str, rng: str | None) -> str:
    """The category of one device activity: its name first, else the host range it was launched
    in (FSDP2's range names: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py)."""
    for part, cat in ODC_KERNELS:
        if part in kernel:
            return cat
    if kernel.startswith("odc") or "torch_odc::" in kernel or "readClockKernel" in kernel:
        return "odc_other"
    if "nccl" in kernel.lower():
        return "nccl"
    if rng:
        if rng.startswith("odc::"):
            return "odc_other"
        if rng.startswith("FSDP::all_gather_copy_out"):
            return "fsdp2_copy_out"
        if rng.startswith("FSDP::all_gather"):
            return "fsdp2_copy_in"
        if rng.startswith("FSDP::post_backward_reduce"):
            return "fsdp2_reduce"
        if rng.startswith("FSDP::"):
            return "fsdp2_other"
        if rng.startswith("Optimizer."):
            return "optimizer"
    return "compute"


def innermost(ranges):
    """Nested host ranges [(start, end, name)] of one thread as sorted change points
    (times, names): at time t the innermost enclosing range is names[bisect_right(times, t) - 1]
    (None: in no range)."""
    points, stack = [], []
    for s, e, name in sorted(ranges, key=lambda r: (r[0], -r[1])):
        while stack and stack[-1][1] <= s:
            end = stack.pop()[1]
            points.append((end, stack[-1][2] if stack else None))
        stack.append((s, e, name))
        points.append((s, name))
    while stack:
        end = stack.pop()[1]
        points.append((end, stack[-1][2] if stack else None))
    points.sort(key=lambda p: p[0])  # stable: of equal times the last state wins
    return [p[0] for p in points], [p[1] for p in points]


def _is_device(e) -> bool:
    return e.device_type == torch.autograd.DeviceType.CUDA


def gpu_breakdown(events) -> dict:
    """GPU time (us) by category of one rank's profiled events (FunctionEvent-like objects:
    name, id, thread, device_type, is_user_annotation, time_range.start/.end in us). A device
    activity is matched to the CUDA runtime call that launched it by correlation id (`id`),
    and that call to the innermost `RANGE_PREFIXES` range around it on its thread. Also returns
    ODC's other device work per range kind."""
    ranges, launches = {}, {}
    for e in events:
        if _is_device(e):
            continue
        if e.name.startswith(RANGE_PREFIXES):
            ranges.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end, e.name))
        elif e.name.startswith(LAUNCH_CALLS):
            launches[e.id] = (e.thread, e.time_range.start)
    lookup = {t: innermost(r) for t, r in ranges.items()}
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    odc_other_by_range, count, unmatched = {}, 0, 0
    for e in events:
        if (
            not _is_device(e)
            or getattr(e, "is_user_annotation", False)
            or e.name.startswith(NOT_KERNELS)
            or e.name in NOT_DEVICE_WORK
        ):
            continue
        rng = None
        launch = launches.get(e.id)
        if launch is None:
            unmatched += 1
        elif launch[0] in lookup:
            times, names = lookup[launch[0]]
            i = bisect.bisect_right(times, launch[1]) - 1
            rng = names[i] if i >= 0 else None
        cat = category(e.name, rng)
        dur = e.time_range.end - e.time_range.start
        by_cat[cat] += dur
        count += 1
        if cat == "odc_other":
            kind = (rng or e.name).split(" ")[0]
            odc_other_by_range[kind] = odc_other_by_range.get(kind, 0.0) + dur
    total = sum(by_cat.values())
    return {
        "total_us": total,
        "by_category_us": by_cat,
        "activities": count,
        "unmatched_launches": unmatched,
        "odc_other_by_range_us": odc_other_by_range,
        "odc_kernels_us": sum(by_cat[c] for c in HEADLINE),
        "odc_share": sum(by_cat[c] for c in HEADLINE) / total if total else None,
        "odc_with_other_share": (sum(by_cat[c] for c in HEADLINE) + by_cat["odc_other"]) / total
        if total
        else None,
        "nccl_share": by_cat["nccl"] / total if total else None,
    }


def host_odc_time(events) -> dict:
    """Host time (us) inside ODC calls: per kind (`odc::gather`, `odc::push`, ...: nested
    kinds are each counted in full), in total (the union of all ODC ranges per thread), the
    part of it the host spent waiting (`WAIT_RANGES`: for its own GPU work at the barrier and
    for the peers' arrival) and the rest, ODC's own host work (`outside_waits_us`)."""
    kinds, spans, waits = {}, {}, {}
    for e in events:
        if _is_device(e) or not e.name.startswith("odc::"):
            continue
        kind = e.name.split(" ")[0]
        k = kinds.setdefault(kind, {"us": 0.0, "calls": 0})
        k["us"] += e.time_range.end - e.time_range.start
        k["calls"] += 1
        spans.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end))
        if kind in WAIT_RANGES:
            waits.setdefault(e.thread, []).append((e.time_range.start, e.time_range.end))
    total = sum(merged_busy(s)[0] for s in spans.values())
    waited = sum(merged_busy(s)[0] for s in waits.values())
    return {
        "by_kind": kinds,
        "total_us": total,
        "waits_us": waited,
        "outside_waits_us": total - waited,
    }


class Phases:
    """Marks on the rank's timeline: CUDA events on the current stream, or host clocks."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Between consecutive marks; call after the device is synchronized."""
        m = self.marks
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(m)]
        return [b - a for a, b in itertools.pairwise(m)]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(args, device, group, odc: bool):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)  # the same full model on every rank before sharding
    with torch.device(device):
        model = Llama(
            args.dim,
            args.layers,
            args.heads,
            args.kv_heads,
            args.ffn,
            args.vocab,
            checkpointing=args.checkpointing,
        )
    mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    handle = torch_odc.attach(model) if odc else None
    return model, handle


def run_config(cfg, args, device, group) -> dict:
    odc = cfg == "odc"
    model, handle = build(args, device, group, odc)
    n_params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":  # not the full model each rank builds before sharding
        torch.cuda.reset_peak_memory_stats(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    # warmup, measured, one with the profiler warming up (CUPTI set up: not measured, so the
    # setup neither inflates a measured minibatch nor skews the ranks of the profiled one), and
    # the profiled one, last.
    total = args.warmup + args.minibatches + 2
    inputs = []  # made (and pinned) before the clock starts: a data loader's work
    for _ in range(total):
        mb = [
            torch.randint(0, args.vocab, (args.seq + 1,), generator=gen)
            for _ in range(args.microbatches)
        ]
        inputs.append([t.pin_memory() for t in mb] if device.type == "cuda" else mb)
    scale = 1.0 / (args.seq * args.microbatches)
    rows, prof, prof_out, moved = [], None, None, None
    gc.collect()
    gc.disable()  # collections between minibatches only (a pause would straggle every rank)
    try:
        for i, tokens in enumerate(inputs):
            profiled = i == total - 1
            if i == total - 2:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(
                    activities=acts,
                    schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1),
                )
                prof.__enter__()
            elif profiled:
                prof.step()  # recording starts
            sync(device)
            dist.barrier()  # the ranks start together (Gloo; no device collective)
            before = handle.stats() if odc else None
            phases = Phases(device)
            t0 = time.perf_counter()
            phases.mark()
            for t in tokens:
                (model([t.to(device, non_blocking=True)]) * scale).backward()
            phases.mark()
            if odc:
                torch_odc.minibatch_barrier()
            phases.mark()
            opt.step()
            opt.zero_grad(set_to_none=True)
            phases.mark()
            sync(device)
            wall = time.perf_counter() - t0
            if profiled:
                prof.__exit__(None, None, None)
            if odc:
                moved = handle.stats()["last"]  # this minibatch's counters
            micro_s, barrier_s, step_s = phases.seconds()
            row = {"wall_s": wall, "micro_s": micro_s, "barrier_s": barrier_s, "step_s": step_s}
            if odc and "host_s" in before:
                # ODC's own host time without the profiler: its entry points' host clock
                # (torch_odc.stats()["host_s"]) less the barrier's waits.
                after = handle.stats()
                waits = [
                    sum(x["total"].get(k, 0.0) for k in ("barrier_wait_s", "publish_wait_s"))
                    for x in (before, after)
                ]
                row["odc_host_s"] = after["host_s"] - before["host_s"]
                row["odc_host_wait_s"] = waits[1] - waits[0]
                # apart: the barrier's (in its clock) and those for peers' publishes (in the
                # gathers' clock, where a gather waits on the host: the CPU transport)
                row["odc_host_waits_by_kind_s"] = {
                    kind: after["total"].get(k, 0.0) - before["total"].get(k, 0.0)
                    for kind, k in (("barrier", "barrier_wait_s"), ("gather", "publish_wait_s"))
                }
                if "host_by_kind_s" in after:  # per entry point (the barrier's waits in it)
                    row["odc_host_by_kind_s"] = {
                        k: v - before["host_by_kind_s"][k]
                        for k, v in after["host_by_kind_s"].items()
                    }
                if "cpp_host_s" in after:  # the C++ part of the keyed calls
                    row["odc_cpp_host_s"] = {
                        k: v - before["cpp_host_s"][k] for k, v in after["cpp_host_s"].items()
                    }
            if profiled:
                events = prof.events()
                prof_out = {
                    "row": row,
                    "gpu": gpu_breakdown(events) if device.type == "cuda" else None,
                    "host_odc": host_odc_time(events),
                }
            elif args.warmup <= i < total - 2:
                rows.append(row)
            gc.collect()
    finally:
        gc.enable()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if handle is not None:
        handle.detach()
    del model, opt, handle
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "rows": rows,
        "profiled": prof_out,
        "n_params": n_params,
        "moved": moved,
        "allocator_peak_bytes": peak,
    }


def time_copies(nbytes: int, calls: int, device, iters: int, cap: int) -> dict:
    """Seconds of moving `nbytes` with a plain device-to-device copy_: as one copy (in pieces of
    at most `cap` bytes: the buffers are bounded) and in `calls` equal pieces (one per ODC call
    that moved them); median over `iters` after 2 warmups."""
    if nbytes <= 0 or calls <= 0:
        return {"bytes": nbytes, "calls": calls, "one_copy_s": 0.0, "per_call_s": 0.0}
    piece = max(16, nbytes // calls // 16 * 16)
    size = min(max(nbytes, piece), cap)
    src = torch.randn((size + 1) // 2, dtype=torch.bfloat16, device=device).view(torch.uint8)
    dst = torch.empty_like(src)

    def pieces(length):
        """(offset, length) slices that move `nbytes` in copies of `length`, cycling the buffer."""
        out, left, off = [], nbytes, 0
        while left > 0:
            n = min(length, left, src.numel())
            if off + n > src.numel():
                off = 0
            out.append((off, n))
            off, left = off + n, left - n
        return out

    def timed(plan) -> float:
        samples = []
        for it in range(iters + 2):
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            else:
                t0 = time.perf_counter()
            for off, n in plan:
                dst[off : off + n].copy_(src[off : off + n])
            if device.type == "cuda":
                end.record()
                end.synchronize()
                s = start.elapsed_time(end) / 1e3
            else:
                s = time.perf_counter() - t0
            if it >= 2:
                samples.append(s)
        return statistics.median(samples)

    out = {
        "bytes": nbytes,
        "calls": calls,
        "piece_bytes": piece,
        "one_copy_s": timed(pieces(src.numel())),
        "per_call_s": timed(pieces(piece)),
    }
    src = dst = None
    return out


def reference(args, device, moved) -> dict:
    """The physical reference for this rank's minibatch, timed while every other rank waits."""
    out = None
    for r in range(dist.get_world_size()):
        sync(device)
        dist.barrier()
        if r == dist.get_rank():
            out = {
                "gathered": time_copies(
                    moved["bytes_fetched"],
                    moved["keyed_gathers"],
                    device,
                    args.copy_iters,
                    args.copy_cap_mib * MiB,
                ),
                "pushed": time_copies(
                    moved["bytes_pushed"],
                    moved["keyed_reduce_scatters"],
                    device,
                    args.copy_iters,
                    args.copy_cap_mib * MiB,
                ),
            }
            sync(device)
    dist.barrier()
    return out


def summarize(cfg, per_rank) -> dict:
    """Slowest rank per minibatch, median over minibatches; GPU categories per minibatch."""
    n = len(per_rank[0][cfg]["rows"])
    walls = [max(r[cfg]["rows"][i]["wall_s"] for r in per_rank) for i in range(n)]
    out = {
        "minibatch_s_median": statistics.median(walls),
        "minibatch_s": walls,
        "minibatch_s_min": min(walls),
    }
    for phase in ("micro_s", "barrier_s", "step_s"):
        out[phase + "_median"] = statistics.median(
            max(r[cfg]["rows"][i][phase] for r in per_rank) for i in range(n)
        )
    if all("odc_host_s" in row for r in per_rank for row in r[cfg]["rows"]):
        # Unprofiled: per rank, the median over the measured minibatches of ODC's host time
        # outside the barrier's waits; the worst rank against the median minibatch.
        own = [
            statistics.median(row["odc_host_s"] - row["odc_host_wait_s"] for row in r[cfg]["rows"])
            for r in per_rank
        ]
        out["host_odc_unprofiled_ms_per_rank"] = [1e3 * x for x in own]
        out["host_odc_unprofiled_waits_ms_per_rank"] = [
            1e3 * statistics.median(row["odc_host_wait_s"] for row in r[cfg]["rows"])
            for r in per_rank
        ]
        out["host_odc_unprofiled_share_max"] = max(own) / out["minibatch_s_median"]
        rows0 = per_rank[0][cfg]["rows"]
        if all("odc_host_by_kind_s" in row for r in per_rank for row in r[cfg]["rows"]):
            # per entry point, medians over the minibatches, less the waits inside it
            def kind_ms(rows, kind):
                return 1e3 * statistics.median(
                    row["odc_host_by_kind_s"][kind] - row["odc_host_waits_by_kind_s"].get(kind, 0.0)
                    for row in rows
                )

            out["host_odc_unprofiled_by_kind_ms_per_rank"] = [
                {k: kind_ms(r[cfg]["rows"], k) for k in rows0[0]["odc_host_by_kind_s"]}
                for r in per_rank
            ]
        if all("odc_cpp_host_s" in row for r in per_rank for row in r[cfg]["rows"]):
            out["host_odc_cpp_ms_per_rank"] = [  # less the publish waits, inside C++ too
                {
                    k: 1e3
                    * statistics.median(
                        row["odc_cpp_host_s"][k] - row["odc_host_waits_by_kind_s"].get(k, 0.0)
                        for row in r[cfg]["rows"]
                    )
                    for k in rows0[0]["odc_cpp_host_s"]
                }
                for r in per_rank
            ]
    gpus = [r[cfg]["profiled"]["gpu"] for r in per_rank]
    if all(g is not None for g in gpus):
        out["gpu_ms_per_rank"] = [
            {k: v / 1e3 for k, v in g["by_category_us"].items()} | {"total": g["total_us"] / 1e3}
            for g in gpus
        ]
        out["gpu_ms_mean"] = {
            k: statistics.mean(g[k] for g in out["gpu_ms_per_rank"])
            for k in out["gpu_ms_per_rank"][0]
        }
        for key in ("odc_share", "odc_with_other_share", "nccl_share"):
            out[key + "_per_rank"] = [g[key] for g in gpus]
            out[key + "_max"] = max(g[key] or 0.0 for g in gpus)
        out["odc_other_by_range_ms_per_rank"] = [
            {k: v / 1e3 for k, v in g["odc_other_by_range_us"].items()} for g in gpus
        ]
        out["unmatched_launches_per_rank"] = [g["unmatched_launches"] for g in gpus]
        out["activities_per_rank"] = [g["activities"] for g in gpus]
    hosts = [r[cfg]["profiled"]["host_odc"] for r in per_rank]
    out["host_odc_ms_per_rank"] = [h["total_us"] / 1e3 for h in hosts]
    out["host_odc_waits_ms_per_rank"] = [h.get("waits_us", 0.0) / 1e3 for h in hosts]
    out["host_odc_outside_waits_ms_per_rank"] = [
        h.get("outside_waits_us", h["total_us"]) / 1e3 for h in hosts
    ]
    # ODC's own host work against the minibatch: its profiled time (the profiler inflates every
    # range) over the median measured minibatch (not inflated), i.e. an upper bound.
    out["host_odc_outside_waits_share_max"] = (
        max(out["host_odc_outside_waits_ms_per_rank"]) / 1e3 / out["minibatch_s_median"]
    )
    out["host_odc_by_kind_ms_per_rank"] = [
        {k: {"ms": v["us"] / 1e3, "calls": v["calls"]} for k, v in h["by_kind"].items()}
        for h in hosts
    ]
    out["profiled_minibatch_wall_s"] = max(r[cfg]["profiled"]["row"]["wall_s"] for r in per_rank)
    out["allocator_peak_bytes_per_rank"] = [r[cfg]["allocator_peak_bytes"] for r in per_rank]
    out["n_params"] = per_rank[0][cfg]["n_params"]
    return out


def make_result(per_rank, configs, title, device_type, shared, env) -> dict:
    """What rank 0 writes: the summary per configuration and every rank's bytes and copies."""
    return {
        "title": title,
        "device_type": device_type,
        "world": len(per_rank),
        "ranks_share_a_gpu": shared,
        "environment": env,
        "configs": {cfg: summarize(cfg, per_rank) for cfg in configs},
        "moved_per_rank": [r["odc"]["moved"] for r in per_rank],
        "reference_per_rank": [r["reference"] for r in per_rank],
        "reference_rank0": per_rank[0]["reference"],
    }


def environment(args, world, device, gpus) -> dict:
    def run(*cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=20)
            return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            return "unavailable"

    def dirty():
        """Whether tracked files differ from the commit (None: no git)."""
        try:
            return bool(
                subprocess.run(
                    ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=20,
                ).stdout.strip()
            )
        except (OSError, subprocess.SubprocessError):
            return None

    cuda = device.type == "cuda"
    return {
        "command": f"torchrun --nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', world)} "
        + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "gpus_visible": gpus,
        "cpus": os.cpu_count(),
        "driver": run("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        if cuda
        else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # ODC_GIT_COMMIT: a tree copied without its .git (device runs of `git archive`).
        "git_commit": os.environ.get("ODC_GIT_COMMIT")
        or run("git", "-C", ROOT, "rev-parse", "HEAD"),
        "git_dirty": dirty(),
        "args": vars(args),
    }


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(result["configs"])
    palette = plt.get_cmap("tab20")
    fig, (ax, ax2, ax3) = plt.subplots(
        1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [max(2, len(configs)), 3, 2]}
    )
    top = 0.0
    for i, cfg in enumerate(configs):
        s = result["configs"][cfg]
        gpu = s.get("gpu_ms_mean")
        if gpu is None:  # CPU: the phases of the minibatch on the host clock
            parts = [
                ("microbatches", s["micro_s_median"] * 1e3),
                ("barrier", s["barrier_s_median"] * 1e3),
                ("optimizer step", s["step_s_median"] * 1e3),
            ]
        else:
            parts = [(c, gpu[c]) for c in CATEGORIES if gpu[c] > 0]
        bottom = 0.0
        for j, (label, v) in enumerate(parts):
            color = palette(CATEGORIES.index(label) if label in CATEGORIES else j)
            ax.bar(i, v, bottom=bottom, color=color, label=label)
            bottom += v
        share = s.get("odc_share_max") if cfg == "odc" else s.get("nccl_share_max")
        who = "ODC kernels" if cfg == "odc" else cfg
        note = f"{bottom:.0f} ms" + (f"\n{who} {share:.1%}" if share is not None else "")
        ax.text(i, bottom, note, ha="center", va="bottom", fontsize=8)
        top = max(top, bottom)
    ax.set_ylim(0, top * 1.18)
    ax.set_xticks(range(len(configs)), configs)
    ax.set_ylabel(
        "GPU ms per minibatch (mean over ranks)"
        if result["device_type"] == "cuda"
        else "host ms per minibatch (CPU run)"
    )
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="lower right")
    ax.set_title(result["title"], fontsize=9)
    odc = result["configs"].get("odc")
    ref = result["reference_rank0"]
    # Middle: ODC's kernels vs a plain copy of the same bytes (rank 0).
    gpu = (odc.get("gpu_ms_per_rank") or [None])[0]
    bars = []
    for what, kern, color in (
        ("gathered", "odc_gather", palette(0)),
        ("pushed", "odc_push", palette(2)),
    ):
        bars += [
            (f"{what}:\none copy", ref[what]["one_copy_s"] * 1e3, "0.6"),
            (f"{what}:\n{ref[what]['calls']} copies", ref[what]["per_call_s"] * 1e3, "0.6"),
        ]
        if gpu:
            bars.append((f"{kern}\nkernels", gpu[kern], color))
    for k, (label, v, color) in enumerate(bars):
        ax2.bar(k, v, color=color)
        ax2.text(k, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax2.set_ylim(0, max(v for _, v, _ in bars) * 1.12 or 1.0)
    ax2.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax2.set_ylabel("ms per minibatch, rank 0")
    ax2.set_title(
        f"bytes moved by rank 0: {ref['gathered']['bytes'] / MiB:.1f} MiB gathered, "
        f"{ref['pushed']['bytes'] / MiB:.1f} MiB pushed; plain copies (grey)",
        fontsize=9,
    )
    # Right: host time inside ODC calls by kind (rank 0; nested kinds each in full).
    kinds = odc["host_odc_by_kind_ms_per_rank"][0]
    names = sorted(kinds)
    ax3.barh(range(len(names)), [kinds[n]["ms"] for n in names], color=palette(6))
    ax3.set_yticks(range(len(names)), [f"{n} ({kinds[n]['calls']})" for n in names], fontsize=7)
    ax3.set_xlabel("host ms per minibatch, rank 0 (calls)")
    ax3.set_title(f"host in ODC calls: {odc['host_odc_ms_per_rank'][0]:.1f} ms in all", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result) -> str:
    configs = list(result["configs"])
    rows = [
        (
            "minibatch s (median, slowest rank)",
            [f"{result['configs'][c]['minibatch_s_median']:.3f}" for c in configs],
        ),
        *[
            (f"  {label} s", [f"{result['configs'][c][p + '_median']:.3f}" for c in configs])
            for label, p in (
                ("microbatches", "micro_s"),
                ("barrier", "barrier_s"),
                ("optimizer step", "step_s"),
            )
        ],
    ]
    gpu = [result["configs"][c].get("gpu_ms_mean") for c in configs]
    if any(gpu):
        rows.append(
            (
                "GPU ms per minibatch (mean of ranks)",
                [f"{g['total']:.1f}" if g else "-" for g in gpu],
            )
        )
        for cat in CATEGORIES:
            if any(g and g[cat] > 0 for g in gpu):
                rows.append((f"  {cat}", [f"{g[cat]:.2f}" if g else "-" for g in gpu]))
        share = [
            result["configs"][c]["odc_share_max" if c == "odc" else "nccl_share_max"]
            for c in configs
        ]  # ODC's: at most 10% (issue 23)
        rows.append(("comm. kernels share (worst rank)", [f"{x:.1%}" for x in share]))
        rows.append(
            (
                "  with ODC's other device work",
                [
                    f"{result['configs'][c]['odc_with_other_share_max']:.1%}" if c == "odc" else "-"
                    for c in configs
                ],
            )
        )
    rows.append(
        (
            "host ms in ODC calls (max rank)",
            [
                f"{max(result['configs'][c]['host_odc_ms_per_rank']):.1f}" if c == "odc" else "-"
                for c in configs
            ],
        )
    )
    if "host_odc_unprofiled_ms_per_rank" in result["configs"].get("odc", {}):
        odc_cfg = result["configs"]["odc"]
        rows.append(
            (
                "ODC host ms outside waits, unprofiled (max)",
                [
                    f"{max(odc_cfg['host_odc_unprofiled_ms_per_rank']):.1f}" if c == "odc" else "-"
                    for c in configs
                ],
            )
        )
        rows.append(
            (
                "  share of the minibatch",
                [
                    f"{odc_cfg['host_odc_unprofiled_share_max']:.2%}" if c == "odc" else "-"
                    for c in configs
                ],
            )
        )
        cpp = odc_cfg.get("host_odc_cpp_ms_per_rank")
        cpp_kind = {"gather": "gather", "push": "push", "root_pre_forward": "publish"}
        for kind in (odc_cfg.get("host_odc_unprofiled_by_kind_ms_per_rank") or [{}])[0]:
            worst = max(r[kind] for r in odc_cfg["host_odc_unprofiled_by_kind_ms_per_rank"])
            text = f"{worst:.2f}"
            if cpp and kind in cpp_kind:  # of which in the C++ of the keyed calls
                text += f" ({max(r[cpp_kind[kind]] for r in cpp):.2f})"
            rows.append(
                (
                    f"    {kind} ms, unprofiled (max; C++ part)",
                    [text if c == "odc" else "-" for c in configs],
                )
            )
    if "host_odc_outside_waits_ms_per_rank" in result["configs"].get("odc", {}):
        odc_cfg = result["configs"]["odc"]
        rows.append(
            (
                "  outside the barrier's waits, profiled (max)",
                [
                    f"{max(odc_cfg['host_odc_outside_waits_ms_per_rank']):.1f}"
                    if c == "odc"
                    else "-"
                    for c in configs
                ],
            )
        )
        rows.append(
            (
                "  share of the minibatch",
                [
                    f"{odc_cfg['host_odc_outside_waits_share_max']:.2%}" if c == "odc" else "-"
                    for c in configs
                ],
            )
        )
    odc_kinds = result["configs"].get("odc", {}).get("host_odc_by_kind_ms_per_rank")
    if odc_kinds:
        worst = {}
        for rank_kinds in odc_kinds:
            for kind, v in rank_kinds.items():
                per_call = 1e3 * v["ms"] / max(1, v["calls"])
                if per_call > worst.get(kind, (0.0, 0))[0]:
                    worst[kind] = (per_call, v["calls"])
        for kind in sorted(worst):
            rows.append(
                (
                    f"  us per {kind} (worst rank, calls)",
                    [
                        f"{worst[kind][0]:.1f} ({worst[kind][1]})" if c == "odc" else "-"
                        for c in configs
                    ],
                )
            )
    width = max(len(r[0]) for r in rows) + 2
    lines = [result["title"], f"{'':<{width}}" + "".join(f"{c:>14}" for c in configs)]
    lines += [f"{name:<{width}}" + "".join(f"{v:>14}" for v in vals) for name, vals in rows]
    ref = result.get("reference_rank0")
    odc = result["configs"].get("odc")
    if ref and odc:
        g = (odc.get("gpu_ms_per_rank") or [None])[0]
        for what, kern in (("gathered", "odc_gather"), ("pushed", "odc_push")):
            r = ref[what]
            have = f"{kern} kernels {g[kern]:.2f} ms vs " if g else ""
            lines.append(
                f"rank 0 {what} {r['bytes'] / MiB:.1f} MiB in {r['calls']} calls: "
                f"{have}plain copy {r['one_copy_s'] * 1e3:.2f} ms "
                f"({r['per_call_s'] * 1e3:.2f} ms in {r['calls']} pieces)"
            )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096, help="tokens per microbatch")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per rank")
    p.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation checkpointing of every layer",
    )
    p.add_argument("--warmup", type=int, default=2, help="minibatches before the measured ones")
    p.add_argument("--minibatches", type=int, default=8, help="measured minibatches")
    p.add_argument(
        "--baseline",
        choices=["auto", "on", "off"],
        default="auto",
        help="also run plain FSDP2 over NCCL (gloo on CPU); auto: when every rank "
        "has a GPU of its own",
    )
    p.add_argument("--copy-iters", type=int, default=10)
    p.add_argument(
        "--copy-cap-mib",
        type=int,
        default=1024,
        help="largest copy buffer of the reference (a larger total cycles it)",
    )
    p.add_argument("--out", default="benchmarks/results/step")
    p.add_argument("--tag", default=None)
    p.add_argument("--plot", default=None, metavar="JSON", help="only redraw the PNG of a result")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot.removesuffix(".json") + ".png")
        return

    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local % gpus)  # with fewer GPUs than ranks, ranks share
        torch.cuda.set_device(device)
        own_gpu = gpus >= local_world
    else:
        gpus, device, own_gpu = 0, torch.device("cpu"), True
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group(backend="odc", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    baseline = args.baseline == "on" or (
        args.baseline == "auto" and own_gpu and args.device == "cuda"
    )
    if baseline and not own_gpu:
        raise SystemExit("--baseline on needs a GPU per rank (NCCL refuses ranks sharing one)")
    configs = {"odc": dist.group.WORLD}
    if baseline:
        configs["nccl" if args.device == "cuda" else "gloo"] = dist.new_group(
            backend="nccl" if args.device == "cuda" else "gloo"
        )
    res = {cfg: run_config(cfg, args, device, group) for cfg, group in configs.items()}
    res["reference"] = reference(args, device, res["odc"]["moved"])
    per_rank = [None] * world
    dist.all_gather_object(per_rank, res)
    if rank == 0:
        share = "sharing " if not own_gpu else ""
        where = (
            f"{world} ranks {share}on {min(gpus, world)} x {torch.cuda.get_device_name(device)}"
            if args.device == "cuda"
            else f"{world} CPU ranks"
        )
        title = (
            f"{args.layers} layers x {args.dim}, {args.microbatches} x {args.seq} tokens "
            f"per rank, {where}"
        )
        result = make_result(
            per_rank,
            list(configs),
            title,
            args.device,
            not own_gpu,
            environment(args, world, device, gpus),
        )
        tag = args.tag or (
            f"{min(gpus, world)}gpu_{world}ranks" if args.device == "cuda" else f"{world}cpu"
        )
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, f"step_{tag}")
        with open(base + ".json", "w") as f:
            json.dump(result, f, indent=1)
        plot(result, base + ".png")
        print(table(result), flush=True)
        print(f"wrote {base}.json and .png", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
