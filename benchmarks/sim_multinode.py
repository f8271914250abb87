"""Projection of one HSDP training minibatch to several nodes: ODC with LB-Mini against FSDP2's own
HSDP over NCCL with LB-Micro. A model on CPU, not a measurement: no multi-node run exists yet.

    python benchmarks/sim_multinode.py          # results/multinode/multinode_projection.{json,png}

What is modeled (every assumption is also written into the JSON):

* Layout: N nodes of G GPUs (default 8), one rank per GPU, mesh (replicate = N, shard = G):
  parameters and gradients sharded inside a node, replicated across nodes. One minibatch of
  ``seqs_per_rank * N * G`` sequences (weak scaling) drawn from benchmarks/workloads.py, planned
  over all N * G ranks by ``torch_odc.balance.plan`` ("micro" for FSDP2, "mini" for ODC), one
  sequence per microbatch (``--pack-tokens 1``, as the e2e runs).
* Compute: a microbatch costs the e2e benchmark's calibrated ``TimeCost`` (per-microbatch floor
  + dense flops / dense rate + attention flops / attention rate), read from the committed
  ``benchmarks/results/e2e/e2e_*.json`` of the model (7B: 2 x H100; 1B: 4 x H200). The fit is
  checked against the per-microbatch GPU times those files hold (``calibration_check``).
  Activation checkpointing: a microbatch is 1/4 forward, 3/4 recompute + backward, spread
  evenly over the L layers (the root's embedding and head counted as layers).
* Inside a node (both schemes move the same bytes; ODC's transport measured at NCCL's rate):
  per layer and microbatch one all-gather of the bf16 layer in the forward, one in the backward
  and one fp32 reduce-scatter, at ``nvlink_gbs`` bus bandwidth (NCCL on 4 H100, facts.md:
  308-350 GB/s; 300 by default). Prefetch overlaps them with compute: a layer takes
  max(compute, communication) with the forward all-gather and the backward's all-gather plus
  reduce-scatter (they share NVLink), plus one exposed all-gather at the start and one
  reduce-scatter at the end of a microbatch.
* Synchronization: FSDP2's per-layer collectives make the ranks of a shard group move in
  lockstep, so a microbatch index takes its slowest rank's time; ODC's ranks run alone until
  the minibatch barrier.
* Across nodes: a ring all-reduce of each rank's fp32 gradient shard over the replicate group,
  the G rings of a node sharing its link of ``link_gbs`` (GB/s per node, what nccl-tests would
  report as bus bandwidth): 2 (N - 1) / N * 4 P / link_gbs seconds for the whole model, plus
  2 (N - 1) latency steps. 25 and 50 GB/s per node are one 200 or 400 Gb/s NIC per node
  (HDR / NDR InfiniBand, or RoCE, as many cloud instances have); 400 GB/s per node is a
  rail-optimized HGX node, one 400 Gb/s NIC per GPU.
  - FSDP2-HSDP, default (``fsdp2_every``): every microbatch all-reduces each layer's shard in
    the backward (overlapped like the reduce-scatter, its last layer exposed); the all-reduce
    is a collective across nodes, so every microbatch index takes the slowest rank of all
    nodes.
  - FSDP2-HSDP with ``set_requires_all_reduce(False)`` on all but the last microbatch
    (``fsdp2_once``): nodes run their microbatches in their own lockstep and all-reduce (and
    meet) in the last microbatch's backward only.
  - ODC-HSDP as implemented (``odc``): at the barrier, after every rank of every node has
    arrived, the accumulators are all-reduced in 256 MiB buckets, not overlapped with compute
    (torch_odc/_handle.py, ``Handle._reduce_across_replicas``), plus ``barrier_s`` of barrier
    work (the host protocol, the flags' all-reduce over Gloo, finalize).
  - Designs, not implemented: ``odc_overlap``: ODC-HSDP whose all-reduce of a layer starts once
    every rank has pushed its last gradient of it (overlapping the last microbatch's backward
    of the rank that finishes last); ``odc_full``: fully sharded ODC over all N * G ranks
    (docs/multinode.md, "Past HSDP"), every gather and push of a layer crossing the node's link
    for the (N - 1) / N of the layer held on other nodes, the G ranks of a node sharing it, with
    no all-reduce.
* Not modeled: the optimizer step (the same in all schemes), host jitter and stragglers, NIC
  contention with other jobs, memory limits, congestion of the network core.

Outputs ``speedup_vs_fsdp2_every`` / ``speedup_vs_fsdp2_once``: the sum of FSDP2's modeled
minibatch seconds over the sum of ODC's on the same draws (> 1: ODC faster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workloads import equal, long_context, rl_like

from torch_odc import balance

WORKLOADS = {
    "long-context": long_context,
    "rl": rl_like,
    "equal": equal,
    "rl-packed": rl_like,
}  # as bench_e2e.WORKLOADS
# name: (dim, layers, heads, kv_heads, ffn, vocab), as bench_e2e.MODELS
SHAPES = {"1b": (2048, 19, 16, 8, 5632, 32000), "7b": (4096, 32, 32, 32, 11008, 32000)}
# The committed e2e run whose calibration each model uses (the cost model of its planner).
CALIBRATION_FILES = {
    "7b": "e2e_7b_2gpu-4spr_h100x2_2026-11-25.json",
    "1b": "e2e_1b_4gpu-16spr_h200x4_2026-11-21.json",
}
REPLICA_BUCKET_BYTES = 256 << 20  # torch_odc/_handle.py, _REPLICA_BUCKET_BYTES


def n_params(model: str) -> float:
    """Parameters of bench_e2e's Llama (as benchmarks/planner_bounds.py counts them)."""
    dim, layers, heads, kv_heads, ffn, vocab = SHAPES[model]
    kv_dim = dim // heads * kv_heads
    return float(
        layers * (2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn + 2 * dim)
        + 2 * vocab * dim
        + dim
    )


@dataclass(frozen=True)
class Machine:
    """The hardware of one projection. Bandwidths in GB/s (1e9 bytes); math.inf allowed."""

    nodes: int
    gpus_per_node: int = 8
    link_gbs: float = 50.0  # inter-node, per node (all its GPUs share it)
    nvlink_gbs: float = 300.0  # NCCL bus bandwidth inside a node
    link_latency_s: float = 10e-6  # per ring step across nodes
    barrier_s: float = 0.01  # ODC's barrier work per minibatch (host protocol, finalize)


@dataclass(frozen=True)
class Model:
    n_params: float
    layers: int  # units that communicate one after another (the root counted as one)
    param_bytes: int = 2  # bf16 all-gathers (MixedPrecisionPolicy(param_dtype=bf16))
    grad_bytes: int = 4  # fp32 reduce-scatter, fp32 accumulators and all-reduce
    forward_share: float = 0.25  # forward / (forward + recompute + backward)


def _time(nbytes: float, gbs: float) -> float:
    return 0.0 if nbytes == 0 or math.isinf(gbs) else nbytes / (gbs * 1e9)


def comm_times(model: Model, m: Machine) -> dict:
    """Seconds per layer inside a node (ag, rs), of one layer's all-reduce across nodes (ar),
    of the whole model's all-reduce across nodes (ar_all), and per layer of fully sharded
    ODC's traffic over the node's link (full_ag, full_push) and NVLink (full_ag_nvl,
    full_rs_nvl)."""
    g, n = m.gpus_per_node, m.nodes
    layer = model.n_params / model.layers
    ring = 2 * (n - 1) / n
    latency = 2 * (n - 1) * m.link_latency_s
    buckets = max(1, math.ceil(model.grad_bytes * model.n_params / g / REPLICA_BUCKET_BYTES))
    remote = (n - 1) / n  # the share of a layer held on other nodes (fully sharded)
    local = (g - 1) / (g * n)
    return {
        "ag": _time((g - 1) / g * model.param_bytes * layer, m.nvlink_gbs),
        "rs": _time((g - 1) / g * model.grad_bytes * layer, m.nvlink_gbs),
        "ar": _time(ring * model.grad_bytes * layer, m.link_gbs) + latency if n > 1 else 0.0,
        "ar_all": (_time(ring * model.grad_bytes * model.n_params, m.link_gbs) + buckets * latency)
        if n > 1
        else 0.0,
        # Fully sharded: every GPU of a node reads / writes (N - 1) / N of each layer through
        # the node's link, all G at once in the worst case (they are not synchronized).
        "full_ag": _time(g * remote * model.param_bytes * layer, m.link_gbs),
        "full_push": _time(g * remote * model.grad_bytes * layer, m.link_gbs),
        "full_ag_nvl": _time(local * model.param_bytes * layer, m.nvlink_gbs),
        "full_rs_nvl": _time(local * model.grad_bytes * layer, m.nvlink_gbs),
    }


def microbatch_s(c: float, model: Model, fwd: tuple, bwd: tuple, head: float, tail: float) -> float:
    """One microbatch of compute c with per-layer communication overlapped: each layer takes
    the longest of its compute and each resource's time (fwd / bwd: per-layer seconds of each
    resource), plus what cannot overlap at the ends."""
    if c <= 0:
        return 0.0
    per_f = c * model.forward_share / model.layers
    per_b = c * (1 - model.forward_share) / model.layers
    return head + model.layers * max(per_f, *fwd) + model.layers * max(per_b, *bwd) + tail


def fsdp2_micro(c: float, model: Model, t: dict, all_reduce: bool) -> float:
    ar = t["ar"] if all_reduce else 0.0
    return microbatch_s(c, model, (t["ag"],), (t["ag"] + t["rs"], ar), t["ag"], t["rs"] + ar)


def odc_micro(c: float, model: Model, t: dict) -> float:
    return microbatch_s(c, model, (t["ag"],), (t["ag"] + t["rs"],), t["ag"], t["rs"])


def odc_full_micro(c: float, model: Model, t: dict) -> float:
    ag = (t["full_ag_nvl"], t["full_ag"])
    return microbatch_s(
        c,
        model,
        ag,
        (t["full_ag_nvl"] + t["full_rs_nvl"], t["full_ag"], t["full_push"]),
        max(ag),
        max(t["full_rs_nvl"], t["full_push"]),
    )


def _nodes(per_rank: list, g: int) -> list:
    return [per_rank[i : i + g] for i in range(0, len(per_rank), g)]


def fsdp2_step(micro_costs: list, model: Model, m: Machine, every: bool = True) -> float:
    """FSDP2-HSDP's minibatch seconds. micro_costs[r]: rank r's microbatch costs (global rank
    order, node-major), the same count on every rank (LB-Micro; 0 for padding)."""
    t = comm_times(model, m)
    count = len(micro_costs[0])
    if any(len(r) != count for r in micro_costs):
        raise ValueError("LB-Micro gives every rank the same number of microbatches")
    if every or m.nodes == 1:  # every index is a collective over all ranks of all nodes
        return sum(
            fsdp2_micro(max(r[j] for r in micro_costs), model, t, m.nodes > 1) for j in range(count)
        )
    ends = []
    for node in _nodes(micro_costs, m.gpus_per_node):  # lockstep inside the node only
        ends.append(
            sum(
                fsdp2_micro(max(r[j] for r in node), model, t, j == count - 1) for j in range(count)
            )
        )
    return max(ends)


def odc_step(micro_costs: list, model: Model, m: Machine, overlap: bool = False) -> float:
    """ODC-HSDP's minibatch seconds: each rank alone, then the barrier, then (several nodes)
    the all-reduce of the accumulators; with overlap (a design), that all-reduce runs behind
    the backward of the last microbatch of the rank that finishes last."""
    t = comm_times(model, m)
    ends = [sum(odc_micro(c, model, t) for c in r) for r in micro_costs]
    last = max(range(len(ends)), key=ends.__getitem__)
    arrive = ends[last] + m.barrier_s
    if m.nodes == 1:
        return arrive
    if not overlap:
        return arrive + t["ar_all"]
    tail_c = micro_costs[last][-1] if micro_costs[last] else 0.0
    hidden = tail_c * (1 - model.forward_share)
    # The last layer's all-reduce cannot start before its last push: at least one layer's.
    return arrive + max(t["ar"], t["ar_all"] - hidden)


def odc_full_step(micro_costs: list, model: Model, m: Machine) -> float:
    """Fully sharded ODC over all ranks (a design): each rank alone, its gathers and pushes
    partly over the node's link, one barrier, no all-reduce."""
    t = comm_times(model, m)
    return max(sum(odc_full_micro(c, model, t) for c in r) for r in micro_costs) + m.barrier_s


def rank_costs(plan, cost, lengths, pad_cost: float) -> list:
    """Each rank's microbatch costs under `plan` (a padding microbatch costs pad_cost: FSDP2
    still runs it)."""
    return [
        [sum(cost(int(lengths[i])) for i in mb) if mb else pad_cost for mb in rank]
        for rank in plan.microbatches
    ]


def plan(lengths, world: int, mode: str, cost, pack: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", balance.OversizedSequenceWarning)
        return balance.plan([int(n) for n in lengths], world, pack, mode=mode, cost=cost)


def load_calibration(model: str, results: str) -> tuple:
    """(TimeCost with pack 1, the e2e JSON) of the model's committed e2e run."""
    with open(os.path.join(results, CALIBRATION_FILES[model])) as f:
        data = json.load(f)
    return time_cost(data["cost_model"]["calibration"], model, 1), data


def time_cost(cal: dict, model: str, pack: int) -> balance.TimeCost:
    dim, layers = SHAPES[model][0], SHAPES[model][1]
    return balance.TimeCost(
        cal["floor_s"],
        cal["dense_flops_per_s"],
        cal["attention_flops_per_s"],
        n_params(model),
        layers,
        dim,
        max(1, pack),
    )


def model_of(model: str) -> Model:
    return Model(n_params(model), SHAPES[model][1] + 1)


def minibatch(model: str, m: Machine, lengths, cost, pad: float) -> dict:
    """Every scheme's modeled seconds for one minibatch of `lengths`."""
    world = m.nodes * m.gpus_per_node
    shape = model_of(model)
    micro = plan(lengths, world, "micro", cost, 1)
    mini = plan(lengths, world, "mini", cost, 1)
    micro_c = rank_costs(micro, cost, lengths, pad)
    mini_c = rank_costs(mini, cost, lengths, pad)
    return {
        "fsdp2_every": fsdp2_step(micro_c, shape, m, every=True),
        "fsdp2_once": fsdp2_step(micro_c, shape, m, every=False),
        "odc": odc_step(mini_c, shape, m),
        "odc_overlap": odc_step(mini_c, shape, m, overlap=True),
        "odc_full": odc_full_step(mini_c, shape, m),
        "planner_micro": micro.makespan,
        "planner_mini": mini.makespan,
        "lower_bound": mini.lower_bound,
    }


def project(
    model: str, workload: str, m: Machine, cost, seqs_per_rank: int, draws: int, seed: int
) -> dict:
    rng = np.random.default_rng(seed)
    world = m.nodes * m.gpus_per_node
    pad = cost(2)  # bench_e2e runs a padding microbatch as a 2-token sequence
    rows = [
        minibatch(model, m, WORKLOADS[workload](rng, seqs_per_rank * world), cost, pad)
        for _ in range(draws)
    ]
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    for base in ("fsdp2_every", "fsdp2_once"):
        for scheme in ("odc", "odc_overlap", "odc_full"):
            out[f"{scheme}_speedup_vs_{base}"] = sum(r[base] for r in rows) / sum(
                r[scheme] for r in rows
            )
    out["planner_bound"] = out["planner_micro"] / out["planner_mini"]
    out["ar_all_s"] = comm_times(model_of(model), m)["ar_all"]
    return out


def _arg(command: str, name: str, default: int) -> int:
    found = re.search(rf"{name}[ =](\d+)", command)
    return int(found.group(1)) if found else default


def validate(path: str, nvlink_gbs: float) -> list:
    """The simulator at the size of a committed e2e run (one node), on the same seeded
    minibatches bench_e2e measured: predicted seconds against the measured wall time."""
    with open(path) as f:
        data = json.load(f)
    env, world = data["environment"], data["world"]
    model, spr = env["model"], env["seqs_per_rank"]
    command = env.get("command", "")
    warmup, measured = _arg(command, "--warmup", 1), _arg(command, "--minibatches", 3)
    m = Machine(nodes=1, gpus_per_node=world, nvlink_gbs=nvlink_gbs)
    out = []
    for workload, entry in data["workloads"].items():
        pack = (
            _arg(command, "--rl-pack-tokens", 16384)
            if workload == "rl-packed"
            else _arg(command, "--pack-tokens", 1)
        )
        if pack > 1:  # packed microbatches: the floor is shared; skip (the model is per sequence)
            continue
        cost = time_cost(data["cost_model"]["calibration"], model, pack)
        rng = np.random.default_rng(1234)  # bench_e2e.workload_lengths
        draws = [
            np.maximum(2, WORKLOADS[workload](rng, spr * world)).astype(np.int64)
            for _ in range(warmup + measured + 1)
        ][warmup:-1]
        rows = [minibatch(model, m, x, cost, cost(2)) for x in draws]
        configs = entry["configs"]
        if "nccl-micro" not in configs or "odc-mini" not in configs:
            continue
        got = {"fsdp2": sum(r["fsdp2_every"] for r in rows), "odc": sum(r["odc"] for r in rows)}
        meas = {"fsdp2": configs["nccl-micro"]["wall_s"], "odc": configs["odc-mini"]["wall_s"]}
        out.append(
            {
                "file": os.path.basename(path),
                "workload": workload,
                "model": model,
                "ranks": world,
                "minibatches": len(rows),
                "modeled_s": got,
                "measured_s": meas,
                "modeled_speedup": got["fsdp2"] / got["odc"],
                "measured_speedup": meas["fsdp2"] / meas["odc"],
            }
        )
    return out


def calibration_check(data: dict, model: str) -> dict:
    """The cost model against the measured GPU milliseconds of each ODC microbatch of the
    committed run (ODC's microbatches run alone; FSDP2's take their index's slowest rank)."""
    cost = time_cost(data["cost_model"]["calibration"], model, 1)
    errors = []
    for entry in data["workloads"].values():
        if (entry.get("pack_tokens") or data["environment"].get("pack_tokens") or 1) > 1:
            continue
        for name, cfg in entry["configs"].items():
            if not name.startswith("odc-mini"):
                continue
            for rank in cfg.get("per_micro_last") or []:
                for tokens, gpu_ms, _ in rank:
                    if tokens and gpu_ms:
                        errors.append(cost(tokens) / (gpu_ms / 1e3) - 1)
    e = np.array(errors)
    return (
        {
            "microbatches": len(e),
            "mean_rel_error": float(e.mean()),
            "mean_abs_rel_error": float(np.abs(e).mean()),
            "max_abs_rel_error": float(np.abs(e).max()),
        }
        if len(e)
        else {"microbatches": 0}
    )


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = result["plot_model"]
    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.2 * len(workloads), 4), sharey=True)
    colors = {25.0: "tab:red", 50.0: "tab:blue", 400.0: "tab:gray"}
    for ax, w in zip(np.atleast_1d(axes), workloads):
        spr = result["seqs_per_rank"][0]
        rows = [
            r
            for r in result["rows"]
            if r["model"] == model and r["workload"] == w and r["seqs_per_rank"] == spr
        ]
        for link in result["link_gbs"]:
            sel = sorted(
                (r for r in rows if r["link_gbs"] in (link, None)), key=lambda r: r["nodes"]
            )
            x = [r["nodes"] for r in sel]
            c = colors.get(link, None)
            ax.plot(
                x,
                [r["odc_speedup_vs_fsdp2_every"] for r in sel],
                "o-",
                color=c,
                label=f"{link:g} GB/s/node, vs FSDP2 all-reduce every microbatch",
            )
            ax.plot(
                x,
                [r["odc_speedup_vs_fsdp2_once"] for r in sel],
                "s--",
                color=c,
                label=f"{link:g} GB/s/node, vs FSDP2 all-reduce once",
            )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(result["nodes"], [str(n) for n in result["nodes"]])
        ax.set_xlabel(f"nodes of {result['gpus_per_node']} GPUs")
        ax.set_title(f"{model}, {w}, {spr} sequences per rank")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("modeled speed-up ODC-HSDP (LB-Mini) / FSDP2-HSDP")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.suptitle("Projection (model, not measured): benchmarks/sim_multinode.py", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


ASSUMPTIONS = [
    (
        "one rank per GPU; mesh (replicate = nodes, shard = GPUs of a node); LB-Micro / LB-Mini "
        "planned over all ranks of all nodes with torch_odc.balance.plan, one sequence per "
        "microbatch"
    ),
    (
        "compute per microbatch: the committed e2e run's calibrated TimeCost (floor + dense + "
        "attention) of the model; 1/4 forward, 3/4 recompute + backward (activation checkpointing), "
        "even over the layers"
    ),
    (
        "inside a node: per layer and microbatch two bf16 all-gathers and one fp32 reduce-scatter at "
        "nvlink_gbs, overlapped with compute per layer, the first all-gather and the last "
        "reduce-scatter exposed; the same bytes and rate for ODC's one-sided gathers and pushes"
    ),
    (
        "FSDP2: every microbatch index takes the slowest rank of the ranks that meet per layer (all "
        "nodes for fsdp2_every, the node for fsdp2_once); ODC ranks meet once per minibatch"
    ),
    (
        "across nodes: ring all-reduce of the fp32 gradient shards, the node's G rings sharing its "
        "link: 2 (N - 1) / N * 4 P / link_gbs seconds for the model, plus 2 (N - 1) steps of "
        "link_latency_s; fsdp2_every per layer per microbatch overlapped with the backward; "
        "fsdp2_once in the last microbatch's backward; odc after the barrier, not overlapped"
    ),
    "odc_overlap and odc_full are designs, not implemented (docs/multinode.md)",
    "not modeled: the optimizer step, host jitter, other traffic on the network, memory limits",
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="7b", help="comma-separated: 7b, 1b")
    p.add_argument("--workloads", default="long-context,rl")
    p.add_argument("--nodes", default="1,2,4,8")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--link-gbs", default="25,50,400", help="inter-node GB/s per node")
    p.add_argument("--nvlink-gbs", type=float, default=300.0)
    p.add_argument(
        "--seqs-per-rank", default="4,16", help="comma-separated; the plot shows the first"
    )
    p.add_argument("--draws", type=int, default=30, help="minibatches per row")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--results",
        default=os.path.join(HERE, "results", "e2e"),
        help="where the committed e2e JSONs are read",
    )
    p.add_argument(
        "--out",
        default=os.path.join(HERE, "results", "multinode", "multinode_projection"),
        help="output path without .json / .png",
    )
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    models = args.models.split(",")
    workloads = args.workloads.split(",")
    nodes = [int(n) for n in args.nodes.split(",")]
    links = [float(x) for x in args.link_gbs.split(",")]
    sprs = [int(x) for x in args.seqs_per_rank.split(",")]
    rows, calibrations = [], {}
    for model in models:
        cost, data = load_calibration(model, args.results)
        calibrations[model] = {
            "file": CALIBRATION_FILES[model],
            "gpu": data["environment"].get("gpu"),
            "time_cost": asdict(cost),
            "calibration_check": calibration_check(data, model),
            "n_params": n_params(model),
        }
        print(
            f"{model}: {calibrations[model]['file']}, cost model vs its measured ODC "
            f"microbatches: {calibrations[model]['calibration_check']}"
        )
        for spr in sprs:
            for workload in workloads:
                for n in nodes:
                    for link in links if n > 1 else [None]:
                        m = Machine(
                            nodes=n,
                            gpus_per_node=args.gpus_per_node,
                            link_gbs=link if link else math.inf,
                            nvlink_gbs=args.nvlink_gbs,
                        )
                        row = {
                            "model": model,
                            "workload": workload,
                            "seqs_per_rank": spr,
                            "nodes": n,
                            "link_gbs": link,
                            **project(model, workload, m, cost, spr, args.draws, args.seed),
                        }
                        rows.append(row)
                        print(
                            f"{model} {workload:<13} spr {spr:2d} nodes {n} link "
                            f"{link or '-':>5}: FSDP2 every {row['fsdp2_every']:6.2f} s, "
                            f"once {row['fsdp2_once']:6.2f}, ODC {row['odc']:6.2f} "
                            f"(all-reduce {row['ar_all_s']:.2f}); ODC vs every "
                            f"{row['odc_speedup_vs_fsdp2_every']:.3f}, vs once "
                            f"{row['odc_speedup_vs_fsdp2_once']:.3f} (designs vs once: "
                            f"overlap {row['odc_overlap_speedup_vs_fsdp2_once']:.3f}, full "
                            f"{row['odc_full_speedup_vs_fsdp2_once']:.3f}); bound "
                            f"{row['planner_bound']:.3f}",
                            flush=True,
                        )
    validation = []
    for name in sorted(os.listdir(args.results)):
        if name.startswith("e2e_") and name.endswith(".json"):
            with open(os.path.join(args.results, name)) as f:
                world = json.load(f)["world"]
            validation += validate(
                os.path.join(args.results, name), 270.0 if world == 2 else args.nvlink_gbs
            )
    for v in validation:
        print(
            f"validation {v['file']} {v['workload']}: modeled speed-up "
            f"{v['modeled_speedup']:.3f} (FSDP2 {v['modeled_s']['fsdp2']:.2f} s, ODC "
            f"{v['modeled_s']['odc']:.2f} s), measured {v['measured_speedup']:.3f} "
            f"({v['measured_s']['fsdp2']:.2f} s, {v['measured_s']['odc']:.2f} s)"
        )
    result = {
        "what": "modeled seconds per minibatch and speed-ups of ODC over FSDP2-HSDP, N nodes",
        "assumptions": ASSUMPTIONS,
        "machine": {
            "gpus_per_node": args.gpus_per_node,
            "nvlink_gbs": args.nvlink_gbs,
            "link_latency_s": Machine(1).link_latency_s,
            "odc_barrier_s": Machine(1).barrier_s,
            "link_gbs_why": "per node: 25 / 50 GB/s = one 200 / 400 Gb/s NIC per node; "
            "400 GB/s = 8 x 400 Gb/s NICs (rail-optimized HGX)",
        },
        "calibrations": calibrations,
        "seqs_per_rank": sprs,
        "draws": args.draws,
        "seed": args.seed,
        "nodes": nodes,
        "link_gbs": links,
        "gpus_per_node": args.gpus_per_node,
        "workloads": workloads,
        "plot_model": models[0],
        "command": " ".join(["python", "benchmarks/sim_multinode.py"] + (argv or sys.argv[1:])),
        "rows": rows,
        "validation_one_node": validation,
    }
    out = args.out
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}.json")
    if args.no_plot:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no PNG (the JSON has every number)")
        return
    plot(result, out + ".png")
    print(f"wrote {out}.png")


if __name__ == "__main__":
    main()
