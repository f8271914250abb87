"""The step core: one optimizer step of on-demand training, trainer-agnostic.

Under ODC ranks meet once per step and may run different numbers of microbatches, so a trainer
adapter does the same few things every step; they live here once (docs/step-core.md):

1. **The step's rows** (:class:`StepRows`, :func:`gather_rows`): every rank's rows' lengths
   (what the token cap counts), their sequences and images (what the cost model counts) and
   whatever the adapter needs from every rank, in one ``all_gather_object``; or, when every
   rank already knows them (a dataset's lengths, a shared sampler), no communication at all.
2. **The plan** (:func:`plan_step`, :class:`LBMini`, :func:`row_costs`, :func:`check_plan`):
   LB-Mini over the whole step, a row over the cap alone in its microbatch (or refused), and a
   check that every row runs exactly once.
3. **The row exchange** (:func:`exchange_rows`, :func:`keep_in_place`): the rows move to the
   ranks the plan names, one all-to-all; with ``keep_in_place`` the plan's shares go to the
   ranks that hold most of their rows.
4. **Microbatches** (:class:`Microbatch`, :mod:`.padding`): a rank's rows packed under a
   padded-token cap (:func:`pack_padded`, :func:`pack_shares`), each microbatch with its rows,
   padded shape and weights; the derived cap (:class:`AutoCap`) matches the unmodified
   trainer's largest microbatch.
5. **Metrics** (:func:`all_reduce_sums`, :func:`all_reduce_min`, :func:`reduce_metrics`):
   per-microbatch values reduced once per step, over uneven counts.

Between 4 and 5 the adapter runs its microbatches and calls :func:`torch_odc.minibatch_barrier`.
"""

from __future__ import annotations

from .cap import AutoCap, fit_bytes_per_token
from .metrics import all_reduce_min, all_reduce_sums, reduce_metrics
from .microbatch import Microbatch
from .padding import (
    fits,
    frontier,
    left_padded_tokens,
    left_padded_widths,
    pack_padded,
    pack_shares,
    padded_tokens,
    plain_largest_microbatch,
    plain_microbatches,
    round_up,
    row_shape,
)
from .plan import LBMini, Planner, check_plan, plan_step, row_costs
from .rows import RowExchange, StepRows, exchange_rows, gather_objects, gather_rows, keep_in_place

__all__ = [
    "AutoCap",
    "LBMini",
    "Microbatch",
    "Planner",
    "RowExchange",
    "StepRows",
    "all_reduce_min",
    "all_reduce_sums",
    "check_plan",
    "exchange_rows",
    "fit_bytes_per_token",
    "fits",
    "frontier",
    "gather_objects",
    "gather_rows",
    "keep_in_place",
    "left_padded_tokens",
    "left_padded_widths",
    "pack_padded",
    "pack_shares",
    "padded_tokens",
    "plain_largest_microbatch",
    "plain_microbatches",
    "plan_step",
    "reduce_metrics",
    "round_up",
    "row_costs",
    "row_shape",
]
