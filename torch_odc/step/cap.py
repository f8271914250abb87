"""The derived cap: each step's padded-token cap when none is given, so that no ODC microbatch
needs more memory than the unmodified trainer's largest one so far (:class:`AutoCap`), from
the marginal peak bytes per token measured in the first step (:func:`fit_bytes_per_token`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["AutoCap", "fit_bytes_per_token"]


class AutoCap:
    """Each step's token cap when none is given (GPU ranks measure, CPU ranks do not).

    ``cap(plain)``: the step's cap from ``plain``, the padded tokens of the largest microbatch
    the unmodified trainer would have run so far in the epoch (its peak memory so far). Until
    the bytes per token are known, half of ``plain`` (the first step measures them); then
    ``plain`` less ODC's extra bytes (a published shard copy, if any, and control words) in
    tokens. On CPU ranks
    ``plain`` itself.

    The measurement, over the first step's microbatches (every rank's): a microbatch's peak
    grows with its tokens as ``a + b * tokens`` (``a``: what every microbatch allocates, such
    as gathered parameters and gradient buffers; ``b``: activations, logits and their
    gradients per token). Trading ``extra`` bytes for tokens at the same peak takes
    ``extra / b`` tokens, so ``b`` is the marginal peak per token, fitted by least squares to
    the points (padded tokens, allocator peak over the microbatch's forward and backward less
    what was allocated at its start). The fit is bounded below by what the forward keeps per
    token (the peak cannot grow slower) and above by the largest microbatch's peak per token
    (``a >= 0``); below three points or a spread of sizes under 25 %, the lower bound. The ranks
    share their points (one all-reduce), so every rank derives the same cap and the same plan.

    Kept free besides (both counted in ``extra_bytes``): the largest amount by which a point
    lies above the line (``margin_bytes``), and ``ALLOWANCE`` of ODC's bytes, since the line is
    fitted on microbatches of at most half the cap and used up to the whole of it, against the
    unmodified trainer, whose fixed part differs from ODC's (2 H200, 1B: the effective slope
    between ODC's and plain TRL's peaks was 10 % below the fit on DPO, 23 % above it on SFT).

    A microbatch that leaves memory allocated behind it (the first backward's gradients on one
    rank) is no point (:meth:`point`): later microbatches start with that memory.

    The measuring step resets the allocator's peak statistics at each of its microbatches
    (``torch.cuda.reset_peak_memory_stats``): a peak from before the first step is not kept."""

    MAX_POINTS = 32  # microbatches per rank the first step measures
    MIN_SPREAD = 1.25  # largest / smallest tokens for a slope
    ALLOWANCE = 0.15  # of ODC's bytes, for the fit's extrapolation (see above)
    KEPT_FRACTION = 0.1  # of its peak growth a microbatch may leave allocated and be a point

    def __init__(self):
        self.bytes_per_token: float | None = None
        self.fit: dict = {}
        self.extra_bytes = 0
        self.odc_bytes = 0
        self._points: list[tuple[int, float, float]] = []  # tokens, forward kept, peak growth
        self._start: tuple[int, int] | None = None
        self._forward: float = 0.0

    @staticmethod
    def measures() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def cap(self, plain: int) -> int:
        if not self.measures():
            return plain
        if self.bytes_per_token is None:
            return max(1, plain // 2)
        return max(1, plain - math.ceil(self.extra_bytes / self.bytes_per_token))

    def describe(self) -> dict:
        return {
            "bytes_per_token": self.bytes_per_token,
            "odc_extra_bytes": self.extra_bytes,
            "odc_bytes": self.odc_bytes,
            **self.fit,
        }

    @property
    def measuring(self) -> bool:
        return self.bytes_per_token is None and self.measures()

    def start(self, tokens: int) -> None:
        """Before a measured microbatch's forward."""
        torch.cuda.reset_peak_memory_stats()
        self._start = (tokens, torch.cuda.memory_allocated())
        self._forward = 0.0

    def after_forward(self, *_args) -> None:
        if self._start is not None:
            self._forward = float(torch.cuda.memory_allocated() - self._start[1])

    def stop(self) -> None:
        """After a measured microbatch's backward."""
        if self._start is None:
            return
        tokens, before = self._start
        self._start = None
        peak = float(torch.cuda.max_memory_allocated() - before)
        kept = float(torch.cuda.memory_allocated() - before)
        point = self.point(tokens, self._forward, peak, kept)
        if point is not None and len(self._points) < self.MAX_POINTS:
            self._points.append(point)

    @classmethod
    def point(cls, tokens: int, forward: float, peak: float, kept: float):
        """A measured microbatch's point (tokens, forward-kept bytes, peak growth), or None.

        None also when the microbatch left more than ``KEPT_FRACTION`` of its peak growth
        allocated after its backward (``kept``): a one-time allocation that every later
        microbatch starts with, such as the gradients FSDP2 creates at the first backward on one
        rank (no reduce-scatter frees them). Counted in that point's peak, it would lie that far
        above the line and be held free as margin: 2.85 GB on one H200 (TRL GRPO, 1B), which
        left a cap of one token and one rollout per microbatch (5x slower than TRL itself)."""
        if tokens <= 0 or peak <= 0 or kept > cls.KEPT_FRACTION * peak:
            return None
        return (tokens, max(forward, 0.0), peak)

    def finish_step(self, handle) -> None:
        """After the first measured step's barrier (every rank): share the points, fit the
        bytes per token, read ODC's extra bytes from the handle."""
        if not self.measuring:
            return
        memory = handle.stats().get("memory", {}) if handle is not None else {}
        extra = memory.get("published_cache_bytes", 0) + memory.get("control_bytes", 0)
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        t = torch.zeros(world, self.MAX_POINTS + 1, 3, dtype=torch.float64)
        t[rank, 0, 0] = float(extra)
        for k, point in enumerate(self._points):
            t[rank, k + 1] = torch.tensor(point, dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t)
        self._points = []
        points = [
            tuple(float(x) for x in row) for row in t[:, 1:].reshape(-1, 3).tolist() if row[0] > 0
        ]
        fitted = fit_bytes_per_token(points)
        if fitted is not None:
            self.bytes_per_token, self.fit = fitted
            self.odc_bytes = odc = int(t[:, 0, 0].max())
            self.extra_bytes = odc + math.ceil(
                self.ALLOWANCE * odc + self.fit.get("margin_bytes", 0)
            )


def fit_bytes_per_token(points: Sequence[tuple[float, float, float]]) -> tuple[float, dict] | None:
    """The marginal peak bytes per token from ``points`` (tokens, forward-kept bytes, peak
    bytes of a microbatch over its start; see :class:`AutoCap`) and how it was found, or None
    without a point. Every rank computes it from the same points."""
    points = [p for p in points if p[0] > 0 and p[2] > 0]
    if not points:
        return None
    largest = max(points, key=lambda p: (p[0], p[2]))
    upper = largest[2] / largest[0]
    # The forward keeps at least this much per token on every microbatch of that size.
    lower = min(min(p[1] for p in points if p[0] == largest[0]) / largest[0], upper)
    tokens = [p[0] for p in points]
    info = {
        "points": len(points),
        "forward_bytes_per_token": lower,
        "peak_bytes_per_token": upper,
        "slope_bytes_per_token": None,
        "margin_bytes": 0.0,
    }
    if len(points) >= 3 and max(tokens) >= AutoCap.MIN_SPREAD * min(tokens):
        n = len(points)
        mx = math.fsum(tokens) / n
        my = math.fsum(p[2] for p in points) / n
        sxx = math.fsum((x - mx) ** 2 for x in tokens)
        sxy = math.fsum((p[0] - mx) * (p[2] - my) for p in points)
        info["slope_bytes_per_token"] = slope = sxy / sxx
        b = min(max(slope, lower), upper) if lower > 0 else min(slope, upper)
        if b <= 0:
            return None
        # The microbatch furthest above the fitted line (its rows laid out less compactly
        # than their padded tokens say): as much again is kept free.
        a = my - b * mx
        info["margin_bytes"] = max(0.0, max(p[2] - (a + b * p[0]) for p in points))
        return b, info
    return (lower, info) if lower > 0 else None
