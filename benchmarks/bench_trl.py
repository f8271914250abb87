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

Variants (docs/benchmarks.md, "The trainers"): ``odc``, ``plain`` (the trainer's defaults) and
``plain-tuned`` (the trainer's own ``pad_to_multiple_of`` at ODC's multiple, ``--pad-multiple``)
by default; SFT also ``odc-padfree`` / ``plain-padfree`` (``padding_free=True``). A row's
headline is the faster ODC variant against the faster baseline of the call; ``--nproc 1
--same-data-as N`` is the plan on one rank on an N-rank row's data, and ``decompose`` splits a
multi-rank row's speed-up with it; ``--note`` / ``--commit-note`` / ``--device-command`` go
into the record (and ``pool``'s).

All variants run the example with the same arguments: ``odc`` with ``odc_trainer(...)`` on the
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
carried as wheels (benchmarks/device/device_trl.sh installs them); the script records every version.
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

# The top-level keys each writer may write (it raises on any other; tests/test_pooled_records.py
# holds every committed record and trainers row to them, so a hand-added field fails there).
_NOTE_KEYS = {"note", "commit_note", "device_command"}
_PROVENANCE_KEYS = {
    *("mode", "hardware", "host_cpu", "kind", "nproc", "versions", "commit", "warmup_steps"),
    *("command", *_NOTE_KEYS),
}
RECORD_KEYS = {  # a run's record (_record)
    *_PROVENANCE_KEYS,
    *("variant_commands", "summary", "runs", "data_ranks", "pad_multiple", "variant_configs"),
    *("attention", "repeats", "rounds", "partial"),
}
POOLED_RECORD_KEYS = {  # pool's record
    *_PROVENANCE_KEYS,
    *("pooled_from", "pooled", "commits", "repeats", "rounds", "variant_configs", "summary"),
}
POOLED_BLOCK_KEYS = {"runs", "note", "steps_per_variant", "speedup_of_each_run", "seconds_per_step"}
ROW_KEYS = {  # a trainers.json row (_finish; decompose adds "decomposition")
    *("trainer", "gpus", "kind", "model", "commit", "metric", "odc_variant", "baseline"),
    *("odc_tokens_per_s_per_gpu", "base_tokens_per_s_per_gpu", "speedup", "odc_peak_gib"),
    *("base_peak_gib", "baselines", "speedup_vs_defaults", "bound", "bound_with_fixed_cost"),
    *("fixed_seconds_per_step", "step_speedup", "steady_speedup", "odc_jit_seconds"),
    *("base_jit_seconds", "repeats", "speedup_of_each_round", "result", "peak_basis"),
    *("attention", "data_ranks", "decomposition", "pooled", "note"),
}
DECOMPOSITION_KEYS = {
    *("plan_one_rank", "bound_one_rank", "odc_variant", "bound", "balance_bound"),
    *("steps_compared", "by_baseline", "one_rank", "multi_rank", "one_rank_kind"),
    "one_rank_commit",
}


def unknown_keys(obj: dict, allowed: set, what: str) -> list[str]:
    """``what.key`` for each top-level key of ``obj`` outside ``allowed``."""
    return [f"{what}.{k}" for k in sorted(set(obj) - allowed)]


def _checked(obj: dict, allowed: set, what: str) -> dict:
    bad = unknown_keys(obj, allowed, what)
    if bad:
        raise AssertionError(f"bench_trl writes a key outside its key set: {', '.join(bad)}")
    return obj


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
        out.update(
            rollout_seconds_per_step=rollout / len(steps),
            update_seconds_per_step=(seconds - rollout) / len(steps),
            update_tokens_per_s_per_gpu=tokens / (seconds - rollout) / world,
        )
    if steps and "jit_seconds" in steps[0]:
        # Triton compilation (docs/examples/_step_probe.py): once per machine, so also the
        # rates without it (the steady state a long run sees).
        jit = sum(s["jit_seconds"] for s in steps)
        out.update(jit_seconds=jit, steady_tokens_per_s_per_gpu=tokens / (seconds - jit) / world)
        if "update_tokens_per_s_per_gpu" in out:
            update_jit = jit - sum(s.get("rollout_jit_seconds", 0.0) for s in steps)
            out.update(
                update_jit_seconds=update_jit,
                steady_update_tokens_per_s_per_gpu=(
                    tokens / (seconds - rollout - update_jit) / world
                ),
            )
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
    pairs = [
        (o, plain_by_step[o["step"]])
        for o in odc_steps
        if o["step"] in plain_by_step and "padded_per_rank" in o
    ]
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

    return {
        "fixed_seconds": fixed,
        "seconds_per_1k_padded_tokens": 1000 * slope,
        "r2": r2,
        "points": n,
        "bound": line(xs_plain) / line(xs_odc),
    }


# In a variant's arguments: PAD becomes the tuned multiple (--pad-multiple, default ODC's own,
# ``odc_multiple``); ODC_PAD becomes ``--pad-to-multiple-of M`` where --pad-multiple was given
# (ODC at the same explicit multiple), else nothing (ODC's default).
PAD, ODC_PAD = "{pad}", "{odc_pad}"
# The sides of a row's headline: the faster ODC variant of these against the faster baseline.
ODC_SIDES = ("odc", "odc-padfree", "odc-rmpad")
BASELINES = ("plain", "plain-tuned", "plain-padfree", "plain-rmpad")
# What each variant sets, for the record (the example's meta["config"] is what reached it).
VARIANT_SETS = {
    "odc": "odc_trainer(...), the derived cap, ODCConfig.pad_to_multiple_of as --pad-multiple "
    "(default None: ODC's own derivation)",
    "plain": "the unmodified trainer with its defaults (pad_to_multiple_of None, padded rows)",
    "plain-tuned": "the unmodified trainer with pad_to_multiple_of={pad} (ODC's multiple)",
    "odc-padfree": "odc_trainer(...) with padding_free=True (ODC's multiple 1: rows concatenated)",
    "plain-padfree": "the unmodified trainer with padding_free=True",
    "odc-local": "odc_trainer(...) without moving rollouts between ranks",
    "odc-nopad": "odc_trainer(...) with ODCConfig.pad_to_multiple_of=1",
    "plain-rmpad": "verl's fsdp2 engine with use_remove_padding=True (rows packed, position_ids)",
    "odc-rmpad": "the odc engine (LB-Mini) with use_remove_padding=True",
}


def odc_multiple(mode: str, cpu: bool) -> int:
    """ODC's own padding multiple where ``ODCConfig.pad_to_multiple_of`` is None: off CUDA 1;
    on CUDA ``ODCConfig.AUTO_PAD_MULTIPLE`` (64) for SFT and DPO, the GRPO adapter's
    ``AUTO_MULTIPLE`` (128) for GRPO (torch_odc.integrations.hf)."""
    if cpu:
        return 1
    if mode == "grpo":
        from torch_odc.integrations.hf.grpo import ODCGRPOTrainerMixin

        return ODCGRPOTrainerMixin.AUTO_MULTIPLE
    from torch_odc.integrations.hf._config import ODCConfig

    return ODCConfig.AUTO_PAD_MULTIPLE


def expand_args(args: list[str], multiple: int, explicit: bool) -> list[str]:
    """A variant's arguments with PAD and ODC_PAD filled in (see there)."""
    out = []
    for a in args:
        if a == ODC_PAD:
            out += ["--pad-to-multiple-of", str(multiple)] if explicit else []
        else:
            out.append(a.replace(PAD, str(multiple)))
    return out


def headline(rates: dict, key: str) -> dict | None:
    """The row's comparison: the faster of the ODC variants measured (``ODC_SIDES``) against
    the faster of the baselines measured (``BASELINES``), and the ODC variant against each
    baseline. None without one of each."""
    odcs = [v for v in ODC_SIDES if v in rates]
    bases = [v for v in BASELINES if v in rates]
    if not odcs or not bases:
        return None
    odc = max(odcs, key=lambda v: rates[v][key])
    base = max(bases, key=lambda v: rates[v][key])
    return {
        "odc_variant": odc,
        "baseline": base,
        "speedup": rates[odc][key] / rates[base][key],
        "speedup_vs": {b: rates[odc][key] / rates[b][key] for b in bases},
    }


SFT_GPU = [
    "--size",
    "1b",
    "--steps",
    "14",
    "--per-device-batch",
    "2",
    "--accumulation",
    "4",
    "--min-len",
    "128",
    "--max-len",
    "8192",
]
MODES: dict[str, Mode] = {
    "sft": Mode(
        example="docs/examples/trl_sft.py",
        log_name="trl_sft_log.json",
        gpu_args=SFT_GPU,
        cpu_args=[
            "--size",
            "tiny",
            "--steps",
            "4",
            "--per-device-batch",
            "2",
            "--accumulation",
            "2",
            "--min-len",
            "16",
            "--max-len",
            "512",
        ],
        variants={
            "odc": [ODC_PAD],
            "plain": ["--no-odc"],
            "plain-tuned": ["--no-odc", "--trl-pad-to-multiple-of", PAD],
            # padding-free (SFTConfig.padding_free): rows concatenated, position_ids
            "odc-padfree": ["--padding-free"],
            "plain-padfree": ["--no-odc", "--padding-free"],
        },
        unit="sequences",
        default_variants=("odc", "plain", "plain-tuned"),
    ),
    "dpo": Mode(
        example="docs/examples/trl_dpo.py",
        log_name="trl_dpo_log.json",
        gpu_args=[
            "--size",
            "1b",
            "--steps",
            "14",
            "--per-device-batch",
            "2",
            "--accumulation",
            "4",
            "--min-prompt",
            "32",
            "--max-prompt",
            "2048",
            "--min-completion",
            "16",
            "--max-completion",
            "2048",
        ],
        cpu_args=[
            "--size",
            "tiny",
            "--steps",
            "4",
            "--per-device-batch",
            "2",
            "--accumulation",
            "2",
            "--max-prompt",
            "128",
            "--max-completion",
            "128",
        ],
        variants={
            "odc": [ODC_PAD],
            "plain": ["--no-odc"],
            "plain-tuned": ["--no-odc", "--trl-pad-to-multiple-of", PAD],
        },
        unit="pairs",
        default_variants=("odc", "plain", "plain-tuned"),
    ),
    "grpo": Mode(
        example="docs/examples/trl_grpo.py",
        log_name="trl_grpo_log.json",
        gpu_args=[
            "--size",
            "1b",
            "--steps",
            "12",
            "--per-device-batch",
            "8",
            "--accumulation",
            "2",
            "--num-generations",
            "8",
            "--min-prompt",
            "64",
            "--max-prompt",
            "2048",
            "--max-completion",
            "32",
            "--mean-completion",
            "16",
        ],
        cpu_args=[
            "--cpu",
            "--size",
            "tiny",
            "--steps",
            "3",
            "--per-device-batch",
            "4",
            "--accumulation",
            "2",
            "--num-generations",
            "4",
            "--max-prompt",
            "64",
            "--max-completion",
            "32",
            "--mean-completion",
            "12",
        ],
        # odc-local: ODC without moving rollouts between ranks (does rebalancing pay?).
        # odc-nopad: ODC without its default length padding (128 on GPUs; docs/integrations/trl-grpo.md).
        # plain-tuned: GRPOConfig.pad_to_multiple_of, which rounds the prompt and the completion
        # widths each (ODC makes their sum the multiple, by more left padding).
        variants={
            "odc": [ODC_PAD],
            "plain": ["--plain"],
            "plain-tuned": ["--plain", "--trl-pad-to-multiple-of", PAD],
            "odc-local": ["--no-rebalance", ODC_PAD],
            "odc-nopad": ["--pad-to-multiple-of", "1"],
        },
        unit="rollouts",
        warmup=2,
        default_variants=("odc", "plain", "plain-tuned"),
    ),
    # verl's actor update (TrainingWorker.train_mini_batch, ppo_loss, dynamic batch size):
    # verl's fsdp2 engine on verl's equal-count dispatch vs the odc engine with LB-Mini over the
    # ranks; long-tailed (log-normal) response lengths.
    "verl": Mode(
        example="docs/examples/verl_ppo.py",
        log_name="verl_ppo_log.json",
        gpu_args=[
            "--size",
            "1b",
            "--steps",
            "13",
            "--warmup",
            "3",
            "--batch",
            "64",
            "--prompt",
            "512",
            "--response",
            "2048",
            "--max-tokens",
            "8192",
            "--lr",
            "1e-5",
        ],
        cpu_args=[
            "--size",
            "tiny",
            "--steps",
            "4",
            "--batch",
            "16",
            "--prompt",
            "16",
            "--response",
            "96",
            "--max-tokens",
            "128",
        ],
        variants={
            "odc": ["--strategy", "odc", "--balance", "mini"],
            "odc-local": ["--strategy", "odc", "--balance", "local"],
            "plain": ["--strategy", "fsdp2"],
            # verl's own tuned setting beside dynamic batch size (on in both): rows packed into
            # one with position_ids, no padding (docs/integrations/verl.md: exact under sdpa).
            "plain-rmpad": ["--strategy", "fsdp2", "--remove-padding"],
            "odc-rmpad": ["--strategy", "odc", "--balance", "mini", "--remove-padding"],
        },
        unit="sequences",
        python="verl",
    ),
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
        raise SystemExit(
            f"verl's environment {venv} is missing: run `bash .ci/bootstrap test` "
            "(it builds it) or set ODC_VERL_PYTHON"
        )
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
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores"


def _hardware(cpu: bool) -> str:
    if not cpu:
        try:
            names = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split("\n")
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
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_variant(
    mode: Mode,
    variant: str,
    nproc: int,
    extra: list[str],
    cpu: bool,
    workdir: str,
    log,
    multiple: int = 1,
    explicit: bool = False,
) -> tuple[dict, list[str]]:
    out = os.path.join(workdir, variant)
    cmd = [
        _python(mode),
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(ROOT, mode.example),
        *(mode.cpu_args if cpu else mode.gpu_args),
        *extra,
        *expand_args(mode.variants[variant], multiple, explicit),
        "--out",
        out,
    ]
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "PYTHONUNBUFFERED": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    }
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
    with subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
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
    """A run's peak per rank: since the Trainer's train begin, across every reset of the
    allocator's statistics, plus what ODC held (``peak_since_train_begin_gib``, the same point
    on both variants; docs/examples/_step_probe.py PeakSince), else (records from before it,
    verl) the adapter's phase-wise figure."""
    meta = result.get("meta", {})
    since = meta.get("peak_since_train_begin_gib")
    if since and any(p is not None for p in since):
        return since
    return meta.get("peak_memory_gib") or []


def _peak_basis(result: dict) -> str:
    since = result.get("meta", {}).get("peak_since_train_begin_gib")
    return (
        "since train begin, every reset folded in, plus ODC's held bytes"
        if since and any(p is not None for p in since)
        else "peak_memory_gib"
    )


def plot(path: str, mode: Mode, summary: dict, peaks: dict, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    variants = list(summary)
    palette = ["tab:blue", "tab:gray", "tab:green", "tab:red", "tab:olive", "tab:cyan"]
    colors = [palette[i % len(palette)] for i in range(len(variants))]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    key = (
        "update_tokens_per_s_per_gpu"
        if "update_tokens_per_s_per_gpu" in summary[variants[0]]
        else "tokens_per_s_per_gpu"
    )
    values = [summary[v][key] for v in variants]
    bars = axes[0].bar(variants, values, color=colors)
    axes[0].bar_label(bars, fmt="%.4g", fontsize=8)
    axes[0].set_ylabel(
        "update tokens/s per GPU" if key.startswith("update") else "tokens/s per GPU"
    )
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
    return [
        max((p for p in pair if p is not None), default=None)
        for pair in itertools.zip_longest(a, b)
    ]


def _variant_configs(mode: Mode, results: dict, multiple: int, explicit: bool) -> dict:
    """Per variant (its first run): what it sets (``VARIANT_SETS``), its arguments as the
    example got them, what reached the trainer (the example's ``meta["config"]``: the
    trainer's pad_to_multiple_of and padding_free as trained, its collator's, ODC's multiple)
    and the attention kernel (``meta["attention"]``, with the masks the first attention layer
    got over the run: ``none``, ``dense <dtype>`` or ``BlockMask``)."""
    out = {}
    for name, result in results.items():
        variant = name.split("@")[0]
        if variant in out or variant not in mode.variants:
            continue
        meta = result.get("meta", {})
        masks = sorted(
            {
                k
                for st in result.get("steps", [])
                for k in st.get("batches", {}).get("attention_masks", [])
            }
        )
        out[variant] = {
            "sets": VARIANT_SETS.get(variant, variant).replace(PAD, str(multiple)),
            "args": expand_args(mode.variants[variant], multiple, explicit),
            **({"reached": meta["config"]} if "config" in meta else {}),
            **({"attention": {**meta["attention"], "masks": masks}} if "attention" in meta else {}),
        }
    return out


def _attention(configs: dict) -> dict | None:
    """The attention kernel of a row: the implementation if every variant ran the same one
    (``same``), each variant's masks."""
    kinds = {v: c["attention"] for v, c in configs.items() if "attention" in c}
    if not kinds:
        return None
    impls = {k.get("implementation") for k in kinds.values()}
    backends = {tuple(k.get("sdpa_backends_enabled", ())) for k in kinds.values()}
    return {
        "implementation": "/".join(sorted(map(str, impls))),
        "same": len(impls) == 1 and len(backends) == 1,
        **(
            {"sdpa_backends_enabled": list(next(iter(backends)))}
            if len(backends) == 1 and next(iter(backends))
            else {}
        ),
        "masks": {v: k.get("masks", []) for v, k in kinds.items()},
    }


def _record(
    args, hardware, commit, warmup, commands, summary, results, partial, rounds, configs=None
) -> dict:
    versions = _versions()
    for result in results.values():  # what the example's own interpreter ran (verl's venv)
        versions.update(
            {k: v for k, v in result.get("meta", {}).get("versions", {}).items() if v is not None}
        )
    record = {
        "mode": args.mode,
        "hardware": hardware,
        "host_cpu": _host_cpu(),
        "kind": args.kind,
        "nproc": args.nproc,
        "versions": versions,
        "commit": commit,
        "warmup_steps": warmup,
        "command": shlex.join([sys.executable, *sys.argv]),
        "variant_commands": commands,
        **_notes(args),
        "summary": summary,
        "runs": results,
    }
    if getattr(args, "data_ranks", None):
        record["data_ranks"] = args.data_ranks
    if configs is not None:
        record["pad_multiple"] = args.pad_multiple
        record["variant_configs"] = configs
        attention = _attention(configs)
        if attention:
            record["attention"] = attention
    if args.repeats > 1:
        # Each round's order and its own figures; "summary" pools the rounds' steps, "runs"
        # holds every run ("odc", "plain", then "odc@2", "plain@2", ...).
        record.update(repeats=args.repeats, rounds=rounds)
    if partial:
        record["partial"] = True
    return _checked(record, RECORD_KEYS, "record")


def _notes(args) -> dict:
    """The record's words from the command line: ``--commit-note`` (the tree and the call),
    ``--device-command`` (the device call that ran it), ``--note`` (also the row's)."""
    return {
        k: getattr(args, k)
        for k in ("note", "commit_note", "device_command")
        if getattr(args, k, None)
    }


def _finish(
    args,
    mode: Mode,
    stem: str,
    hardware: str,
    commit,
    model: str,
    warmup: int,
    summary: dict,
    peaks: dict,
    pooled: dict,
    rounds: list,
    record,
    configs: dict | None = None,
    row_extra: dict | None = None,
) -> None:
    """The PNG, the table, the fixed-cost bound and the trainers row of a finished run (or of
    pooled runs); ``record()`` gives the JSON record to rewrite with the fixed-cost bound."""
    key = _rate_key(args.mode)
    configs = configs or {}
    label = "verl actor update" if args.mode == "verl" else f"TRL {args.mode}"
    plot(
        os.path.join(args.out, f"{stem}.png"),
        mode,
        summary,
        peaks,
        f"{label}: {', '.join(summary)}, {args.nproc} ranks on {hardware} "
        f"({(commit if '+' in commit else commit[:7]) if commit else '?'}"
        f"{f'; {args.repeats} rounds pooled' if args.repeats > 1 else ''})",
    )
    unit = mode.unit
    print(f"\n{label}, {args.nproc} ranks on {hardware} (steps after {warmup} warm-up)")
    print(
        f"{'variant':14s} {unit + '/s/GPU':>16s} {'tokens/s/GPU':>14s} {'s/step':>8s} "
        f"{'update tok/s':>13s} {'peak GiB':>9s} {'bound':>6s}"
    )
    for variant, s in summary.items():
        peak = max((p for p in peaks[variant] if p is not None), default=float("nan"))
        print(
            f"{variant:14s} {s[f'{unit}_per_s_per_gpu']:16.3f} "
            f"{s['tokens_per_s_per_gpu']:14.1f} {s['seconds_per_step']:8.3f} "
            f"{s.get('update_tokens_per_s_per_gpu', 0):13.1f} {peak:9.2f} "
            f"{s.get('bound') or 0:6.3f}"
        )
    head = headline(summary, key)
    if head is None:
        return
    odc_v, base_v, ratio = head["odc_variant"], head["baseline"], head["speedup"]
    odc, base = summary[odc_v], summary[base_v]
    each = [r["speedup"] for r in rounds if "speedup" in r]
    print(
        f"{odc_v} / {base_v} (the faster baseline) {key}: {ratio:.3f}"
        + (
            f" (every round's measured steps pooled; the rounds alone: "
            f"{', '.join(f'{x:.3f}' for x in each)})"
            if args.repeats > 1
            else ""
        )
    )
    for b, x in head["speedup_vs"].items():
        print(f"   {odc_v} / {b}: {x:.3f}")
    fixed = None
    if "odc" in pooled and "plain" in pooled and pooled["odc"] and pooled["plain"]:
        fixed = fixed_cost_bound(pooled["odc"], pooled["plain"])
    if fixed:
        summary["odc"]["fixed_cost_bound"] = fixed
        with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
            json.dump(record(), f, indent=1)
        print(
            f"odc vs plain: seconds = {fixed['fixed_seconds']:.3f} + "
            f"{fixed['seconds_per_1k_padded_tokens']:.4f} per 1k padded tokens of the "
            f"slowest rank (r2 {fixed['r2']:.3f}): bound with the fixed part "
            f"{fixed['bound']:.3f}"
        )
    steady = f"steady_{key}" in odc and f"steady_{key}" in base
    if steady:
        print(
            f"without Triton compilation ({odc_v} {odc['jit_seconds']:.1f} s, {base_v} "
            f"{base['jit_seconds']:.1f} s in the measured steps): "
            f"{odc[f'steady_{key}'] / base[f'steady_{key}']:.3f}"
        )
    if not args.summary:
        return

    def peak_of(v):
        return max((p for p in peaks[v] if p is not None), default=None)

    row = {
        "trainer": args.mode,
        "gpus": args.nproc,
        "kind": args.kind or hardware,
        "model": model,
        "commit": commit,
        "metric": key,
        "odc_variant": odc_v,
        "baseline": base_v,
        "odc_tokens_per_s_per_gpu": odc[key],
        "base_tokens_per_s_per_gpu": base[key],
        "speedup": ratio,
        "odc_peak_gib": peak_of(odc_v),
        "base_peak_gib": peak_of(base_v),
        "baselines": {
            b: {
                "tokens_per_s_per_gpu": summary[b][key],
                "peak_gib": peak_of(b),
                "speedup": x,
                **(
                    {"sets": configs[b]["sets"], "args": configs[b]["args"]} if b in configs else {}
                ),
            }
            for b, x in head["speedup_vs"].items()
        },
        **(
            {"speedup_vs_defaults": head["speedup_vs"]["plain"]}
            if "plain" in head["speedup_vs"]
            else {}
        ),
        "bound": odc.get("bound"),
        **(
            {
                "bound_with_fixed_cost": fixed["bound"],
                "fixed_seconds_per_step": fixed["fixed_seconds"],
            }
            if fixed
            else {}
        ),
        "step_speedup": base["seconds_per_step"] / odc["seconds_per_step"],
        **(
            {
                "steady_speedup": odc[f"steady_{key}"] / base[f"steady_{key}"],
                "odc_jit_seconds": odc["jit_seconds"],
                "base_jit_seconds": base["jit_seconds"],
            }
            if steady
            else {}
        ),
        **({"repeats": args.repeats, "speedup_of_each_round": each} if args.repeats > 1 else {}),
        "result": f"{stem}.json",
    }
    if "peak_basis" in odc:
        row["peak_basis"] = odc["peak_basis"]
    attention = _attention(configs)
    if attention:
        row["attention"] = attention["implementation"] + (
            "" if attention["same"] else " (differs by variant)"
        )
    if getattr(args, "data_ranks", None):
        row["data_ranks"] = args.data_ranks
    if args.nproc == 1:
        # (a) of the decomposition: the plan on one rank, nothing to communicate.
        row["decomposition"] = {
            "plan_one_rank": head["speedup_vs"],
            "bound_one_rank": odc.get("bound"),
        }
    row.update(row_extra or {})
    if getattr(args, "note", None) and "pooled" not in row:  # a pooled row has it there
        row["note"] = args.note
    update_summary(args.summary, _checked(row, ROW_KEYS, "row"))


def _model(mode: Mode, extra: list[str], cpu: bool) -> str:
    """The example's --size as the runs got it (the last one given wins, as argparse takes)."""
    argv = [*(mode.cpu_args if cpu else mode.gpu_args), *extra]
    sizes = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--size"]
    return sizes[-1] if sizes else "?"


def _last_value(argv: list[str], flag: str) -> str | None:
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values[-1] if values else None


def _add_note_arguments(ap) -> None:
    ap.add_argument(
        "--note", default=None, help="words for the record and the trainers row (what the run is)"
    )
    ap.add_argument(
        "--commit-note", default=None, help="the tree, machine and day of the call, for the record"
    )
    ap.add_argument(
        "--device-command", default=None, help="the device call that ran it, for the record"
    )


def _spread(values: list[float]) -> dict:
    import statistics

    return {
        "mean": statistics.fmean(values),
        "median": statistics.median(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def pool_main(argv: list[str]) -> None:
    """``pool RECORD.json ...``: one row from the measured steps of several records of the same
    trainer, ranks and arguments (runs of separate calls, e.g. a 3B GRPO row whose round takes
    most of a device call), as --repeats pools the rounds of one call. The row's ``pooled``
    block (the records, each one's own speed-up, the seconds per step of both sides, --note)
    and the pooled record's notes are written from the arguments."""
    ap = argparse.ArgumentParser(prog="bench_trl.py pool", description=pool_main.__doc__)
    ap.add_argument("records", nargs="+", help="bench_trl JSON records to pool")
    ap.add_argument("--out", required=True, help="directory for the pooled JSON and PNG")
    ap.add_argument("--summary", default=None, help="trainers.json to update with the row")
    ap.add_argument("--kind", default=None, help="machine kind (default: the records')")
    ap.add_argument(
        "--stem",
        default=None,
        help="file name of the pooled JSON and PNG, without extension (default "
        "bench_trl_MODE_Ngpu_pooled)",
    )
    _add_note_arguments(ap)
    args = ap.parse_args(argv)
    records = []
    for path in args.records:
        with open(path) as f:
            records.append(json.load(f))
    first = records[0]
    for path, r in zip(args.records, records, strict=True):
        same = (r["mode"], r["nproc"], r["warmup_steps"], r.get("partial", False))
        if same != (first["mode"], first["nproc"], first["warmup_steps"], False):
            raise SystemExit(
                f"{path}: (mode, ranks, warm-up, partial) {same} differs from "
                f"{(first['mode'], first['nproc'], first['warmup_steps'], False)}"
            )
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
        own = headline(r["summary"], rate)
        rounds += r.get("rounds") or [
            {"order": list(r["runs"]), **({"speedup": own["speedup"]} if own else {})}
        ]
    args.repeats = len(rounds)  # a record of --repeats N brings its N rounds
    for variant, steps in pooled.items():
        summary[variant] = _rates(steps, worlds[variant], mode.unit)
        summary[variant]["peak_memory_gib"] = peaks[variant]
    commits = list(dict.fromkeys(str(r.get("commit")) for r in records))
    commit = "+".join(c[:7] for c in commits)
    stem = args.stem or f"bench_trl_{args.mode}_{args.nproc}gpu_pooled"
    configs = {}
    for r in records:
        for v, c in (r.get("variant_configs") or {}).items():
            configs.setdefault(v, c)
    head = headline(summary, rate)
    block = {
        "runs": [os.path.basename(p) for p in args.records],
        **({"note": args.note} if args.note else {}),
        "steps_per_variant": {v: len(st) for v, st in pooled.items()},
        "speedup_of_each_run": [x.get("speedup") for x in rounds],
    }
    if head:
        block["seconds_per_step"] = {
            v: _spread(
                [
                    s["seconds"] - s.get("rollout_seconds", 0.0)
                    if args.mode == "grpo"
                    else s["seconds"]
                    for s in pooled[v]
                ]
            )
            for v in (head["odc_variant"], head["baseline"])
        }
    os.makedirs(args.out, exist_ok=True)

    _checked(block, POOLED_BLOCK_KEYS, "pooled")

    def record() -> dict:
        rec = {
            "mode": args.mode,
            "hardware": first["hardware"],
            "host_cpu": sorted({str(r.get("host_cpu")) for r in records}),
            "kind": args.kind,
            "nproc": args.nproc,
            "versions": first["versions"],
            "commit": commit,
            "warmup_steps": warmup,
            "command": shlex.join([sys.executable, *sys.argv]),
            **_notes(args),
            "pooled_from": [os.path.basename(p) for p in args.records],
            "pooled": block,
            "commits": commits,
            "repeats": args.repeats,
            "rounds": rounds,
            **({"variant_configs": configs} if configs else {}),
            "summary": summary,
        }
        return _checked(rec, POOLED_RECORD_KEYS, "pooled record")

    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(record(), f, indent=1)
    _finish(
        args,
        mode,
        stem,
        first["hardware"],
        commit,
        str(first["runs"]["odc"]["meta"].get("size")),
        warmup,
        summary,
        peaks,
        pooled,
        rounds,
        record,
        configs,
        row_extra={"pooled": block},
    )


GENERATED_TOKENS_RTOL = 0.02  # GRPO: completions sampled (decompose)


def decompose(one: dict, multi: dict, key: str) -> dict:
    """The decomposition of a multi-rank row (issue 63): (a) ``plan_one_rank``, the ODC
    variant's speed-up against each baseline with one rank on the same data (each step the
    multi-rank step's rows: ``--same-data-as``), nothing to communicate; ``bound_one_rank``,
    the padded-token ratio of that one-rank plan (the padding the plan saves); (b) ``bound``,
    the planner's bound across the ranks as the multi-rank record has it, and
    ``balance_bound`` = bound / bound_one_rank, what balancing across ranks adds to the
    one-rank plan's padding; (c) ``measured``, the multi-rank speed-up against each baseline
    both records have; ``remainder`` = c / (a x balance_bound): the single sync and the
    transport (the one-rank plan's padding counted once), and ``remainder_whole_bound`` =
    c / (a x bound) as the issue writes it (which counts that padding in a and in b)."""
    head1, headn = headline(one["summary"], key), headline(multi["summary"], key)
    if head1 is None or headn is None:
        raise SystemExit("decompose: each record needs an ODC variant and a baseline")
    steps1 = [s["tokens"] for s in one["runs"][head1["odc_variant"]]["steps"]]
    stepsn = [s["tokens"] for s in multi["runs"][headn["odc_variant"]]["steps"]]
    n = min(len(steps1), len(stepsn))
    # GRPO's rows are sampled: the same prompts give completions whose lengths move with the
    # batch's numerics (a rank's rows, its microbatches), so its steps hold the same rollouts
    # and tokens within GENERATED_TOKENS_RTOL; the other trainers' rows are the data's, exactly.
    grpo = one.get("mode") == "grpo"
    rtol = GENERATED_TOKENS_RTOL if grpo else 0.0
    if n == 0 or any(abs(x - y) > rtol * y for x, y in zip(steps1[:n], stepsn[:n], strict=True)):
        raise SystemExit(
            "decompose: the records' steps hold different tokens (run the "
            "one-rank record with --same-data-as the multi-rank ranks)"
        )
    if grpo:
        rollouts = [
            [s["rollouts"] for s in r["runs"][h["odc_variant"]]["steps"][:n]]
            for r, h in ((one, head1), (multi, headn))
        ]
        if rollouts[0] != rollouts[1]:
            raise SystemExit("decompose: the records' steps hold different rollouts")
    b1 = one["summary"][head1["odc_variant"]].get("bound")
    bn = multi["summary"][headn["odc_variant"]].get("bound")
    balance = bn / b1 if bn and b1 else None
    out = {
        "odc_variant": {"one_rank": head1["odc_variant"], "multi_rank": headn["odc_variant"]},
        "bound_one_rank": b1,
        "bound": bn,
        "balance_bound": balance,
        "steps_compared": n,
        "by_baseline": {},
    }
    for b, a in head1["speedup_vs"].items():
        entry = {"plan_one_rank": a}
        c = headn["speedup_vs"].get(b)
        if c is not None:
            entry["measured"] = c
            if balance:
                entry["remainder"] = c / (a * balance)
            if bn:
                entry["remainder_whole_bound"] = c / (a * bn)
        out["by_baseline"][b] = entry
    return out


def decompose_main(argv: list[str]) -> None:
    """``decompose ONE_RANK.json MULTI_RANK.json``: the multi-rank row's ``decomposition``
    (see :func:`decompose`), printed, and written into that row of --summary."""
    ap = argparse.ArgumentParser(prog="bench_trl.py decompose", description=decompose_main.__doc__)
    ap.add_argument("one_rank")
    ap.add_argument("multi_rank")
    ap.add_argument("--summary", default=None, help="trainers.json holding the multi-rank row")
    ap.add_argument(
        "--kind", default=None, help="the multi-rank row's machine kind (default: its record's)"
    )
    args = ap.parse_args(argv)
    with open(args.one_rank) as f:
        one = json.load(f)
    with open(args.multi_rank) as f:
        multi = json.load(f)
    if one["mode"] != multi["mode"] or one["nproc"] != 1:
        raise SystemExit("decompose: a one-rank record and a multi-rank record of one trainer")
    out = decompose(one, multi, _rate_key(one["mode"]))
    out.update(
        one_rank=os.path.basename(args.one_rank),
        multi_rank=os.path.basename(args.multi_rank),
        one_rank_kind=one.get("kind"),
        one_rank_commit=one.get("commit"),
    )
    print(json.dumps(out, indent=1))
    if args.summary:
        with open(args.summary) as f:
            rows = json.load(f)["rows"]
        size = str(multi["runs"][next(iter(multi["runs"]))]["meta"].get("size"))
        key = (multi["mode"], multi["nproc"], args.kind or multi.get("kind"), size)
        hit = [r for r in rows if _row_key(r) == key]
        if not hit:
            raise SystemExit(f"decompose: no row {key} in {args.summary}")
        hit[0]["decomposition"] = _checked(out, DECOMPOSITION_KEYS, "decomposition")
        with open(args.summary, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


def main() -> None:
    if sys.argv[1:2] == ["pool"]:
        pool_main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["decompose"]:
        decompose_main(sys.argv[2:])
        return
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("--out", required=True, help="directory for the JSON, PNG and log")
    ap.add_argument("--nproc", type=int, default=2, help="ranks (GPUs); 1: the plan on one rank")
    ap.add_argument("--cpu", action="store_true", help="CPU smoke test (tiny model)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps left out of the rates (default: the mode's on GPUs, 1 on CPU)",
    )
    ap.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants (default: odc,plain,plain-tuned; verl "
        "odc,plain; sft also odc-padfree, plain-padfree; grpo odc-local, "
        "odc-nopad)",
    )
    ap.add_argument(
        "--pad-multiple",
        type=int,
        default=None,
        help="plain-tuned's pad_to_multiple_of, and ODC's when given (default: "
        "ODC's own, 64 for SFT/DPO and 128 for GRPO on GPUs, 1 on CPU, which "
        "ODC then keeps as its default)",
    )
    ap.add_argument(
        "--same-data-as",
        type=int,
        default=None,
        metavar="N",
        help="each step holds the rows of an N-rank step (the example's "
        "--accumulation times N / --nproc): with --nproc 1, the plan on one "
        "rank on the data of the N-rank row (bench_trl.py decompose)",
    )
    ap.add_argument(
        "--summary",
        default=None,
        help="trainers.json to update with this run's row (an ODC variant and a baseline needed)",
    )
    ap.add_argument(
        "--kind",
        default=os.environ.get("ODC_DEVICE_KIND"),
        help="machine kind recorded in the summary row (default $ODC_DEVICE_KIND)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of runs, the variants' order reversed every other round "
        "(odc,plain then plain,odc); the rates pool every round's measured "
        "steps (default 1)",
    )
    _add_note_arguments(ap)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    mode = MODES[args.mode]
    variants = args.variants.split(",") if args.variants else list(mode.default_variants)
    unknown = [v for v in variants if v not in mode.variants]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; {args.mode} has {list(mode.variants)}")
    explicit = args.pad_multiple is not None
    if args.mode != "verl":
        args.pad_multiple = args.pad_multiple if explicit else odc_multiple(args.mode, args.cpu)
    args.data_ranks = None
    if args.same_data_as:
        if args.mode == "verl":
            raise SystemExit("--same-data-as: the TRL modes (the example's --accumulation)")
        acc = int(
            _last_value([*(mode.cpu_args if args.cpu else mode.gpu_args), *extra], "--accumulation")
            or 1
        )
        if acc * args.same_data_as % args.nproc:
            raise SystemExit(
                f"--same-data-as {args.same_data_as}: accumulation {acc} x "
                f"{args.same_data_as} is not a multiple of --nproc {args.nproc}"
            )
        extra = [*extra, "--accumulation", str(acc * args.same_data_as // args.nproc)]
        args.data_ranks = args.same_data_as
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu else mode.warmup)
    os.makedirs(args.out, exist_ok=True)
    stem = f"bench_trl_{args.mode}_{args.nproc}{'cpu' if args.cpu else 'gpu'}"
    workdir = tempfile.mkdtemp(prefix=f"{stem}-")
    results, summary, commands, peaks = {}, {}, {}, {}
    pooled: dict[str, list[dict]] = {v: [] for v in variants}  # measured steps, every round
    rounds: list[dict] = []
    hardware, commit = _hardware(args.cpu), _commit()
    key = _rate_key(args.mode)

    def configs():
        return _variant_configs(mode, results, args.pad_multiple or 1, explicit)

    with open(os.path.join(args.out, f"{stem}.log"), "w") as log:
        for i in range(args.repeats):
            # Reversed every other round: a drift of the machine over the call (its host's
            # noise, a clock) weighs on both variants alike.
            order = variants if i % 2 == 0 else variants[::-1]
            rates = {}
            for variant in order:
                name = variant if i == 0 else f"{variant}@{i + 1}"  # a run's key in "runs"
                result, cmd = run_variant(
                    mode,
                    variant,
                    args.nproc,
                    extra,
                    args.cpu,
                    os.path.join(workdir, f"round{i + 1}"),
                    log,
                    args.pad_multiple or 1,
                    explicit,
                )
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
                summary[variant]["peak_basis"] = _peak_basis(result)
                # Written after every run (marked partial until the last): a run stopped
                # later keeps the runs that finished.
                record = _record(
                    args,
                    hardware,
                    commit,
                    warmup,
                    commands,
                    summary,
                    results,
                    partial=len(results) < len(variants) * args.repeats,
                    rounds=rounds,
                    configs=configs(),
                )
                with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
                    json.dump(record, f, indent=1)
            done = {
                "order": order,
                **{f"{v}_seconds_per_step": r["seconds_per_step"] for v, r in rates.items()},
            }
            head = headline(rates, key)
            if head:
                done.update(
                    speedup=head["speedup"],
                    baseline=head["baseline"],
                    speedup_vs=head["speedup_vs"],
                )
            rounds.append(done)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:  # with the last round
        json.dump(
            _record(
                args,
                hardware,
                commit,
                warmup,
                commands,
                summary,
                results,
                partial=False,
                rounds=rounds,
                configs=configs(),
            ),
            f,
            indent=1,
        )
    _finish(
        args,
        mode,
        stem,
        hardware,
        commit,
        _model(mode, extra, args.cpu),
        warmup,
        summary,
        peaks,
        pooled,
        rounds,
        lambda: _record(
            args,
            hardware,
            commit,
            warmup,
            commands,
            summary,
            results,
            partial=False,
            rounds=rounds,
            configs=configs(),
        ),
        configs(),
    )


if __name__ == "__main__":
    main()
