"""Seconds each rank spends compiling Triton kernels, per training step (the examples' logs).

TRL computes log-probabilities and entropies with Triton kernels (``trl.kernels``), compiled on
first use for each specialization of their integer arguments (a length divisible by 16 or not,
...) and kept in Triton's on-disk cache. A compile takes one to a few seconds of host time
during which the device idles, once per machine: in a short benchmark it lands in whichever
early steps first meet a new specialization, and a run that finds the cache already filled
by an earlier run does not pay it. The examples record it per step so that the benchmark can
say how much of a step was compilation (benchmarks/bench_trl.py).

Measured through Triton's runtime hooks (``triton.knobs.runtime.jit_cache_hook`` before a
kernel is compiled or loaded from the disk cache, ``jit_post_compile_hook`` after); without
Triton, nothing is recorded.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class JitClock:
    def __init__(self):
        self.total = 0.0
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

    def step(self, **parts: float) -> None:
        """At the end of a step: its compile seconds on this rank (``jit_seconds``), and any
        ``parts`` of them the caller timed itself (``<part>_jit_seconds``)."""
        self.per_step.append({"jit_seconds": self.total - self._taken,
                              **{f"{k}_jit_seconds": v for k, v in parts.items()}})
        self._taken = self.total

    def gather_max(self) -> list[dict]:
        """Every step's largest compile seconds over the ranks, key by key (a step waits for
        its slowest rank); one gather, after training. Every rank calls it."""
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, self.per_step)
        out = []
        for i in range(max(len(x) for x in lists)):
            rows = [x[i] for x in lists if i < len(x)]
            out.append({k: max(r.get(k, 0.0) for r in rows) for k in rows[0]})
        return out
