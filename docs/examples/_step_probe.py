"""What each rank's training step spent besides its work, for the examples' per-step logs:
seconds compiling Triton kernels, the CUDA caching allocator's device allocations, frees and
retries, and on the steps asked for, the top ops under torch.profiler.

TRL computes log-probabilities and entropies with Triton kernels (``trl.kernels``), compiled on
first use for each specialization of their integer arguments (a length divisible by 16 or not,
...) and kept in Triton's on-disk cache. A compile takes host time during which the device
idles (0.2-1.1 s per run of the 1B TRL benchmarks on 2 H200), once per machine: in a short benchmark it lands in whichever
early steps first meet a new specialization, and a run that finds the cache already filled
by an earlier run does not pay it. The examples record it per step so that the benchmark can
say how much of a step was compilation (benchmarks/bench_trl.py).

Measured through Triton's runtime hooks (``triton.knobs.runtime.jit_cache_hook`` before a
kernel is compiled or loaded from the disk cache, ``jit_post_compile_hook`` after); without
Triton, nothing is recorded. The allocator's counters (``torch.cuda.memory_stats``:
``num_device_alloc``, ``num_device_free``, ``num_alloc_retries``) count its cudaMalloc and
cudaFree calls: a step that grows the cache or frees it to retry an allocation shows there.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

ALLOCATOR = {
    "num_device_alloc": "cuda_mallocs",
    "num_device_free": "cuda_frees",
    "num_alloc_retries": "alloc_retries",
}
PER_RANK = ("host_seconds", "profile")  # kept per rank by gather_max, not reduced


def add_arguments(ap) -> None:
    """The examples' ``--profile-steps`` (what :class:`StepProbe` takes)."""
    ap.add_argument(
        "--profile-steps",
        type=lambda v: sorted({int(x) for x in v.split(",") if x}),
        default=[],
        help="comma-separated steps to run under torch.profiler "
        "(their records get the top ops; see _step_probe.py)",
    )
    ap.add_argument(
        "--profile-trace",
        default=None,
        metavar="DIR",
        help="also write each profiled step's Chrome trace there, per rank "
        "(step<N>_rank<R>.json.gz; benchmarks/trace_phases.py reads them)",
    )


class StepProbe:
    """``profile_steps``: steps (1-based, as logged) to run under torch.profiler (CPU and CUDA
    activity, from the end of the step before to the end of the step); each such step's record
    gets ``profile``: per rank the ops of most self CPU time and of most self device time
    (name, calls, self CPU ms, self device ms), the CUDA runtime's allocation calls among them,
    and how long the device was busy (``_busy``).
    The profiler slows the steps it covers: for finding where a step's time goes, not rates."""

    TOP = 15

    def __init__(self, profile_steps=(), device_only: bool = False, trace_dir: str | None = None):
        self.profile_steps = set(profile_steps)
        self.device_only = device_only  # CUDA activity only (no host ops)
        self.trace_dir = trace_dir  # each profiled step's Chrome trace, per rank
        self._profiler = None
        if 1 in self.profile_steps:
            self._start_profiler()
        self.total = 0.0
        self._counters = self._allocator()
        self._started: float | None = None
        self._taken = 0.0
        self.per_step: list[dict] = []
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def on_miss(*args, **kwargs):
            self._started = time.perf_counter()
            # A true value from the hook skips the kernel: pass on the previous hook's answer only.
            return before(*args, **kwargs) if before else None

        def on_compiled(*args, **kwargs):
            if self._started is not None:
                self.total += time.perf_counter() - self._started
                self._started = None
            return after(*args, **kwargs) if after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = on_miss, on_compiled

    def step(self, host: dict | None = None, **parts: float) -> None:
        """At the end of a step: its compile seconds on this rank (``jit_seconds``), any
        ``parts`` of them the caller timed itself (``<part>_jit_seconds``), and the allocator's
        counters over the step (``cuda_mallocs``, ``cuda_frees``, ``alloc_retries``); ``host``:
        the ODC trainer's ``host_seconds`` of the step on this rank, kept per rank."""
        counters = self._allocator()
        self.per_step.append(
            {
                "jit_seconds": self.total - self._taken,
                **{f"{k}_jit_seconds": v for k, v in parts.items()},
                **{k: v - self._counters.get(k, 0) for k, v in counters.items()},
            }
        )
        if host is not None:
            self.per_step[-1]["host_seconds"] = host
        self._taken, self._counters = self.total, counters
        if self._profiler is not None:
            self._profiler.stop()
            self.per_step[-1]["profile"] = self._summary(self._profiler)
            if self.trace_dir:
                import os

                os.makedirs(self.trace_dir, exist_ok=True)
                rank = dist.get_rank() if dist.is_initialized() else 0
                self._profiler.export_chrome_trace(
                    os.path.join(self.trace_dir, f"step{len(self.per_step)}_rank{rank}.json.gz")
                )
            self._profiler = None
        if len(self.per_step) + 1 in self.profile_steps:
            self._start_profiler()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = (
            [] if self.device_only and torch.cuda.is_available() else [ProfilerActivity.CPU]
        )
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.start()

    @classmethod
    def _summary(cls, profiler) -> dict:
        events = list(profiler.key_averages())

        def row(e):
            return [
                e.key,
                e.count,
                round(e.self_cpu_time_total / 1e3, 3),
                round(getattr(e, "self_device_time_total", 0.0) / 1e3, 3),
            ]

        def top(key):
            return [row(e) for e in sorted(events, key=key, reverse=True)[: cls.TOP]]

        return {
            **cls._busy(profiler),
            "columns": ["op", "calls", "self_cpu_ms", "self_device_ms"],
            "cpu": top(lambda e: e.self_cpu_time_total),
            "device": top(lambda e: getattr(e, "self_device_time_total", 0.0)),
            "allocation": [
                row(e) for e in events if e.key.startswith(("cudaMalloc", "cudaFree", "cuMem"))
            ],
        }

    @staticmethod
    def _busy(profiler) -> dict:
        """``device_busy_ms``: the time any kernel or copy ran (the union of their intervals),
        ``device_span_ms``: from the first's start to the last's end; their ratio is how busy the
        device was while the step ran on it (the rest: waiting for the host or a peer)."""
        from torch.autograd import DeviceType

        spans = sorted(
            (e.time_range.start, e.time_range.end)
            for e in profiler.events()
            if e.device_type == DeviceType.CUDA
        )
        if not spans:
            return {}
        busy, start, end = 0.0, spans[0][0], spans[0][1]
        for a, b in spans[1:]:
            if a > end:
                busy, start = busy + end - start, a
            end = max(end, b)
        busy += end - start
        return {
            "device_busy_ms": round(busy / 1e3, 3),
            "device_span_ms": round((max(b for _, b in spans) - spans[0][0]) / 1e3, 3),
        }

    @staticmethod
    def _allocator() -> dict:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {}
        stats = torch.cuda.memory_stats()
        return {name: stats.get(key, 0) for key, name in ALLOCATOR.items()}

    def gather_max(self) -> list[dict]:
        """Every step's largest figures over the ranks, key by key (a step waits for its
        slowest rank), and ``host_seconds`` and ``profile`` as every rank's; one gather, after
        training. Every rank calls it."""
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, self.per_step)
        out = []
        for i in range(max(len(x) for x in lists)):
            rows = [x[i] for x in lists if i < len(x)]
            keys = dict.fromkeys(k for r in rows for k in r)
            out.append(
                {
                    k: (
                        [r.get(k) for r in rows]
                        if k in PER_RANK
                        else max(r.get(k, 0.0) for r in rows)
                    )
                    for k in keys
                }
            )
        return out


def mask_kind(mask) -> str:
    """What an attention layer got as its mask: ``none`` (the kernel's own causal mask, e.g.
    SDPA's ``is_causal``), ``dense LxL <dtype>`` (a materialized 4-D mask: padding, or the
    block-diagonal mask transformers builds from packed rows' ``position_ids`` for SDPA and
    eager), ``BlockMask`` (flex_attention's block-sparse mask), else the type's name."""
    if mask is None:
        return "none"
    if isinstance(mask, torch.Tensor):
        return f"dense {mask.shape[-2]}x{mask.shape[-1]} {str(mask.dtype).replace('torch.', '')}"
    return type(mask).__name__


class BatchProbe:
    """What the training forwards of each step got, on this rank, as the model saw them (so
    the configuration that reached the trainer, not the one asked for): each microbatch's
    sequence length (``widths``) and rows, whether ``position_ids`` (padding-free rows) and
    an ``attention_mask`` came in, and what the first attention layer got as its mask
    (:func:`mask_kind`). Only forwards with gradients are counted (the update, not
    generation or reference log-probs). ``step()`` closes a step; :meth:`gather` after
    training (every rank)."""

    def __init__(self, model):
        self.per_step: list[dict] = []
        self._now: dict = self._empty()
        model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        attention = next(
            (m for name, m in model.named_modules() if name.endswith("self_attn")), None
        )
        if attention is not None:
            attention.register_forward_pre_hook(self._on_attention, with_kwargs=True)

    @staticmethod
    def _empty() -> dict:
        return {
            "widths": [],
            "rows": [],
            "position_ids": False,
            "attention_mask": False,
            "masks": [],
        }

    def _on_forward(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not (torch.is_grad_enabled() and isinstance(ids, torch.Tensor)):
            return
        now = self._now
        now["widths"].append(int(ids.shape[-1]))
        now["rows"].append(int(ids.shape[0]) if ids.dim() > 1 else 1)
        now["position_ids"] |= kwargs.get("position_ids") is not None
        now["attention_mask"] |= kwargs.get("attention_mask") is not None

    def _on_attention(self, _module, _args, kwargs):
        if torch.is_grad_enabled():
            kind = mask_kind(kwargs.get("attention_mask"))
            kind = kind if not kind.startswith("dense") else "dense " + kind.split(" ")[-1]
            if kind not in self._now["masks"]:
                self._now["masks"].append(kind)

    def step(self) -> None:
        self.per_step.append(self._now)
        self._now = self._empty()

    def gather(self) -> list[dict]:
        """Per step, every rank's widths and rows (``widths_per_rank``, ``rows_per_rank``) and
        whether any rank got position_ids / an attention mask, and the mask kinds seen."""
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, self.per_step)
        out = []
        for i in range(max(len(x) for x in lists)):
            rows = [x[i] if i < len(x) else self._empty() for x in lists]
            out.append(
                {
                    "widths_per_rank": [r["widths"] for r in rows],
                    "rows_per_rank": [r["rows"] for r in rows],
                    "position_ids": any(r["position_ids"] for r in rows),
                    "attention_mask": any(r["attention_mask"] for r in rows),
                    "attention_masks": sorted({k for r in rows for k in r["masks"]}),
                }
            )
        return out


class PeakSince:
    """The allocator's peak since one point of the run, whoever resets the peak statistics
    in between: ODC's derived cap resets them at each microbatch of its first step, and the
    GRPO adapter at each phase (``torch.cuda.reset_peak_memory_stats``), which would hide
    the peaks before those resets. From :meth:`start` (both variants call it at the same
    point: the Trainer's ``on_train_begin``, after the model is sharded and before the first
    step), every reset first folds the peak so far into this one. The allocator's own
    figures (what the derived cap reads) are unchanged."""

    def __init__(self):
        self.folded = 0
        self.started = False

    def start(self) -> None:
        if not torch.cuda.is_available() or self.started:
            return
        self.started = True
        torch.cuda.reset_peak_memory_stats()
        reset, probe = torch.cuda.reset_peak_memory_stats, self

        def folding_reset(*args, **kwargs):
            probe.folded = max(probe.folded, torch.cuda.max_memory_allocated())
            return reset(*args, **kwargs)

        torch.cuda.reset_peak_memory_stats = folding_reset
        torch.cuda.memory.reset_peak_memory_stats = folding_reset

    def peak_bytes(self) -> int | None:
        if not self.started:
            return None
        return max(self.folded, torch.cuda.max_memory_allocated())

    def gather_gib(self, trainer) -> list:
        """Every rank's peak since :meth:`start` plus what ODC held beside the allocator
        (``trainer.odc_memory_bytes``, its largest: the GRPO adapter holds less during
        generation, so there this is an upper bound of ODC's peak), in GiB (None on CPU
        ranks); one gather, every rank."""
        peak = self.peak_bytes()
        if peak is not None:
            peak = (peak + getattr(trainer, "odc_memory_bytes", 0)) / 2**30
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        return peaks


def attention_record(model, sdpa_backends: bool = True) -> dict:
    """The attention kernel a run used: the model's ``attn_implementation`` and, on CUDA,
    which of SDPA's backends were enabled (PyTorch picks among them per call)."""
    config = getattr(model, "config", None)
    out = {"implementation": getattr(config, "_attn_implementation", None)}
    if sdpa_backends and torch.cuda.is_available():
        b = torch.backends.cuda
        out["sdpa_backends_enabled"] = [
            name
            for name, on in (
                ("cudnn", b.cudnn_sdp_enabled()),
                ("flash", b.flash_sdp_enabled()),
                ("efficient", b.mem_efficient_sdp_enabled()),
                ("math", b.math_sdp_enabled()),
            )
            if on
        ]
    return out
