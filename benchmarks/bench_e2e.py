"""End-to-end training benchmark: FSDP2 over NCCL with LB-Micro vs ODC with LB-Mini / LB-Micro.

Launch one process per GPU (the device runs; see docs/benchmarks.md):

    torchrun --nproc-per-node=4 benchmarks/bench_e2e.py --out benchmarks/results/e2e

A Llama-style decoder (RMSNorm, rotary, SwiGLU, causal flash attention; random init, no
downloads) trained with bf16 compute, fp32 master weights and fp32 gradient reduction, activation
checkpointing, per-layer fully_shard plus root. One sequence per microbatch (no padding), or with
--pack-tokens N sequences packed back to back up to N tokens with document-causal varlen flash
attention. Configurations, on the same seeded samples and one shared cost model (run each in its
own process and --merge the results: benchmarks/device/device_run.sh e2e):

* ``nccl-micro``: plain FSDP2 on an NCCL group, LB-Micro plan (same microbatch count per rank);
* ``odc-mini``:   FSDP2 + torch_odc.attach on the "odc" group, LB-Mini plan;
* ``odc-micro``:  the same with the LB-Micro plan (isolates the transport from the balancing).

Per configuration: tokens/s per GPU and MFU over the measured minibatches; per-rank busy time and
idle fractions over one more, profiled minibatch (busy = the union of the rank's compute kernels;
communication kernels, ODC waits and peer copies excluded; idle = 1 - busy / wall, split into
blocked = time in communication only or waiting at the end for the slowest rank, and host gap =
no kernel running, the GPU waiting for the host); the plan's own idle bound; GPU time per
microbatch (CUDA events); peak memory and the ODC region; the planner's predicted makespan ratio
micro/mini for the same data. On CPU (a smoke test of the code path: --device cpu, tiny model)
busy is the host time and only indicative.

``--model 7b`` (Llama-2-7B's shape, 2 GPUs; docs/benchmarks.md, "7B-class on 2 GPUs") is built
on the meta device and each rank initializes only its own shards after fully_shard, trains
with SGD (AdamW's states do not fit beside its long-context activations; the arithmetic is at
MODELS) and reports ODC's memory beside FSDP2's per sharded parameter. ``--dry-plan`` prints,
without a GPU, the plans, planner bound, memory arithmetic and modeled run time.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import socket
import sys
import time
import warnings
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import equal, long_context, rl_like

import torch_odc
from torch_odc import balance

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
WORKLOADS = {
    "long-context": long_context,
    "rl": rl_like,
    "equal": equal,
    # RL as RL trainers run it: the same sequences as "rl" (same seed), packed into
    # microbatches of up to --rl-pack-tokens tokens (document-causal varlen attention).
    "rl-packed": rl_like,
}
MODELS = {  # name: (dim, layers, heads, kv_heads, ffn, vocab)
    "1b": (2048, 19, 16, 8, 5632, 32000),  # 1.03e9 parameters
    "7b": (4096, 32, 32, 32, 11008, 32000),  # Llama-2-7B's shape: 6.74e9 parameters
    "tiny": (64, 2, 4, 2, 176, 512),
}
# 7B on 2 x H100 80GB (docs/benchmarks.md, "7B-class on 2 GPUs"). Per rank, 3.37e9 sharded
# parameters: fp32 master 12.55 GiB, fp32 gradients 12.55 GiB (FSDP2's .grad; under ODC the
# accumulators, of which .grad is a view), ODC's bf16 published cache 6.28 GiB; AdamW's two fp32
# states would add 25.1 GiB. Activations per token of a microbatch (bf16, checkpointing): the
# 32 layer inputs, 32 x 8 KB = 256 KB, held until the backward reaches them, plus the larger of
# one layer's recompute with its backward (~255 KB: q, k, v, rotary, attention, norms, the
# 2 x 11008 SwiGLU input, their gradients) and the fp32 log-softmax of the chunked loss (128
# KB): ~0.5 MiB per token, 31 GiB at the longest sequence run (63165 tokens, long-context),
# plus FSDP2's unsharded layers (two bf16 layers of 386 MiB, a layer's bf16 gradients and the
# fp32 reduce-scatter input, the root's 500 MiB embedding and head), ~2.4 GiB. With SGD, ODC's
# peak is ~12.55 + 18.8 (region) + 2.4 + 30.4 = ~64 GiB; FSDP2's ~45 (the longest sequence runs
# first, before its .grad exists; ~58 with it); with AdamW ~89 GiB: it does not fit, and leaves
# ~14 GiB of activations (~28K tokens). So 7B runs SGD (no state; the step is outside the timed
# window, and the memory ODC adds beside FSDP2 is the same either way). `memory_estimate` and
# --dry-plan compute this.
DEFAULT_OPTIMIZER = {"7b": "sgd"}  # the others: adamw
META_INIT = ("7b",)  # built on the meta device, initialized shard by shard after fully_shard
# The cost model's lengths per model (None: calibration_lengths): 7B costs ~8x 1B per token, so
# six points, one warmup pass over two short lengths.
CALIBRATION = {"7b": ([509, 2039], [1021, 3067, 6143, 12281, 24571, 32749])}
H200_BF16_DENSE_FLOPS = 989.4e12
COMM_KERNELS = (
    "nccl",
    "publishKernel",
    "publishFlagsKernel",
    "Memcpy PtoP",
    "odcWaitAll",
    "odcGather",
    "odcPush",
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * (
            self.weight
        )


def rotary_tables(positions, head_dim: int, dtype, base: float = 500000.0):
    """cos / sin of every token's position, (T, 1, head_dim / 2): computed once per microbatch
    and shared by every layer (per-layer recomputation is host work on the critical path)."""
    inv = 1.0 / base ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    ang = positions.float()[:, None] * inv[None]
    return ang.cos().to(dtype)[:, None], ang.sin().to(dtype)[:, None]


def rotary(x, cos, sin):
    """x: (..., T, heads, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Docs:
    """The documents packed into one microbatch: token offsets (cu_seqlens) and the longest."""

    def __init__(self, lengths, device):
        self.lengths = [int(n) for n in lengths]
        cu = torch.from_numpy(np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32))
        if torch.device(device).type == "cuda":  # no host sync: pinned, asynchronous copy
            cu = cu.pin_memory()
        self.cu = cu.to(device, non_blocking=True)
        self.max_len = max(self.lengths)


def attention(q, k, v, docs: Docs):
    """Causal attention within each document of a packed microbatch; q, k, v: (T, heads, d)."""
    if len(docs.lengths) == 1:  # one sequence: SDPA's flash path
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
        )
        return att[0].transpose(0, 1)
    if q.is_cuda:  # packed: varlen flash attention, no padding and no cross-document attention
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(
            q, k, v, docs.cu, docs.cu, docs.max_len, docs.max_len, window_size=(-1, 0)
        )
    outs, start = [], 0  # CPU (smoke tests): one SDPA per document
    for n in docs.lengths:
        sl = slice(start, start + n)
        outs.append(attention(q[sl], k[sl], v[sl], Docs([n], q.device)))
        start += n
    return torch.cat(outs)


class LlamaBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin, docs: Docs):
        t = x.shape[0]  # x: (T, dim), the microbatch's documents back to back
        h = self.attn_norm(x)
        q = self.wq(h).view(t, self.heads, self.head_dim)
        k, v = self.wkv(h).view(t, 2, self.kv_heads, self.head_dim).unbind(1)
        # Expand the kv heads so the flash kernels run (their GQA support varies by version).
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = attention(rotary(q, cos, sin), rotary(k, cos, sin), v, docs)
        x = x + self.wo(att.reshape(t, -1))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, dim, layers, heads, kv_heads, ffn, vocab, checkpointing=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.checkpointing = checkpointing
        self.head_dim = dim // heads

    def forward(self, seqs, chunk: int = 8192):
        """Summed next-token loss of a microbatch of sequences (1-D token tensors of length n + 1),
        packed back to back; the LM head runs in chunks to bound memory."""
        device = seqs[0].device
        inputs = torch.cat([s[:-1] for s in seqs])
        targets = torch.cat([s[1:] for s in seqs])
        docs = Docs([s.numel() - 1 for s in seqs], device)
        positions = torch.cat([torch.arange(n, device=device) for n in docs.lengths])
        x = self.embed(inputs)
        cos, sin = rotary_tables(positions, self.head_dim, x.dtype)
        for layer in self.layers:
            if self.checkpointing:
                x = checkpoint(layer, x, cos, sin, docs, use_reentrant=False)
            else:
                x = layer(x, cos, sin, docs)
        x = self.norm(x)
        total = x.new_zeros((), dtype=torch.float32)
        for s in range(0, x.shape[0], chunk):
            logits = self.head(x[s : s + chunk]).float()
            total = total + F.cross_entropy(logits, targets[s : s + chunk], reduction="sum")
        return total


def model_flops(lengths, n_params: float, layers: int, dim: int) -> float:
    """Training flops (forward + backward, no recompute): 6 N L + 6 layers dim L^2 (causal)."""
    return float(sum(6 * n_params * n + 6 * layers * dim * n * n for n in lengths))


def plans(lengths, world, mode, cost, pack_tokens: int = 1):
    """Microbatches of at most `pack_tokens` tokens; the default cap of one token makes every
    sequence its own microbatch."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", balance.OversizedSequenceWarning)
        return balance.plan([int(n) for n in lengths], world, pack_tokens, mode=mode, cost=cost)


class CostModel(tuple):
    """Seconds of a sequence = floor + dense flops / dense rate + attention flops / attention
    rate (flops as in balance.flops_cost: 6 N L dense, 6 layers dim L^2 attention). Two rates,
    because attention kernels and GEMMs run at different speeds and long-context and RL
    workloads weigh them differently."""

    def __new__(cls, dense_rate: float, attn_rate: float, floor: float):
        return super().__new__(cls, (float(dense_rate), float(attn_rate), float(floor)))

    dense_rate = property(lambda self: self[0])
    attn_rate = property(lambda self: self[1])
    floor = property(lambda self: self[2])

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """'DENSE,ATTN,FLOOR' (or 'RATE,FLOOR': one rate for both)."""
        v = [float(x) for x in text.split(",")]
        return cls(v[0], v[0], v[1]) if len(v) == 2 else cls(*v)

    def __str__(self):
        return f"{self.dense_rate:.10g},{self.attn_rate:.10g},{self.floor:.10g}"


def time_cost(model: CostModel, n_params: float, layers: int, dim: int, pack_tokens: int = 1):
    """Seconds of one sequence under `model` (fitted by `calibrate`), as the library's
    `balance.TimeCost`: GPU time at the measured rates plus the per-microbatch floor (the host
    and fixed GPU time every microbatch pays: issuing every layer's forward, recompute and
    backward with FSDP2's hooks). A sequence that shares a packed microbatch pays its token
    share of the floor."""
    return balance.TimeCost(
        model.floor, model.dense_rate, model.attn_rate, n_params, layers, dim, max(1, pack_tokens)
    )


def calibration_lengths(scale: float = 1.0):
    """The lengths the cost model is fitted on: 512 to 48K tokens, none repeated (a real
    workload brings new lengths all the time, and first use of a shape costs host time)."""
    base = [509, 1021, 2039, 3067, 4093, 6143, 8191, 12281, 16381, 24571, 32749, 49139]
    return [max(2, int(n * scale)) for n in base]


def fit_cost(samples, n_params: float, layers: int, dim: int) -> CostModel:
    """`balance.TimeCost.fit` (least squares in relative error) as a CostModel."""
    t = balance.TimeCost.fit(samples, num_params=n_params, num_layers=layers, hidden_size=dim)
    return CostModel(t.dense_flops_per_s, t.attention_flops_per_s, t.floor_s)


def calibrate(args, device, nccl_group):
    """Fits the cost model on this machine: one warmup pass, then one timed pass over lengths
    this process has not run (`calibration_lengths`, or the model's own in CALIBRATION), each
    sequence its own microbatch under ODC, timed from issue to GPU completion. Every rank fits
    its own; the slowest rates and the largest floor over ranks are kept, so every rank plans
    with the same numbers."""
    dim, layers, vocab = MODELS[args.model][0], MODELS[args.model][1], MODELS[args.model][5]
    model, handle, n_params = build(args, device, "odc")
    lengths = calibration_lengths(args.length_scale)
    warm = [n + 3 for n in lengths]
    if args.model in CALIBRATION:
        warm, lengths = (
            [max(2, int(n * args.length_scale)) for n in x] for x in CALIBRATION[args.model]
        )
    samples = []
    for timed in (False, True):
        for n in lengths if timed else warm:
            tokens = torch.randint(0, vocab, (n + 1,), device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model([tokens]).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if timed:
                samples.append((n, time.perf_counter() - t0))
    torch_odc.minibatch_barrier()
    handle.detach()
    del model
    fit = fit_cost(samples, n_params, layers, dim)
    vals = torch.tensor(
        [-fit.dense_rate, -fit.attn_rate, fit.floor],
        dtype=torch.float64,
        device=device if device.type == "cuda" else "cpu",
    )
    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=nccl_group)
    agreed = CostModel(-float(vals[0]), -float(vals[1]), float(vals[2]))
    if dist.get_rank() == 0:
        fitted = time_cost(agreed, n_params, layers, dim)
        print(
            "calibration (length: seconds measured on rank 0 / modeled): "
            + ", ".join(f"{n}: {t:.3f}/{fitted(n):.3f}" for n, t in samples),
            flush=True,
        )
    return agreed


def hsdp_mesh(device, replicas: int, shards: int, backend):
    """A (replicas x shards) HSDP mesh over groups of `backend` (None: the default, "odc"):
    rank r is in shard group r // shards and replicate group r % shards."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, layout = dist.get_rank(), torch.arange(replicas * shards).view(replicas, shards)
    shard = replicate = None
    for row in layout.tolist():  # every rank creates every group, in the same order
        group = dist.new_group(row, backend=backend)
        shard = group if rank in row else shard
    for col in layout.t().tolist():
        group = dist.new_group(col, backend=backend)
        replicate = group if rank in col else replicate
    return DeviceMesh.from_group(
        [replicate, shard], device.type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


def build(args, device, kind, eager_publish=True):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dim, layers, heads, kv_heads, ffn, vocab = MODELS[args.model]
    torch.manual_seed(0)
    meta = args.model in META_INIT or getattr(args, "meta_init", False)
    with torch.device("meta" if meta else device):
        model = Llama(dim, layers, heads, kv_heads, ffn, vocab)
    odc = kind == "odc"
    if args.mesh:  # HSDP: ODC inside each shard group vs FSDP2-HSDP over NCCL, same mesh
        backend = None if odc else ("nccl" if device.type == "cuda" else "gloo")
        mesh = hsdp_mesh(device, *args.mesh, backend)
    else:
        group = dist.group.WORLD if odc else build.nccl_group
        mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if meta:  # only this rank's shards are ever allocated
        model.to_empty(device=device)
        init_shards(model, device, seed=dist.get_rank())
    handle = torch_odc.attach(model, eager_publish=eager_publish) if odc else None
    return model, handle, sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_shards(model, device, seed: int):
    """Random weights written into each rank's own shards (after `to_empty`), distributed as
    the modules' defaults: norms 1, embedding N(0, 1), linear weights U(+-1 / sqrt(fan_in)).
    Seeded by rank, so every configuration starts from the same values."""
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # a view of the shard
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name == "embed.weight":
            local.normal_(0.0, 1.0, generator=gen)
        else:
            bound = p.shape[1] ** -0.5  # the global (out, in) shape
            local.uniform_(-bound, bound, generator=gen)


def merged_busy(intervals):
    """Union of (start, end) intervals: total length and the merged spans."""
    spans, total = [], 0.0
    for s, e in sorted(intervals):
        if spans and s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], e)
        else:
            spans.append([s, e])
    for s, e in spans:
        total += e - s
    return total, spans


class SyncReport:
    """Collects the Python stacks of CUDA synchronizations (torch.cuda.set_sync_debug_mode)."""

    def __init__(self):
        import collections
        import traceback

        self.sites = collections.Counter()
        self._format = traceback.format_stack
        self._show = warnings.showwarning

    def __enter__(self):
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                self.sites["".join(self._format(limit=8)[:-1])] += 1
            else:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._show
        for stack, n in self.sites.most_common():
            print(f"--- {n} synchronizing operation(s) at:\n{stack}", flush=True)
        if not self.sites:
            print("--- no synchronizing operation in the measured minibatches", flush=True)


LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchCooperativeKernel",
    "cudaMemcpy",
    "cudaMemsetAsync",
)


def launch_times(events) -> dict:
    """Correlation id -> host start time (us) of the CUDA runtime call that launched it (the
    profiler records these with its CUDA activity; kernels carry the same id)."""
    return {
        e.id: e.time_range.start
        for e in events
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(LAUNCH_CALLS)
    }


def kernel_breakdown(kernels, launched=None) -> dict:
    """Splits a rank's profiled minibatch (kernels with .name, .time_range in us and .id) into
    busy (compute kernels), blocked in communication (no compute kernel running, a
    communication kernel running, and the next compute kernel already issued by the host) and
    host gap (the rest: the host had not issued the next compute kernel yet, or launch gaps),
    over its work window: from its start marker to its end marker (after the last microbatch;
    the barrier's publish and finalize kernels come later and count as waiting for the slowest
    rank).

    `launched` maps a kernel's id to the host time of its launch (`launch_times`). Without it
    (and for the gap after the last compute kernel) blocked is all communication-only time
    (`comm_only_s`, reported for comparison), which also counts a push or gather that runs
    while the GPU waits for the host."""
    markers = sorted(e.time_range.start for e in kernels if "spin_kernel" in e.name)
    if len(markers) < 2:  # no markers: the window of the compute kernels themselves
        own = [e.time_range for e in kernels if not any(k in e.name for k in COMM_KERNELS)]
        if not own:
            return {}
        markers = [min(r.start for r in own), max(r.end for r in own)]
    start, work_end = markers[0], markers[-1]

    def is_compute(name):
        return not any(k in name for k in COMM_KERNELS + ("spin_kernel",))

    compute = clipped(kernels, start, work_end, is_compute)
    if not compute:
        return {}
    busy_us, spans = merged_busy(compute)
    _, comm_spans = merged_busy(
        clipped(kernels, start, work_end, lambda n: any(k in n for k in COMM_KERNELS))
    )
    comm_only_us = uncovered(comm_spans, spans)
    work_us = work_end - start
    launched = launched or {}
    firsts = sorted(
        (
            (max(e.time_range.start, start) - start, e)
            for e in kernels
            if is_compute(e.name) and e.time_range.end > start and e.time_range.start < work_end
        ),
        key=lambda x: x[0],
    )
    gaps, end, known = [], 0.0, 0
    for begin, e in firsts:  # each gap before a compute kernel, with that kernel
        if begin > end:
            gaps.append((end, begin, launched.get(getattr(e, "id", None))))
        end = max(end, min(e.time_range.end, work_end) - start)
    gaps.append((end, work_us, None))
    blocked_us = 0.0
    for a, b, issued in gaps:
        lo = a  # blocked: communication running, the next compute kernel already issued
        if issued is not None:
            known += 1
            lo = min(max(issued - start, a), b)
        blocked_us += (b - lo) - uncovered([[lo, b]], comm_spans)
    # For the picture only: close gaps under 0.2 ms (kernel launch gaps).
    _, coarse = merged_busy([(s, e + 200.0) for s, e in spans])
    return {
        "busy_s": busy_us / 1e6,
        "work_span_s": work_us / 1e6,
        "comm_only_s": comm_only_us / 1e6,
        "blocked_in_work_s": blocked_us / 1e6,
        "gaps_with_launch_time": known,
        "gaps": len(gaps),
        "host_gap_s": (work_us - busy_us - blocked_us) / 1e6,
        "busy_spans_ms": [[round(s / 1e3, 2), round((e - 200.0) / 1e3, 2)] for s, e in coarse],
    }


def kernel_ms_by_window(kernels, top=25) -> list:
    """GPU ms per kernel name (its first 60 characters) between consecutive markers (the
    profiled minibatch's microbatches, then what follows the last one up to the end marker),
    the `top` names by time in each: what one backend runs that the other does not, or runs
    slower."""
    markers = sorted(e.time_range.start for e in kernels if "spin_kernel" in e.name)
    out = []
    for lo, hi in itertools.pairwise(markers):
        by = {}
        for e in kernels:
            s, t = max(e.time_range.start, lo), min(e.time_range.end, hi)
            if t > s and "spin_kernel" not in e.name:
                c = by.setdefault(e.name[:60], [0, 0.0])
                c[0] += 1
                c[1] += (t - s) / 1e3
        best = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
        out.append(
            {
                "window_ms": round((hi - lo) / 1e3, 2),
                "kernels": {k: [n, round(ms, 3)] for k, (n, ms) in best},
            }
        )
    return out


def clipped(kernels, start, end, pred):
    """(start, end) of the profiled kernels whose name satisfies `pred`, clipped to the window
    and relative to its start."""
    return [
        (max(e.time_range.start, start) - start, min(e.time_range.end, end) - start)
        for e in kernels
        if pred(e.name) and e.time_range.end > start and e.time_range.start < end
    ]


def uncovered(spans, cover):
    """Total length of the merged `spans` not covered by the merged `cover` (both sorted)."""
    total, j = 0.0, 0
    for s, e in spans:
        pos = s
        while j < len(cover) and cover[j][1] <= pos:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < e:
            if cover[k][0] > pos:
                total += cover[k][0] - pos
            pos = max(pos, cover[k][1])
            k += 1
        total += max(0.0, e - pos)
    return total


def memory_estimate(
    model: str, world: int, optimizer: str, tokens: int, loss_chunk: int = 8192
) -> dict:
    """GiB per rank, by the arithmetic of the comment at MODELS (docs/benchmarks.md, "7B-class
    on 2 GPUs"), for a microbatch of `tokens` tokens. Per token, one layer's recompute with
    its backward holds ~62 B x dim (58 measured on CPU with
    torch.distributed._tools.mem_tracker at dim 512 and 1024, plus CUDA flash attention's fp32
    dq accumulator). Checked on the 1B model's 4 x H200 run (long-context / RL, 4 sequences per
    rank): 17.1-18.1 / 9.3-10.2 GiB (without / with FSDP2's .grad) where the allocator peaked
    at 17.9 / 9.4 GiB."""
    dim, layers, heads, kv_heads, ffn, vocab = MODELS[model]
    with torch.device("meta"):
        net = Llama(dim, layers, heads, kv_heads, ffn, vocab)
    n = sum(p.numel() for p in net.parameters())
    layer = sum(p.numel() for p in net.layers[0].parameters())
    root = n - layers * layer
    shard = n / world
    gib = 2**30
    state = {
        "fp32 master shards": 4 * shard,
        "fp32 gradients (FSDP2 .grad / ODC accumulators)": 4 * shard,
        "optimizer states": (8 * shard if optimizer == "adamw" else 0),
    }
    checkpoints = layers * dim * 2 * tokens  # every layer's bf16 input
    recompute = 62 * dim * tokens
    logits = 4 * vocab * tokens + 6 * vocab * min(loss_chunk, tokens)  # fp32 log-softmax + chunk
    unsharded = 2 * root + layer * (2 + 2 + 2 + 4)  # root; 2 layers, bf16 grads, fp32 RS input
    act = checkpoints + max(recompute, logits)
    odc = sum(state.values()) + 2 * shard + unsharded + act
    fsdp_first = sum(state.values()) - 4 * shard + unsharded + act  # no .grad yet
    return {
        "params": n,
        "sharded_params": shard,
        **{k: v / gib for k, v in state.items()},
        "ODC published bf16 cache": 2 * shard / gib,
        "unsharded layers and root": unsharded / gib,
        "activations": act / gib,
        "odc_total": odc / gib,
        "fsdp2_total_grad_held": (odc - 2 * shard) / gib,
        "fsdp2_total_first_microbatch": fsdp_first / gib,
    }


def dry_plan(args):
    """No GPU, no process group: the model's size, each workload's seeded lengths, plans and
    planner bound at --world ranks, the memory arithmetic at the longest microbatch and the
    run time the cost model predicts (--calibration; default: a guess for H100)."""
    world = args.world
    dim, layers = MODELS[args.model][0], MODELS[args.model][1]
    fit = CostModel.parse(args.calibration or "4.5e14,2.4e14,0.45")
    est = memory_estimate(args.model, world, optimizer_of(args), 1)
    n_params = est["params"]
    print(
        f"model {args.model}: {n_params / 1e9:.3f}e9 parameters, {est['sharded_params'] / 1e9:.3f}e9 "
        f"per rank at {world} ranks; optimizer {optimizer_of(args)}; cost model {fit}"
    )
    n_minibatches = args.warmup + args.minibatches + 1
    for w in args.workloads:
        pack = pack_tokens_of(w, args)
        cost = time_cost(fit, n_params, layers, dim, pack)
        lengths = workload_lengths(w, args, world, n_minibatches)
        span = {
            m: [plans(x, world, m, cost, pack).makespan for x in lengths] for m in ("micro", "mini")
        }
        measured = lengths[args.warmup : -1]
        ratio = np.mean(
            [
                plans(x, world, "micro", cost, pack).makespan
                / plans(x, world, "mini", cost, pack).makespan
                for x in measured
            ]
        )
        longest = max(
            max(
                sum(int(x[i]) for i in m)
                for r in plans(x, world, "mini", cost, pack).microbatches
                for m in r
            )
            for x in lengths
        )
        mem = memory_estimate(args.model, world, optimizer_of(args), longest)
        print(
            f"[{w}] longest microbatch {longest} tokens; planner micro/mini {ratio:.3f} "
            f"(measured minibatches); modeled seconds of the {n_minibatches} minibatches: "
            f"micro {sum(span['micro']):.1f}, mini {sum(span['mini']):.1f}"
        )
        print(
            "   memory (GiB per rank): "
            + ", ".join(
                f"{k} {v:.2f}" for k, v in mem.items() if k not in ("params", "sharded_params")
            )
        )


def optimizer_of(args) -> str:
    return args.optimizer or DEFAULT_OPTIMIZER.get(args.model, "adamw")


def memory_vs_reference(entry) -> dict:
    """ODC's memory beside FSDP2 over NCCL's on the same workload, per sharded parameter of a
    rank: (ODC's allocator peak + its region) - FSDP2's allocator peak, the largest rank of
    each; the same for what stays allocated through the microbatches (FSDP2's .grad, ODC's
    accumulators); and the region beside the fp32 .grad FSDP2 keeps (its published cache and
    control words). FSDP2 allocates its .grad at a minibatch's first reduce-scatter, so a peak
    reached in a rank's first microbatch (plans run the longest sequence first) lacks it: the
    peak difference can exceed the cache by up to the gradients' 4 B per parameter."""
    cfgs = entry["configs"]
    ref = next((c for c in cfgs if c.split("-")[0] in ("nccl", "gloo")), None)
    out = {}
    if ref is None:
        return out
    ra = cfgs[ref]["allocator_per_rank"]
    numel = max(a.get("sharded_numel", 0) for a in ra)
    for cfg, s in cfgs.items():
        if not cfg.startswith("odc") or not numel:
            continue
        oa = s["allocator_per_rank"]
        row = {
            "reference": ref,
            "sharded_numel": numel,
            "region_bytes": max(a.get("region_bytes", 0) for a in oa),
        }
        row["region_minus_fp32_grad_b_per_param"] = (row["region_bytes"] - 4 * numel) / numel
        if all("peak_bytes" in a for a in oa + ra):
            odc = max(a["peak_bytes"] + a.get("region_bytes", 0) for a in oa)
            fsdp = max(a["peak_bytes"] for a in ra)
            row.update(
                odc_peak_plus_region_bytes=odc,
                reference_peak_bytes=fsdp,
                peak_b_per_param=(odc - fsdp) / numel,
            )
            odc = max(a["held_after_microbatches_bytes"] + a.get("region_bytes", 0) for a in oa)
            fsdp = max(a["held_after_microbatches_bytes"] for a in ra)
            row["held_b_per_param"] = (odc - fsdp) / numel
        out[cfg] = row
    return out


def workload_lengths(workload: str, args, world: int, n_minibatches: int) -> list:
    """The sequence lengths of every minibatch of a run (warmup, measured, profiled), seeded:
    the same for every configuration and for --dry-plan."""
    rng = np.random.default_rng(1234)
    return [
        np.maximum(
            2,
            (WORKLOADS[workload](rng, args.seqs_per_rank * world) * args.length_scale).astype(
                np.int64
            ),
        )
        for _ in range(n_minibatches)
    ]


def pack_tokens_of(workload: str, args) -> int:
    """The token cap of the workload's microbatches (1: one sequence per microbatch)."""
    return args.rl_pack_tokens if workload == "rl-packed" else args.pack_tokens


def config_base(cfg: str) -> str:
    """The configuration a config label runs: "odc-mini" of "odc-mini#2" (a repeat) and of
    "odc-mini@ODC_CUDA_CTAS=32" (ODC with environment settings for that run only)."""
    return cfg.split("#")[0].split("@")[0]


def config_env(cfg: str) -> dict:
    """The environment settings of a config label ("odc-mini@ODC_CUDA_CTAS=32,ODC_X=1"): set
    for that run only, before its model attaches (the transport reads them when it is made)."""
    _, _, env = cfg.split("#")[0].partition("@")
    pairs = [kv.split("=", 1) for kv in env.split(",") if kv]
    if any(len(kv) != 2 or not kv[0].startswith("ODC_") for kv in pairs):
        raise SystemExit(f"config {cfg!r}: settings after '@' are ODC_NAME=VALUE pairs")
    return dict(pairs)


def run_config(cfg, args, device, world, rank, workload_lengths, nccl_group, cost, pack=None):
    pack = args.pack_tokens if pack is None else pack
    vocab = MODELS[args.model][5]
    odc = cfg.startswith("odc")
    # "odc-mini-lazy": shards published at each module's first all-gather instead of up front.
    model, handle, n_params = build(
        args, device, "odc" if odc else "nccl", eager_publish=not cfg.endswith("-lazy")
    )
    # Python's cyclic GC pauses one rank at random points (a straggler for everyone under
    # collectives); like torchtitan, collect between minibatches only.
    gc.collect()
    gc.disable()
    if optimizer_of(args) == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mode = cfg.split("-")[1]
    held = 0  # allocator bytes after a minibatch's microbatches, before the barrier: max
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = []
    for mb, lengths in enumerate(workload_lengths):
        plan = plans(lengths, world, mode, cost, pack)
        total_tokens = int(sum(lengths))
        # warmup, measured (tokens/s), then one profiled minibatch (busy/idle timeline): the
        # profiler's per-kernel overhead stays out of the throughput numbers.
        profiled = mb == len(workload_lengths) - 1
        measured = args.warmup <= mb and not profiled
        # The rank's token tensors, made and pinned before the clock starts (a data loader's
        # work, off the training loop), so copying them in never makes the host wait for the GPU.
        inputs = []
        for micro in plan.microbatches[rank]:
            seqs = []
            for idx in micro:  # the same tokens for sequence idx whatever plan places it
                gen = torch.Generator().manual_seed(mb * 1_000_003 + idx)
                t = torch.randint(0, vocab, (int(lengths[idx]) + 1,), generator=gen)
                seqs.append(t.pin_memory() if device.type == "cuda" else t)
            inputs.append(seqs)
        gc.collect()
        prof = None
        if profiled and device.type == "cuda":
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        dist.barrier(group=nccl_group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if args.sync_debug and measured and rank == 0 and device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        if prof is not None:  # marks the start of the rank's work on the profiled timeline
            torch.cuda._sleep(1)
        comm_s = 0.0
        marks = []  # (tokens, start event, end event, host seconds) per microbatch
        for micro, seqs in zip(plan.microbatches[rank], inputs):
            ev = (
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                if device.type == "cuda"
                else None
            )
            if ev:
                ev[0].record()
            th = time.perf_counter()
            if not micro:  # LB-Micro pads with an empty microbatch: still one forward (collective)
                if odc:
                    continue
                tokens = torch.zeros(2, dtype=torch.long, device=device)
                (model([tokens]) * 0.0).backward()
                if ev:
                    ev[1].record()
                marks.append((0, ev, time.perf_counter() - th))
                continue
            (
                model([t.to(device, non_blocking=True) for t in seqs]) * world / total_tokens
            ).backward()
            if ev:
                ev[1].record()
            marks.append((sum(int(lengths[i]) for i in micro), ev, time.perf_counter() - th))
            if prof is not None:  # a marker between microbatches: kernel time per microbatch
                torch.cuda._sleep(1)
        if args.sync_debug and device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        if prof is not None:  # ... and its end, before the barrier's own kernels
            torch.cuda._sleep(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            # What stays allocated through the microbatches (FSDP2 holds its sharded fp32 .grad
            # here; ODC its accumulators, in the region): no sync, the allocator's own count.
            held = max(held, torch.cuda.memory_allocated(device))
        t_work = time.perf_counter() - t0
        if odc:
            tb = time.perf_counter()
            torch_odc.minibatch_barrier()
            comm_s += time.perf_counter() - tb
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not (measured or profiled):
            continue
        row = {
            "minibatch": mb,
            "wall_s": wall,
            "work_s": t_work,
            "barrier_s": comm_s,
            "tokens": total_tokens,
            "microbatches": len(plan.microbatches[rank]),
            # per microbatch: [tokens, GPU ms (start to end event), host ms to enqueue]
            "per_micro": [
                [n, round(e[0].elapsed_time(e[1]), 2) if e else None, round(h * 1e3, 2)]
                for n, e, h in marks
            ],
        }
        if prof is not None:
            events = prof.events()
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            row.update(kernel_breakdown(kernels, launch_times(events)))
            row["kernel_ms_by_micro"] = kernel_ms_by_window(kernels)
            # HSDP: the all-reduces across replicas (FSDP2's after each microbatch's
            # reduce-scatter; ODC's once, in the barrier), kernel time on this rank.
            row["allreduce_kernel_ms"] = (
                sum(e.time_range.end - e.time_range.start for e in kernels if "AllReduce" in e.name)
                / 1e3
            )
        else:  # CPU: no kernel timeline; the rank's work is busy, the barrier is blocked
            row.update(
                busy_s=t_work,
                work_span_s=t_work,
                comm_only_s=0.0,
                blocked_in_work_s=0.0,
                host_gap_s=0.0,
            )
        if profiled:
            prof_row = row
        else:
            rows.append(row)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    alloc = {}
    if device.type == "cuda":
        st = torch.cuda.memory_stats(device)
        alloc = {
            k: st.get(k)
            for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
        }
        alloc["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        alloc["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        alloc["held_after_microbatches_bytes"] = held
    region = region_detail = None
    if handle is not None:
        stats = handle.stats()
        region, region_detail = stats["region_bytes"] / 2**30, stats.get("memory")
        alloc["region_bytes"] = stats["region_bytes"]
        handle.detach()
    # this rank's sharded parameters (FSDP2's and ODC's per-parameter memory is per these)
    alloc["sharded_numel"] = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    gc.enable()
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "rows": rows,
        "profiled": prof_row,
        "peak_mem_gib": peak,
        "n_params": n_params,
        "allocator": alloc,
        "odc_region_gib": region,
        "odc_region": region_detail,
    }


def summarize(per_rank, args, world, lengths_measured, n_params):
    dim, layers = MODELS[args.model][0], MODELS[args.model][1]
    wall = sum(
        max(r["rows"][i]["wall_s"] for r in per_rank) for i in range(len(per_rank[0]["rows"]))
    )
    tokens = sum(int(sum(x)) for x in lengths_measured)
    flops = sum(model_flops(x, n_params, layers, dim) for x in lengths_measured)
    # Busy/idle over the profiled minibatch (after the measured ones).
    last_wall = max(r["profiled"]["wall_s"] for r in per_rank)
    busy = [r["profiled"].get("busy_s", 0.0) for r in per_rank]
    idle = [1 - b / last_wall for b in busy]
    # The idle: time blocked in communication or in the barrier (after the rank's own
    # work, waiting for the slowest), over wall time. The rest of the non-compute time is the
    # GPU waiting for the host (host_gap).
    tail = [last_wall - r["profiled"].get("work_span_s", last_wall) for r in per_rank]
    blocked = [
        (t + r["profiled"].get("blocked_in_work_s", r["profiled"].get("comm_only_s", 0.0)))
        / last_wall
        for t, r in zip(tail, per_rank)
    ]
    # The earlier rule (blocked = only communication kernels running), for comparison: it also
    # counts a communication kernel that runs while the GPU waits for the host.
    comm_only = [
        (t + r["profiled"].get("comm_only_s", 0.0)) / last_wall for t, r in zip(tail, per_rank)
    ]
    host_gap = [r["profiled"].get("host_gap_s", 0.0) / last_wall for r in per_rank]
    return {
        "tokens_per_s_per_gpu": tokens / wall / world,
        "mfu": flops / wall / world / H200_BF16_DENSE_FLOPS if args.device == "cuda" else None,
        "wall_s": wall,
        "last_minibatch_wall_s": last_wall,
        "busy_s_per_rank": busy,
        "idle_fraction_per_rank": idle,
        "idle_fraction_mean": float(np.mean(idle)),
        "blocked_fraction_per_rank": blocked,
        "blocked_fraction_mean": float(np.mean(blocked)),
        "blocked_comm_only_rule_fraction_mean": float(np.mean(comm_only)),
        "gaps_with_launch_time": [r["profiled"].get("gaps_with_launch_time") for r in per_rank],
        "host_gap_fraction_mean": float(np.mean(host_gap)),
        "peak_mem_gib_per_rank": [r["peak_mem_gib"] for r in per_rank],
        # The ODC region (caches, accumulators) is allocated outside torch's allocator.
        "odc_region_gib_per_rank": [r["odc_region_gib"] for r in per_rank],
        "odc_region_per_rank": [r.get("odc_region") for r in per_rank],
        "barrier_s_per_rank": [sum(row["barrier_s"] for row in r["rows"]) for r in per_rank],
        "microbatches_per_rank": [[row["microbatches"] for row in r["rows"]] for r in per_rank],
        "profiled_minibatch": {
            "wall_s_per_rank": [r["profiled"]["wall_s"] for r in per_rank],
            "microbatches_per_rank": [r["profiled"]["microbatches"] for r in per_rank],
        },
        "wall_s_per_rank_last": [r["rows"][-1]["wall_s"] for r in per_rank],
        "work_s_per_rank_last": [r["rows"][-1]["work_s"] for r in per_rank],
        "per_micro_last": [r["rows"][-1]["per_micro"] for r in per_rank],
        "profiled_kernel_ms_by_micro": [r["profiled"].get("kernel_ms_by_micro") for r in per_rank],
        "allocator_per_rank": [r["allocator"] for r in per_rank],
        **({"replicate": replicate_traffic(per_rank, args)} if args.mesh else {}),
    }


def replicate_traffic(per_rank, args) -> dict:
    """HSDP, the profiled minibatch: the gradient bytes each rank all-reduces across replicas
    (its fp32 shard: FSDP2 after every microbatch, padding ones included; ODC once per
    minibatch), the ring's bytes on the wire per rank (2 (R - 1) / R of them), and the
    all-reduce kernels' time."""
    replicas = args.mesh[0]
    shard = [4 * r["allocator"]["sharded_numel"] for r in per_rank]
    calls = [
        1 if r.get("odc_region_gib") is not None else r["profiled"]["microbatches"]
        for r in per_rank
    ]
    reduced = [b * c for b, c in zip(shard, calls)]
    return {
        "replicas": replicas,
        "allreduces_per_rank": calls,
        "bytes_per_rank": reduced,
        "ring_bytes_per_rank": [2 * (replicas - 1) / replicas * b for b in reduced],
        "allreduce_kernel_ms_per_rank": [
            r["profiled"].get("allreduce_kernel_ms") for r in per_rank
        ],
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"])
    configs = results["configs"]
    rows_per_timeline = len(configs) * results["world"]
    heights = [3] + [0.25 * rows_per_timeline + 1] * len(workloads)
    fig, axes = plt.subplots(
        1 + len(workloads), 1, figsize=(11, sum(heights)), gridspec_kw={"height_ratios": heights}
    )
    ax = axes[0]
    width = 0.8 / len(configs)
    for i, cfg in enumerate(configs):  # a config run on some workloads only: no bar elsewhere
        vals = [
            results["workloads"][w]["configs"].get(cfg, {}).get("tokens_per_s_per_gpu", 0.0)
            for w in workloads
        ]
        ax.bar(np.arange(len(workloads)) + i * width, vals, width, label=cfg)
    ax.set_xticks(np.arange(len(workloads)) + width * (len(configs) - 1) / 2, workloads)
    ax.set_ylabel("tokens/s per GPU")
    ax.legend()
    for ax, w in zip(axes[1:], workloads):  # one timeline per workload: ranks x configs
        y = 0
        for cfg in [c for c in configs if c in results["workloads"][w]["configs"]]:
            for rank, spans in enumerate(results["workloads"][w]["configs"][cfg]["timeline"]):
                ax.broken_barh(
                    [(s, e - s) for s, e in spans or []],
                    (y - 0.4, 0.8),
                    color=f"C{configs.index(cfg)}",
                )
                ax.text(0, y, f"{cfg} r{rank} ", ha="right", va="center", fontsize=7)
                y += 1
            y += 0.5
        ax.set_yticks([])
        ax.set_xlabel(f"{w}: busy (compute kernels) across the profiled minibatch, ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(results, out, tag):
    """JSON + PNG under `out`, and the table on stdout; speedups relative to the first config."""
    for entry in results["workloads"].values():
        base = next(iter(entry["configs"].values()))["tokens_per_s_per_gpu"]
        first = next(iter(entry["configs"]))
        for s in entry["configs"].values():
            s["speedup_vs_" + first] = s["tokens_per_s_per_gpu"] / base
            s["of_planner_bound"] = (
                s["speedup_vs_" + first] / entry["predicted_speedup_mini_over_micro"]
            )
        entry["memory_vs_reference"] = memory_vs_reference(entry)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, tag + ".json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(out, tag + ".png"))
    print(
        f"\n{'workload':<13}{'config':<27}{'tok/s/GPU':>10}{'speedup':>8}{'MFU':>7}"
        f"{'idle':>7}{'blocked':>8}{'host gap':>9}{'plan idle':>10}{'peak GiB':>9}"
        "  planner micro/mini (speedup / planner)"
    )
    for w, entry in results["workloads"].items():
        first = next(iter(entry["configs"]))
        for cfg, s in entry["configs"].items():
            mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "-"
            peak = max((m or 0) for m in s["peak_mem_gib_per_rank"])
            bound = entry.get("plan_idle_bound", {}).get(config_base(cfg).split("-")[1])
            bound = f"{bound['profiled_minibatch']:.1%}" if bound else "-"
            print(
                f"{w:<13}{cfg:<27}{s['tokens_per_s_per_gpu']:>10.0f}"
                f"{s['speedup_vs_' + first]:>8.2f}{mfu:>7}"
                f"{s['idle_fraction_mean']:>7.1%}{s.get('blocked_fraction_mean', 0):>8.1%}"
                f"{s.get('host_gap_fraction_mean', 0):>9.1%}{bound:>10}{peak:>9.1f}  "
                f"{entry['predicted_speedup_mini_over_micro']:.3f} "
                f"({s['speedup_vs_' + first] / entry['predicted_speedup_mini_over_micro']:.1%})"
            )
    for w, entry in results["workloads"].items():  # ODC's memory beside FSDP2's
        for cfg, m in memory_vs_reference(entry).items():
            line = (
                f"memory {w} {cfg} vs {m['reference']} ({m['sharded_numel'] / 1e6:.1f}M "
                f"sharded params per rank): region {m['region_bytes'] / 2**30:.2f} GiB "
                f"= fp32 .grad + {m['region_minus_fp32_grad_b_per_param']:.3f} B/param"
            )
            if "peak_b_per_param" in m:
                line += (
                    f"; peak+region {m['odc_peak_plus_region_bytes'] / 2**30:.2f} GiB vs "
                    f"peak {m['reference_peak_bytes'] / 2**30:.2f}: "
                    f"{m['peak_b_per_param']:+.3f} B/param; held through the microbatches "
                    f"{m['held_b_per_param']:+.3f} B/param"
                )
            print(line)


def merge(paths, out, tag):
    """Joins the results of runs that each measured some (workload, config) pairs, e.g. one
    process per configuration so no configuration runs after another in the same process."""
    merged = None
    for path in paths:
        with open(path) as f:
            part = json.load(f)
        if merged is None:
            merged = {k: v for k, v in part.items() if k != "workloads"}
            merged["workloads"], merged["configs"], merged["commands"] = {}, [], []
        merged["commands"].append(part["environment"]["command"])
        for w, entry in part["workloads"].items():
            into = merged["workloads"].setdefault(
                w, {k: v for k, v in entry.items() if k != "configs"} | {"configs": {}}
            )
            for cfg, summary in entry["configs"].items():
                label, n = cfg, 1  # a repeated run of a config: "#2", "#3", ... in run order
                while label in into["configs"]:
                    n += 1
                    label = f"{cfg.split('#')[0]}#{n}"
                into["configs"][label] = summary
                if label not in merged["configs"]:
                    merged["configs"].append(label)
    merged["environment"]["command"] = "; ".join(merged.pop("commands"))
    write_results(merged, out, tag)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument(
        "--optimizer",
        choices=["adamw", "sgd"],
        default=None,
        help="default: sgd for 7b (AdamW's states do not fit beside its long-context "
        "activations on 2 x 80 GB), adamw otherwise",
    )
    p.add_argument(
        "--meta-init",
        action="store_true",
        help="build on the meta device and initialize each rank's shards after "
        "fully_shard (always for 7b; no full copy of the weights anywhere)",
    )
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument(
        "--configs",
        nargs="+",
        default=["nccl-micro", "odc-mini", "odc-micro"],
        help="nccl-micro, odc-mini, odc-micro, odc-mini-lazy; a suffix "
        "@ODC_NAME=VALUE[,...] runs that config with those settings (e.g. "
        "odc-mini@ODC_CUDA_CTAS=32: the transport's thread blocks per operation)",
    )
    p.add_argument("--seqs-per-rank", type=int, default=4)
    p.add_argument(
        "--mesh",
        type=int,
        nargs=2,
        default=None,
        metavar=("REPLICAS", "SHARDS"),
        help="HSDP over a (replicas x shards) mesh: ODC inside each shard group and "
        "one all-reduce per minibatch across replicas, vs FSDP2-HSDP over NCCL",
    )
    p.add_argument(
        "--pack-tokens",
        type=int,
        default=1,
        help="token cap of a microbatch: sequences are packed back to back with "
        "document-causal (varlen flash) attention; 1 = one sequence each",
    )
    p.add_argument(
        "--rl-pack-tokens",
        type=int,
        default=16384,
        help="token cap of the rl-packed workload's microbatches",
    )
    p.add_argument("--minibatches", type=int, default=3, help="measured minibatches")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--cost",
        choices=["calibrated", "flops"],
        default="calibrated",
        help="planner cost: measured time model (GPU rate + per-microbatch floor) or modeled FLOPs",
    )
    p.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="multiply sequence lengths (CPU smoke tests use ~1/256)",
    )
    p.add_argument("--out", default="benchmarks/results/e2e")
    p.add_argument("--tag", default=None, help="file name tag (default: model_world)")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="DENSE,ATTN,FLOOR",
        help="use this cost model instead of measuring it (runs that are merged "
        "must plan with the same one)",
    )
    p.add_argument(
        "--calibrate-only",
        action="store_true",
        help="measure the cost model, print CALIBRATION=DENSE,ATTN,FLOOR, exit",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="no training: merge result files of earlier runs into --tag",
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="diagnostic: report every operation in the measured minibatches that "
        "makes the host wait for the GPU, with its Python stack (rank 0)",
    )
    p.add_argument(
        "--dry-plan",
        action="store_true",
        help="no GPU, no process group: print the model size, plans, planner bound, "
        "memory arithmetic and modeled run time of --workloads at --world ranks",
    )
    p.add_argument("--world", type=int, default=2, help="ranks of --dry-plan")
    args = p.parse_args()
    if args.dry_plan:
        dry_plan(args)
        return
    if args.merge:
        merge(args.merge, args.out, args.tag or "e2e_merged")
        return
    if args.calibrate_only:
        args.workloads, args.configs = [], []

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("odc", timeout=datetime.timedelta(minutes=10))
    ref_backend = "nccl" if args.device == "cuda" else "gloo"
    nccl_group = dist.new_group(backend=ref_backend)
    configs = []  # a repeated config (to expose order effects) gets a "#2" suffix
    for c in args.configs:
        config_env(c)  # a malformed label fails here, before any run
        c = c.replace("nccl", ref_backend) if args.device == "cpu" else c
        configs.append(
            c if c not in configs else f"{c}#{sum(x.split('#')[0] == c for x in configs) + 1}"
        )
    dim, layers = MODELS[args.model][0], MODELS[args.model][1]
    results = {"workloads": {}, "configs": configs, "world": world}
    n_minibatches = args.warmup + args.minibatches + 1  # + the profiled one
    build.nccl_group = nccl_group
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(*MODELS[args.model]).parameters())
    if args.cost == "flops":
        fit = CostModel(1.0, 1.0, 0.0)
        calibration = None
    else:
        if args.calibration:
            fit = CostModel.parse(args.calibration)
        else:
            fit = calibrate(args, device, nccl_group)
        calibration = {
            "dense_flops_per_s": fit.dense_rate,
            "attention_flops_per_s": fit.attn_rate,
            "floor_s": fit.floor,
        }
        if rank == 0:
            print(
                f"cost model: dense {fit.dense_rate / 1e12:.0f} TFLOP/s, attention "
                f"{fit.attn_rate / 1e12:.0f} TFLOP/s (model flops), floor "
                f"{fit.floor * 1e3:.0f} ms per microbatch\nCALIBRATION={fit}",
                flush=True,
            )
    if args.calibrate_only:
        dist.destroy_process_group()
        return
    results["cost_model"] = {
        "kind": args.cost,
        "calibration": calibration,
        "form": "floor + dense flops / dense rate + attention flops / attention rate",
    }
    sync_report = SyncReport() if args.sync_debug and rank == 0 else None
    if sync_report:
        sync_report.__enter__()
    for w in args.workloads:
        # The planner's cost per workload: a packed sequence pays its token share of the floor.
        pack = pack_tokens_of(w, args)
        cost = time_cost(fit, n_params, layers, dim, pack)
        lengths = workload_lengths(w, args, world, n_minibatches)
        measured = lengths[args.warmup : -1]
        entry = {"configs": {}}
        for cfg in configs:
            with mock.patch.dict(os.environ, config_env(cfg)):  # this run's settings only
                out = run_config(
                    config_base(cfg), args, device, world, rank, lengths, nccl_group, cost, pack
                )
            per_rank = [None] * world
            dist.all_gather_object(per_rank, out, group=nccl_group)
            if rank == 0:
                summary = summarize(per_rank, args, world, measured, out["n_params"])
                summary["timeline"] = [r["profiled"].get("busy_spans_ms") for r in per_rank]
                entry["configs"][cfg] = summary
                entry["n_params"] = out["n_params"]
                launch = [r["profiled"].get("gaps_with_launch_time") for r in per_rank]
                gaps = [r["profiled"].get("gaps") for r in per_rank]
                print(
                    f"[{w}] {cfg}: {summary['tokens_per_s_per_gpu']:.0f} tok/s/GPU, idle "
                    f"{summary['idle_fraction_mean']:.1%}, blocked "
                    f"{summary['blocked_fraction_mean']:.1%} (communication-only rule "
                    f"{summary['blocked_comm_only_rule_fraction_mean']:.1%}; gaps with a "
                    f"launch time per rank {launch} of {gaps})",
                    flush=True,
                )
                for r, pr in enumerate(per_rank):  # the last minibatch, per rank
                    last = pr["rows"][-1]
                    gpu = sum(m[1] or 0 for m in last["per_micro"])
                    print(
                        f"   r{r}: micro {last['microbatches']:2d} tokens "
                        f"{sum(m[0] for m in last['per_micro']):6d} wall {last['wall_s']:.3f} "
                        f"work {last['work_s']:.3f} barrier {last['barrier_s']:.3f} busy "
                        f"{last.get('busy_s', 0):.3f} gpu-sum {gpu / 1e3:.3f} "
                        f"alloc {pr['allocator']}",
                        flush=True,
                    )
        if rank == 0:
            ratios = [
                plans(x, world, "micro", cost, pack).makespan
                / plans(x, world, "mini", cost, pack).makespan
                for x in measured
            ]
            entry["predicted_speedup_mini_over_micro"] = float(np.mean(ratios))

            def idle_bound(x, mode, cost=cost, pack=pack):  # the idle the plan itself implies
                p = plans(x, world, mode, cost, pack)
                return 1.0 - sum(p.rank_costs) / (world * p.makespan)

            # Whole sequences cannot be split: one that costs more than a rank's share forces
            # idle on the others whatever the balancer does.
            entry["plan_idle_bound"] = {
                mode: {
                    "measured_minibatches": float(np.mean([idle_bound(x, mode) for x in measured])),
                    "profiled_minibatch": idle_bound(lengths[-1], mode),
                }
                for mode in ("mini", "micro")
            }
            entry["mean_length"] = float(np.mean(np.concatenate(measured)))
            entry["pack_tokens"] = pack
            # The memory arithmetic (memory_estimate) at this run's longest microbatch, to set
            # beside the measured peaks.
            longest = max(
                sum(int(x[i]) for i in m)
                for x in lengths
                for r in plans(x, world, "mini", cost, pack).microbatches
                for m in r
            )
            est = memory_estimate(args.model, world, optimizer_of(args), longest)
            entry["memory_estimate_gib"] = {"longest_microbatch_tokens": longest, **est}
            print(
                f"[{w}] memory arithmetic at the longest microbatch ({longest} tokens): ODC "
                f"~{est['odc_total']:.1f} GiB (allocator + region), FSDP2 "
                f"~{est['fsdp2_total_first_microbatch']:.1f} GiB in a first microbatch, "
                f"~{est['fsdp2_total_grad_held']:.1f} GiB with its .grad",
                flush=True,
            )
            results["workloads"][w] = entry
    if sync_report:
        sync_report.__exit__(None, None, None)
    if rank == 0:
        results["environment"] = {
            "host": socket.gethostname(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name(device) if args.device == "cuda" else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))
            if args.device == "cuda"
            else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": f"torchrun --nproc-per-node={world} " + " ".join(sys.argv),
            "git_commit": os.environ.get("ODC_GIT_COMMIT"),
            "model": args.model,
            "seqs_per_rank": args.seqs_per_rank,
            "optimizer": optimizer_of(args),
            "length_scale": args.length_scale,
            "pack_tokens": args.pack_tokens,
        }
        tag = args.tag or f"e2e_{args.model}_{world}{'gpu' if args.device == 'cuda' else 'cpu'}"
        write_results(results, args.out, tag)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
