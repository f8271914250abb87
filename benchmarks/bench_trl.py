"""TRL trainers under ODC vs the unmodified trainer with FSDP2 over NCCL, on the same data: the
runnable examples of docs/examples/ launched with torchrun, once per variant, each writing its
per-step log; this script reads the logs and reports per GPU the rollouts (or samples) per
second and the tokens per second, as JSON and PNG in --out, and a table last.

    python benchmarks/bench_trl.py grpo --out benchmarks/results             # 2 GPUs
    python benchmarks/bench_trl.py grpo --cpu --out /tmp/bench_trl           # CPU smoke test
    python benchmarks/bench_trl.py grpo --out DIR -- --size medium --steps 6 # example arguments

Everything after ``--`` goes to the example unchanged (both variants). Steps before --warmup are
left out of the rates (the first ones compile kernels and grow the allocator).

Modes. ``MODES`` maps a name to a :class:`Mode`: the example script, its log file, its
arguments on GPUs and for the CPU smoke test, the variants (name -> extra arguments) and
``summarize(steps, world)`` turning the measured steps of one variant into the reported numbers.
Adding a trainer (``dpo``) is one more entry.

grpo: docs/examples/trl_grpo.py (HF generation, no vLLM). ``odc``: odc_trainer(GRPOTrainer) on
the "odc" group, rollouts moved between ranks by LB-Mini and packed into token-capped
microbatches; ``odc-local`` (with ``--variants``): the same without moving rollouts; ``plain``: the unmodified GRPOTrainer on an NCCL group, FSDP2 as accelerate sets
it up (on CPU: Gloo, and accelerate uses DDP), decoding with ``synced_gpus`` (FSDP2's per-layer
all-gathers are collectives: ranks must decode the same number of steps). A step is one
generation round and one optimizer step; a rollout is one completion; tokens are prompt +
completion tokens (TRL's ``num_input_tokens_seen``). Also reported: the rollout phase
(generation, rewards, old/reference log-probs) and the update phase (the rest) per step.

On the GPU machines (no package registry): TRL 1.16 with transformers >= 5.23 is what the
adapter is verified with; if the image has other versions, carry wheels
(``pip download --no-deps trl==1.16.0 transformers==5.23.0 accelerate==1.15.0 -d wheels``
here, then ``pip install --no-deps wheels/*`` there). The script records every version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Mode:
    example: str  # path under the repository root
    log_name: str  # the JSON the example writes into its --out
    gpu_args: list[str]
    cpu_args: list[str]
    variants: dict[str, list[str]]
    summarize: Callable[[list[dict], int], dict]
    default_variants: tuple[str, ...] = ("odc", "plain")
    unit: str = "rollouts"  # what one row of a step is


def _rates(steps: list[dict], world: int, unit: str) -> dict:
    seconds = sum(s["seconds"] for s in steps)
    rollout = sum(s.get("rollout_seconds", 0.0) for s in steps)
    items = sum(s[unit] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    return {
        "steps": len(steps),
        "seconds_per_step": seconds / len(steps),
        "rollout_seconds_per_step": rollout / len(steps),
        "update_seconds_per_step": (seconds - rollout) / len(steps),
        f"{unit}_per_s_per_gpu": items / seconds / world,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        f"{unit}_per_step": items / len(steps),
        "tokens_per_step": tokens / len(steps),
    }


def _grpo_summary(steps: list[dict], world: int) -> dict:
    out = _rates(steps, world, "rollouts")
    out["mean_completion_length"] = (sum(s.get("completions/mean_length", 0.0) for s in steps)
                                     / len(steps))
    if steps and "microbatches" in steps[0]:
        out["microbatches_per_rank"] = [s["microbatches"] for s in steps]
        out["rollouts_moved_per_step"] = sum(s["moved"] for s in steps) / len(steps)
    return out


MODES: dict[str, Mode] = {
    "grpo": Mode(
        example="docs/examples/trl_grpo.py",
        log_name="trl_grpo_log.json",
        gpu_args=["--size", "1b", "--steps", "8", "--per-device-batch", "8",
                  "--accumulation", "4", "--num-generations", "8", "--min-prompt", "64",
                  "--max-prompt", "2048", "--max-completion", "512",
                  "--mean-completion", "160", "--max-tokens-per-microbatch", "8192"],
        cpu_args=["--cpu", "--size", "tiny", "--steps", "3", "--per-device-batch", "4",
                  "--accumulation", "2", "--num-generations", "4", "--max-prompt", "64",
                  "--max-completion", "32", "--mean-completion", "12",
                  "--max-tokens-per-microbatch", "96"],
        # odc-local: ODC without moving rollouts between ranks (does rebalancing pay?).
        variants={"odc": [], "plain": ["--plain"], "odc-local": ["--no-rebalance"]},
        summarize=_grpo_summary,
    ),
}


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _hardware(cpu: bool) -> str:
    if not cpu:
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, check=True).stdout.split("\n")
            return ", ".join(n for n in names if n)
        except (OSError, subprocess.CalledProcessError):
            pass
    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_variant(mode: Mode, variant: str, nproc: int, extra: list[str], cpu: bool,
                workdir: str, log) -> tuple[dict, list[str]]:
    out = os.path.join(workdir, variant)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(ROOT, mode.example),
           *(mode.cpu_args if cpu else mode.gpu_args), *extra, *mode.variants[variant],
           "--out", out]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    print(f"== {variant}: {shlex.join(cmd)}", flush=True)
    log.write(f"== {variant}: {shlex.join(cmd)}\n")
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    log.write(proc.stdout + proc.stderr)
    log.flush()
    for line in proc.stdout.splitlines():
        if line.startswith("step "):
            print(f"   {line}", flush=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise SystemExit(f"{variant} failed (exit {proc.returncode}):\n{tail}")
    with open(os.path.join(out, mode.log_name)) as f:
        result = json.load(f)
    result["wall_seconds"] = time.perf_counter() - start
    return result, cmd


def plot(path: str, name: str, mode: Mode, summary: dict, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    variants = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, key, label in ((axes[0], f"{mode.unit}_per_s_per_gpu", f"{mode.unit}/s per GPU"),
                           (axes[1], "tokens_per_s_per_gpu", "tokens/s per GPU")):
        values = [summary[v][key] for v in variants]
        bars = ax.bar(variants, values, color=["tab:blue", "tab:gray", "tab:green"][:len(values)])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_ylabel(label)
    ax = axes[2]
    roll = [summary[v]["rollout_seconds_per_step"] for v in variants]
    upd = [summary[v]["update_seconds_per_step"] for v in variants]
    ax.bar(variants, roll, label="rollout (generation, scoring)", color="tab:orange")
    ax.bar(variants, upd, bottom=roll, label="update", color="tab:purple")
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("--out", required=True, help="directory for the JSON, PNG and log")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs)")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke test (tiny model)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps left out of the rates (default: 2 on GPUs, 1 on CPU)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants (default: odc,plain; grpo also has "
                         "odc-local, ODC without moving rollouts)")
    args = ap.parse_args(argv)
    mode = MODES[args.mode]
    variants = args.variants.split(",") if args.variants else list(mode.default_variants)
    unknown = [v for v in variants if v not in mode.variants]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; {args.mode} has {list(mode.variants)}")
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else 2)
    os.makedirs(args.out, exist_ok=True)
    stem = f"bench_trl_{args.mode}"
    workdir = tempfile.mkdtemp(prefix=f"{stem}-")
    results, summary, commands = {}, {}, {}
    with open(os.path.join(args.out, f"{stem}.log"), "w") as log:
        for variant in variants:
            result, cmd = run_variant(mode, variant, args.nproc, extra, args.cpu, workdir, log)
            steps = result["steps"][warmup:]
            if not steps:
                raise SystemExit(f"{variant}: no step after --warmup {warmup}")
            results[variant], commands[variant] = result, shlex.join(cmd)
            summary[variant] = mode.summarize(steps, result["meta"]["world"])
    hardware = _hardware(args.cpu)
    record = {"mode": args.mode, "hardware": hardware, "nproc": args.nproc,
              "versions": _versions(), "commit": _commit(), "warmup_steps": warmup,
              "command": shlex.join([sys.executable, *sys.argv]), "variant_commands": commands,
              "summary": summary, "runs": results}
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(record, f, indent=1)
    plot(os.path.join(args.out, f"{stem}.png"), stem, mode, summary,
         f"TRL {args.mode}: ODC vs plain, {args.nproc} ranks on {hardware}")
    unit = mode.unit
    print(f"\nTRL {args.mode}, {args.nproc} ranks on {hardware} (steps after {warmup} warm-up)")
    print(f"{'variant':10s} {unit + '/s/GPU':>16s} {'tokens/s/GPU':>14s} {'s/step':>8s} "
          f"{'rollout s':>10s} {'update s':>9s}")
    for variant, s in summary.items():
        print(f"{variant:10s} {s[f'{unit}_per_s_per_gpu']:16.3f} {s['tokens_per_s_per_gpu']:14.1f} "
              f"{s['seconds_per_step']:8.2f} {s['rollout_seconds_per_step']:10.2f} "
              f"{s['update_seconds_per_step']:9.2f}")
    if "odc" in summary and "plain" in summary:
        ratio = (summary["odc"]["tokens_per_s_per_gpu"]
                 / summary["plain"]["tokens_per_s_per_gpu"])
        print(f"odc / plain tokens/s: {ratio:.3f}")


if __name__ == "__main__":
    main()
