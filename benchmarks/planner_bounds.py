"""What balancing alone allows: the LB-Micro / LB-Mini makespan ratio that the planner predicts
for the end-to-end benchmark's workloads, over many seeded minibatches, under a fitted cost
model (CPU only, no GPU: planner arithmetic).

    python benchmarks/planner_bounds.py --calibration DENSE,ATTN,FLOOR   # from a device run

Writes benchmarks/results/balance/planner-bounds_cpu.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import MODELS, CostModel, plans, time_cost
from workloads import long_context, rl_like

WORKLOADS = {"long-context": long_context, "rl": rl_like}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--calibration",
        default="7.107057653e+14,2.546091454e+14,0.1728656397",
        help="DENSE,ATTN,FLOOR (default: the 4x H200 fit of 2026-11-21)",
    )
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--draws", type=int, default=300, help="minibatches per row (4 per rank)")
    p.add_argument("--seed", type=int, default=99)
    p.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.abspath(__file__)),
            "results",
            "balance",
            "planner-bounds_cpu.json",
        ),
    )
    args = p.parse_args(argv)
    dim, layers, heads, kv_heads, ffn, vocab = MODELS[args.model]
    kv_dim = dim // heads * kv_heads
    n_params = layers * (2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn + 2 * dim) + (
        2 * vocab * dim + dim
    )
    model = CostModel.parse(args.calibration)
    rows = []
    print(
        f"{'pack':>6} {'workload':<13}{'seqs/rank':>10}{'ranks':>6}{'mean':>7}{'median':>7}"
        f"{'pooled':>7}{'>=1.2':>7}"
    )
    for pack in (1, 16384):
        cost = time_cost(model, n_params, layers, dim, pack)
        for name, draw in WORKLOADS.items():
            for spr in (4, 16):
                if pack > 1 and spr > 4:
                    continue
                for world in (4, 8):
                    rng = np.random.default_rng(args.seed)
                    micro, mini = [], []
                    for _ in range(args.draws if spr == 4 else max(1, args.draws // 3)):
                        x = draw(rng, spr * world)
                        micro.append(plans(x, world, "micro", cost, pack).makespan)
                        mini.append(plans(x, world, "mini", cost, pack).makespan)
                    r = np.array(micro) / np.array(mini)
                    row = {
                        "pack_tokens": pack,
                        "workload": name,
                        "seqs_per_rank": spr,
                        "ranks": world,
                        "minibatches": len(r),
                        "mean": float(r.mean()),
                        "median": float(np.median(r)),
                        "pooled": float(sum(micro) / sum(mini)),
                        "share_at_least_1.2": float(np.mean(r >= 1.2)),
                    }
                    rows.append(row)
                    print(
                        f"{pack:>6} {name:<13}{spr:>10}{world:>6}{row['mean']:>7.3f}"
                        f"{row['median']:>7.3f}{row['pooled']:>7.3f}"
                        f"{row['share_at_least_1.2']:>7.0%}",
                        flush=True,
                    )
    with open(args.out, "w") as f:
        json.dump(
            {
                "cost_model": str(model),
                "model": args.model,
                "n_params": n_params,
                "seed": args.seed,
                "command": " ".join(["python"] + sys.argv),
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
