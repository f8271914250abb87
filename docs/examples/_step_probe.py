"""What each rank's training step spent besides its work, for the examples' per-step logs:
seconds compiling Triton kernels, and the CUDA caching allocator's device allocations, frees
and retries.

TRL computes log-probabilities and entropies with Triton kernels (``trl.kernels``), compiled on
first use for each specialization of their integer arguments (a length divisible by 16 or not,
...) and kept in Triton's on-disk cache. A compile takes one to a few seconds of host time
during which the device idles, once per machine: in a short benchmark it lands in whichever
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

ALLOCATOR = {"num_device_alloc": "cuda_mallocs", "num_device_free": "cuda_frees",
             "num_alloc_retries": "alloc_retries"}


class StepProbe:
    def __init__(self):
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
        self.per_step.append({"jit_seconds": self.total - self._taken,
                              **{f"{k}_jit_seconds": v for k, v in parts.items()},
                              **{k: v - self._counters.get(k, 0) for k, v in counters.items()}})
        if host is not None:
            self.per_step[-1]["host_seconds"] = host
        self._taken, self._counters = self.total, counters

    @staticmethod
    def _allocator() -> dict:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return {}
        stats = torch.cuda.memory_stats()
        return {name: stats.get(key, 0) for key, name in ALLOCATOR.items()}

    def gather_max(self) -> list[dict]:
        """Every step's largest figures over the ranks, key by key (a step waits for
        its slowest rank), and ``host_seconds`` as every rank's; one gather, after training.
        Every rank calls it."""
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, self.per_step)
        out = []
        for i in range(max(len(x) for x in lists)):
            rows = [x[i] for x in lists if i < len(x)]
            out.append({k: ([r.get(k) for r in rows] if k == "host_seconds"
                            else max(r.get(k, 0.0) for r in rows)) for k in rows[0]})
        return out
