"""TRL trainers and verl's actor update under ODC vs the unmodified trainer with FSDP2 over NCCL, on the same data: the
runnable examples of docs/examples/ launched with torchrun, once per variant, each writing its
per-step log; this script reads the logs and reports per GPU the rows (sequences, pairs or
rollouts) per second and the tokens per second, the peak memory per rank and the planner's
bound, as JSON and PNG in --out, one row per trainer in --summary (trainers.json), and a
table last.

    python benchmarks/bench_trl.py sft --nproc 2 --out benchmarks/results   # SFTTrainer, 2 GPUs
    python benchmarks/bench_trl.py dpo --nproc 4 --out benchmarks/results   # DPOTrainer, 4 GPUs
    python benchmarks/bench_trl.py grpo --nproc 2 --out benchmarks/results  # GRPOTrainer
    python benchmarks/bench_trl.py verl --nproc 2 --out benchmarks/results  # verl's actor update
    python benchmarks/bench_trl.py sft --cpu --out /tmp/bench_trl           # CPU smoke test
    python benchmarks/bench_trl.py grpo --out DIR -- --size medium --steps 6 # example arguments
    python benchmarks/bench_trl.py sft --out DIR -- --profile-steps 2,3,8   # where steps go
    python benchmarks/bench_trl.py verl --nproc 4 --repeats 2 --out DIR     # odc,plain,plain,odc

Everything after ``--`` goes to the example unchanged (both variants); ``--profile-steps``
puts the top ops of those steps (torch.profiler, every rank) into their records
(docs/examples/_step_probe.py), slowing those steps. Steps before --warmup are
left out of the rates (the first ones compile kernels and grow the allocator; ODC's first step
measures the marginal peak bytes per token at half the derived cap).

Both variants run the example with the same arguments: ``odc`` with ``odc_trainer(...)`` on the
"odc" group and no ``max_tokens_per_microbatch`` (the derived cap: no ODC microbatch holds more
padded tokens than the largest one the unmodified trainer runs in the same step, less ODC's
shard cache); ``plain`` the unmodified trainer on an NCCL group, FSDP2 as accelerate sets it up
(on CPU: Gloo, and accelerate uses DDP). The data are long-tailed: lengths log-uniform between
the example's minimum and maximum (SFT sequences; DPO prompts and completions; GRPO prompts,
completions ending at an EOS whose bias sets their mean), in the same sequential order; verl's
responses log-normal (most short, a few near the cap), its prompts uniform. verl's ``plain`` is
its own fsdp2 engine (equal microbatch counts, the driver's equal-count dispatch); its bound
compares each rank's tokens as dispatched with those LB-Mini gives it.

Reported per variant: tokens/s per GPU (non-padding tokens of the measured steps over their
time), the same without the seconds spent compiling TRL's Triton kernels (``steady_``: each
variant starts from an empty Triton cache of its own and compiles on first use of each kernel
specialization, once per machine), seconds per step, each rank's peak memory (torch's allocator
peak plus the memory ODC holds outside it), and for GRPO the rollout phase (generation, rewards, old/reference log-probs)
and the update phase (the rest: what ODC changes) apart. The planner's bound: the sum over the
measured steps of the slowest rank's padded tokens as the unmodified trainer runs them, over the
same under ODC's plan (each step's work is proportional to its padded tokens), the speed-up that
balancing alone allows on this data. For GRPO the bound and the row's speed-up are the update
phase's. Work is not only padded tokens: ``fixed_cost_bound`` fits one line, seconds = fixed +
per-token cost times the slowest rank's padded tokens, to both variants' measured steps, and
reports the bound with that fixed part counted (``bound_with_fixed_cost`` in the row): what
balancing can reach when each step also does work that no plan shrinks.

``--repeats N`` runs N rounds, the variants' order reversed every other round, and pools every
round's measured steps into the rates (the record's ``rounds`` keeps each round's own figures).
Where a trainer's steps are host-bound and move by ~10 % from one run to the next (verl on these
machines, docs/benchmarks.md), one pair of runs cannot tell a few per cent apart.

Modes. ``MODES`` maps a name to a :class:`Mode`: the example script, its log file, its
arguments on GPUs and for the CPU smoke test, the variants (name -> extra arguments) and the
unit of a row. grpo also has the variant ``odc-local`` (``--variants``): ODC without moving
rollouts between ranks. Plain GRPO decodes with ``synced_gpus`` (FSDP2's per-layer all-gathers
are collectives: ranks must decode the same number of steps).

On the GPU machines (no package registry) the pinned transformers, TRL, peft and datasets are
carried as wheels (benchmarks/device_trl.sh installs them); the script records every version.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Mode:
    example: str  # path under the repository root
    log_name: str  # the JSON the example writes into its --out
    gpu_args: list[str]
    cpu_args: list[str]
    variants: dict[str, list[str]]
    unit: str  # what one row of a step is
    warmup: int = 3  # default steps left out on GPUs
    default_variants: tuple[str, ...] = ("odc", "plain")
    python: str | None = None  # "verl": verl's own environment (see _python)


def _rates(steps: list[dict], world: int, unit: str) -> dict:
    seconds = sum(s["seconds"] for s in steps)
    rollout = sum(s.get("rollout_seconds", 0.0) for s in steps)
    items = sum(s[unit] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    out = {
        "steps": len(steps),
        "seconds_per_step": seconds / len(steps),
        f"{unit}_per_s_per_gpu": items / seconds / world,
        "tokens_per_s_per_gpu": tokens / seconds / world,
        f"{unit}_per_step": items / len(steps),
        "tokens_per_step": tokens / len(steps),
    }
    if any("rollout_seconds" in s for s in steps):
        out.update(rollout_seconds_per_step=rollout / len(steps),
                   update_seconds_per_step=(seconds - rollout) / len(steps),
                   update_tokens_per_s_per_gpu=tokens / (seconds - rollout) / world)
    if steps and "jit_seconds" in steps[0]:
        # Triton compilation (docs/examples/_step_probe.py): once per machine, so also the
        # rates without it (the steady state a long run sees).
        jit = sum(s["jit_seconds"] for s in steps)
        out.update(jit_seconds=jit, steady_tokens_per_s_per_gpu=tokens / (seconds - jit) / world)
        if "update_tokens_per_s_per_gpu" in out:
            update_jit = jit - sum(s.get("rollout_jit_seconds", 0.0) for s in steps)
            out.update(update_jit_seconds=update_jit, steady_update_tokens_per_s_per_gpu=(
                tokens / (seconds - rollout - update_jit) / world))
    if steps and "microbatches" in steps[0]:
        out["microbatches_per_rank"] = [s["microbatches"] for s in steps]
        out["caps"] = [s.get("cap") for s in steps]
    if steps and "moved" in steps[0]:  # rows that changed rank (GRPO, verl's LB-Mini)
        out[f"{unit}_moved_per_step"] = sum(s["moved"] for s in steps) / len(steps)
    if steps and "balance_seconds" in steps[0]:  # verl: LB-Mini's plan and exchange
        out["balance_seconds_per_step"] = sum(s["balance_seconds"] for s in steps) / len(steps)
    if steps and all("padded_per_rank" in s for s in steps):
        plain = sum(max(s["plain_padded_per_rank"]) for s in steps)
        odc = sum(max(s["padded_per_rank"]) for s in steps)
        out["bound"] = plain / odc if odc else None
    return out


def fixed_cost_bound(odc_steps: list[dict], plain_steps: list[dict]) -> dict | None:
    """The planner's bound with the step's fixed work counted. One line, seconds = fixed +
    per_token * (the slowest rank's padded tokens), fitted by least squares to both variants'
    measured steps (the update phase where there is one): plain's at its padded tokens, ODC's at
    its own (the same steps, the same data). The fixed part is what balancing cannot shrink (the
    optimizer step, per-step host work, the exchange); the bound is then the sum over the steps
    of the line at plain's padded tokens over the same at ODC's. None without the padding
    record, with fewer than 3 steps, or when the line does not explain the steps (r2 below 0.8,
    or a negative fixed part: steps whose time is not their padded tokens', e.g. host-bound)."""
    plain_by_step = {s["step"]: s for s in plain_steps}
    pairs = [(o, plain_by_step[o["step"]]) for o in odc_steps
             if o["step"] in plain_by_step and "padded_per_rank" in o]
    if len(pairs) < 3:
        return None

    def seconds(s):
        return s["seconds"] - s.get("rollout_seconds", 0.0)

    xs_odc = [max(o["padded_per_rank"]) for o, _ in pairs]
    xs_plain = [max(o["plain_padded_per_rank"]) for o, _ in pairs]
    x = xs_odc + xs_plain
    y = [seconds(o) for o, _ in pairs] + [seconds(p) for _, p in pairs]
    n, mx, my = len(x), sum(x) / len(x), sum(y) / len(y)
    sxx = sum((a - mx) ** 2 for a in x)
    if sxx == 0:
        return None
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
    fixed = my - slope * mx
    residual = sum((b - fixed - slope * a) ** 2 for a, b in zip(x, y))
    total = sum((b - my) ** 2 for b in y)

    r2 = 1 - residual / total if total else 0.0
    if r2 < 0.8 or fixed < 0:
        return None

    def line(xs):
        return sum(fixed + slope * a for a in xs)

    return {"fixed_seconds": fixed, "seconds_per_1k_padded_tokens": 1000 * slope,
            "r2": r2, "points": n,
            "bound": line(xs_plain) / line(xs_odc)}


SFT_GPU = ["--size", "1b", "--steps", "14", "--per-device-batch", "2", "--accumulation", "4",
           "--min-len", "128", "--max-len", "8192"]
MODES: dict[str, Mode] = {
    "sft": Mode(
        example="docs/examples/trl_sft.py", log_name="trl_sft_log.json", gpu_args=SFT_GPU,
        cpu_args=["--size", "tiny", "--steps", "4", "--per-device-batch", "2",
                  "--accumulation", "2", "--min-len", "16", "--max-len", "512"],
        variants={"odc": [], "plain": ["--no-odc"]}, unit="sequences"),
    "dpo": Mode(
        example="docs/examples/trl_dpo.py", log_name="trl_dpo_log.json",
        gpu_args=["--size", "1b", "--steps", "14", "--per-device-batch", "2",
                  "--accumulation", "4", "--min-prompt", "32", "--max-prompt", "2048",
                  "--min-completion", "16", "--max-completion", "2048"],
        cpu_args=["--size", "tiny", "--steps", "4", "--per-device-batch", "2",
                  "--accumulation", "2", "--max-prompt", "128", "--max-completion", "128"],
        variants={"odc": [], "plain": ["--no-odc"]}, unit="pairs"),
    "grpo": Mode(
        example="docs/examples/trl_grpo.py", log_name="trl_grpo_log.json",
        gpu_args=["--size", "1b", "--steps", "12", "--per-device-batch", "8",
                  "--accumulation", "2", "--num-generations", "8", "--min-prompt", "64",
                  "--max-prompt", "2048", "--max-completion", "32",
                  "--mean-completion", "16"],
        cpu_args=["--cpu", "--size", "tiny", "--steps", "3", "--per-device-batch", "4",
                  "--accumulation", "2", "--num-generations", "4", "--max-prompt", "64",
                  "--max-completion", "32", "--mean-completion", "12"],
        # odc-local: ODC without moving rollouts between ranks (does rebalancing pay?).
        # odc-nopad: ODC without its default length padding (128 on GPUs; docs/integrations.md).
        variants={"odc": [], "plain": ["--plain"], "odc-local": ["--no-rebalance"],
                  "odc-nopad": ["--pad-to-multiple-of", "1"]},
        unit="rollouts", warmup=2),
    # verl's actor update (TrainingWorker.train_mini_batch, ppo_loss, dynamic batch size):
    # verl's fsdp2 engine on verl's equal-count dispatch vs the odc engine with LB-Mini over the
    # ranks; long-tailed (log-normal) response lengths.
    "verl": Mode(
        example="docs/examples/verl_ppo.py", log_name="verl_ppo_log.json",
        gpu_args=["--size", "1b", "--steps", "13", "--warmup", "3", "--batch", "64",
                  "--prompt", "512", "--response", "2048", "--max-tokens", "8192",
                  "--lr", "1e-5"],
        cpu_args=["--size", "tiny", "--steps", "4", "--batch", "16", "--prompt", "16",
                  "--response", "96", "--max-tokens", "128"],
        variants={"odc": ["--strategy", "odc", "--balance", "mini"],
                  "odc-local": ["--strategy", "odc", "--balance", "local"],
                  "plain": ["--strategy", "fsdp2"]},
        unit="sequences", python="verl"),
}


def _python(mode: Mode) -> str:
    """The interpreter of a mode's example: this one, or for verl its own environment
    ($ODC_VERL_PYTHON, else .venv/verl-<torch line>/bin/python, as .ci/bootstrap test builds
    it; verl pins a transformers that TRL's environment does not have)."""
    if mode.python != "verl":
        return sys.executable
    if os.environ.get("ODC_VERL_PYTHON"):
        return os.environ["ODC_VERL_PYTHON"]
    import torch

    line = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    venv = os.path.join(ROOT, ".venv", f"verl-{line}", "bin", "python")
    if not os.path.exists(venv):
        raise SystemExit(f"verl's environment {venv} is missing: run `bash .ci/bootstrap test` "
                         "(it builds it) or set ODC_VERL_PYTHON")
    return venv


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def _host_cpu() -> str:
    """The host's CPU model and logical cores: a host-bound row (GRPO's 1B microbatches, verl)
    moves with it (docs/benchmarks.md)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores"


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
    """$ODC_COMMIT (a device machine's copy of the tree may not carry the checkout's HEAD),
    else git HEAD."""
    if os.environ.get("ODC_COMMIT"):
        return os.environ["ODC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_variant(mode: Mode, variant: str, nproc: int, extra: list[str], cpu: bool,
                workdir: str, log) -> tuple[dict, list[str]]:
    out = os.path.join(workdir, variant)
    cmd = [_python(mode), "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(ROOT, mode.example),
           *(mode.cpu_args if cpu else mode.gpu_args), *extra, *mode.variants[variant],
           "--out", out]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    # Each variant compiles TRL's Triton kernels itself (an empty cache of its own): a cache
    # filled by the variant before would spare the later one compiles the first one paid.
    env["TRITON_CACHE_DIR"] = os.path.join(workdir, f"triton-{variant}")
    print(f"== {variant}: {shlex.join(cmd)}", flush=True)
    log.write(f"== {variant}: {shlex.join(cmd)}\n")
    start = time.perf_counter()
    # Streamed into the log line by line: a run stopped from outside (a device call's limit)
    # still leaves what it printed.
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            tail.append(line.rstrip("\n"))
            if line.startswith("step ") or "] step " in line:  # TRL's examples; verl_ppo.py
                print(f"   {line.rstrip()}", flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    with open(os.path.join(out, mode.log_name)) as f:
        result = json.load(f)
    result["wall_seconds"] = time.perf_counter() - start
    return result, cmd


def _peak(result: dict) -> list:
    return result.get("meta", {}).get("peak_memory_gib") or []


def plot(path: str, mode: Mode, summary: dict, peaks: dict, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    variants = list(summary)
    colors = ["tab:blue", "tab:gray", "tab:green"][:len(variants)]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    key = ("update_tokens_per_s_per_gpu" if "update_tokens_per_s_per_gpu" in summary[variants[0]]
           else "tokens_per_s_per_gpu")
    values = [summary[v][key] for v in variants]
    bars = axes[0].bar(variants, values, color=colors)
    axes[0].bar_label(bars, fmt="%.4g", fontsize=8)
    axes[0].set_ylabel("update tokens/s per GPU" if key.startswith("update") else
                       "tokens/s per GPU")
    ax = axes[1]
    if "rollout_seconds_per_step" in summary[variants[0]]:
        roll = [summary[v]["rollout_seconds_per_step"] for v in variants]
        upd = [summary[v]["update_seconds_per_step"] for v in variants]
        ax.bar(variants, roll, label="rollout (generation, scoring)", color="tab:orange")
        ax.bar(variants, upd, bottom=roll, label="update", color="tab:purple")
        ax.legend(fontsize=7)
    else:
        ax.bar(variants, [summary[v]["seconds_per_step"] for v in variants], color=colors)
    ax.set_ylabel("seconds per step")
    ax = axes[2]
    peak = [max((p for p in peaks[v] if p is not None), default=0.0) for v in variants]
    bars = ax.bar(variants, peak, color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("peak memory per rank (GiB, max)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _row_key(row: dict) -> tuple:
    """A trainers row's identity: trainer, GPUs, machine kind and model size (rows from
    before sizes were recorded are the 1B rows)."""
    return row["trainer"], row["gpus"], row["kind"], row.get("model", "1b")


def _rate_key(mode: str) -> str:
    """The rate a row compares: GRPO's update phase (generation apart), else the whole step."""
    return "update_tokens_per_s_per_gpu" if mode == "grpo" else "tokens_per_s_per_gpu"


def update_summary(path: str, row: dict) -> None:
    """Replaces the row of (trainer, gpus, kind, model) in the trainers' summary JSON."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = json.load(f).get("rows", [])
    rows = [r for r in rows if _row_key(r) != _row_key(row)] + [row]
    rows.sort(key=lambda r: (r["kind"], r["gpus"], r["trainer"], r.get("model", "1b")))
    with open(path, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


def _max_peaks(a: list | None, b: list) -> list:
    """Per rank, the larger of two runs' peaks (None where a run has none)."""
    if not a:
        return list(b)
    return [max((p for p in pair if p is not None), default=None)
            for pair in itertools.zip_longest(a, b)]


def _record(args, hardware, commit, warmup, commands, summary, results, partial,
            rounds) -> dict:
    versions = _versions()
    for result in results.values():  # what the example's own interpreter ran (verl's venv)
        versions.update({k: v for k, v in result.get("meta", {}).get("versions", {}).items()
                         if v is not None})
    record = {"mode": args.mode, "hardware": hardware, "host_cpu": _host_cpu(),
              "kind": args.kind, "nproc": args.nproc, "versions": versions, "commit": commit,
              "warmup_steps": warmup,
              "command": shlex.join([sys.executable, *sys.argv]), "variant_commands": commands,
              "summary": summary, "runs": results}
    if args.repeats > 1:
        # Each round's order and its own figures; "summary" pools the rounds' steps, "runs"
        # holds every run ("odc", "plain", then "odc@2", "plain@2", ...).
        record.update(repeats=args.repeats, rounds=rounds)
    if partial:
        record["partial"] = True
    return record


def _finish(args, mode: Mode, stem: str, hardware: str, commit, model: str, warmup: int,
            summary: dict, peaks: dict, pooled: dict, rounds: list, record) -> None:
    """The PNG, the table, the fixed-cost bound and the trainers row of a finished run (or of
    pooled runs); ``record()`` gives the JSON record to rewrite with the fixed-cost bound."""
    key = _rate_key(args.mode)
    label = "verl actor update" if args.mode == "verl" else f"TRL {args.mode}"
    plot(os.path.join(args.out, f"{stem}.png"), mode, summary, peaks,
         f"{label}: ODC vs plain, {args.nproc} ranks on {hardware} "
         f"({(commit if '+' in commit else commit[:7]) if commit else '?'}"
         f"{f'; {args.repeats} rounds pooled' if args.repeats > 1 else ''})")
    unit = mode.unit
    print(f"\n{label}, {args.nproc} ranks on {hardware} (steps after {warmup} warm-up)")
    print(f"{'variant':10s} {unit + '/s/GPU':>16s} {'tokens/s/GPU':>14s} {'s/step':>8s} "
          f"{'update tok/s':>13s} {'peak GiB':>9s} {'bound':>6s}")
    for variant, s in summary.items():
        peak = max((p for p in peaks[variant] if p is not None), default=float("nan"))
        print(f"{variant:10s} {s[f'{unit}_per_s_per_gpu']:16.3f} {s['tokens_per_s_per_gpu']:14.1f} "
              f"{s['seconds_per_step']:8.3f} {s.get('update_tokens_per_s_per_gpu', 0):13.1f} "
              f"{peak:9.2f} {s.get('bound') or 0:6.3f}")
    if "odc" in summary and "plain" in summary:
        odc, plain = summary["odc"], summary["plain"]
        ratio = odc[key] / plain[key]
        each = [r["speedup"] for r in rounds if "speedup" in r]
        print(f"odc / plain {key}: {ratio:.3f}" + (
            f" (every round's measured steps pooled; the rounds alone: "
            f"{', '.join(f'{x:.3f}' for x in each)})" if args.repeats > 1 else ""))
        fixed = fixed_cost_bound(pooled["odc"], pooled["plain"])
        if fixed:
            odc["fixed_cost_bound"] = fixed
            with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
                json.dump(record(), f, indent=1)
            print(f"seconds = {fixed['fixed_seconds']:.3f} + "
                  f"{fixed['seconds_per_1k_padded_tokens']:.4f} per 1k padded tokens of the "
                  f"slowest rank (both variants, r2 {fixed['r2']:.3f}): bound with the fixed "
                  f"part {fixed['bound']:.3f}, reached {ratio / fixed['bound']:.1%}")
        if f"steady_{key}" in odc and f"steady_{key}" in plain:
            print(f"without Triton compilation (odc {odc['jit_seconds']:.1f} s, plain "
                  f"{plain['jit_seconds']:.1f} s in the measured steps): "
                  f"{odc[f'steady_{key}'] / plain[f'steady_{key}']:.3f}")
        if args.summary:
            def peak_of(v):
                return max((p for p in peaks[v] if p is not None), default=None)

            update_summary(args.summary, {
                "trainer": args.mode, "gpus": args.nproc, "kind": args.kind or hardware,
                "model": model, "commit": commit, "odc_tokens_per_s_per_gpu": odc[key],
                "base_tokens_per_s_per_gpu": plain[key], "speedup": ratio,
                "odc_peak_gib": peak_of("odc"), "base_peak_gib": peak_of("plain"),
                "bound": odc.get("bound"), "metric": key,
                **({"bound_with_fixed_cost": fixed["bound"],
                    "fixed_seconds_per_step": fixed["fixed_seconds"]} if fixed else {}),
                "step_speedup": plain["seconds_per_step"] / odc["seconds_per_step"],
                **({"steady_speedup": odc[f"steady_{key}"] / plain[f"steady_{key}"],
                    "odc_jit_seconds": odc["jit_seconds"], "base_jit_seconds": plain["jit_seconds"]}
                   if f"steady_{key}" in odc and f"steady_{key}" in plain else {}),
                **({"repeats": args.repeats, "speedup_of_each_round": each}
                   if args.repeats > 1 else {}),
                "result": f"{stem}.json"})


def _model(mode: Mode, extra: list[str], cpu: bool) -> str:
    """The example's --size as the runs got it (the last one given wins, as argparse takes)."""
    argv = [*(mode.cpu_args if cpu else mode.gpu_args), *extra]
    sizes = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--size"]
    return sizes[-1] if sizes else "?"


def pool_main(argv: list[str]) -> None:
    """``pool RECORD.json ...``: one row from the measured steps of several records of the same
    trainer, ranks and arguments (runs of separate calls, e.g. a 3B GRPO row whose round takes
    most of a device call), as --repeats pools the rounds of one call."""
    ap = argparse.ArgumentParser(prog="bench_trl.py pool", description=pool_main.__doc__)
    ap.add_argument("records", nargs="+", help="bench_trl JSON records to pool")
    ap.add_argument("--out", required=True, help="directory for the pooled JSON and PNG")
    ap.add_argument("--summary", default=None, help="trainers.json to update with the row")
    ap.add_argument("--kind", default=None, help="machine kind (default: the records')")
    args = ap.parse_args(argv)
    records = []
    for path in args.records:
        with open(path) as f:
            records.append(json.load(f))
    first = records[0]
    for path, r in zip(args.records, records, strict=True):
        same = (r["mode"], r["nproc"], r["warmup_steps"], r.get("partial", False))
        if same != (first["mode"], first["nproc"], first["warmup_steps"], False):
            raise SystemExit(f"{path}: (mode, ranks, warm-up, partial) {same} differs from "
                             f"{(first['mode'], first['nproc'], first['warmup_steps'], False)}")
        sizes = {run["meta"].get("size") for run in r["runs"].values()}
        if sizes != {first["runs"]["odc"]["meta"].get("size")}:
            raise SystemExit(f"{path}: model sizes {sizes} differ from the first record's")
    mode, warmup = MODES[first["mode"]], first["warmup_steps"]
    args.mode, args.nproc = first["mode"], first["nproc"]
    args.kind = args.kind or first.get("kind")
    pooled: dict[str, list[dict]] = collections.defaultdict(list)
    peaks: dict[str, list] = {}
    worlds: dict[str, int] = {}
    rounds, summary, rate = [], {}, _rate_key(args.mode)
    for r in records:
        for name, run in r["runs"].items():
            variant = name.split("@")[0]
            pooled[variant] += run["steps"][warmup:]
            peaks[variant] = _max_peaks(peaks.get(variant), _peak(run))
            worlds[variant] = run["meta"]["world"]
        # A record of one round has no "rounds": its own speed-up stands for it.
        own = r["summary"]
        rounds += r.get("rounds") or [{"order": list(r["runs"]), **(
            {"speedup": own["odc"][rate] / own["plain"][rate]}
            if {"odc", "plain"} <= set(own) else {})}]
    args.repeats = len(rounds)  # a record of --repeats N brings its N rounds
    for variant, steps in pooled.items():
        summary[variant] = _rates(steps, worlds[variant], mode.unit)
        summary[variant]["peak_memory_gib"] = peaks[variant]
    commits = list(dict.fromkeys(str(r.get("commit")) for r in records))
    commit = "+".join(c[:7] for c in commits)
    stem = f"bench_trl_{args.mode}_{args.nproc}gpu_pooled"
    os.makedirs(args.out, exist_ok=True)

    def record() -> dict:
        return {"mode": args.mode, "hardware": first["hardware"],
                "host_cpu": sorted({str(r.get("host_cpu")) for r in records}),
                "kind": args.kind, "nproc": args.nproc, "versions": first["versions"],
                "commit": commit,
                "warmup_steps": warmup, "command": shlex.join([sys.executable, *sys.argv]),
                "pooled_from": [os.path.basename(p) for p in args.records],
                "commits": commits, "repeats": args.repeats, "rounds": rounds,
                "summary": summary}

    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(record(), f, indent=1)
    _finish(args, mode, stem, first["hardware"], commit,
            str(first["runs"]["odc"]["meta"].get("size")), warmup, summary, peaks, pooled,
            rounds, record)


def main() -> None:
    if sys.argv[1:2] == ["pool"]:
        pool_main(sys.argv[2:])
        return
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
                    help="steps left out of the rates (default: the mode's on GPUs, 1 on CPU)")
    ap.add_argument("--variants", default=None,
                    help="comma-separated variants (default: odc,plain; grpo also has "
                         "odc-local, ODC without moving rollouts)")
    ap.add_argument("--summary", default=None,
                    help="trainers.json to update with this run's row (odc and plain needed)")
    ap.add_argument("--kind", default=os.environ.get("ODC_DEVICE_KIND"),
                    help="machine kind recorded in the summary row (default $ODC_DEVICE_KIND)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of runs, the variants' order reversed every other round "
                         "(odc,plain then plain,odc); the rates pool every round's measured "
                         "steps (default 1)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    mode = MODES[args.mode]
    variants = args.variants.split(",") if args.variants else list(mode.default_variants)
    unknown = [v for v in variants if v not in mode.variants]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; {args.mode} has {list(mode.variants)}")
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else mode.warmup)
    os.makedirs(args.out, exist_ok=True)
    stem = f"bench_trl_{args.mode}_{args.nproc}{'cpu' if args.cpu else 'gpu'}"
    workdir = tempfile.mkdtemp(prefix=f"{stem}-")
    results, summary, commands, peaks = {}, {}, {}, {}
    pooled: dict[str, list[dict]] = {v: [] for v in variants}  # measured steps, every round
    rounds: list[dict] = []
    hardware, commit = _hardware(args.cpu), _commit()
    key = _rate_key(args.mode)
    with open(os.path.join(args.out, f"{stem}.log"), "w") as log:
        for i in range(args.repeats):
            # Reversed every other round: a drift of the machine over the call (its host's
            # noise, a clock) weighs on both variants alike.
            order = variants if i % 2 == 0 else variants[::-1]
            rates = {}
            for variant in order:
                name = variant if i == 0 else f"{variant}@{i + 1}"  # a run's key in "runs"
                result, cmd = run_variant(mode, variant, args.nproc, extra, args.cpu,
                                          os.path.join(workdir, f"round{i + 1}"), log)
                steps = result["steps"][warmup:]
                if not steps:
                    raise SystemExit(f"{variant}: no step after --warmup {warmup}")
                results[name], commands[name] = result, shlex.join(cmd)
                world = result["meta"]["world"]
                rates[variant] = _rates(steps, world, mode.unit)
                pooled[variant] += steps
                summary[variant] = _rates(pooled[variant], world, mode.unit)
                peaks[variant] = _max_peaks(peaks.get(variant), _peak(result))
                summary[variant]["peak_memory_gib"] = peaks[variant]
                # Written after every run (marked partial until the last): a run stopped
                # later keeps the runs that finished.
                record = _record(args, hardware, commit, warmup, commands, summary, results,
                                 partial=len(results) < len(variants) * args.repeats,
                                 rounds=rounds)
                with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
                    json.dump(record, f, indent=1)
            done = {"order": order, **{f"{v}_seconds_per_step": r["seconds_per_step"]
                                       for v, r in rates.items()}}
            if "odc" in rates and "plain" in rates:
                done["speedup"] = rates["odc"][key] / rates["plain"][key]
            rounds.append(done)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:  # with the last round
        json.dump(_record(args, hardware, commit, warmup, commands, summary, results,
                          partial=False, rounds=rounds), f, indent=1)
    _finish(args, mode, stem, hardware, commit, _model(mode, extra, args.cpu), warmup, summary,
            peaks, pooled, rounds,
            lambda: _record(args, hardware, commit, warmup, commands, summary, results,
                            partial=False, rounds=rounds))


if __name__ == "__main__":
    main()
