"""Load balancing for on-demand training: the LB-Mini and LB-Micro planners.

A minibatch of variable-length sequences is split over ``world_size`` ranks, and each rank's
share into microbatches of at most ``max_tokens_per_microbatch`` tokens. The two modes differ in
when ranks synchronize:

* ``"mini"`` (LB-Mini, what on-demand communication allows): ranks meet once per minibatch, so
  only each rank's total cost matters; ranks may run different numbers of microbatches.
  ``makespan`` is the largest rank total.
* ``"micro"`` (LB-Micro, what collective FSDP needs): ranks meet after every microbatch, so all
  ranks run the same number of microbatches and ``makespan`` is the sum over microbatch index of
  the most expensive rank at that index.

:func:`exchange_rows` (``exchange.py``) then moves a step's rows to the ranks a plan names.

The planning runs in C++ (``csrc/balance/``: ``lb_mini.cpp``, ``lb_micro.cpp`` and the shared
``packing.cpp``); see ``docs/balance.md`` for the algorithms, the cost model and measured
quality.
"""

from __future__ import annotations

import array
import math
import numbers
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from torch_odc import _C
from torch_odc.balance.exchange import RowExchange, exchange_rows, keep_in_place

__all__ = [
    "BalancedBatchSampler",
    "OversizedSequenceWarning",
    "Plan",
    "RankPlan",
    "RowExchange",
    "TimeCost",
    "exchange_rows",
    "flops_cost",
    "keep_in_place",
    "plan",
    "plan_for_rank",
    "sequence_costs",
]

CostSpec = str | Callable[[int], float]

_MODES = ("mini", "micro")
_FLOPS_DEFAULTS = {"num_params": 8e9, "num_layers": 32, "hidden_size": 4096, "training": True}


class OversizedSequenceWarning(UserWarning):
    """A sequence is longer than ``max_tokens_per_microbatch``; it gets a microbatch of its own."""


@dataclass(frozen=True)
class Plan:
    """The plan for one minibatch.

    Attributes:
        microbatches: ``microbatches[r]`` is rank r's list of microbatches, each a list of
            indices into the planned ``lengths``, costliest microbatch first.
        rank_costs: total modeled cost of each rank.
        makespan: modeled minibatch time under the mode's synchronization (see module doc).
        lower_bound: ``max(sum(costs) / world_size, max(costs))``; no plan in either mode beats it.
        mode: ``"mini"`` or ``"micro"``.
        oversized: indices of sequences longer than the token cap (each alone in a microbatch).
    """

    microbatches: list
    rank_costs: list
    makespan: float
    lower_bound: float
    mode: str
    oversized: tuple = ()

    @property
    def ratio(self) -> float:
        """``makespan / lower_bound``: 1.0 is a perfect balance."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def world_size(self) -> int:
        return len(self.microbatches)


def flops_cost(
    length: int,
    *,
    num_params: float = 8e9,
    num_layers: int = 32,
    hidden_size: int = 4096,
    training: bool = True,
) -> float:
    """Modeled FLOPs of one sequence of ``length`` tokens through a dense decoder.

    ``m * (num_params * L + num_layers * hidden_size * L**2)`` with ``m = 6`` for training
    (forward 2, backward 4) and ``m = 2`` for a forward pass only. The first term is the dense
    matmuls (2 FLOPs per parameter per token forward); the second is causal self-attention, whose
    score and value matmuls cost ``2 * hidden_size * L**2`` per layer forward (``4 * d * L**2``
    halved by the causal mask). ``num_params`` should exclude embeddings. The defaults describe an
    8B Llama-like model. See docs/balance.md for the derivation.
    """
    m = 6.0 if training else 2.0
    x = float(length)
    return m * (num_params * x + num_layers * hidden_size * x * x)


@dataclass(frozen=True)
class TimeCost:
    """Modeled seconds of one training sequence: a cost for :func:`plan` fitted to timings.

    ``floor_s + 6 N L / dense_flops_per_s + 6 num_layers hidden_size L**2 /
    attention_flops_per_s`` (the two terms of :func:`flops_cost` at their own measured rates).
    The floor is what every microbatch pays whatever its length: issuing every layer's forward,
    recompute and backward from the host, and fixed device work. On 4 H200 with a 1B model it
    was ~170 ms (docs/benchmarks.md), as much as 5K tokens of compute; a FLOPs-only cost then
    hands one rank many short microbatches and makes LB-Mini slower than LB-Micro. With
    ``max_tokens_per_microbatch > 1`` (packed microbatches) a sequence pays its token share of
    the floor. Fit one with :meth:`fit`.
    """

    floor_s: float
    dense_flops_per_s: float
    attention_flops_per_s: float
    num_params: float
    num_layers: int
    hidden_size: int
    max_tokens_per_microbatch: int = 1

    def __post_init__(self):
        for name in (
            "dense_flops_per_s",
            "attention_flops_per_s",
            "num_params",
            "num_layers",
            "hidden_size",
            "max_tokens_per_microbatch",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"TimeCost.{name} must be a number, got {v!r}")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"TimeCost.{name} must be positive and finite, got {v!r}")
        if not (
            isinstance(self.floor_s, numbers.Real)
            and math.isfinite(self.floor_s)
            and self.floor_s >= 0
        ):
            raise ValueError(f"TimeCost.floor_s must be finite and >= 0, got {self.floor_s!r}")

    def _terms(self, length: float) -> tuple[float, float]:
        return (
            6.0 * self.num_params * length,
            6.0 * self.num_layers * self.hidden_size * length * length,
        )

    def __call__(self, length: int) -> float:
        dense, attention = self._terms(float(length))
        share = min(1.0, length / self.max_tokens_per_microbatch)
        return (
            self.floor_s * share
            + dense / self.dense_flops_per_s
            + attention / self.attention_flops_per_s
        )

    @classmethod
    def fit(
        cls,
        samples,
        *,
        num_params: float,
        num_layers: int,
        hidden_size: int,
        max_tokens_per_microbatch: int = 1,
    ) -> TimeCost:
        """Least squares in relative error (short sequences count as much as long ones) over
        ``samples``: ``(length, seconds)`` of sequences each timed alone in a microbatch, from
        issue to device completion, at lengths the process has not run before (first use of a
        shape costs extra host time, and real data keeps bringing new lengths). With fewer than
        3 samples or a degenerate fit, one rate for both terms."""
        pts = [(float(n), float(t)) for n, t in samples]
        if not pts or any(n < 1 or not (math.isfinite(t) and t > 0) for n, t in pts):
            raise ValueError("samples must be (length >= 1, seconds > 0) pairs, at least one")
        probe = cls(0.0, 1.0, 1.0, num_params, num_layers, hidden_size)
        rows = [(1.0, *probe._terms(n), t) for n, t in pts]

        def solve(columns):  # minimise sum((row . x) / t - 1)^2 over the given columns
            a = [[r[c] / r[3] for c in columns] for r in rows]
            k = len(columns)
            m = [
                [sum(x[i] * x[j] for x in a) for j in range(k)] + [sum(x[i] for x in a)]
                for i in range(k)
            ]
            for i in range(k):  # Gaussian elimination with partial pivoting
                p = max(range(i, k), key=lambda r: abs(m[r][i]))
                if abs(m[p][i]) < 1e-300:
                    return None
                m[i], m[p] = m[p], m[i]
                for r in range(k):
                    if r != i:
                        f = m[r][i] / m[i][i]
                        m[r] = [x - f * y for x, y in zip(m[r], m[i])]
            return [m[i][k] / m[i][i] for i in range(k)]

        x = solve((0, 1, 2)) if len(rows) >= 3 else None
        if x is not None and x[1] > 0 and x[2] > 0:
            floor, per_dense, per_attention = x
        else:  # one rate: cost = floor + (dense + attention) / rate
            rows = [(1.0, r[1] + r[2], 0.0, r[3]) for r in rows]
            x = solve((0, 1)) if len(rows) >= 2 else None
            if x is not None and x[1] > 0:
                floor, per_dense = x
            else:
                floor, per_dense = 0.0, max(r[3] / r[1] for r in rows)
            per_attention = per_dense
        return cls(
            max(0.0, floor),
            1.0 / per_dense,
            1.0 / per_attention,
            num_params,
            num_layers,
            hidden_size,
            max_tokens_per_microbatch,
        )


def _check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _check_mode(mode) -> str:
    if mode not in _MODES:
        raise ValueError(f"mode must be 'mini' or 'micro', got {mode!r}")
    return mode


def _lengths_array(lengths) -> array.array:
    """Validates ``lengths`` and returns them as a contiguous int64 array."""
    if hasattr(lengths, "tolist") and not isinstance(lengths, (list, tuple)):
        # numpy arrays and torch tensors: one conversion instead of per-element attribute calls.
        ndim = getattr(lengths, "ndim", 1)
        if ndim != 1:
            raise ValueError(f"lengths must be one-dimensional, got {ndim} dimensions")
        dtype = str(getattr(lengths, "dtype", ""))
        if "float" in dtype or "complex" in dtype or "bool" in dtype:
            raise TypeError(f"lengths must be integers, got dtype {dtype}")
        lengths = lengths.tolist()
    try:
        values = list(lengths)
    except TypeError:
        raise TypeError(
            f"lengths must be a sequence of integers, got {type(lengths).__name__}"
        ) from None
    if not values:
        raise ValueError("lengths must not be empty")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise TypeError(f"lengths must be integers, got {v!r} at index {i}")
        if v < 1:
            raise ValueError(f"lengths must be positive, got {v} at index {i}")
    try:
        return array.array("q", values)
    except OverflowError:
        raise ValueError("lengths must fit in int64") from None


def _cost_array(lengths: array.array, cost: CostSpec, cost_args: dict) -> array.array:
    """One modeled cost per sequence, as a float64 array."""
    if callable(cost):
        if cost_args:
            raise TypeError(f"cost_args {sorted(cost_args)} apply to cost='flops' only")
        fn = cost
    elif cost == "tokens":
        if cost_args:
            raise TypeError(f"cost_args {sorted(cost_args)} apply to cost='flops' only")
        return array.array("d", lengths)
    elif cost == "flops":
        unknown = set(cost_args) - set(_FLOPS_DEFAULTS)
        if unknown:
            raise TypeError(
                f"unknown cost_args {sorted(unknown)} for cost='flops'; "
                f"expected some of {sorted(_FLOPS_DEFAULTS)}"
            )
        args = {**_FLOPS_DEFAULTS, **cost_args}
        for name in ("num_params", "num_layers", "hidden_size"):
            v = args[name]
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"{name} must be a number, got {v!r}")
            if not v > 0:
                raise ValueError(f"{name} must be positive, got {v!r}")
        m = 6.0 if args["training"] else 2.0
        a = m * float(args["num_params"])
        b = m * float(args["num_layers"]) * float(args["hidden_size"])
        return array.array("d", [(a + b * x) * x for x in lengths])
    else:
        raise ValueError(f"cost must be 'tokens', 'flops' or a callable, got {cost!r}")
    # Lengths repeat a lot in practice; call the user's function once per distinct length.
    memo: dict = {}
    out = array.array("d", bytes(8 * len(lengths)))
    for i, x in enumerate(lengths):
        c = memo.get(x)
        if c is None:
            c = fn(x)
            if isinstance(c, bool) or not isinstance(c, numbers.Real):
                raise TypeError(f"cost({x}) must return a real number, got {c!r}")
            c = float(c)
            if not math.isfinite(c) or c < 0:
                raise ValueError(f"cost({x}) must be finite and non-negative, got {c}")
            memo[x] = c
        out[i] = c
    return out


def _warn_oversized(count: int, cap: int, stacklevel: int) -> None:
    warnings.warn(
        f"{count} sequence(s) longer than max_tokens_per_microbatch={cap}; each is placed alone "
        f"in its own microbatch",
        OversizedSequenceWarning,
        stacklevel=stacklevel + 1,
    )


def _plan_arrays(
    lengths: array.array, costs: array.array, world_size: int, cap: int, mode: str
) -> Plan:
    microbatches, rank_costs, makespan, lower_bound, oversized = _C._plan_balance(
        lengths, costs, world_size, cap, mode == "micro"
    )
    return Plan(microbatches, rank_costs, makespan, lower_bound, mode, tuple(oversized))


def sequence_costs(lengths: Sequence[int], cost: CostSpec = "tokens", **cost_args) -> list:
    """The modeled cost of each sequence of ``lengths`` under ``cost`` (as in :func:`plan`).
    A row of several sequences (a preference pair) costs the sum of its sequences' costs, which
    a nonlinear model does not give for the summed length: sum these and pass them to
    :func:`plan` as ``costs``."""
    return list(_cost_array(_lengths_array(lengths), cost, cost_args))


def plan(
    lengths: Sequence[int],
    world_size: int,
    max_tokens_per_microbatch: int,
    mode: str = "mini",
    cost: CostSpec = "tokens",
    *,
    costs: Sequence[float] | None = None,
    **cost_args,
) -> Plan:
    """Plans one minibatch of sequences with the given token ``lengths`` over ``world_size`` ranks.

    Args:
        lengths: token count of each sequence (positive integers; list, tuple, numpy array or
            tensor).
        world_size: number of ranks.
        max_tokens_per_microbatch: token cap of a microbatch. A longer sequence gets a microbatch
            of its own and an :class:`OversizedSequenceWarning` is issued, except with a cap of
            1, which asks for one sequence per microbatch.
        mode: ``"mini"`` (balance each rank's total) or ``"micro"`` (same number of microbatches
            on every rank, each microbatch index balanced across ranks).
        cost: ``"tokens"`` (cost = L), ``"flops"`` (see :func:`flops_cost`; ``cost_args`` may set
            ``num_params``, ``num_layers``, ``hidden_size``, ``training``) or a callable
            ``L -> cost`` returning a finite non-negative number.
        costs: instead of ``cost``, each item's modeled cost (finite, non-negative), e.g. a
            row of several sequences costed by :func:`sequence_costs`; the token cap still
            applies to ``lengths``.

    Returns:
        A :class:`Plan`. Every index appears exactly once; every rank gets at least one sequence
        when there are at least ``world_size`` of them. In ``"mini"`` mode a rank without
        sequences has no microbatches; in ``"micro"`` mode every rank has the same number of
        microbatches and one is empty only when there are fewer sequences than microbatches in
        total. The result depends only on the inputs.

    Raises:
        ValueError: empty ``lengths``, a length below 1, ``world_size`` or
            ``max_tokens_per_microbatch`` below 1, an unknown mode or cost name, or a negative or
            non-finite cost.
        TypeError: a length, ``world_size`` or cap that is not an integer, a cost callable that
            does not return a number, or unknown ``cost_args``.
    """
    lens = _lengths_array(lengths)
    world_size = _check_positive_int(world_size, "world_size")
    cap = _check_positive_int(max_tokens_per_microbatch, "max_tokens_per_microbatch")
    mode = _check_mode(mode)
    if costs is None:
        costs = _cost_array(lens, cost, cost_args)
    else:
        if cost != "tokens" or cost_args:
            raise TypeError("plan: pass either costs= or a cost model (cost=, cost_args), not both")
        try:
            costs = array.array("d", [float(c) for c in costs])
        except (TypeError, ValueError):
            raise TypeError("costs must be real numbers") from None
        if len(costs) != len(lens):
            raise ValueError(f"{len(costs)} costs for {len(lens)} lengths")
        if not all(math.isfinite(c) and c >= 0 for c in costs):
            raise ValueError("costs must be finite and non-negative")
    result = _plan_arrays(lens, costs, world_size, cap, mode)
    if result.oversized and cap > 1:  # a cap of 1: one sequence per microbatch, on purpose
        _warn_oversized(len(result.oversized), cap, stacklevel=2)
    return result


class BalancedBatchSampler:
    """Yields one rank's balanced microbatches for each minibatch of a dataset.

    Each epoch the dataset indices are shuffled with a generator seeded from ``(seed, epoch)``
    (never Python's salted ``hash``), cut into minibatches of ``sequences_per_minibatch``
    sequences, and each minibatch is planned with :func:`plan`. Every rank builds the same
    sampler with its own ``rank`` and computes the same global plan, so no communication is
    needed; iterating yields, per step, this rank's list of microbatches, each a list of dataset
    indices.

    Args:
        lengths: token count of every sequence in the dataset.
        world_size: number of ranks.
        rank: this rank, ``0 <= rank < world_size``.
        sequences_per_minibatch: number of sequences in one minibatch, over all ranks together
            (the global batch size in sequences, not a per-rank count).
        max_tokens_per_microbatch: token cap of a microbatch.
        mode: ``"mini"`` or ``"micro"``, as in :func:`plan`.
        seed: shuffling seed; must be the same on every rank.
        shuffle: shuffle the dataset each epoch (otherwise minibatches follow index order).
        drop_last: drop the final minibatch when it has fewer than ``sequences_per_minibatch``
            sequences. When kept, a small last minibatch can leave a rank with no sequence (an
            empty list in ``"mini"``, empty microbatches in ``"micro"``); that rank must still take
            part in the step's gradient synchronization.
        cost, cost_args: the cost model, as in :func:`plan`.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        world_size: int,
        rank: int,
        sequences_per_minibatch: int,
        max_tokens_per_microbatch: int,
        mode: str = "mini",
        seed: int = 0,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        cost: CostSpec = "tokens",
        **cost_args,
    ) -> None:
        self._lengths = _lengths_array(lengths)
        self.world_size = _check_positive_int(world_size, "world_size")
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
            raise TypeError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        self.rank = int(rank)
        self.sequences_per_minibatch = _check_positive_int(
            sequences_per_minibatch, "sequences_per_minibatch"
        )
        self.max_tokens_per_microbatch = _check_positive_int(
            max_tokens_per_microbatch, "max_tokens_per_microbatch"
        )
        self.mode = _check_mode(mode)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self._costs = _cost_array(self._lengths, cost, cost_args)
        self.epoch = 0
        self.last_plan: Plan | None = None
        oversized = sum(1 for x in self._lengths if x > self.max_tokens_per_microbatch)
        if oversized and self.max_tokens_per_microbatch > 1:
            _warn_oversized(oversized, self.max_tokens_per_microbatch, stacklevel=2)

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch that seeds the shuffle, like ``DistributedSampler.set_epoch``."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        n, b = len(self._lengths), self.sequences_per_minibatch
        return n // b if self.drop_last else -(-n // b)

    def minibatches(self) -> list[list[int]]:
        """This epoch's minibatches as lists of dataset indices (identical on every rank)."""
        order = list(range(len(self._lengths)))
        if self.shuffle:
            # A str seed goes through SHA-512, so the stream is the same in every process.
            random.Random(f"torch_odc.balance:{self.seed}:{self.epoch}").shuffle(order)
        b = self.sequences_per_minibatch
        return [order[s : s + b] for s in range(0, len(self) * b, b)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        for indices in self.minibatches():
            lens = array.array("q", (self._lengths[i] for i in indices))
            costs = array.array("d", (self._costs[i] for i in indices))
            local = _plan_arrays(
                lens, costs, self.world_size, self.max_tokens_per_microbatch, self.mode
            )
            global_mbs = [[[indices[i] for i in mb] for mb in rank] for rank in local.microbatches]
            self.last_plan = Plan(
                global_mbs,
                local.rank_costs,
                local.makespan,
                local.lower_bound,
                local.mode,
                tuple(indices[i] for i in local.oversized),
            )
            yield global_mbs[self.rank]


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a planned minibatch: what a training loop needs per minibatch.

    Attributes:
        microbatches: this rank's microbatches, each a list of indices into the planned
            ``lengths`` (``plan.microbatches[rank]``); empty when this rank has no sequence.
        num_tokens: the minibatch's loss tokens over all ranks: ``sum(loss_tokens)`` (by default
            ``sum(lengths)``). The denominator of a token-mean loss; identical on every rank.
        rank: the rank this share is for.
        plan: the whole :class:`Plan` (identical on every rank).
    """

    microbatches: list
    num_tokens: int
    rank: int
    plan: Plan

    @property
    def indices(self) -> list:
        """This rank's sequences, microbatch by microbatch."""
        return [i for mb in self.microbatches for i in mb]

    def loss_scale(self, gradient_divide_factor: float | None = None) -> float:
        """The factor for a microbatch's *summed* token loss that makes the reduced gradient the
        gradient of the token mean over the whole minibatch (``num_tokens``).

        FSDP2 divides the summed gradient by its gradient divide factor: the shard group size by
        default (``ReduceOp.AVG``, pass None), or what ``set_gradient_divide_factor`` set (pass
        it; torchtitan sets 1.0). ODC applies the same division. 0.0 when ``num_tokens`` is 0.
        """
        factor = self.plan.world_size if gradient_divide_factor is None else gradient_divide_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor > 0:
            raise ValueError(f"gradient_divide_factor must be a positive number, got {factor!r}")
        return float(factor) / self.num_tokens if self.num_tokens else 0.0


def plan_for_rank(
    lengths: Sequence[int],
    world_size: int,
    rank: int,
    max_tokens_per_microbatch: int,
    mode: str = "mini",
    cost: CostSpec = "tokens",
    *,
    loss_tokens: Sequence[int] | None = None,
    **cost_args,
) -> RankPlan:
    """Plans one minibatch and returns this rank's microbatches and the global token count.

    Every rank calls it with the same arguments but its own ``rank``: the plan depends only on
    the inputs, so every rank computes the same global plan and the same ``num_tokens`` with no
    communication. That needs the minibatch's lengths (and ``loss_tokens``) of *all* ranks on
    every rank, as a sampler that draws the minibatch from a shared seed has them. A rank that
    only knows its own sequences must gather the lengths first (one
    ``all_gather_object`` per minibatch) and then move sequences to the ranks the plan names.

    Args:
        lengths, world_size, max_tokens_per_microbatch, mode, cost, cost_args: as in
            :func:`plan`.
        rank: this rank, ``0 <= rank < world_size``.
        loss_tokens: per sequence, the number of tokens its loss is summed over (labels not
            ignored, e.g. ``length - 1`` for next-token prediction, or the response tokens in
            RL); defaults to ``lengths``. Only ``num_tokens`` uses it.

    Returns:
        A :class:`RankPlan`. Scale each microbatch's summed token loss by
        :meth:`RankPlan.loss_scale` and the gradients after ``torch_odc.minibatch_barrier()``
        are those of the token-mean loss over the whole minibatch, however the sequences were
        spread over ranks and microbatches.
    """
    lens = _lengths_array(lengths)
    world_size = _check_positive_int(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"rank must be an integer, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    cap = _check_positive_int(max_tokens_per_microbatch, "max_tokens_per_microbatch")
    mode = _check_mode(mode)
    if loss_tokens is None:
        num_tokens = sum(lens)
    else:
        counts = loss_tokens.tolist() if hasattr(loss_tokens, "tolist") else list(loss_tokens)
        if len(counts) != len(lens):
            raise ValueError(f"loss_tokens has {len(counts)} entries for {len(lens)} sequences")
        for i, v in enumerate(counts):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"loss_tokens must be integers, got {v!r} at index {i}")
            if v < 0:
                raise ValueError(f"loss_tokens must be >= 0, got {v} at index {i}")
        num_tokens = int(sum(counts))
    costs = _cost_array(lens, cost, cost_args)
    result = _plan_arrays(lens, costs, world_size, cap, mode)
    if result.oversized and cap > 1:
        _warn_oversized(len(result.oversized), cap, stacklevel=2)
    return RankPlan(result.microbatches[rank], num_tokens, int(rank), result)
