"""Moving a step's rows to the ranks a plan names: the step core the trainer adapters share.

A trainer adapter that balances a whole step (LB-Mini over every rank's rows, TRL's GRPO and
verl's engine) does the same three things: every rank plans the step's rows identically, the
rows move to the ranks the plan gives them, and each rank runs its microbatches. This module is
the second part, :func:`exchange_rows`:

* Rows are numbered globally: rank r's local row i is ``sum(counts[:r]) + i``.
* The plan gives each rank its microbatches as lists of global row numbers (a :class:`Plan`'s
  ``microbatches``, or the same shape from an adapter's own planner).
* ``keep_in_place=True`` first hands each rank the plan's share that overlaps most with the rows
  it already holds (LB-Mini's rank labels are arbitrary): the same balance, fewer rows moved.
* Every rank receives its rows in the order of its microbatches, so microbatch k is a range of
  positions.

Two transports: a mapping of tensors whose trailing shapes and dtypes agree on every rank travels
as one all-to-all of its raw bytes on the tensors' device (exact for every dtype); any other
container travels pickled through the group's CPU backend, given ``take`` (select rows) and
``join`` (concatenate pieces). Every rank checks that the others passed the same plan, the same
counts and the same row layout before anything moves, so a disagreement is an error that names
the rank, never rows silently placed wrong.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RowExchange", "exchange_rows", "keep_in_place"]


@dataclass(frozen=True)
class RowExchange:
    """What :func:`exchange_rows` returns on one rank.

    Attributes:
        rows: this rank's rows in the order of its microbatches (the container type given).
        microbatches: this rank's microbatches as positions into ``rows``.
        plan: every rank's microbatches of global row numbers, as used (after
            ``keep_in_place``).
        moved: rows of all ranks that changed rank.
        received: rows this rank got from other ranks.
    """

    rows: Any
    microbatches: list
    plan: list
    moved: int
    received: int


def _owners(counts: Sequence[int]) -> list[int]:
    return [r for r, n in enumerate(counts) for _ in range(n)]


def keep_in_place(plan: Sequence, counts: Sequence[int]) -> list:
    """``plan``'s per-rank shares handed to the ranks that already hold most of their rows
    (greedily, largest overlap first). Depends only on its inputs, so every rank computes the
    same."""
    world = len(counts)
    owner = _owners(counts)
    overlap = [[0] * world for _ in range(world)]  # [share][rank]
    for share, micros in enumerate(plan):
        for micro in micros:
            for pos in micro:
                overlap[share][owner[pos]] += 1
    pairs = sorted((-overlap[s][r], s, r) for s in range(world) for r in range(world))
    rank_of, taken = {}, set()
    for _, share, rank in pairs:
        if share not in rank_of and rank not in taken:
            rank_of[share] = rank
            taken.add(rank)
    out = [None] * world
    for share, rank in rank_of.items():
        out[rank] = [list(m) for m in plan[share]]
    return out


_keep_shares = keep_in_place  # exchange_rows's flag of the same name hides the function


def _dense_layout(rows) -> list | None:
    """(key, dtype, trailing shape) of each tensor of a mapping of tensors, else None."""
    if not isinstance(rows, Mapping) or not rows:
        return None
    if not all(
        isinstance(v, torch.Tensor) and v.dim() >= 1 and not v.is_nested for v in rows.values()
    ):
        return None
    return [(k, str(v.dtype), tuple(v.shape[1:])) for k, v in rows.items()]


def _row_bytes(layout) -> list[int]:
    return [
        math.prod(shape) * getattr(torch, dtype.split(".")[1]).itemsize
        for _, dtype, shape in layout
    ]


def exchange_rows(
    rows,
    plan,
    counts: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
    keep_in_place: bool = False,
    take: Callable[[Any, list], Any] | None = None,
    join: Callable[[list], Any] | None = None,
    where: str = "exchange_rows",
) -> RowExchange:
    """Moves this rank's ``rows`` to the ranks ``plan`` gives them; returns this rank's rows.

    Every rank of ``group`` calls it with the same ``plan`` and ``counts``.

    Args:
        rows: this rank's ``counts[rank]`` rows: a mapping of tensors whose first dimension is
            the row (their trailing shapes and dtypes the same on every rank), or any
            container when ``take`` and ``join`` are given.
        plan: a :class:`~torch_odc.balance.Plan`, or per rank a list of microbatches of global
            row numbers; every row appears exactly once.
        counts: how many rows each rank holds (``len(counts)`` is the group's size).
        group: the process group (default: the default group).
        keep_in_place: relabel the plan's shares to keep rows where they are
            (:func:`keep_in_place`).
        take: ``take(container, positions)`` -> the rows at ``positions`` (for containers that
            are not a mapping of tensors, e.g. a TensorDict).
        join: ``join(list of containers)`` -> one container (their rows in order).
        where: a name for error messages (the caller's).

    Raises:
        ValueError: a plan that is not a permutation of the rows, or ranks that disagree on the
            plan, the counts or the rows' layout (named by rank).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    where = f"{where}, rank {rank}"
    counts = [int(n) for n in counts]
    shares = [[list(m) for m in micros] for micros in getattr(plan, "microbatches", plan)]
    if len(counts) != world or len(shares) != world:
        raise ValueError(
            f"{where}: {len(counts)} counts and a plan for {len(shares)} ranks in "
            f"a group of {world}"
        )
    total = sum(counts)
    seen = sorted(pos for micros in shares for micro in micros for pos in micro)
    if seen != list(range(total)):
        raise ValueError(f"{where}: the plan does not place each of the {total} rows exactly once")
    if keep_in_place:
        shares = _keep_shares(shares, counts)
    layout = _dense_layout(rows) if take is None and join is None else None
    if layout is None and (take is None or join is None):
        raise TypeError(
            f"{where}: rows must be a mapping of tensors (one row per index of their "
            "first dimension), or pass take= and join="
        )
    if layout is not None:
        local = {len(v) for v in rows.values()}
        if local != {counts[rank]}:
            raise ValueError(
                f"{where}: holds rows of {sorted(local)} counts, counts names {counts[rank]}"
            )
    digest = hashlib.sha1(repr((counts, shares)).encode()).hexdigest()
    mine = (digest, layout)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    for r, other in enumerate(everyone):
        if other[0] != digest:
            raise ValueError(
                f"{where}: rank {r} planned the step's rows differently (plan or "
                "counts differ): every rank must pass the same plan and counts"
            )
        if other[1] != layout:
            raise ValueError(
                f"{where}: rank {r}'s rows are laid out as {other[1]}, this rank's as {layout}"
            )

    owner = _owners(counts)
    offset = sum(counts[:rank])
    order = [pos for micro in shares[rank] for pos in micro]  # this rank's rows, plan order
    sends = [
        [pos - offset for micro in shares[d] for pos in micro if owner[pos] == rank]
        for d in range(world)
    ]
    arrived = [pos for src in range(world) for pos in order if owner[pos] == src]
    index = {pos: j for j, pos in enumerate(arrived)}
    perm = [index[pos] for pos in order]
    if layout is not None:
        out = _move_dense(
            rows, layout, sends, [sum(owner[p] == s for p in order) for s in range(world)], group
        )
    else:
        out = _move_objects(rows, sends, group, take, join)
    if perm != list(range(len(perm))):
        out = (
            {k: v[torch.tensor(perm, dtype=torch.long, device=v.device)] for k, v in out.items()}
            if layout is not None
            else take(out, perm)
        )
    micro_positions, at = [], 0
    for micro in shares[rank]:
        micro_positions.append(list(range(at, at + len(micro))))
        at += len(micro)
    moved = sum(owner[pos] != d for d in range(world) for micro in shares[d] for pos in micro)
    received = sum(owner[pos] != rank for pos in order)
    return RowExchange(out, micro_positions, shares, moved, received)


def _move_dense(rows: Mapping, layout, sends, receive_counts, group) -> dict:
    """One all-to-all of the rows' raw bytes, (rows, bytes per row), on their device (host
    memory where the group runs CUDA collectives over Gloo)."""
    tensors = list(rows.values())
    device = tensors[0].device
    if device.type == "cuda" and os.environ.get("ODC_CUDA_COLLECTIVES") == "gloo":
        device = torch.device("cpu")
    n = len(tensors[0])
    parts = []
    for t, width in zip(tensors, _row_bytes(layout), strict=True):
        t = t.to(device).contiguous().reshape(n, math.prod(t.shape[1:]))
        parts.append(t.view(torch.uint8).reshape(n, width))
    buf = torch.cat(parts, dim=1) if parts else torch.empty((n, 0), dtype=torch.uint8)
    order = torch.tensor([i for dest in sends for i in dest], dtype=torch.long, device=device)
    buf = buf[order].contiguous()
    recv = buf.new_empty((sum(receive_counts), buf.size(1)))
    dist.all_to_all_single(
        recv,
        buf,
        output_split_sizes=list(receive_counts),
        input_split_sizes=[len(d) for d in sends],
        group=group,
    )
    out, col, m = {}, 0, recv.size(0)
    for (key, dtype, shape), width in zip(layout, _row_bytes(layout), strict=True):
        # A copy with the row stride of this piece alone (.contiguous() keeps a single row's
        # stride, which a dtype view refuses).
        piece = recv[:, col : col + width].clone(memory_format=torch.contiguous_format)
        t = piece.view(getattr(torch, dtype.split(".")[1])).reshape(m, *shape)
        out[key] = t.to(rows[key].device)
        col += width
    return out


def _move_objects(rows, sends, group, take, join):
    """Each destination's rows pickled (torch.save) and moved as bytes through the group's CPU
    backend; this rank's own rows stay unpickled. Returns the rows that arrived, by source."""
    world, rank = len(sends), dist.get_rank(group)
    blobs = []
    for d, positions in enumerate(sends):
        if not positions or d == rank:
            blobs.append(b"")
            continue
        buf = io.BytesIO()
        torch.save(take(rows, positions), buf)
        blobs.append(buf.getvalue())
    send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    recv_sizes = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    send = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)
    total = int(recv_sizes.sum())
    recv = torch.empty(max(1, total), dtype=torch.uint8)
    dist.all_to_all_single(
        recv[:total],
        send[: int(send_sizes.sum())],
        output_split_sizes=recv_sizes.tolist(),
        input_split_sizes=send_sizes.tolist(),
        group=group,
    )
    pieces, at = [], 0
    for src, size in enumerate(recv_sizes.tolist()):
        if src == rank and sends[rank]:
            pieces.append(take(rows, sends[rank]))
        elif size:
            raw = recv[at : at + size].numpy().tobytes()
            pieces.append(torch.load(io.BytesIO(raw), weights_only=False))
        at += size
    if not pieces:
        return take(rows, [])
    return pieces[0] if len(pieces) == 1 else join(pieces)
