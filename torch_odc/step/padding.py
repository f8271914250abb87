"""Padded-token arithmetic: what a microbatch of rows costs in memory once a collator pads it,
and the packing of a rank's rows into microbatches under a padded-token cap.

A microbatch's activations grow with its padded tokens: rows x the longest sequence for the
default collators (every row padded to the longest), the tokens themselves for padding-free
collators. A trainer that runs a fixed number of consecutive rows per microbatch (the Hugging
Face Trainer's ``per_device_train_batch_size``) runs microbatches whose largest padded size is
known before the step (:func:`plain_largest_microbatch`); the derived cap (:mod:`.cap`) keeps
every ODC microbatch at or below it, and :func:`pack_padded` packs under it. A row is a tuple of
its sequences' lengths: one for a language-modeling row, two for a preference pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = [
    "CUDNN_NAN_MODULUS",
    "CUDNN_NAN_REMAINDER",
    "fits",
    "frontier",
    "left_padded_tokens",
    "left_padded_widths",
    "pack_padded",
    "pack_shares",
    "padded_tokens",
    "plain_largest_microbatch",
    "plain_microbatches",
    "round_up",
    "row_shape",
]


def padded_tokens(
    rows: Sequence[Sequence[int]], padding_free: bool = False, multiple: int = 1
) -> int:
    """The tokens of one microbatch of ``rows`` (each a tuple of its sequences' lengths: one
    for a language-modeling row, two for a preference pair) once collated: every sequence
    padded to the longest, rounded up to ``multiple`` (the collator's ``pad_to_multiple_of``),
    or concatenated when ``padding_free``."""
    if not rows:
        return 0
    if padding_free:
        return sum(sum(r) for r in rows)
    return sum(len(r) for r in rows) * round_up(max(max(r) for r in rows), multiple)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (a collator's ``pad_to_multiple_of``)."""
    return -(-n // multiple) * multiple


# torch 2.11 (at least to 2.13; pytorch/pytorch#196678): on H100/H200 cuDNN's attention backward
# returns NaN in the query gradient when a mask is given, the length is 64 modulo 128 and a query
# row sees only masked keys, as a left-padded row's leading pads do. Clean at multiples of 128.
CUDNN_NAN_MODULUS, CUDNN_NAN_REMAINDER = 128, 64


def left_padded_widths(
    prompt: int, completion: int, multiple: int, cuda: bool, length_multiple: int = 1
) -> tuple[int, int]:
    """A left-padded microbatch's prompt and completion widths (GRPO's layout) from its longest
    of each: at least one completion column, each rounded up to ``multiple`` (TRL's
    ``pad_to_multiple_of``); then as many more prompt columns (left padding, masked;
    ``multiple`` at a time) as make the length, prompt plus completion, a multiple of
    ``length_multiple`` (ODC's: few distinct lengths for cuDNN's plans; the padding goes where
    only the model's body pays for it, not the logits of the completion); on CUDA, as many more
    completion columns (``multiple`` at a time; right padding, masked) as keep the length off
    64 modulo 128, the lengths at which cuDNN's attention backward gives NaN gradients for
    left-padded rows (see ``CUDNN_NAN_MODULUS``)."""
    pw, cw = round_up(prompt, multiple), round_up(max(1, completion), multiple)
    while (pw + cw) % length_multiple:
        pw += multiple
    while cuda and (pw + cw) % CUDNN_NAN_MODULUS == CUDNN_NAN_REMAINDER:
        cw += multiple  # a multiple of 128 never lands here; 64 and any other leave at once
    return pw, cw


def left_padded_tokens(
    shapes: Sequence[tuple[int, int]],
    multiple: int = 1,
    cuda: bool = False,
    length_multiple: int = 1,
) -> int:
    """The tokens of one left-padded microbatch of rows of ``shapes`` (prompt length,
    completion length each) once laid out by :func:`left_padded_widths`: every row as wide as
    the longest prompt plus the longest completion, rounded."""
    if not shapes:
        return 0
    pw, cw = left_padded_widths(
        max(p for p, _ in shapes), max(c for _, c in shapes), multiple, cuda, length_multiple
    )
    return len(shapes) * (pw + cw)


def plain_largest_microbatch(
    rows: Sequence[Sequence[int]], per_device: int, padding_free: bool = False, multiple: int = 1
) -> int:
    """The padded tokens of the largest microbatch the unmodified trainer runs of ``rows`` (a
    step's rows in order): consecutive groups of ``per_device`` rows."""
    return max(
        padded_tokens(rows[i : i + per_device], padding_free, multiple)
        for i in range(0, len(rows), per_device)
    )


def plain_microbatches(
    rows: Sequence[Sequence[int]],
    patches: Sequence[int],
    per_device: int,
    padding_free: bool = False,
    multiple: int = 1,
) -> list[tuple[int, int]]:
    """(padded tokens, vision patches) of each microbatch the unmodified trainer runs of
    ``rows`` (a step's rows in order, ``patches[k]`` the vision patches of row k's images):
    consecutive groups of ``per_device`` rows. A vision tower runs a microbatch's images
    unpadded, one after another, so its patches add up."""
    return [
        (
            padded_tokens(rows[i : i + per_device], padding_free, multiple),
            sum(patches[i : i + per_device]),
        )
        for i in range(0, len(rows), per_device)
    ]


def frontier(points) -> list[tuple[int, int]]:
    """The (tokens, patches) points that no other point dominates (holds at least as many of
    both), by tokens. A microbatch dominated by one of them needs no more memory than that
    one, as far as its memory grows with its padded tokens and with its patches."""
    best: list[tuple[int, int]] = []
    for t, p in sorted(set(points), key=lambda x: (-x[0], -x[1])):
        if not best or p > best[-1][1]:
            best.append((t, p))
    return sorted(best)


def fits(cap, tokens: int, patches: int = 0) -> bool:
    """Whether a microbatch of ``tokens`` padded tokens and ``patches`` vision patches fits
    ``cap``: a token cap (rows without images), or a frontier of (tokens, patches) points (a
    microbatch fits when one point holds at least as many of both)."""
    if isinstance(cap, int):
        return tokens <= cap and patches == 0
    return any(tokens <= t and patches <= p for t, p in cap)


def pack_padded(
    positions: Sequence[int],
    row: Callable[[int], tuple[int, tuple[int, ...]]],
    width: Callable[[tuple[int, ...]], int],
    cap,
    patches: Callable[[int], int] | None = None,
) -> list[list[int]]:
    """``positions`` into microbatches of at most ``cap`` padded tokens (a row above the cap
    alone). ``row(i)`` gives row i's ``(weight, dims)``: a microbatch pads every row to its
    largest of each dimension, so its padded tokens are the sum of its rows' weights times
    ``width(the largest of each dimension)`` (``padded_tokens``: sequences per row, times the
    longest rounded up; padding-free: each row's tokens, times ``width(()) = 1``).

    Rows with images: ``patches(i)`` gives row i's vision patches (a microbatch's add up) and
    ``cap`` is a frontier of (padded tokens, patches) points (:func:`fits`); the cutting below
    minimizes the padded tokens as before (the patches are the same for any cutting).

    The rows are sorted largest first (ties by position) and cut into consecutive runs: as few
    runs as any cutting of that order allows and, among those, the fewest padded tokens in all.
    Filling each microbatch as far as the cap allows gives the same count but can pad short
    rows to a long one's length: four rows of 1800 tokens and a dozen of 600 under a cap of
    14400 fill as 7 x 1800 + 9 x 600 = 18000 padded tokens; cut as 4 x 1800 + 12 x 600 they
    are 14400. Deterministic."""
    info = {i: row(i) for i in positions}
    extra = {i: (patches(i) if patches is not None else 0) for i in positions}
    widths: dict[tuple[int, ...], int] = {}

    def tokens(weight: int, dims: tuple[int, ...]) -> int:
        if dims not in widths:
            widths[dims] = width(dims)
        return weight * widths[dims]

    def largest(a: tuple[int, ...] | None, b: tuple[int, ...]) -> tuple[int, ...]:
        return b if a is None else tuple(map(max, a, b))

    order = sorted(positions, key=lambda i: (-tokens(*info[i]), i))
    n = len(order)
    if not n:
        return []
    dims = None
    for i in order:
        dims = largest(dims, info[i][1])
    if fits(cap, tokens(sum(info[i][0] for i in order), dims), sum(extra.values())):
        return [order]  # one microbatch holds them all
    # best[j]: (microbatches, padded tokens, start of the last run) of the best cutting of
    # order[:j]. The runs ending at j grow from the shortest; one past the cap ends the search
    # (a longer run pads at least as much).
    best: list[tuple[int, int, int]] = [(0, 0, 0)] + [(n + 1, 0, 0)] * n
    for j in range(1, n + 1):
        weight, dims, vision = 0, None, 0
        for i in range(j - 1, -1, -1):
            w, d = info[order[i]]
            weight, dims, vision = weight + w, largest(dims, d), vision + extra[order[i]]
            size = tokens(weight, dims)
            if not fits(cap, size, vision) and i < j - 1:
                break
            count, padded, _ = best[i]
            if (count + 1, padded + size) < best[j][:2]:
                best[j] = (count + 1, padded + size, i)
    out: list[list[int]] = []
    j = n
    while j > 0:
        i = best[j][2]
        out.append(order[i:j])
        j = i
    out.reverse()
    return out


def row_shape(row: Sequence[int], padding_free: bool = False) -> tuple[int, tuple[int, ...]]:
    """A row of sequence lengths as :func:`pack_padded` weighs it, the way
    :func:`padded_tokens` counts it: (its sequences, (its longest,)), or padding-free (its
    tokens, ())."""
    return (sum(row), ()) if padding_free else (len(row), (max(row),))


def pack_shares(
    plan: Sequence[Sequence[Sequence[int]]],
    row: Callable[[int], tuple[int, tuple[int, ...]]],
    width: Callable[[tuple[int, ...]], int],
    cap,
    patches: Callable[[int], int] | None = None,
) -> list[list[list[int]]]:
    """Every rank's share of ``plan`` (its microbatches' rows, taken together) repacked by
    :func:`pack_padded` under ``cap`` padded tokens: the plan decides which rank runs a row,
    the packing how its rows make microbatches. Every rank computes every rank's packing the
    same way, so the microbatch counts agree without a collective."""
    return [
        pack_padded([i for micro in share for i in micro], row, width, cap, patches)
        for share in plan
    ]
