"""GPU memory given back between phases (RL's rollout between two updates), ODC vs FSDP2 alone.

    torchrun --nproc-per-node 2 benchmarks/bench_release.py [--model 1b] [--out DIR]

Each rank trains the bench_e2e model (bf16 compute, fp32 master weights and reduction, AdamW)
for two minibatches, then switches phases as verl's ``param_offload`` + ``optimizer_offload``
does: the model and the optimizer state to the CPU and ``empty_cache()``; under ODC
:func:`torch_odc.release_memory` first (the shard caches, the accumulators and the control
words go too). Then everything comes back (``model.to(device)``, the optimizer state, under
ODC :func:`torch_odc.restore_memory`) and one more minibatch trains. The same sequence runs
under FSDP2 alone (no attach: FSDP2's collectives over the odc group's inner backends, NCCL
with one GPU per rank, Gloo for ranks sharing one GPU) and under ODC without the phase switch.

Recorded at each phase, after every rank reached it: the driver's free memory of each GPU
(``torch.cuda.mem_get_info``: what a colocated rollout engine could take), this rank's
allocator reservation and ODC's region; and the largest parameter difference between ODC with
and without the switch (exactness) and against FSDP2 alone (equal counts on every rank).
Writes release_<tag>.json and .png under --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import MODELS
from bench_memory import build  # the same model, mesh and mixed precision

import torch_odc

GiB = 2**30
PHASES = ("start", "trained", "released", "restored")


def optimizer_to(opt, device) -> None:
    """verl's offload_fsdp_optimizer / load_fsdp_optimizer: every state tensor moves."""
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)


def snapshot(device) -> dict:
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()  # every rank reached this phase: the driver's figure covers all of them
    free, total = torch.cuda.mem_get_info(device)
    stats = torch_odc.stats()
    dist.barrier()
    return {
        "driver_free_bytes": free,
        "driver_total_bytes": total,
        "reserved_bytes": torch.cuda.memory_reserved(device),
        "odc_region_bytes": stats[0]["region_bytes"] if stats else 0,
    }


def run(args, device, group, mode: str) -> dict:
    """mode: "fsdp2" (no attach, phase switch), "odc" (attach, phase switch), "odc_plain" and
    "odc_plain_again" (attach, no switch)."""
    out = {"phases": {"start": snapshot(device)}}
    model, handle = build(args, device, group, odc=mode != "fsdp2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = MODELS[args.model][-1]
    gen = torch.Generator().manual_seed(dist.get_rank())

    def minibatch():
        for _ in range(args.microbatches):
            tokens = torch.randint(0, vocab, (args.seq_len + 1,), generator=gen).to(device)
            (model([tokens]) / args.seq_len).backward()
        if handle is not None:
            torch_odc.minibatch_barrier()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        minibatch()
    out["phases"]["trained"] = snapshot(device)
    if mode != "odc_plain":
        if handle is not None:
            torch_odc.release_memory()
        model.to("cpu")
        optimizer_to(opt, "cpu")
    out["phases"]["released"] = snapshot(device)
    if mode != "odc_plain":
        model.to(device)
        optimizer_to(opt, device)
        if handle is not None:
            torch_odc.restore_memory()
    minibatch()
    out["phases"]["restored"] = snapshot(device)
    out["params"] = {n: p.to_local().detach().float().cpu() for n, p in model.named_parameters()}
    if handle is not None:
        handle.detach()
    model = opt = handle = None  # freed before the next mode builds its own
    gc.collect()
    torch.cuda.empty_cache()
    return out


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, mode in enumerate(("fsdp2", "odc")):
        if mode not in result["modes"]:
            continue
        phases = result["modes"][mode]["phases"]
        used = [
            (phases[p]["driver_total_bytes"] - phases[p]["driver_free_bytes"]) / GiB for p in PHASES
        ]
        ax.bar(
            [x + i * width for x in range(len(PHASES))],
            used,
            width,
            label="FSDP2 alone" if mode == "fsdp2" else "ODC",
        )
    ax.set_xticks([x + width / 2 for x in range(len(PHASES))], PHASES)
    ax.set_ylabel("GPU memory in use (driver), GiB")
    ax.set_title(
        f"{result['model']} model, {result['world']} ranks on {result['gpus']} GPU(s): "
        "memory given back between phases"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/results/memory")
    p.add_argument("--tag", default=None)
    args = p.parse_args()
    dist.init_process_group("odc")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(backend="odc")
    # FSDP2 alone needs a GPU per rank (NCCL refuses ranks sharing one): there its released
    # phase can hold no less than the CUDA contexts of the "start" phase, which ODC's is
    # compared with.
    alone = torch.cuda.device_count() >= world
    modes = {}
    # ODC without the switch twice: two ranks' pushes into one accumulator land in either
    # order, so runs differ by rounding (AdamW's normalized step turns that into up to ~lr per
    # step for near-zero gradients): the floor the switch's difference is read against.
    for mode in (
        ("fsdp2", "odc", "odc_plain", "odc_plain_again")
        if alone
        else ("odc", "odc_plain", "odc_plain_again")
    ):
        modes[mode] = run(args, device, group, mode)
    params = {m: modes[m].pop("params") for m in modes}

    def diff(a, b):
        if a not in params or b not in params:
            return None
        return max((params[a][k] - params[b][k]).abs().max().item() for k in params[a])

    result = {
        "model": args.model,
        "world": world,
        "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(device),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["torchrun", f"--nproc-per-node {world}", *sys.argv]),
        "args": vars(args),
        "modes": modes,
        "max_param_diff_odc_switch_vs_no_switch": diff("odc", "odc_plain"),
        "max_param_diff_odc_vs_fsdp2": diff("odc", "fsdp2"),
        "max_param_diff_noise_no_switch_twice": diff("odc_plain", "odc_plain_again"),
    }
    diffs = [None] * world
    dist.all_gather_object(
        diffs,
        [
            result["max_param_diff_odc_switch_vs_no_switch"],
            result["max_param_diff_odc_vs_fsdp2"],
            result["max_param_diff_noise_no_switch_twice"],
        ],
    )
    result["per_rank_max_param_diff"] = diffs
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tag = args.tag or f"{args.model}_{world}r{result['gpus']}g"
        with open(os.path.join(args.out, f"release_{tag}.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.join(args.out, f"release_{tag}.png"))
        print(f"{'phase':10} {'FSDP2 used GiB':>15} {'ODC used GiB':>13} {'ODC region GiB':>15}")
        for phase in PHASES:
            od = modes["odc"]["phases"][phase]
            f2 = modes.get("fsdp2", {}).get("phases", {}).get(phase)
            used = (
                f"{(f2['driver_total_bytes'] - f2['driver_free_bytes']) / GiB:15.2f}"
                if f2
                else f"{'-':>15}"
            )
            print(
                f"{phase:10} {used} "
                f"{(od['driver_total_bytes'] - od['driver_free_bytes']) / GiB:13.2f} "
                f"{od['odc_region_bytes'] / GiB:15.2f}"
            )
        print(
            "max |param| diff, ODC with vs without the switch:",
            result["max_param_diff_odc_switch_vs_no_switch"],
            " without, twice:",
            result["max_param_diff_noise_no_switch_twice"],
            " ODC vs FSDP2:",
            result["max_param_diff_odc_vs_fsdp2"],
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
