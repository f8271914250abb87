"""A step's plan: which rank runs which rows, in which microbatches.

:class:`LBMini` is the default planner (LB-Mini over the whole step, :func:`torch_odc.balance.plan`),
:func:`row_costs` the cost of rows of several sequences or with images, :func:`plan_step`
runs a planner and :func:`check_plan` refuses any plan that does not run every row exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from torch_odc import balance

__all__ = ["LBMini", "Planner", "check_plan", "plan_step", "row_costs"]

# planner(lengths, world_size, step) -> plan[rank] = list of microbatches, each a list of
# positions into `lengths`; every position exactly once over all ranks.
Planner = Callable[[Sequence[int], int, int], Sequence[Sequence[Sequence[int]]]]


class LBMini:
    """LB-Mini with a token cap, as a planner (a class, not a closure: DataLoader workers may
    pickle it).

    ``LBMini(max_tokens_per_microbatch, cost, cost_args)(lengths, world_size, step)`` is
    :func:`torch_odc.balance.plan` in mode ``"mini"``: a row longer than the cap gets a
    microbatch of its own (with an ``OversizedSequenceWarning``). ``costs``, when given, are the
    rows' modeled costs (a row of several sequences, such as a preference pair, costs the sum
    of its sequences' costs, which a nonlinear cost model does not give for the summed length:
    :func:`row_costs`); the token cap still applies to ``lengths``. ``cap`` replaces the
    configured cap for one call (a derived cap's step)."""

    def __init__(
        self,
        max_tokens_per_microbatch: int | None = None,
        cost: Any = "tokens",
        cost_args: dict | None = None,
    ):
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.cost = cost
        self.cost_args = dict(cost_args or {})

    @classmethod
    def from_config(cls, config) -> LBMini:
        """From anything with ``max_tokens_per_microbatch``, ``cost`` and ``cost_args``
        (the Hugging Face adapters' ``ODCConfig``)."""
        return cls(config.max_tokens_per_microbatch, config.cost, config.cost_args)

    def __call__(self, lengths, world_size, step=0, costs=None, cap=None):
        cap = cap if cap is not None else self.max_tokens_per_microbatch
        if costs is None:
            return balance.plan(
                lengths, world_size, cap, mode="mini", cost=self.cost, **self.cost_args
            ).microbatches
        return balance.plan(lengths, world_size, cap, mode="mini", costs=costs).microbatches


def row_costs(
    rows: Sequence[Sequence[int]],
    cost: Any = "tokens",
    cost_args: dict | None = None,
    images: Sequence[Sequence[int]] | None = None,
    *,
    every_row: bool = False,
) -> list[float] | None:
    """Per row (each a tuple of its sequences' lengths), the sum of its sequences' modeled
    costs and, for a row with images (``images[k]``: the vision patches of each of row k's
    images), of its images' costs: each image costs as a sequence of its patches under the same
    model (a vision tower attends within an image; under ``"tokens"`` a patch costs as a
    token). None when every row is one sequence without images (LB-Mini then costs the lengths
    itself, the same values), unless ``every_row``."""
    if not every_row and all(len(r) == 1 for r in rows) and not (images and any(images)):
        return None
    parts = [(*r, *(images[k] if images else ())) for k, r in enumerate(rows)]
    flat = [n for r in parts for n in r]
    seq = balance.sequence_costs(flat, cost, **(cost_args or {}))
    out, at = [], 0
    for r in parts:
        out.append(math.fsum(seq[at : at + len(r)]))
        at += len(r)
    return out


def check_plan(plan, n: int, world: int, step: int = 0, where: str = "torch_odc.step") -> list:
    """``plan`` (a :class:`~torch_odc.balance.Plan` or per rank its microbatches) as lists,
    refused unless it gives every one of the ``n`` rows to exactly one microbatch of one of
    ``world`` ranks: a row left out or run twice would silently change the gradient."""
    plan = getattr(plan, "microbatches", plan)
    if len(plan) != world:
        raise ValueError(
            f"{where}: step {step}: the planner returned "
            f"{len(plan)} ranks' microbatches for a world of {world}"
        )
    seen = [0] * n
    out = []
    for rank_plan in plan:
        mbs = []
        for mb in rank_plan:
            mb = [int(i) for i in mb]
            if not mb:
                raise ValueError(f"{where}: step {step}: an empty microbatch")
            for i in mb:
                if not 0 <= i < n:
                    raise ValueError(
                        f"{where}: step {step}: position {i} is outside the step's {n} sequences"
                    )
                seen[i] += 1
            mbs.append(mb)
        out.append(mbs)
    bad = [i for i, c in enumerate(seen) if c != 1]
    if bad:
        raise ValueError(
            f"{where}: step {step}: the plan runs sequences "
            f"{bad[:5]} {[seen[i] for i in bad[:5]]} times (must be once each)"
        )
    return out


def plan_step(
    lengths: Sequence[int],
    world_size: int,
    planner: Planner | None = None,
    *,
    step: int = 0,
    costs: Sequence[float] | None = None,
    cap: int | None = None,
    oversized: str = "alone",
    cap_note: str = "",
    where: str = "torch_odc.step",
) -> list:
    """The step's plan, checked (:func:`check_plan`): per rank its microbatches as lists of
    positions into ``lengths``.

    ``planner`` is an :class:`LBMini` (given ``costs`` and ``cap`` when not None) or any
    :data:`Planner` (given ``cap`` only when not None). Without one, ``LBMini(cap)``.
    ``oversized``: ``"alone"`` (LB-Mini's rule: a row longer than the cap runs in a microbatch
    of its own) or ``"raise"`` (refused here, naming the row's length and the cap, and
    ``cap_note``: where the cap comes from)."""
    if oversized not in ("alone", "raise"):
        raise ValueError(f"{where}: oversized must be 'alone' or 'raise', got {oversized!r}")
    if planner is None:
        planner = LBMini(cap)
    if oversized == "raise":
        limit = cap if cap is not None else getattr(planner, "max_tokens_per_microbatch", None)
        if limit is not None and lengths and max(lengths) > limit:
            raise ValueError(
                f"{where}: a sequence of {max(lengths)} tokens is longer than the cap of "
                f"{limit} tokens{f' ({cap_note})' if cap_note else ''}"
            )
    kwargs: dict = {}
    if costs is not None and isinstance(planner, LBMini):
        kwargs["costs"] = costs
    if cap is not None:
        kwargs["cap"] = cap
    return check_plan(
        planner(lengths, world_size, step, **kwargs), len(lengths), world_size, step, where
    )
