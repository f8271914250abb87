"""Benchmarks the LB-Mini and LB-Micro planners (torch_odc.balance) on CPU.

For each length distribution, world size and sequences per rank it draws minibatches, plans them
in both modes and reports makespan / lower_bound (1.0 = perfectly balanced) and planning time,
then times the 10,000-sequence, 64-rank case. Writes benchmarks/results/balance/balance_cpu.json and
balance_cpu.png and prints the table last.

    python benchmarks/bench_balance.py            # full run (about a minute on 2 cores)
    python benchmarks/bench_balance.py --draws 3  # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import numpy as np
from workloads import equal, long_context, rl_like

from torch_odc import balance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "balance")

WORLD_SIZES = (4, 8, 32, 64)
PER_RANK = (4, 16)
COSTS = ("flops", "tokens")


# The token cap of a microbatch is the longest sequence the distribution allows, the smallest cap
# under which no sequence needs a microbatch of its own.
DISTRIBUTIONS = {
    "long-context": (long_context, 65536),
    "rl-like": (rl_like, 2048 + 20480),
    "equal": (equal, 16384),
}


def timed_plan(lengths, world_size, cap, mode, cost):
    start = time.perf_counter()
    p = balance.plan(lengths, world_size, cap, mode=mode, cost=cost)
    return p, time.perf_counter() - start


def run_grid(draws: int, seed: int) -> list[dict]:
    rows = []
    for dist_name, (draw_fn, cap) in DISTRIBUTIONS.items():
        for cost in COSTS:
            for world_size in WORLD_SIZES:
                for per_rank in PER_RANK:
                    rng = np.random.default_rng([seed, world_size, per_rank])
                    ratios = {"mini": [], "micro": []}
                    times = {"mini": [], "micro": []}
                    microbatches = []
                    for _ in range(draws):
                        lengths = draw_fn(rng, world_size * per_rank)
                        for mode in ("mini", "micro"):
                            p, dt = timed_plan(lengths, world_size, cap, mode, cost)
                            ratios[mode].append(p.ratio)
                            times[mode].append(dt)
                            if mode == "micro":
                                microbatches.append(len(p.microbatches[0]))
                    rows.append(
                        {
                            "distribution": dist_name,
                            "cost": cost,
                            "world_size": world_size,
                            "sequences_per_rank": per_rank,
                            "max_tokens_per_microbatch": cap,
                            "draws": draws,
                            "mini_ratio_mean": statistics.fmean(ratios["mini"]),
                            "mini_ratio_max": max(ratios["mini"]),
                            "micro_ratio_mean": statistics.fmean(ratios["micro"]),
                            "micro_ratio_max": max(ratios["micro"]),
                            "micro_microbatches_mean": statistics.fmean(microbatches),
                            "mini_plan_ms_median": 1e3 * statistics.median(times["mini"]),
                            "micro_plan_ms_median": 1e3 * statistics.median(times["micro"]),
                        }
                    )
    return rows


def run_large(repeats: int, seed: int) -> list[dict]:
    """The planning-time target: 10,000 sequences over 64 ranks, end to end from Python."""
    lengths = long_context(np.random.default_rng(seed), 10_000)
    out = []
    for cost in COSTS:
        for mode in ("mini", "micro"):
            times, p = [], None
            for _ in range(repeats):
                p, dt = timed_plan(lengths, 64, 65536, mode, cost)
                times.append(dt)
            out.append(
                {
                    "sequences": 10_000,
                    "world_size": 64,
                    "distribution": "long-context",
                    "cost": cost,
                    "mode": mode,
                    "repeats": repeats,
                    "plan_ms_median": 1e3 * statistics.median(times),
                    "plan_ms_min": 1e3 * min(times),
                    "ratio": p.ratio,
                }
            )
    return out


def environment() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--", "csrc/balance", "torch_odc"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if dirty:
            commit += " (planner sources modified)"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import torch

    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "git_commit": commit,
    }


def summary(rows: list[dict]) -> dict:
    """The issue's quality target: LB-Mini within 2% of the lower bound on average."""
    out = {}
    for dist in ("long-context", "rl-like"):
        for cost in COSTS:
            sel = [r for r in rows if r["distribution"] == dist and r["cost"] == cost]
            out[f"{dist}/{cost}"] = {
                "mini_ratio_mean": statistics.fmean(r["mini_ratio_mean"] for r in sel),
                "micro_ratio_mean": statistics.fmean(r["micro_ratio_mean"] for r in sel),
            }
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(COSTS), len(DISTRIBUTIONS), figsize=(15, 7), sharey=True, squeeze=False
    )
    for i, cost in enumerate(COSTS):
        for j, dist in enumerate(DISTRIBUTIONS):
            ax = axes[i][j]
            sel = [r for r in rows if r["distribution"] == dist and r["cost"] == cost]
            labels = [f"{r['world_size']}x{r['sequences_per_rank']}" for r in sel]
            x = np.arange(len(sel))
            ax.bar(x - 0.2, [r["mini_ratio_mean"] for r in sel], 0.4, label="LB-Mini")
            ax.bar(x + 0.2, [r["micro_ratio_mean"] for r in sel], 0.4, label="LB-Micro")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xticks(x, labels, rotation=45, fontsize=8)
            ax.set_title(f"{dist}, cost={cost}", fontsize=10)
            ax.set_ylim(0.98, max(1.05, max(r["micro_ratio_mean"] for r in rows) + 0.02))
            if j == 0:
                ax.set_ylabel("makespan / lower bound")
            if i == len(COSTS) - 1:
                ax.set_xlabel("world size x sequences per rank")
    axes[0][0].legend()
    fig.suptitle("torch_odc.balance: modeled minibatch time over the lower bound (mean of draws)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(rows: list[dict], large: list[dict], summ: dict) -> str:
    header = (
        "| distribution | cost | world | seqs/rank | cap | LB-Mini | LB-Micro | "
        "micro mbs/rank | mini ms (median) | micro ms (median) |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['distribution']} | {r['cost']} | {r['world_size']} | "
            f"{r['sequences_per_rank']} | {r['max_tokens_per_microbatch']} | "
            f"{r['mini_ratio_mean']:.4f} | {r['micro_ratio_mean']:.4f} | "
            f"{r['micro_microbatches_mean']:.1f} | {r['mini_plan_ms_median']:.2f} | "
            f"{r['micro_plan_ms_median']:.2f} |"
        )
    lines += ["", "| 10,000 seqs x 64 ranks | mode | median ms | min ms | ratio |"]
    lines.append("|---|---|---:|---:|---:|")
    for r in large:
        lines.append(
            f"| long-context, cost={r['cost']} | {r['mode']} | {r['plan_ms_median']:.1f} | "
            f"{r['plan_ms_min']:.1f} | {r['ratio']:.5f} |"
        )
    lines += ["", "| mean over world sizes and seqs/rank | LB-Mini | LB-Micro |"]
    lines.append("|---|---:|---:|")
    for key, v in summ.items():
        lines.append(f"| {key} | {v['mini_ratio_mean']:.4f} | {v['micro_ratio_mean']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=20, help="minibatches per configuration")
    parser.add_argument("--repeats", type=int, default=11, help="timings of the 10k case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(RESULTS, "balance_cpu"), help="path stem")
    args = parser.parse_args()

    rows = run_grid(args.draws, args.seed)
    large = run_large(args.repeats, args.seed)
    summ = summary(rows)
    result = {
        "command": "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "python_executable": sys.executable,
        "environment": environment(),
        "settings": {
            "draws": args.draws,
            "repeats": args.repeats,
            "seed": args.seed,
            "flops_cost": "torch_odc.balance.flops_cost defaults (8e9 params, 32 layers, "
            "hidden 4096, training)",
            "ratio": "makespan / lower_bound, lower_bound = max(total cost / world, max cost)",
        },
        "grid": rows,
        "large": large,
        "summary": summ,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, args.out + ".png")
    env = result["environment"]
    print(f"# {result['command']}")
    print(f"# {env['cpu_model']}, {env['cpus_usable']} usable cores; python {env['python']},")
    print(f"# torch {env['torch']}, numpy {env['numpy']}, commit {env['git_commit']}")
    print(f"# wrote {args.out}.json and {args.out}.png")
    print(table(rows, large, summ))


if __name__ == "__main__":
    main()
