"""Memory of ODC vs FSDP2 on the end-to-end model: allocator peak plus ODC's region, per rank.

    torchrun --nproc-per-node 2 benchmarks/bench_memory.py [--model 1b] [--out DIR]

Each rank trains the bench_e2e model (bf16 compute, fp32 master weights and reduction,
activation checkpointing, AdamW) for a few minibatches of several microbatches and records
``torch.cuda.max_memory_allocated`` over the last minibatch and its optimizer step, and, under
ODC, the bytes of its region by category (``torch_odc.stats()["memory"]``: the parameters
living in the shard caches, published copies, accumulators, control), which lie outside the allocator.

FSDP2 over NCCL runs for real when every rank has a GPU of its own. Ranks sharing one GPU (the
1-GPU machine kinds: CUDA IPC works there, NCCL refuses) measure ODC only, and FSDP2's figure is
accounted from the same run: ODC's allocator peak plus FSDP2's sharded fp32 gradients, which
FSDP2 keeps in the allocator from the first microbatch's reduce-scatter to zero_grad() (so
throughout every later microbatch's backward, where the peak is), while under ODC they are views
of the accumulators, plus the sharded parameters, which live in ODC's shard caches. Everything else either side allocates (parameters, optimizer state,
all-gather and reduce-scatter buffers, activations) is the same model code on the same data.
Writes memory_<tag>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import MODELS, Llama

import torch_odc

GiB = 2**30


def build(args, device, group, odc: bool):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dim, layers, heads, kv_heads, ffn, vocab = MODELS[args.model]
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(dim, layers, heads, kv_heads, ffn, vocab)
    mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    handle = torch_odc.attach(model) if odc else None
    return model, handle


def run(args, device, group, odc: bool) -> dict:
    model, handle = build(args, device, group, odc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = MODELS[args.model][-1]
    gen = torch.Generator().manual_seed(dist.get_rank())
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    for mb in range(args.minibatches):
        if mb == args.minibatches - 1:  # optimizer state exists: measure the steady state
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.microbatches):
            tokens = torch.randint(0, vocab, (args.seq_len + 1,), generator=gen).to(device)
            (model([tokens]) / args.seq_len).backward()
        # What .grad holds in the allocator at the end of the minibatch's backward: FSDP2's
        # sharded gradients; under ODC nothing (the gradients are in the accumulators, .grad
        # a placeholder that allocates nothing and refuses to be read before the barrier).
        grad_bytes = (
            0
            if handle is not None
            else sum(
                p.grad.to_local().numel() * p.grad.to_local().element_size()
                for p in model.parameters()
                if p.grad is not None
            )
        )
        if handle is not None:
            torch_odc.minibatch_barrier()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(device)
    out = {
        "allocator_peak_bytes": torch.cuda.max_memory_allocated(device),
        "sharded_param_numel": shard_numel,
        "sharded_grad_bytes": 4 * shard_numel,  # fp32 master weights: fp32 sharded .grad
        "grad_bytes_held_before_barrier": grad_bytes,
    }
    if handle is not None:
        stats = handle.stats()
        out["region_bytes"] = stats["region_bytes"]
        out["region"] = stats["memory"]
        if args.cycles:
            out["gradient_memory_cycles"] = free_restore_cycles(args, model, handle, device, gen)
        handle.detach()
    del model, opt, handle
    gc.collect()
    torch.cuda.empty_cache()
    return out


def free_restore_cycles(args, model, handle, device, gen) -> list[dict]:
    """--cycles: the host seconds of free_gradient_memory() and restore_gradient_memory() (the
    GRPO adapter's pair around generation), each cycle followed by one microbatch and the
    barrier, with the engine's split of each (stats()["gradient_memory"])."""
    vocab = MODELS[args.model][-1]
    cycles = []
    for _ in range(args.cycles):
        before = handle.stats()["gradient_memory"]
        torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        handle.free_gradient_memory()
        t1 = time.perf_counter()
        handle.restore_gradient_memory()
        t2 = time.perf_counter()
        after = handle.stats()["gradient_memory"]
        cycles.append(
            {
                "free_s": t1 - t0,
                "restore_s": t2 - t1,
                "engine": {k: after[k] - before[k] for k in after if k.endswith("_s")},
            }
        )
        tokens = torch.randint(0, vocab, (args.seq_len + 1,), generator=gen).to(device)
        (model([tokens]) / args.seq_len).backward()
        torch_odc.minibatch_barrier()
        model.zero_grad()
    return cycles


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = result["per_rank"][0]
    odc, fsdp2 = r["odc"], r["fsdp2"]
    fig, ax = plt.subplots(figsize=(7, 4))
    region = odc["region"]
    bars = [
        (
            "ODC",
            [
                ("allocator peak", odc["allocator_peak_bytes"]),
                ("parameters (shard cache)", region.get("parameter_bytes", 0)),
                ("published cache", region["published_cache_bytes"]),
                ("accumulators (= .grad)", region["accumulator_bytes"]),
                ("control", region["control_bytes"]),
            ],
        ),
        (f"FSDP2 ({fsdp2['how']})", [("allocator peak", fsdp2["allocator_peak_bytes"])]),
    ]
    colors = {
        "allocator peak": "#4c72b0",
        "parameters (shard cache)": "#8172b3",
        "published cache": "#dd8452",
        "accumulators (= .grad)": "#55a868",
        "control": "#c44e52",
    }
    for i, (name, parts) in enumerate(bars):
        bottom = 0.0
        for label, value in parts:
            ax.bar(
                i,
                value / GiB,
                bottom=bottom,
                color=colors[label],
                label=label if i == 0 or label != "allocator peak" else None,
            )
            bottom += value / GiB
        ax.text(i, bottom, f"{bottom:.2f} GiB", ha="center", va="bottom")
    top = max(sum(v for _, v in parts) for _, parts in bars) / GiB
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_ylabel("GiB per rank")
    ax.set_title(
        f"{result['model']} model, {result['world']} ranks, {result['device']}\n"
        f"ODC - FSDP2 = {result['extra_bytes_per_sharded_param']:.3f} B per sharded "
        "parameter"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=3)
    p.add_argument(
        "--cycles",
        type=int,
        default=0,
        help="then time this many free/restore_gradient_memory cycles (ODC)",
    )
    p.add_argument("--out", default="benchmarks/results/memory")
    p.add_argument("--tag", default=None)
    p.add_argument("--plot", default=None, metavar="JSON", help="only redraw the PNG of a result")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.plot.removesuffix(".json") + ".png")
        return

    dist.init_process_group(backend="odc", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    own_gpu = gpus >= world
    fsdp2_group = dist.new_group(backend="nccl") if own_gpu else None
    res = {"odc": run(args, device, dist.group.WORLD, odc=True)}
    if own_gpu:
        res["fsdp2"] = run(args, device, fsdp2_group, odc=False)
        res["fsdp2"]["how"] = "measured, NCCL"
    else:
        odc = res["odc"]
        res["fsdp2"] = {
            "how": "accounted",
            "allocator_peak_bytes": odc["allocator_peak_bytes"]
            + odc["sharded_grad_bytes"]
            + odc["region"].get("parameter_bytes", 0),
        }
    per_rank = [None] * world
    dist.all_gather_object(per_rank, res)
    if rank == 0:
        extra = [
            (
                r["odc"]["allocator_peak_bytes"]
                + r["odc"]["region_bytes"]
                - r["fsdp2"]["allocator_peak_bytes"]
            )
            / r["odc"]["sharded_param_numel"]
            for r in per_rank
        ]
        result = {
            "command": f"torchrun --nproc-per-node {world} benchmarks/bench_memory.py "
            + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(device),
            "gpus": gpus,
            "world": world,
            "ranks_share_a_gpu": not own_gpu,
            "torch": torch.__version__,
            "model": args.model,
            "seq_len": args.seq_len,
            "microbatches": args.microbatches,
            "per_rank": per_rank,
            "extra_bytes_per_sharded_param": max(extra),
            "extra_bytes_per_sharded_param_by_rank": extra,
        }
        tag = args.tag or f"{args.model}_w{world}"
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"memory_{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.join(args.out, f"memory_{tag}.png"))
        for r_i, r in enumerate(per_rank):
            o, f2 = r["odc"], r["fsdp2"]
            print(
                f"rank {r_i}: ODC allocator peak {o['allocator_peak_bytes'] / GiB:.3f} GiB + "
                f"region {o['region_bytes'] / GiB:.3f} GiB ({o['region']}) ; FSDP2 "
                f"({f2['how']}) {f2['allocator_peak_bytes'] / GiB:.3f} GiB; extra "
                f"{extra[r_i]:.3f} B per sharded parameter"
            )
            cycles = o.get("gradient_memory_cycles")
            if cycles:
                med = {
                    k: statistics.median(c["engine"][k] for c in cycles)
                    for k in cycles[0]["engine"]
                }
                print(
                    f"rank {r_i}: free/restore over {len(cycles)} cycles, median ms: free "
                    f"{1e3 * statistics.median(c['free_s'] for c in cycles):.2f}, restore "
                    f"{1e3 * statistics.median(c['restore_s'] for c in cycles):.2f}; engine "
                    + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in med.items())
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
