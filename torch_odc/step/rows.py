"""A step's rows as every rank sees them: :func:`gather_rows` (one ``all_gather_object`` of each
rank's row lengths, images and whatever else the adapter's plan needs), and the move of rows to
the ranks a plan names (:func:`torch_odc.balance.exchange_rows`, re-exported here).

Rows are numbered globally, rank-major: rank r's local row i is ``sum(counts[:r]) + i``, the
numbering a plan over :attr:`StepRows.lengths` and :func:`exchange_rows` share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from torch_odc.balance.exchange import RowExchange, exchange_rows, keep_in_place

from .plan import row_costs

__all__ = [
    "RowExchange",
    "StepRows",
    "exchange_rows",
    "gather_objects",
    "gather_rows",
    "keep_in_place",
]


def gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (picklable), by rank of ``group``: one ``all_gather_object``; a
    list of ``obj`` alone without a process group of several ranks."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


@dataclasses.dataclass(frozen=True)
class StepRows:
    """Every rank's rows of one step, rank-major (what :func:`gather_rows` returns on every
    rank, the same everywhere).

    Attributes:
        lengths: per row, the tokens the microbatch cap counts.
        counts: rows per rank.
        sequences: per row its sequences' lengths (the cost model's input; ``(length,)``
            when a rank gave none).
        images: per row the vision patches of each of its images (``()`` for a row without,
            or for every row of a rank that gave none), or None when no rank gave any.
        extras: per rank, the ``extra`` it passed.
        rank: this rank in the group.
        group: the process group (None: the default group).
    """

    lengths: list[int]
    counts: list[int]
    sequences: list[tuple[int, ...]]
    images: list[tuple[int, ...]] | None
    extras: list
    rank: int
    group: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.counts)

    def offset(self, rank: int) -> int:
        """The global number of ``rank``'s first row."""
        return sum(self.counts[:rank])

    def costs(
        self, cost: Any = "tokens", cost_args: dict | None = None, *, every_row: bool = False
    ) -> list[float] | None:
        """Per row its modeled cost (:func:`row_costs`: its sequences' and its images'), or None
        when every row is one sequence without images (a planner costs the lengths itself),
        unless ``every_row``."""
        return row_costs(self.sequences, cost, cost_args, self.images, every_row=every_row)

    def exchange(
        self,
        rows,
        plan,
        *,
        keep_in_place: bool = False,
        take=None,
        join=None,
        where: str = "torch_odc.step",
    ) -> RowExchange:
        """This rank's ``rows`` (its ``counts[rank]`` rows of the step) moved to the ranks
        ``plan`` names (a plan over :attr:`lengths`): :func:`exchange_rows` over the step's
        counts and group, every rank calling it with the same plan."""
        return exchange_rows(
            rows,
            plan,
            self.counts,
            group=self.group,
            keep_in_place=keep_in_place,
            take=take,
            join=join,
            where=where,
        )


def gather_rows(
    lengths: Sequence[int],
    *,
    sequences: Sequence[Sequence[int]] | None = None,
    images: Sequence[Sequence[int]] | None = None,
    extra: Any = None,
    group: dist.ProcessGroup | None = None,
) -> StepRows:
    """Every rank's rows of the step, from this rank's: one ``all_gather_object`` (every rank
    of ``group`` calls it once per step).

    Args:
        lengths: this rank's rows' token counts, as the microbatch cap counts them.
        sequences: per row its sequences' lengths, for the cost model (default ``(length,)``).
        images: per row the vision patches of each of its images, or None for rows without.
        extra: anything picklable the adapter's plan needs from every rank (its trainer's own
            normalizers, widths, layout); returned by rank in :attr:`StepRows.extras`.
        group: the process group (default: the default group).
    """
    lengths = [int(n) for n in lengths]
    if sequences is not None and len(sequences) != len(lengths):
        raise ValueError(f"gather_rows: {len(sequences)} sequences for {len(lengths)} rows")
    if images is not None and len(images) != len(lengths):
        raise ValueError(f"gather_rows: {len(images)} rows' images for {len(lengths)} rows")
    mine = (
        lengths,
        None if sequences is None else [tuple(int(x) for x in s) for s in sequences],
        None if images is None else [tuple(int(x) for x in im) for im in images],
        extra,
    )
    everyone = gather_objects(mine, group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    all_lengths = [n for part in everyone for n in part[0]]
    all_sequences = [
        s for ls, seqs, _, _ in everyone for s in (seqs if seqs is not None else [(n,) for n in ls])
    ]
    all_images = (
        [im for ls, _, ims, _ in everyone for im in (ims if ims is not None else [()] * len(ls))]
        if any(part[2] for part in everyone)
        else None
    )
    return StepRows(
        all_lengths,
        [len(part[0]) for part in everyone],
        all_sequences,
        all_images,
        [part[3] for part in everyone],
        rank,
        group,
    )
