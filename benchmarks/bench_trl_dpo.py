"""TRL DPOTrainer, ODC vs plain TRL: the DPO example (docs/examples/trl_dpo.py) trained on the
same pairs in both modes, pairs/s and tokens/s per GPU.

* ``odc``:   ``odc_trainer(DPOTrainer)`` on the "odc" group: LB-Mini plans each step's pairs
  over the ranks, microbatches of at most ``--max-tokens-per-microbatch`` pair tokens, any
  number per rank, one barrier per step.
* ``plain``: TRL's DPOTrainer with accelerate's FSDP2 on an NCCL group (Gloo on CPU, where
  accelerate turns FSDP into DDP: a smoke test of the code path only): per rank
  ``--accumulation`` microbatches of ``--per-device-batch`` pairs, padded to their longest.

Both see the same pairs in the same steps (sequential order, ``per-device-batch x accumulation
x world`` pairs a step) and the same reference (``--ref precompute`` by default: log-probs
computed before training, so a step is the policy's forward and backward only). Tokens are the
pairs' non-padding tokens (prompt twice, both completions). The first ``--warmup`` steps are
not measured.

    # one GPU per rank (2 GPUs): both modes, then the comparison (JSON + PNG + table)
    python benchmarks/bench_trl_dpo.py --launch 2 --out benchmarks/results/trl_dpo --size medium
    # or each mode on its own, then merge
    torchrun --nproc-per-node 2 benchmarks/bench_trl_dpo.py --mode odc --out DIR
    torchrun --nproc-per-node 2 benchmarks/bench_trl_dpo.py --mode plain --out DIR
    python benchmarks/bench_trl_dpo.py --merge DIR
    # smoke test on 2 CPU ranks
    python benchmarks/bench_trl_dpo.py --launch 2 --out /tmp/dpo-bench --size tiny --steps 4 \\
        --warmup 1
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "docs", "examples"))

MODES = ("odc", "plain")
# Defaults for the GPU comparison (the example's own defaults suit a CPU run).
GPU_DEFAULTS = {"size": "medium", "steps": 20, "per_device_batch": 8, "accumulation": 2,
                "min_prompt": 32, "max_prompt": 2048, "min_completion": 16,
                "max_completion": 2048, "max_tokens_per_microbatch": 8192}


def parser():
    import trl_dpo

    ap = trl_dpo.parser()
    ap.description = __doc__.split("\n\n")[0]
    ap.add_argument("--mode", choices=MODES, help="run one mode (under torchrun)")
    ap.add_argument("--warmup", type=int, default=3, help="steps not measured")
    ap.add_argument("--merge", metavar="DIR", help="compare the modes' JSON files in DIR")
    ap.add_argument("--launch", type=int, metavar="N",
                    help="run both modes with torchrun on N ranks, then merge")
    ap.add_argument("--gpu-defaults", action="store_true",
                    help=f"the GPU comparison's settings: {GPU_DEFAULTS}")
    ap.add_argument("--commit", default=None, help="recorded in the JSON (default: git HEAD)")
    return ap


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict:
    import accelerate
    import torch
    import transformers
    import trl

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__, "accelerate": accelerate.__version__,
           "python": platform.python_version()}
    try:
        import peft

        out["peft"] = peft.__version__
    except ImportError:
        pass
    return out


def run_mode(args) -> None:
    """One mode on this torchrun rank: trains, then rank 0 writes DIR/trl_dpo_<mode>.json."""
    import warnings

    import torch
    import torch.distributed as dist
    import trl_dpo

    from torch_odc import balance

    odc = args.mode == "odc"
    trl_dpo.init_process_group(odc)
    warnings.filterwarnings("ignore", category=balance.OversizedSequenceWarning)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    log = trl_dpo.train(args, odc)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        measured = log["steps"][args.warmup:]
        if not measured:
            raise SystemExit(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
        seconds = sum(e["seconds"] for e in measured)
        pairs = sum(e["pairs"] for e in measured)
        tokens = sum(e["tokens"] for e in measured)
        summary = {
            "measured_steps": len(measured), "seconds": seconds,
            "seconds_per_step": seconds / len(measured),
            "pairs_per_s_per_gpu": pairs / seconds / world,
            "tokens_per_s_per_gpu": tokens / seconds / world,
            "peak_memory_gib": peaks, "wall_s": wall,
            "final_loss": log["steps"][-1]["loss"],
        }
        if odc:
            counts = [e["microbatches"] for e in log["steps"]]
            summary["uneven_steps"] = sum(len(set(c)) > 1 for c in counts)
            summary["microbatches_per_rank"] = [sum(c[r] for c in counts) for r in range(world)]
        log["meta"].update(versions(), commit=args.commit or commit(), host=platform.node(),
                           command=f"torchrun --nproc-per-node={world} " + " ".join(sys.argv),
                           warmup=args.warmup, gpus=world if cuda else 0)
        log["summary"] = summary
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"trl_dpo_{args.mode}.json")
        with open(path, "w") as f:
            json.dump(log, f, indent=1)
        print(f"{args.mode}: {summary['pairs_per_s_per_gpu']:.2f} pairs/s/GPU, "
              f"{summary['tokens_per_s_per_gpu']:.0f} tokens/s/GPU -> {path}", flush=True)
    dist.destroy_process_group()


def merge(directory: str) -> dict:
    """The comparison of the modes' runs in ``directory``: JSON, PNG and a table."""
    runs = {}
    for mode in MODES:
        path = os.path.join(directory, f"trl_dpo_{mode}.json")
        if os.path.exists(path):
            with open(path) as f:
                runs[mode] = json.load(f)
    if not runs:
        raise SystemExit(f"no trl_dpo_<mode>.json in {directory}")
    table = {mode: run["summary"] for mode, run in runs.items()}
    result = {"modes": table, "meta": {m: r["meta"] for m, r in runs.items()}}
    if len(runs) == 2:
        result["speedup_tokens_per_s"] = (table["odc"]["tokens_per_s_per_gpu"]
                                          / table["plain"]["tokens_per_s_per_gpu"])
        same = [e["tokens"] for e in runs["odc"]["steps"]] == [
            e["tokens"] for e in runs["plain"]["steps"]]
        result["same_pairs_per_step"] = same
    with open(os.path.join(directory, "trl_dpo_compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(runs, os.path.join(directory, "trl_dpo_compare.png"))
    meta = next(iter(runs.values()))["meta"]
    print(f"\nDPO {meta['size']}, ref {meta['ref']}, {meta['world']} ranks on {meta['device']}, "
          f"{meta['pairs_per_step']} pairs a step, commit {meta.get('commit')}; "
          + ", ".join(f"{m}: {r['meta'].get('wrapping')}" for m, r in runs.items()))
    print(f"{'mode':6s} {'pairs/s/GPU':>12s} {'tokens/s/GPU':>13s} {'s/step':>8s} "
          f"{'peak GiB':>9s} {'final loss':>11s}")
    for mode, s in table.items():
        peak = max((p for p in s["peak_memory_gib"] if p is not None), default=None)
        peak = f"{peak:9.2f}" if peak is not None else f"{'-':>9s}"
        print(f"{mode:6s} {s['pairs_per_s_per_gpu']:12.2f} {s['tokens_per_s_per_gpu']:13.0f} "
              f"{s['seconds_per_step']:8.3f} {peak} {s['final_loss']:11.4f}")
    if "speedup_tokens_per_s" in result:
        print(f"ODC / plain tokens/s: {result['speedup_tokens_per_s']:.3f}"
              f"{'' if result['same_pairs_per_step'] else '  (NOT the same pairs per step)'}")
    return result


def plot(runs: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    modes = list(runs)
    axes[0].bar(modes, [runs[m]["summary"]["tokens_per_s_per_gpu"] for m in modes],
                color=["tab:green" if m == "odc" else "tab:gray" for m in modes])
    axes[0].set_ylabel("tokens/s per GPU (non-padding)")
    for mode in modes:
        steps = runs[mode]["steps"]
        axes[1].plot([e["step"] for e in steps], [e["seconds"] for e in steps], marker="o",
                     label=mode)
    axes[1].axvline(runs[modes[0]]["meta"]["warmup"] + 0.5, color="k", lw=0.5, ls="--")
    axes[1].set_xlabel("optimizer step")
    axes[1].set_ylabel("step time (s)")
    axes[1].legend()
    meta = runs[modes[0]]["meta"]
    plain = runs.get("plain", {}).get("meta", {}).get("wrapping", "FSDP2")
    fig.suptitle(f"TRL DPO {meta['size']} (ref {meta['ref']}), {meta['world']} ranks on "
                 f"{meta['device']}: ODC + LB-Mini vs plain TRL ({plain})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launch(args, argv: list[str]) -> None:
    """Both modes, each in its own torchrun, then the comparison."""
    skip = {"--launch"}
    rest, i = [], 0
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        if argv[i].startswith("--launch="):
            i += 1
            continue
        rest.append(argv[i])
        i += 1
    for mode in MODES:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.launch}",
               os.path.abspath(__file__), "--mode", mode, *rest]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    merge(args.out)


def main() -> None:
    ap = parser()
    if "--gpu-defaults" in sys.argv:
        ap.set_defaults(**GPU_DEFAULTS)  # what the command line gives still wins
    args = ap.parse_args()
    if args.merge:
        merge(args.merge)
    elif args.launch:
        if not args.out:
            raise SystemExit("--launch needs --out DIR")
        launch(args, sys.argv[1:])
    elif args.mode:
        if not args.out:
            raise SystemExit("--mode needs --out DIR")
        if args.no_odc:
            raise SystemExit("--no-odc: use --mode plain")
        run_mode(args)
    else:
        raise SystemExit("give --mode (under torchrun), --launch N or --merge DIR")


if __name__ == "__main__":
    main()
