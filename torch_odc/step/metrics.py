"""Metrics over uneven microbatch counts: a trainer that reduces a metric in every microbatch
calls a collective that ranks with different counts cannot all call. Each rank instead keeps
its microbatches' values (or their sums) and reduces them once per step, after the barrier,
with these (every rank calls each once, also a rank that ran no microbatch)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .rows import gather_objects

__all__ = ["KINDS", "all_reduce_min", "all_reduce_sums", "reduce_metrics"]

KINDS = ("sum", "mean", "min", "max")


def _reduce(values: Sequence[float], op, group) -> list[float]:
    """One all-reduce of a small CPU float64 vector: under "odc" it runs on Gloo, also for
    ranks that share one GPU."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def all_reduce_sums(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Each value summed over the ranks of ``group`` (one all-reduce)."""
    return _reduce(values, dist.ReduceOp.SUM, group)


def all_reduce_min(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Each value's minimum over the ranks of ``group`` (one all-reduce; ``inf`` where no rank
    had one, negate for a maximum)."""
    return _reduce(values, dist.ReduceOp.MIN, group)


def reduce_metrics(
    local: Mapping[str, tuple[str, Sequence[float]]],
    group: dist.ProcessGroup | None = None,
    where: str = "torch_odc.step",
) -> dict[str, tuple[str, float, int]]:
    """Per-microbatch values of every rank reduced to one value per metric: ``local[name] =
    (kind, this rank's values, one per microbatch; any number, none included)`` with kind
    ``"sum"`` (over every microbatch of every rank), ``"mean"`` (over all of them), ``"min"``
    or ``"max"``. Returns ``{name: (kind, value, microbatches)}`` (the same on every rank;
    without any value a sum is 0, a mean, minimum or maximum ``nan``). One
    ``all_gather_object``."""
    mine = {}
    for name, (kind, values) in local.items():
        if kind not in KINDS:
            raise ValueError(f"{where}: metric {name!r}: kind {kind!r} is not one of {KINDS}")
        mine[name] = (kind, [float(x) for x in values])
    everyone = gather_objects(mine, group)
    out = {}
    for name in sorted({k for part in everyone for k in part}):
        kinds = {part[name][0] for part in everyone if name in part}
        if len(kinds) != 1:
            raise RuntimeError(
                f"{where}: metric {name!r} is aggregated as {sorted(kinds)} on different ranks"
            )
        kind = kinds.pop()
        values = [x for part in everyone if name in part for x in part[name][1]]
        if kind == "sum":
            value = sum(values)
        elif not values:
            value = math.nan
        elif kind == "mean":
            value = sum(values) / len(values)
        elif kind == "min":
            value = min(values)
        else:
            value = max(values)
        out[name] = (kind, value, len(values))
    return out
