"""Planning a Trainer's optimizer steps: the step loader (one item per optimizer step, this
rank's microbatches of it), LB-Mini with a token cap, and the derived cap (no more memory than
the unmodified trainer's microbatches). Runs in DataLoader workers when there are any: nothing
here holds a trainer."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from torch_odc import balance

from ._config import ODCConfig

__all__ = [
    "ODCStep",
    "fits",
    "frontier",
    "pack_padded",
    "padded_tokens",
    "plain_largest_microbatch",
    "plain_microbatches",
    "row_shape",
]


class ODCStep:
    """One optimizer step as this rank sees it: its collated microbatches (possibly none).

    ``counts[r]`` is rank r's number of microbatches in the step, ``indices`` this rank's
    dataset indices per microbatch, ``step``/``epoch`` where the step is in the epoch. It is not
    a mapping of model inputs (``"labels" in step`` is False), so the Trainer's loop counts and
    gathers nothing from it. With the derived cap (``ODCConfig.max_tokens_per_microbatch=None``)
    the loader hands out every rank's rows of the step (``assigned``, dataset indices) and this
    rank's features uncollated; the trainer packs and collates them in its own process
    (``_odc_materialize``), where the cap is known. Rows with images (a vision-language
    dataset) plan against ``plain_frontier``: (padded tokens, vision patches) of the unmodified
    trainer's microbatches so far that no other of them holds fewer of both (see
    ``plain_microbatches``); ``plain_tokens`` is then their largest padded tokens."""

    __slots__ = (
        "assigned",
        "cap",
        "cap_frontier",
        "collate",
        "counts",
        "epoch",
        "features",
        "indices",
        "microbatches",
        "order_position",
        "plain_frontier",
        "plain_tokens",
        "step",
        "work",
    )

    def __init__(
        self,
        microbatches,
        counts,
        indices,
        epoch,
        step,
        *,
        assigned=None,
        features=None,
        collate=None,
        plain_tokens=None,
        order_position=None,
        plain_frontier=None,
    ):
        self.microbatches, self.counts, self.indices = microbatches, counts, indices
        self.epoch, self.step = epoch, step
        self.assigned, self.features, self.collate = assigned, features, collate
        self.plain_tokens, self.order_position = plain_tokens, order_position
        self.plain_frontier = plain_frontier
        self.cap, self.cap_frontier, self.work = None, None, None

    def __contains__(self, key) -> bool:
        return False

    def __repr__(self) -> str:
        return f"ODCStep(epoch={self.epoch}, step={self.step}, microbatches per rank {self.counts})"


# -- the derived cap --------------------------------------------------------------------------
#
# A microbatch's activations grow with its padded tokens: rows x the longest sequence for the
# default collators (every row padded to the longest), the tokens themselves for padding-free
# collators. The unmodified trainer runs per_device_train_batch_size consecutive rows of the
# step's order per microbatch (accelerate's seedable sampler, the order _StepData follows), so
# the largest padded microbatch it would run in a step is known before the step. The derived
# cap keeps every ODC microbatch at or below it, less the memory ODC holds beside FSDP2's (the
# control words, and a published copy of shards where the parameters cannot live in the shard
# cache; the cache holds the parameters themselves, and the accumulators FSDP2's sharded .grad).


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


class _AutoCap:
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

    The measuring step resets the allocator's peak statistics at each of its microbatches
    (``torch.cuda.reset_peak_memory_stats``): a peak from before the first step is not kept."""

    MAX_POINTS = 32  # microbatches per rank the first step measures
    MIN_SPREAD = 1.25  # largest / smallest tokens for a slope
    ALLOWANCE = 0.15  # of ODC's bytes, for the fit's extrapolation (see above)

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
        if tokens > 0 and peak > 0 and len(self._points) < self.MAX_POINTS:
            self._points.append((tokens, max(self._forward, 0.0), peak))

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
    bytes of a microbatch over its start; see ``_AutoCap``) and how it was found, or None
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
    if len(points) >= 3 and max(tokens) >= _AutoCap.MIN_SPREAD * min(tokens):
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


class _LBMini:
    """The default planner (a class, not a closure: DataLoader workers may pickle it).

    ``costs``, when given, are the rows' modeled costs (a row of several sequences, such as a
    preference pair, costs the sum of its sequences' costs, which a nonlinear cost model does
    not give for the summed length); the token cap still applies to ``lengths``. ``cap``
    replaces the configured cap (the derived cap's step)."""

    def __init__(self, config: ODCConfig):
        self.config = config

    def __call__(self, lengths, world_size, step, costs=None, cap=None):
        c = self.config
        cap = cap if cap is not None else c.max_tokens_per_microbatch
        if costs is None:
            return balance.plan(
                lengths, world_size, cap, mode="mini", cost=c.cost, **c.cost_args
            ).microbatches
        return balance.plan(lengths, world_size, cap, mode="mini", costs=costs).microbatches


def _row_costs(
    rows: Sequence[Sequence[int]], config: ODCConfig, images: Sequence[Sequence[int]] | None = None
) -> list[float] | None:
    """Per row, the sum of its sequences' modeled costs and, for a row with images
    (``images[k]``: the vision patches of each of row k's images), of its images' costs: each
    image costs as a sequence of its patches under the same model (a vision tower attends
    within an image; under ``"tokens"`` a patch costs as a token). None when every row is one
    sequence without images (LB-Mini then costs the lengths itself)."""
    if all(len(r) == 1 for r in rows) and not (images and any(images)):
        return None
    parts = [(*r, *(images[k] if images else ())) for k, r in enumerate(rows)]
    flat = [n for r in parts for n in r]
    seq = balance.sequence_costs(flat, config.cost, **config.cost_args)
    out, at = [], 0
    for r in parts:
        out.append(math.fsum(seq[at : at + len(r)]))
        at += len(r)
    return out


def _checked_plan(plan, n: int, world: int, step: int) -> list:
    """The plan as lists, refused unless it gives every one of the n sequences to exactly one
    microbatch: a sequence left out or run twice would silently change the gradient."""
    if len(plan) != world:
        raise ValueError(
            f"torch_odc.integrations.hf: step {step}: the planner returned "
            f"{len(plan)} ranks' microbatches for a world of {world}"
        )
    seen = [0] * n
    out = []
    for rank_plan in plan:
        mbs = []
        for mb in rank_plan:
            mb = [int(i) for i in mb]
            if not mb:
                raise ValueError(f"torch_odc.integrations.hf: step {step}: an empty microbatch")
            for i in mb:
                if not 0 <= i < n:
                    raise ValueError(
                        f"torch_odc.integrations.hf: step {step}: position {i} is "
                        f"outside the step's {n} sequences"
                    )
                seen[i] += 1
            mbs.append(mb)
        out.append(mbs)
    bad = [i for i, c in enumerate(seen) if c != 1]
    if bad:
        raise ValueError(
            f"torch_odc.integrations.hf: step {step}: the plan runs sequences "
            f"{bad[:5]} {[seen[i] for i in bad[:5]]} times (must be once each)"
        )
    return out


class _StepData(torch.utils.data.Dataset):
    """The epoch's optimizer steps: item (epoch, step) is this rank's collated share of it.
    Runs in the DataLoader's workers when there are any; holds no trainer."""

    def __init__(
        self,
        dataset,
        collate,
        lengths,
        per_step,
        world,
        rank,
        planner,
        shuffle,
        seed,
        drop_last,
        costs=None,
        rows=None,
        per_device=None,
        padding_free=False,
        plain_multiple=1,
        patches=None,
    ):
        self.dataset, self.collate, self.lengths, self.costs = dataset, collate, lengths, costs
        self.per_step, self.world, self.rank, self.planner = per_step, world, rank, planner
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        # The derived cap (rows given): per row its sequences' lengths, the unmodified
        # trainer's rows per microbatch, and how the collator lays rows out.
        self.rows, self.per_device, self.padding_free = rows, per_device, padding_free
        self.plain_multiple = plain_multiple  # the user's collator's pad_to_multiple_of
        # Per row its images' vision patches in all, when the dataset has images: the derived
        # cap is then a frontier of (padded tokens, patches) points (plain_up_to).
        self.patches = patches
        self._orders: dict[int, list[int]] = {}
        self._plain_max: tuple[int | None, list] = (None, [])

    def __len__(self) -> int:  # what the Trainer reports as "Num examples"
        return len(self.lengths)

    def num_steps(self) -> int:
        n = len(self.lengths)
        return n // self.per_step if self.drop_last else math.ceil(n / self.per_step)

    def plain_up_to(self, epoch: int, step: int):
        """The padded tokens of the largest microbatch the unmodified trainer runs in this
        epoch up to and including ``step``: its peak memory so far, which the derived cap
        matches (a per-step match would be stricter than the run's peak asks). With images,
        the frontier of its microbatches so far as (padded tokens, patches) points
        (:func:`frontier`): an ODC microbatch holding no more of both than one of them."""
        if self._plain_max[0] != epoch:
            order, n = self.order(epoch), self.num_steps()
            best, prefix = ([] if self.patches is not None else 0), []
            for k in range(n):
                ids = order[k * self.per_step : (k + 1) * self.per_step]
                rows = [self.rows[i] for i in ids]
                if self.patches is not None:
                    best = frontier(
                        [
                            *best,
                            *plain_microbatches(
                                rows,
                                [self.patches[i] for i in ids],
                                self.per_device,
                                self.padding_free,
                                self.plain_multiple,
                            ),
                        ]
                    )
                else:
                    best = max(
                        best,
                        plain_largest_microbatch(
                            rows, self.per_device, self.padding_free, self.plain_multiple
                        ),
                    )
                prefix.append(best)
            self._plain_max = (epoch, prefix)
        return self._plain_max[1][step]

    def order(self, epoch: int) -> list[int]:
        """The epoch's sequence order, the same on every rank (a generator seeded from the
        seed and the epoch, like accelerate's seedable sampler)."""
        if epoch not in self._orders:
            n = len(self.lengths)
            if self.shuffle:
                gen = torch.Generator()
                gen.manual_seed(self.seed + epoch)
                self._orders = {epoch: torch.randperm(n, generator=gen).tolist()}
            else:
                self._orders = {epoch: list(range(n))}
        return self._orders[epoch]

    def __getitem__(self, key) -> ODCStep:
        epoch, step = key
        ids = self.order(epoch)[step * self.per_step : (step + 1) * self.per_step]
        lengths = [self.lengths[i] for i in ids]
        if self.rows is not None:  # the derived cap: LB-Mini assigns rows to ranks here
            plain = self.plain_up_to(epoch, step)
            points = None
            if self.patches is not None:  # LB-Mini's own packing: tokens and patches as one
                points, plain = plain, max(t for t, _ in plain)
                cap = max(t + p for t, p in points)
            else:
                cap = plain
            costs = [self.costs[i] for i in ids] if self.costs is not None else None
            plan = _checked_plan(
                self.planner(lengths, self.world, step, costs=costs, cap=cap),
                len(ids),
                self.world,
                step,
            )
            assigned = [[ids[j] for mb in p for j in mb] for p in plan]
            features = {i: self.dataset[i] for i in assigned[self.rank]}
            return ODCStep(
                None,
                None,
                None,
                epoch,
                step,
                assigned=assigned,
                features=features,
                collate=self.collate,
                plain_tokens=plain,
                order_position={i: j for j, i in enumerate(ids)},
                plain_frontier=points,
            )
        if self.costs is not None and isinstance(self.planner, _LBMini):
            plan = self.planner(lengths, self.world, step, costs=[self.costs[i] for i in ids])
        else:
            plan = self.planner(lengths, self.world, step)
        plan = _checked_plan(plan, len(ids), self.world, step)
        mine = [[ids[j] for j in mb] for mb in plan[self.rank]]
        batches = [self.collate([self.dataset[i] for i in mb]) for mb in mine]
        return ODCStep(batches, [len(p) for p in plan], mine, epoch, step)


class _StepKeys(torch.utils.data.Sampler):
    """The loader's batch sampler: one batch per optimizer step, holding the step's one key
    (epoch, step). Being a batch sampler is what lets the Trainer resume mid-epoch: its
    ``skip_first_batches`` wraps it in a sampler that drops the first k batches (keys only: the
    skipped steps are neither planned nor collated) and reaches ``set_epoch`` through it. The
    steps that follow are planned exactly as in the uninterrupted run: a step's plan is a
    function of (epoch, step) and the dataset only."""

    def __init__(self, steps: _StepData):
        self.steps, self.epoch = steps, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps.num_steps()

    def __iter__(self):
        return iter([[(self.epoch, s)] for s in range(len(self))])


class _StepLoader(torch.utils.data.DataLoader):
    """A DataLoader of ODCSteps; the Trainer calls set_epoch on it before every epoch."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def _only(items):
    """The collate function of the step loader: a batch is one ODCStep."""
    (step,) = items
    return step


def _sequence_lengths(dataset, key: str) -> list[int]:
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset) and key in dataset.column_names:
            return [len(x) for x in dataset[key]]
    except ImportError:
        pass
    return [len(dataset[i][key]) for i in range(len(dataset))]
