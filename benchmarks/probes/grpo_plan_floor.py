"""Would a planner that prices each microbatch's fixed host time run GRPO's update faster?
(CPU only: planner arithmetic on the GRPO example's rows.)

The benchmark's token bound prices padded tokens only, but a GRPO microbatch also costs a
floor of host time whatever its tokens (PyTorch's eager launches: ~0.15-0.25 s at 1B,
docs/benchmarks.md). This takes the rows of the GPU rows' data (docs/examples/trl_grpo.py: its
prompts, completions drawn geometric with the example's mean and cap, since the real ones come
from generation), plans each step as the GRPO adapter does (LB-Mini over the rows' lengths, then
each rank's rows packed into the fewest microbatches of at most the step's cap in padded
tokens, ODC's widths), and then searches, by moving and swapping rows between ranks and packing
each rank for the least ``floor x microbatches + padded tokens``, for a plan whose slowest rank
costs less under that model. Reports, per floor (in tokens: the floor's seconds over the
seconds per padded token), the slowest rank's cost under the adapter's plan and under the best
plan found.

    python benchmarks/probes/grpo_plan_floor.py --record benchmarks/results/trainers/trl_grpo_1b_2gpu-round1_h200x2_2026-11-30.json
    python benchmarks/probes/grpo_plan_floor.py --gpus 4 --caps 4436,14292,...   # caps per step

Writes --out (default benchmarks/results/probes/grpo_plan_floor.json; the committed runs are
probes/grpo-plan-floor_1b_{2,4}gpu_cpu_2026-11-30.json, from the 2-GPU record above and
trainers/trl_grpo_1b_4gpu_h200x4_2026-11-29.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "docs", "examples"))

from trl_grpo import build_prompts

from torch_odc.integrations.hf import ODCGRPOConfig
from torch_odc.integrations.hf.grpo import ODCGRPOTrainerMixin
from torch_odc.step import LBMini, left_padded_widths, pack_padded

MULTIPLE = ODCGRPOTrainerMixin.AUTO_MULTIPLE  # ODC's GRPO length multiple on CUDA


def width(prompt: int, completion: int) -> int:
    return sum(left_padded_widths(prompt, completion, 1, True, MULTIPLE))


def padded(rows, mb) -> int:
    return len(mb) * width(max(rows[i][0] for i in mb), max(rows[i][1] for i in mb))


def pack_fewest(rows, members, cap):
    """The adapter's packing: the fewest microbatches, then the fewest padded tokens."""
    return pack_padded(members, lambda i: (1, tuple(rows[i])), lambda d: width(*d), cap)


def pack_cheapest(rows, members, cap, floor):
    """Consecutive runs of the rows sorted largest first, for the least floor x runs + padded
    tokens (a run above the cap only alone)."""
    order = sorted(members, key=lambda i: (-width(*rows[i]), i))
    best = [(0.0, 0)] + [(math.inf, 0)] * len(order)
    for j in range(1, len(order) + 1):
        p = c = 0
        for i in range(j - 1, -1, -1):
            p, c = max(p, rows[order[i]][0]), max(c, rows[order[i]][1])
            size = (j - i) * width(p, c)
            if size > cap and i < j - 1:
                break
            if best[i][0] + floor + size < best[j][0]:
                best[j] = (best[i][0] + floor + size, i)
    out, j = [], len(order)
    while j > 0:
        out.append(order[best[j][1] : j])
        j = best[j][1]
    return out


def cost(rows, members, cap, floor) -> tuple[float, int, int]:
    """(floor x microbatches + padded tokens, microbatches, padded tokens) of one rank."""
    if not members:
        return 0.0, 0, 0
    mbs = pack_cheapest(rows, members, cap, floor)
    tokens = sum(padded(rows, mb) for mb in mbs)
    return floor * len(mbs) + tokens, len(mbs), tokens


def slowest(rows, assign, world, cap, floor) -> float:
    return max(
        cost(rows, [i for i, r in enumerate(assign) if r == rank], cap, floor)[0]
        for rank in range(world)
    )


def search(rows, assign, world, cap, floor) -> float:
    """Moves and swaps of rows between ranks while the slowest rank's cost falls."""
    best = slowest(rows, assign, world, cap, floor)
    improved = True
    while improved:
        improved = False
        n = len(rows)
        moves = [(i, None, r) for i in range(n) for r in range(world)]
        moves += [(i, k, None) for i in range(n) for k in range(i + 1, n)]
        for i, k, r in moves:
            old = list(assign)
            if k is None:
                if assign[i] == r:
                    continue
                assign[i] = r
            else:
                if assign[i] == assign[k]:
                    continue
                assign[i], assign[k] = assign[k], assign[i]
            value = slowest(rows, assign, world, cap, floor)
            if value < best - 1e-9:
                best, improved = value, True
            else:
                assign[:] = old
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--record",
        help="a bench_trl GRPO record of one run (not pooled): its ranks and each step's cap",
    )
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--caps", help="comma-separated cap per step (instead of --record)")
    p.add_argument(
        "--floors",
        default="0,2000,4000,6000,8000",
        help="microbatch floors to try, in padded tokens",
    )
    p.add_argument("--per-device-batch", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion", type=int, default=32)
    p.add_argument("--mean-completion", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=os.path.join(HERE, "..", "results", "probes", "grpo_plan_floor.json")
    )
    args = p.parse_args(argv)
    world = args.gpus
    if args.record:
        with open(args.record) as f:
            record = json.load(f)
        world = record["nproc"]
        caps = [step.get("cap") for step in record["runs"]["odc"]["steps"]]
    else:
        caps = [int(c) for c in args.caps.split(",")]
    per_step = args.per_device_batch * args.accumulation * world
    groups = per_step // args.num_generations
    prompts = build_prompts(groups * len(caps), 32000, 64, 2048)
    rng = random.Random(f"grpo_plan_floor:{args.seed}")
    lbmini = LBMini.from_config(ODCGRPOConfig())
    floors = [float(f) for f in args.floors.split(",")]
    steps = []
    for s, cap in enumerate(caps):
        rows = []
        for g in range(groups):
            prompt = len(prompts[s * groups + g].split())
            for _ in range(args.num_generations):
                c = 1  # geometric with the example's mean, at most its cap
                while c < args.max_completion and rng.random() > 1 / args.mean_completion:
                    c += 1
                rows.append((prompt, c))
        if cap is None:
            continue
        lengths = [a + b for a, b in rows]
        plan = lbmini(lengths, world, s + 1, cap=max(cap, max(lengths)))
        assign = [0] * len(rows)
        for rank, mbs in enumerate(plan):
            for mb in mbs:
                for i in mb:
                    assign[i] = rank
        adapter = [
            pack_fewest(rows, [i for i, r in enumerate(assign) if r == rank], cap)
            for rank in range(world)
        ]
        entry = {
            "step": s + 1,
            "cap": cap,
            "adapter": [
                {"microbatches": len(m), "padded": sum(padded(rows, b) for b in m)} for m in adapter
            ],
            "floors": {},
        }
        for floor in floors:
            theirs = max(floor * len(m) + sum(padded(rows, b) for b in m) for m in adapter)
            found = search(rows, list(assign), world, cap, floor)
            entry["floors"][str(int(floor))] = {"adapter": theirs, "best_found": found}
        steps.append(entry)
        print(
            f"step {s + 1} cap {cap}: adapter {entry['adapter']}; "
            + ", ".join(
                f"floor {k}: {v['adapter']:.0f} -> {v['best_found']:.0f}"
                for k, v in entry["floors"].items()
            )
        )
    totals = {
        k: {
            "adapter": sum(e["floors"][k]["adapter"] for e in steps),
            "best_found": sum(e["floors"][k]["best_found"] for e in steps),
        }
        for k in steps[0]["floors"]
    }
    for k, v in totals.items():
        print(
            f"floor {k} tokens: the slowest ranks' cost over the steps, adapter "
            f"{v['adapter']:.0f}, best found {v['best_found']:.0f} "
            f"({v['adapter'] / v['best_found']:.4f}x)"
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                "world": world,
                "steps": steps,
                "totals": totals,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
