"""ODC inside the Hugging Face ``Trainer`` and TRL's ``SFTTrainer``: LB-Mini plans per optimizer
step, any number of microbatches per rank (zero included), one barrier per step.

    import torch_odc
    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    dist.init_process_group("odc")          # before TrainingArguments / SFTConfig
    args = SFTConfig(..., fsdp=True, fsdp_config={"version": 2})
    trainer = odc_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds,
                                      odc=ODCConfig(max_tokens_per_microbatch=8192))
    trainer.train()

What the returned subclass changes in the Trainer (docs/integrations.md has the whole story):

* **One optimizer step = one item of the training dataloader**: the step's sequences are the
  next ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` of the epoch's
  order (the Trainer's global batch; shuffled from ``data_seed``/``seed`` and the epoch, the same
  on every rank). LB-Mini (:func:`torch_odc.balance.plan`) splits them over ranks by their lengths
  and packs each rank's share into microbatches of at most ``max_tokens_per_microbatch`` tokens,
  which the trainer's own collator collates. The Trainer's loop then runs with
  ``gradient_accumulation_steps = 1`` on a copy of ``args``.
* ``training_step`` runs this rank's microbatches (any number, zero included) through the
  trainer's own ``training_step`` with ``num_items_in_batch`` = the step's label tokens over all
  ranks (one all-reduce of a CPU integer per step, before the first forward), then calls
  :func:`torch_odc.minibatch_barrier`: the Trainer's clipping and grad norm, which run right
  after ``training_step`` returns, see the complete gradient.
* Metrics the trainer would gather per microbatch (TRL's entropy, token accuracy and token
  count; ``include_num_input_tokens_seen``) are summed locally and all-reduced once per step,
  after the barrier.
* ``torch_odc.attach`` at ``on_train_begin`` (after accelerate prepared the model with FSDP2),
  ``detach`` at ``on_train_end``.
* On CPU ranks accelerate turns the job into ``MULTI_CPU`` and drops its FSDP plugin (it would
  wrap the model in DDP): the subclass then shards the model itself with accelerate's own
  ``fsdp2_prepare_model`` and the plugin built from ``args.fsdp_config``, before the optimizer is
  created, and marks it prepared so that accelerate does not wrap it again.
* Checkpoints are the Trainer's own (``save_strategy``, ``resume_from_checkpoint``, FULL or
  SHARDED ``state_dict_type``): its checkpoint methods call accelerate's FSDP2 checkpoint
  functions with accelerate's plugin, or on CPU ranks with the module's; the step loader skips
  trained steps on resume (one key per step) and each step checks its position; state the
  adapter carries across steps (TRL's token count) goes into ``trainer_state.json``. A save
  inside an optimizer step (before its barrier) is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import torch_odc
from torch_odc import balance

from . import _compat

__all__ = ["ODCConfig", "ODCStep", "ODCTrainerMixin"]

IGNORE_INDEX = -100

# planner(lengths, world_size, step) -> plan[rank] = list of microbatches, each a list of
# positions into `lengths`; every position exactly once over all ranks.
Planner = Callable[[Sequence[int], int, int], Sequence[Sequence[Sequence[int]]]]


@dataclasses.dataclass
class ODCConfig:
    """How the module plans each optimizer step.

    Attributes:
        max_tokens_per_microbatch: token cap of one microbatch (unpadded tokens; the collator
            pads each microbatch to its longest sequence). A longer sequence gets a microbatch
            of its own, with a warning. ``None`` (the default): the cap of each step follows
            from the unmodified trainer's own microbatches (``per_device_train_batch_size``
            rows, padded), so that ODC needs no more memory than the run it replaces (see
            ``_AutoCap``): the step's microbatches hold at most as many padded tokens as the
            largest microbatch the unmodified trainer would have run so far, less ODC's own
            memory (its published shard cache) at the activation bytes per token measured in
            the first step.
        cost: LB-Mini's cost model: ``"tokens"``, ``"flops"`` or a callable length -> cost,
            e.g. a fitted :class:`torch_odc.balance.TimeCost` (docs/balance.md).
        cost_args: keyword arguments of the cost model (``"flops"``: ``num_params``, ...).
        planner: replaces LB-Mini: ``planner(lengths, world_size, step)`` returns, per rank,
            its microbatches as lists of positions into ``lengths``; every rank must return the
            same plan. Checked to cover every sequence exactly once. Needs an explicit
            ``max_tokens_per_microbatch`` only if the planner reads it.
        eager_publish: passed to :func:`torch_odc.attach`.
    """

    max_tokens_per_microbatch: int | None = None
    cost: Any = "tokens"
    cost_args: dict = dataclasses.field(default_factory=dict)
    planner: Planner | None = None
    eager_publish: bool = True

    def __post_init__(self):
        cap = self.max_tokens_per_microbatch
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError("ODCConfig.max_tokens_per_microbatch must be a positive int or None "
                             f"(derived from the trainer's own microbatches), got {cap!r}")

    @property
    def auto_cap(self) -> bool:
        """Whether each step's cap is derived (no explicit cap, LB-Mini plans)."""
        return self.max_tokens_per_microbatch is None and self.planner is None


class ODCStep:
    """One optimizer step as this rank sees it: its collated microbatches (possibly none).

    ``counts[r]`` is rank r's number of microbatches in the step, ``indices`` this rank's
    dataset indices per microbatch, ``step``/``epoch`` where the step is in the epoch. It is not
    a mapping of model inputs (``"labels" in step`` is False), so the Trainer's loop counts and
    gathers nothing from it. With the derived cap (``ODCConfig.max_tokens_per_microbatch=None``)
    the loader hands out every rank's rows of the step (``assigned``, dataset indices) and this
    rank's features uncollated; the trainer packs and collates them in its own process
    (``_odc_materialize``), where the cap is known."""

    __slots__ = ("assigned", "cap", "collate", "counts", "epoch", "features", "indices",
                 "microbatches", "order_position", "plain_tokens", "step", "work")

    def __init__(self, microbatches, counts, indices, epoch, step, *, assigned=None,
                 features=None, collate=None, plain_tokens=None, order_position=None):
        self.microbatches, self.counts, self.indices = microbatches, counts, indices
        self.epoch, self.step = epoch, step
        self.assigned, self.features, self.collate = assigned, features, collate
        self.plain_tokens, self.order_position = plain_tokens, order_position
        self.cap, self.work = None, None

    def __contains__(self, key) -> bool:
        return False

    def __repr__(self) -> str:
        return (f"ODCStep(epoch={self.epoch}, step={self.step}, microbatches per rank "
                f"{self.counts})")


# -- the derived cap --------------------------------------------------------------------------
#
# A microbatch's activations grow with its padded tokens: rows x the longest sequence for the
# default collators (every row padded to the longest), the tokens themselves for padding-free
# collators. The unmodified trainer runs per_device_train_batch_size consecutive rows of the
# step's order per microbatch (accelerate's seedable sampler, the order _StepData follows), so
# the largest padded microbatch it would run in a step is known before the step. The derived
# cap keeps every ODC microbatch at or below it, less the memory ODC holds beside FSDP2's (the
# published shard cache and control words; its accumulators replace FSDP2's sharded .grad).


def padded_tokens(rows: Sequence[Sequence[int]], padding_free: bool = False) -> int:
    """The tokens of one microbatch of ``rows`` (each a tuple of its sequences' lengths: one
    for a language-modeling row, two for a preference pair) once collated: every sequence
    padded to the longest, or concatenated when ``padding_free``."""
    if not rows:
        return 0
    if padding_free:
        return sum(sum(r) for r in rows)
    return sum(len(r) for r in rows) * max(max(r) for r in rows)


def plain_largest_microbatch(rows: Sequence[Sequence[int]], per_device: int,
                             padding_free: bool = False) -> int:
    """The padded tokens of the largest microbatch the unmodified trainer runs of ``rows`` (a
    step's rows in order): consecutive groups of ``per_device`` rows."""
    return max(padded_tokens(rows[i:i + per_device], padding_free)
               for i in range(0, len(rows), per_device))


def pack_padded(positions: Sequence[int], size: Callable[[list[int]], int], cap: int
                ) -> list[list[int]]:
    """``positions`` into microbatches of at most ``cap`` padded tokens (``size(microbatch)``),
    largest rows first, each microbatch filled in that order until the next row would pass the
    cap; a row above the cap alone. Sorted by size, rows of similar length share a microbatch,
    which keeps the padding small. Deterministic (ties by position)."""
    order = sorted(positions, key=lambda i: (-size([i]), i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and size([*cur, i]) > cap:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


class _AutoCap:
    """Each step's token cap when none is given (GPU ranks measure, CPU ranks do not).

    ``cap(plain)``: the step's cap from ``plain``, the padded tokens of the largest microbatch
    the unmodified trainer would have run so far in the epoch (its peak memory so far). Until the activation bytes per token are known, half
    of ``plain`` (the first step measures them); then ``plain`` less ODC's extra bytes (shard
    cache and control words) in tokens. On CPU ranks ``plain`` itself.

    The measurement: per microbatch of the first step, the allocator's growth from the
    microbatch's start to the end of its forward (the activations kept for the backward,
    logits and loss included) per padded token, taken from the largest microbatch; the ranks
    agree on the smallest (one all-reduce, so every rank derives the same cap and the same
    plan). The backward's peak per token is higher than what the forward keeps, so the
    correction in tokens errs on the side of less memory."""

    def __init__(self):
        self.bytes_per_token: float | None = None
        self.extra_bytes = 0
        self._sample: tuple[int, float] | None = None  # (padded tokens, bytes/token)
        self._start: tuple[int, int] | None = None

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
        return {"bytes_per_token": self.bytes_per_token, "odc_extra_bytes": self.extra_bytes}

    @property
    def measuring(self) -> bool:
        return self.bytes_per_token is None and self.measures()

    def start(self, tokens: int) -> None:
        self._start = (tokens, torch.cuda.memory_allocated())

    def after_forward(self, *_args) -> None:
        if self._start is None:
            return
        tokens, before = self._start
        self._start = None
        grown = torch.cuda.memory_allocated() - before
        if tokens > 0 and grown > 0 and (self._sample is None or tokens > self._sample[0]):
            self._sample = (tokens, grown / tokens)

    def finish_step(self, handle) -> None:
        """After the first measured step's barrier (every rank): agree on the bytes per token
        and read ODC's extra bytes from the handle."""
        if not self.measuring:
            return
        mine = self._sample[1] if self._sample is not None else math.inf
        memory = handle.stats().get("memory", {}) if handle is not None else {}
        extra = memory.get("published_cache_bytes", 0) + memory.get("control_bytes", 0)
        t = torch.tensor([-mine, float(extra)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if math.isfinite(-float(t[0])):
            self.bytes_per_token = -float(t[0])
            self.extra_bytes = int(t[1])
        self._sample = None


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
            return balance.plan(lengths, world_size, cap, mode="mini",
                                cost=c.cost, **c.cost_args).microbatches
        return balance.plan(lengths, world_size, cap, mode="mini", costs=costs).microbatches


def _row_costs(rows: Sequence[Sequence[int]], config: ODCConfig) -> list[float] | None:
    """Per row, the sum of its sequences' modeled costs; None when every row is one sequence
    (LB-Mini then costs the lengths itself)."""
    if all(len(r) == 1 for r in rows):
        return None
    flat = [n for r in rows for n in r]
    seq = balance.sequence_costs(flat, config.cost, **config.cost_args)
    out, at = [], 0
    for r in rows:
        out.append(math.fsum(seq[at:at + len(r)]))
        at += len(r)
    return out


def _checked_plan(plan, n: int, world: int, step: int) -> list:
    """The plan as lists, refused unless it gives every one of the n sequences to exactly one
    microbatch: a sequence left out or run twice would silently change the gradient."""
    if len(plan) != world:
        raise ValueError(f"torch_odc.integrations.hf: step {step}: the planner returned "
                         f"{len(plan)} ranks' microbatches for a world of {world}")
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
                    raise ValueError(f"torch_odc.integrations.hf: step {step}: position {i} is "
                                     f"outside the step's {n} sequences")
                seen[i] += 1
            mbs.append(mb)
        out.append(mbs)
    bad = [i for i, c in enumerate(seen) if c != 1]
    if bad:
        raise ValueError(f"torch_odc.integrations.hf: step {step}: the plan runs sequences "
                         f"{bad[:5]} {[seen[i] for i in bad[:5]]} times (must be once each)")
    return out


class _StepData(torch.utils.data.Dataset):
    """The epoch's optimizer steps: item (epoch, step) is this rank's collated share of it.
    Runs in the DataLoader's workers when there are any; holds no trainer."""

    def __init__(self, dataset, collate, lengths, per_step, world, rank, planner, shuffle, seed,
                 drop_last, costs=None, rows=None, per_device=None, padding_free=False):
        self.dataset, self.collate, self.lengths, self.costs = dataset, collate, lengths, costs
        self.per_step, self.world, self.rank, self.planner = per_step, world, rank, planner
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        # The derived cap (rows given): per row its sequences' lengths, the unmodified
        # trainer's rows per microbatch, and how the collator lays rows out.
        self.rows, self.per_device, self.padding_free = rows, per_device, padding_free
        self._orders: dict[int, list[int]] = {}
        self._plain_max: tuple[int | None, list[int]] = (None, [])

    def __len__(self) -> int:  # what the Trainer reports as "Num examples"
        return len(self.lengths)

    def num_steps(self) -> int:
        n = len(self.lengths)
        return n // self.per_step if self.drop_last else math.ceil(n / self.per_step)

    def plain_up_to(self, epoch: int, step: int) -> int:
        """The padded tokens of the largest microbatch the unmodified trainer runs in this
        epoch up to and including ``step``: its peak memory so far, which the derived cap
        matches (a per-step match would be stricter than the run's peak asks)."""
        if self._plain_max[0] != epoch:
            order, n = self.order(epoch), self.num_steps()
            best, prefix = 0, []
            for k in range(n):
                ids = order[k * self.per_step:(k + 1) * self.per_step]
                best = max(best, plain_largest_microbatch([self.rows[i] for i in ids],
                                                          self.per_device, self.padding_free))
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
        ids = self.order(epoch)[step * self.per_step:(step + 1) * self.per_step]
        lengths = [self.lengths[i] for i in ids]
        if self.rows is not None:  # the derived cap: LB-Mini assigns rows to ranks here
            plain = self.plain_up_to(epoch, step)
            costs = [self.costs[i] for i in ids] if self.costs is not None else None
            plan = _checked_plan(self.planner(lengths, self.world, step, costs=costs, cap=plain),
                                 len(ids), self.world, step)
            assigned = [[ids[j] for mb in p for j in mb] for p in plan]
            features = {i: self.dataset[i] for i in assigned[self.rank]}
            return ODCStep(None, None, None, epoch, step, assigned=assigned, features=features,
                           collate=self.collate, plain_tokens=plain,
                           order_position={i: j for j, i in enumerate(ids)})
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


class _WithPlugin:
    """An accelerate state object with the FSDP plugin set; everything else the real one's."""

    def __init__(self, state, plugin):
        self._state, self.fsdp_plugin = state, plugin

    def __getattr__(self, name):
        return getattr(self._state, name)


def _off_local_rank_device(accelerator) -> bool:
    """Whether this rank's GPU is not ``cuda:<local rank>`` (ranks sharing one GPU)."""
    return (torch.cuda.is_available() and torch.cuda.is_initialized()
            and torch.cuda.current_device() != accelerator.local_process_index)


class _AcceleratorWithPlugin:
    """The Accelerator as accelerate's FSDP2 functions (``fsdp2_prepare_model``, the FSDP
    checkpoint functions) read it, with the FSDP plugin that accelerate's CPU state does not
    keep and ``is_fsdp2``: everything else is the real one's."""

    is_fsdp2 = True

    def __init__(self, accelerator, plugin):
        self._accelerator = accelerator
        self.state = _WithPlugin(accelerator.state, plugin)

    def __getattr__(self, name):
        return getattr(self._accelerator, name)

    def wait_for_everyone(self):
        """accelerate's barrier names the device ``cuda:<local rank>``; ranks sharing one GPU
        (a test layout: NCCL refuses it) are all on another device: the barrier runs on the
        device this rank is on."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            self._accelerator.wait_for_everyone()


def _load_models_whole(cls: type, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The trainer's constructor arguments, with models given by name loaded whole on one
    device. TRL loads such a model with ``device_map="auto"`` unless accelerate's job is
    MULTI_GPU or DeepSpeed; with FSDP it is neither, so on a host with more GPUs than ranks
    "auto" spreads the model over every visible GPU behind accelerate's dispatch hooks (rank 1's
    embedding on cuda:0, its inputs on cuda:1). FSDP2 shards a model that lives on one device:
    ``device_map=None`` is set in ``model_init_kwargs`` (on a copy of the arguments) unless the
    user chose a device map, which is refused."""
    import inspect

    # The first constructor past the mixins that names its parameters (a subclass's
    # ``__init__(self, *args, **kwargs)`` passes them on).
    sig = None
    for c in cls.__mro__:
        if issubclass(c, ODCTrainerMixin) or "__init__" not in vars(c):
            continue
        try:
            candidate = inspect.signature(c.__init__)
        except (TypeError, ValueError):
            return args, kwargs
        if not any(p.kind == p.VAR_POSITIONAL for p in candidate.parameters.values()):
            sig = candidate
            break
    if sig is None:
        return args, kwargs
    try:
        bound = sig.bind_partial(None, *args, **kwargs)
    except TypeError:
        return args, kwargs
    targs, model = bound.arguments.get("args"), bound.arguments.get("model")
    if not isinstance(model, str) or not hasattr(targs, "model_init_kwargs"):
        return args, kwargs
    init = dict(targs.model_init_kwargs or {})
    if init.get("device_map", None) is not None:
        raise ValueError(
            f"torch_odc.integrations.hf: model_init_kwargs device_map={init['device_map']!r}: "
            "under FSDP2 every rank holds its shard of a model on its own device; leave "
            "device_map unset (the adapter loads the model whole, device_map=None)")
    init["device_map"] = None
    targs = copy.copy(targs)
    targs.model_init_kwargs = init
    bound.arguments["args"] = targs
    out: dict = {}
    for i, (name, param) in enumerate(sig.parameters.items()):
        if i == 0 or name not in bound.arguments:  # self
            continue
        if param.kind == param.VAR_KEYWORD:
            out.update(bound.arguments[name])
        else:
            out[name] = bound.arguments[name]
    return (), out


class ODCTrainerMixin:
    """Mixes ODC into a ``transformers.Trainer`` subclass: ``class T(ODCTrainerMixin, Trainer)``
    (or :func:`odc_trainer`). The constructor takes one keyword more, ``odc=ODCConfig(...)``.

    After training, ``odc_steps`` holds per optimizer step the microbatch count of every rank
    and the step's label tokens."""

    # The compatibility manifest's users this adapter needs (see _compat.require).
    _odc_compat_users: tuple[str, ...] = ("trainer",)
    _odc_where = "torch_odc.integrations.hf"

    def __init__(self, *args, odc: ODCConfig | None = None, **kwargs):
        # First: a transformers / accelerate / TRL release without what the adapter uses is
        # refused here, naming it, not with an AttributeError mid-step.
        _compat.require(self._odc_compat_users, self._odc_where)
        if odc is None:
            odc = self._odc_default_config()
        if not isinstance(odc, ODCConfig):
            raise TypeError("torch_odc.integrations.hf: odc= takes an ODCConfig (or None for "
                            f"the defaults), got {type(odc).__name__}")
        args, kwargs = _load_models_whole(type(self), args, kwargs)
        super().__init__(*args, **kwargs)
        self.odc = odc
        self._odc_autocap = _AutoCap()
        self._odc_check_args()
        # The step's sequences: the Trainer's global batch (its "total train batch size").
        self._odc_sequences_per_step = (_compat.read(self, "_train_batch_size")
                                        * self.args.world_size
                                        * self.args.gradient_accumulation_steps)
        # The Trainer's loop draws one ODCStep per optimizer step; the counting of input tokens
        # (one gather per microbatch otherwise) moves into the step's metrics reduction.
        args = copy.copy(self.args)
        args.gradient_accumulation_steps = 1
        self._odc_tokens_seen = args.include_num_input_tokens_seen
        args.include_num_input_tokens_seen = "no"
        self.args = args
        self._odc_handle = None
        self._odc_in_step = False  # in this rank's microbatches (compute_loss's ODC path)
        self._odc_step_in_progress: ODCStep | None = None  # from training_step to its barrier
        self._odc_sums: dict[str, float] = {}
        self._odc_totals: dict[str, float] = {}
        self._odc_fsdp_plugin_cpu = None  # the plugin of the module's own sharding (CPU ranks)
        self._odc_model_checkpoint = None  # CPU ranks: a model to load once sharded
        self._odc_steps_per_epoch: int | None = None
        self.odc_steps: list[dict] = []
        self.odc_memory_bytes = 0  # set at train end (see _odc_detach)
        from transformers import TrainerCallback

        ExportableState = _compat.load("transformers.trainer_callback", "ExportableState")

        owner = self

        # A class per trainer, closing over it: with restore_callback_states_from_checkpoint the
        # Trainer re-creates stateful callbacks from their class without arguments.
        class ODCTrainerCallback(TrainerCallback, ExportableState):
            """Attaches at train begin, detaches at train end; its state (saved by the Trainer
            in every checkpoint's trainer_state.json) is the adapter's, see
            ``_odc_checkpoint_state``."""

            def on_train_begin(self, args, state, control, **kwargs):
                owner._odc_attach()

            def on_train_end(self, args, state, control, **kwargs):
                owner._odc_detach()

            def state(self) -> dict:
                return {"args": {}, "attributes": {"odc": owner._odc_checkpoint_state()}}

        self._odc_callback_name = ODCTrainerCallback.__name__
        self.add_callback(ODCTrainerCallback())

    # -- set-up ------------------------------------------------------------------------------

    @staticmethod
    def _odc_default_config() -> ODCConfig:
        return ODCConfig()

    def _odc_padding_free(self) -> bool:
        """Whether the collator concatenates a microbatch's rows instead of padding them
        (what a microbatch's padded tokens count, for the derived cap)."""
        return False

    def _odc_check_args(self) -> None:
        a, where = self.args, "torch_odc.integrations.hf"
        plugin = a.fsdp_plugin_args
        if not a.fsdp or plugin is None or plugin.get("fsdp_version") != 2:
            raise ValueError(f"{where}: ODC serves FSDP2: set fsdp=True and "
                             "fsdp_config={'version': 2} in the training arguments")
        if plugin.get("cpu_offload"):
            raise ValueError(f"{where}: fsdp_config cpu_offload is not supported by ODC")
        if a.auto_find_batch_size:
            raise ValueError(f"{where}: auto_find_batch_size is not supported (the step's "
                             "size is the plan's)")
        if a.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(f"{where}: train_sampling_strategy={a.train_sampling_strategy!r}: "
                             "ODC plans the step itself (LB-Mini); use 'random' or 'sequential'")
        if getattr(self, "is_deepspeed_enabled", False) or a.parallelism_config is not None:
            raise ValueError(f"{where}: DeepSpeed and parallelism_config (TP/CP/SP) are not "
                             "supported")
        if not a.average_tokens_across_devices:
            raise ValueError(f"{where}: average_tokens_across_devices=False: ODC normalizes the "
                             "loss by the step's token count over all ranks; set it to True")
        self._odc_check_loss()

    def _odc_check_loss(self) -> None:
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            raise ValueError(
                "torch_odc.integrations.hf: the model's loss does not take num_items_in_batch "
                f"({type(self.model).__name__}.forward has no **kwargs), so the Trainer would "
                "average it per microbatch: the gradient would depend on how sequences are "
                "split. Pass a compute_loss_func that sums token losses and divides by "
                "num_items_in_batch.")

    def get_total_train_batch_size(self, args) -> int:
        n = getattr(self, "_odc_sequences_per_step", None)
        return n if n is not None else super().get_total_train_batch_size(args)

    def _odc_shards_itself(self) -> bool:
        DistributedType = _compat.load("accelerate.utils", "DistributedType")
        return (not self.is_fsdp_enabled
                and self.accelerator.distributed_type == DistributedType.MULTI_CPU)

    def create_optimizer(self, model=None):
        # The Trainer creates the optimizer right before accelerator.prepare(model, optimizer).
        # On CPU ranks accelerate would wrap the model in DDP: shard it here first, with
        # accelerate's own FSDP2 preparation, so that the optimizer holds the sharded parameters.
        if self._odc_shards_itself():
            self._odc_shard_like_accelerate()
        return super().create_optimizer(model)

    def _odc_shard_like_accelerate(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        FullyShardedDataParallelPlugin = _compat.load("accelerate.utils",
                                                      "FullyShardedDataParallelPlugin")
        fsdp2_prepare_model = _compat.load("accelerate.utils", "fsdp2_prepare_model")

        if any(isinstance(m, FSDPModule) for m in self.model.modules()):
            return
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        if plugin.activation_checkpointing or plugin.cpu_ram_efficient_loading:
            raise ValueError("torch_odc.integrations.hf: on CPU ranks the module shards the model "
                             "itself, without fsdp_config activation_checkpointing or "
                             "cpu_ram_efficient_loading")
        if self.accelerator.mixed_precision != "no":
            plugin.set_mixed_precision(self.accelerator.mixed_precision)
        fsdp2_prepare_model(_AcceleratorWithPlugin(self.accelerator, plugin), self.model)
        self._odc_fsdp_plugin_cpu = plugin  # checkpoints go through it (odc_fsdp_plugin)
        # accelerate's own mark of what it prepared: prepare() then leaves the model as it is.
        _compat.write(self.model, "_is_accelerate_prepared", True)

    def _odc_attach(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        if self._odc_handle is not None:
            return
        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):
            raise RuntimeError(
                "torch_odc.integrations.hf: accelerate did not shard the model with FSDP2 "
                f"(distributed type {self.accelerator.distributed_type}); check fsdp and "
                "fsdp_config={'version': 2} in the training arguments")
        self._odc_handle = torch_odc.attach(self.model, eager_publish=self.odc.eager_publish)

    def _odc_detach(self) -> None:
        if self._odc_handle is not None:
            # What ODC held beside torch's allocator (shard cache, accumulators, control words):
            # not in torch.cuda.max_memory_allocated(); a run's peak is the sum of both.
            memory = self._odc_handle.stats().get("memory", {})
            self.odc_memory_bytes = int(sum(memory.values()))
            self._odc_handle.detach()
            self._odc_handle = None

    # -- data ----------------------------------------------------------------------------------

    def _odc_row_lengths(self, dataset) -> list[tuple[int, ...]]:
        """Per training row, the token lengths of the sequences it becomes in a microbatch (one
        for a language-modeling row). A step's rows are planned by their summed length against
        the token cap, and by the sum of their sequences' costs; a row is never split.
        Adapters whose rows have no ``input_ids`` (preference pairs) override this."""
        key = getattr(self.model, "main_input_name", "input_ids")
        return [(n,) for n in _sequence_lengths(dataset, key)]

    def get_train_dataloader(self):
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError("torch_odc.integrations.hf: the training dataset must have a length "
                             "(LB-Mini plans each step from its sequences' lengths)")
        rows = [tuple(int(n) for n in r) for r in self._odc_row_lengths(dataset)]
        if len(rows) != len(dataset):
            raise ValueError(f"torch_odc.integrations.hf: {len(rows)} row lengths for a training "
                             f"dataset of {len(dataset)} rows")
        args, workers = self.args, self.args.dataloader_num_workers
        steps = _StepData(
            dataset,
            _compat.call(self, "_get_collator_with_removed_columns", self.data_collator,
                         description="training"),
            [sum(r) for r in rows],
            self._odc_sequences_per_step,
            args.world_size,
            args.process_index,
            self.odc.planner or _LBMini(self.odc),
            shuffle=args.train_sampling_strategy == "random",
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
            costs=_row_costs(rows, self.odc) if self.odc.planner is None else None,
            **({"rows": rows, "per_device": _compat.read(self, "_train_batch_size"),
                "padding_free": self._odc_padding_free()} if self.odc.auto_cap else {}),
        )
        self._odc_rows_of_dataset = rows
        self._odc_steps_per_epoch = steps.num_steps()
        return _StepLoader(
            steps, batch_sampler=_StepKeys(steps), collate_fn=_only,
            num_workers=workers, pin_memory=args.dataloader_pin_memory,
            persistent_workers=bool(workers and args.dataloader_persistent_workers),
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        )

    # -- checkpoints ---------------------------------------------------------------------------
    #
    # The Trainer saves and resumes an FSDP2 model through accelerate's FSDP checkpoint functions
    # (save_fsdp_model / save_fsdp_optimizer / load_fsdp_*) with accelerate's FSDP plugin. On CPU
    # ranks accelerate has no plugin (MULTI_CPU): the Trainer would take its non-FSDP branches and
    # write the model's DTensor shards through safetensors on rank 0 alone (which fails on their
    # storage-less wrappers, and rank 1 goes on into the next step's collectives), then resume
    # into an unsharded model. These methods make the Trainer's FSDP2 calls with the plugin the
    # module sharded the model with; on GPUs with accelerate's own, so both take one path.

    def _odc_sharded(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for m in self.model.modules())

    @property
    def odc_fsdp_plugin(self):
        """accelerate's FSDP plugin the checkpoints go through: the accelerator's, or on CPU
        ranks (where accelerate drops it) the one the module sharded the model with; None
        before the model is sharded. E.g. ``trainer.odc_fsdp_plugin.set_state_dict_type(
        "FULL_STATE_DICT")`` before a final ``save_model`` of a run checkpointed sharded."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        return plugin if plugin is not None else self._odc_fsdp_plugin_cpu

    def _odc_fsdp_accelerator(self):
        """The accelerator for accelerate's FSDP checkpoint functions: on CPU ranks one that
        says FSDP2 (``load_fsdp_model`` otherwise returns early on every rank but 0, leaving
        the others in their next collective)."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if plugin is not None and not _off_local_rank_device(self.accelerator):
            return self.accelerator
        return _AcceleratorWithPlugin(self.accelerator, plugin or self.odc_fsdp_plugin)

    def _odc_check_save_point(self, what: str) -> None:
        """Refuses a checkpoint between this rank's first microbatch of an optimizer step and
        the step's barrier: the gradients are complete only at the barrier, and the other ranks
        are elsewhere in their microbatches (any number, zero included), so a save there, a
        collective, would not line up."""
        step = self._odc_step_in_progress
        if step is None:
            return
        rank = self.args.process_index
        raise RuntimeError(
            f"torch_odc.integrations.hf: rank {rank}: {what} inside optimizer step "
            f"{self.state.global_step + 1} (epoch {step.epoch}, step {step.step}; microbatches "
            f"per rank {step.counts}), before its torch_odc.minibatch_barrier(). Under ODC the "
            "step's gradients are reduced only at the barrier and the other ranks are at other "
            "microbatches, so nothing was saved. Let the Trainer save after the step: set "
            "control.should_save = True in a callback (e.g. on_step_end); it saves on every "
            "rank after the barrier and the optimizer step.")

    def _save_checkpoint(self, model, trial):
        self._odc_check_save_point("a checkpoint save (_save_checkpoint)")
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        self._odc_check_save_point("save_model")
        if not self._odc_sharded():
            return super().save_model(output_dir, _internal_call)
        # The Trainer's FSDP2 branch: a full state dict for save_pretrained (a collective), none
        # with SHARDED_STATE_DICT (the checkpoint holds the model as DCP shards).
        if "FULL_STATE_DICT" in str(self.odc_fsdp_plugin.state_dict_type):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                       cpu_offload=True)
            state_dict = get_model_state_dict(self.model, options=options)
            _compat.call(self, "_save",
                         output_dir if output_dir is not None else self.args.output_dir,
                         state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._odc_check_save_point("saving the optimizer")
        if not self._odc_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        save_fsdp_model = _compat.load("accelerate.utils", "save_fsdp_model")
        save_fsdp_optimizer = _compat.load("accelerate.utils", "save_fsdp_optimizer")
        get_fsdp_ckpt_kwargs = _compat.load("transformers.trainer", "get_fsdp_ckpt_kwargs")
        SCHEDULER_NAME = _compat.load("transformers.trainer", "SCHEDULER_NAME")

        plugin = self.odc_fsdp_plugin
        accelerator = self._odc_fsdp_accelerator()
        save_fsdp_model(plugin, accelerator, self.model, output_dir, **get_fsdp_ckpt_kwargs())
        save_fsdp_optimizer(plugin, accelerator, self.optimizer, self.model, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._odc_sharded():
            load_fsdp_model = _compat.load("accelerate.utils", "load_fsdp_model")
            get_fsdp_ckpt_kwargs = _compat.load("transformers.trainer", "get_fsdp_ckpt_kwargs")
            load_fsdp_model(self.odc_fsdp_plugin, self._odc_fsdp_accelerator(),
                            model if model is not None else self.model, resume_from_checkpoint,
                            **get_fsdp_ckpt_kwargs())
            return None
        if self._odc_shards_itself():
            # train() loads before anything is prepared when accelerate has no FSDP plugin; the
            # module shards the model only in create_optimizer: it is loaded into the sharded
            # model right before the optimizer (_load_optimizer_and_scheduler).
            self._odc_model_checkpoint = resume_from_checkpoint
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._odc_sharded():
            return super()._load_optimizer_and_scheduler(checkpoint)
        if self._odc_model_checkpoint is not None:
            model_checkpoint, self._odc_model_checkpoint = self._odc_model_checkpoint, None
            self._load_from_checkpoint(model_checkpoint)
        load_fsdp_optimizer = _compat.load("accelerate.utils", "load_fsdp_optimizer")
        OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME, get_fsdp_ckpt_kwargs = (
            _compat.load("transformers.trainer", name) for name in
            ("OPTIMIZER_NAME", "OPTIMIZER_NAME_BIN", "SCHEDULER_NAME", "get_fsdp_ckpt_kwargs"))

        # As the Trainer: a checkpoint without optimizer state (save_only_model) loads the model.
        names = os.listdir(checkpoint)
        has_optimizer = OPTIMIZER_NAME_BIN in names or any(
            n.startswith(OPTIMIZER_NAME_BIN.split(".")[0])
            and os.path.isdir(os.path.join(checkpoint, n)) for n in names)
        if not (has_optimizer and SCHEDULER_NAME in names):
            if OPTIMIZER_NAME in names:
                raise ValueError(f"torch_odc.integrations.hf: {checkpoint} holds a non-FSDP "
                                 "optimizer state; it cannot resume an FSDP2 model")
            return None
        load_fsdp_optimizer(self.odc_fsdp_plugin, self._odc_fsdp_accelerator(), self.optimizer,
                            self.model, checkpoint, **get_fsdp_ckpt_kwargs())
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
        return None

    def _load_best_model(self) -> None:
        if not self._odc_sharded():
            return super()._load_best_model()
        load_fsdp_model = _compat.load("accelerate.utils", "load_fsdp_model")
        get_fsdp_ckpt_kwargs = _compat.load("transformers.trainer", "get_fsdp_ckpt_kwargs")
        load_fsdp_model(self.odc_fsdp_plugin, self._odc_fsdp_accelerator(), self.model,
                        self.state.best_model_checkpoint, **get_fsdp_ckpt_kwargs())
        return None

    def _odc_checkpoint_state(self) -> dict:
        """What the adapter carries across a save and resume besides the Trainer's own state
        (model, optimizer, scheduler, RNG, TrainerState with the global step and
        ``num_input_tokens_seen``): JSON values, the same on every rank (rank 0's are written,
        into trainer_state.json's ``stateful_callbacks``). Adapters add theirs."""
        return {}

    def _odc_restore_checkpoint_state(self, state: dict) -> None:
        """Restores what :meth:`_odc_checkpoint_state` returned, when resuming."""

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial):
        out = super()._init_training_state(max_steps, num_update_steps_per_epoch,
                                           num_train_epochs, resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None:
            saved = self.state.stateful_callbacks.get(self._odc_callback_name)
            if isinstance(saved, list):
                saved = saved[0]
            if saved is None or "odc" not in saved.get("attributes", {}):
                import warnings

                warnings.warn(f"torch_odc.integrations.hf: {resume_from_checkpoint} has no ODC "
                              "state (not saved by odc_trainer): metrics the trainer "
                              "accumulates across steps restart from zero", stacklevel=2)
            else:
                self._odc_restore_checkpoint_state(saved["attributes"]["odc"])
        return out

    # -- the step ------------------------------------------------------------------------------

    def _odc_label_tokens(self, batch) -> int:
        """The label tokens of one microbatch, counted as the Trainer counts num_items_in_batch."""
        if "shift_labels" in batch:
            labels = batch["shift_labels"]
        elif "labels" in batch:
            labels = batch["labels"]
            if _compat.read(self, "_loss_shifts_labels", True):
                labels = labels[..., 1:]
        else:
            raise ValueError("torch_odc.integrations.hf: a microbatch without 'labels': the "
                             "step's token count (the loss's denominator) needs them")
        return int(labels.ne(IGNORE_INDEX).sum())

    def _odc_step_totals(self, step: ODCStep) -> dict[str, float]:
        """This rank's sums of the quantities the loss divides by, over its microbatches of the
        step (none included); ``training_step`` all-reduces them once, before the first forward,
        into ``self._odc_totals``. ``"label_tokens"``, when present, becomes the Trainer's
        ``num_items_in_batch``."""
        return {"label_tokens": sum(self._odc_label_tokens(b) for b in step.microbatches)}

    def _odc_input_tokens(self, batch) -> int:
        main = getattr(self.model, "main_input_name", "input_ids")
        if self._odc_tokens_seen == "non_padding" and "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return batch[main].numel() if main in batch else 0

    def _odc_metric_keys(self) -> tuple[str, ...]:
        """The local sums reduced once per step after the barrier (the same keys on every
        rank, also on one that ran no microbatch)."""
        return ("input_tokens",) if self._odc_tokens_seen not in ("no", False, None) else ()

    def _odc_record_metrics(self, sums: dict[str, float]) -> None:
        if "input_tokens" in sums:
            self.state.num_input_tokens_seen += int(sums["input_tokens"])

    def log(self, logs: dict, start_time: float | None = None) -> None:
        # The Trainer logs the tokens seen only when its own (per-microbatch) count is on; the
        # module counts them once per step instead and logs them the same way.
        if self._odc_tokens_seen not in ("no", False, None):
            speed_metrics = _compat.load("transformers.trainer_utils", "speed_metrics")
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                seen = (self.state.num_input_tokens_seen
                        - _compat.read(self, "_initial_num_input_tokens_seen", 0))
                logs.update(speed_metrics("train", start_time, num_tokens=seen))
        super().log(logs, start_time)

    def _odc_unshard_output_head(self) -> None:
        """Unshards the LM head's FSDP unit before a training forward whose loss multiplies by
        ``lm_head.weight`` without calling ``lm_head`` (TRL's ``fused_lm_head``). A weight still
        sharded there (a DTensor) TRL gathers with ``full_tensor()``: a collective in every
        forward, which ranks with different microbatch counts cannot all call. That happens
        when no module of the head's unit runs a forward: accelerate shards ``[final norm,
        lm_head]`` as one unit, but finds no final norm in a PEFT model and shards ``lm_head``
        alone. FSDP2's public ``unshard()`` (under ODC a one-sided read; a no-op when the unit
        is unsharded) leaves the weight a plain tensor; FSDP2 reshards the unit after the
        backward, the barrier at the latest."""
        from torch.distributed.fsdp import FSDPModule

        head = self.accelerator.unwrap_model(self.model).get_output_embeddings()
        if isinstance(head, FSDPModule):
            head.unshard()

    @staticmethod
    def _odc_all_reduce(values: list[float]) -> list[float]:
        """One all-reduce of a small CPU float64 vector: under "odc" it runs on Gloo, also for
        ranks that share one GPU."""
        t = torch.tensor(values, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        return t.tolist()

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(inputs, ODCStep):
            raise TypeError("torch_odc.integrations.hf: training_step expects an ODCStep from the "
                            "module's own train dataloader, got " + type(inputs).__name__)
        step = inputs
        self._odc_check_position(step)
        if step.assigned is not None and step.microbatches is None:
            self._odc_materialize(step)
        # Until the barrier returns, a checkpoint is refused (see _odc_check_save_point).
        self._odc_step_in_progress = step
        # The loss's denominators (the step's label tokens, ...) over all ranks, known before
        # the first forward (every rank calls this once per step, also with no microbatch).
        local = self._odc_step_totals(step)
        self._odc_totals = (dict(zip(local, self._odc_all_reduce(list(local.values())),
                                     strict=True)) if local else {})
        num_items = None
        if "label_tokens" in self._odc_totals:
            num_items = torch.tensor(self._odc_totals["label_tokens"], dtype=torch.float32,
                                     device=self.args.device)
        keys = self._odc_metric_keys()
        self._odc_sums = dict.fromkeys(keys, 0.0)
        total = torch.zeros((), device=self.args.device)
        self._odc_in_step = True
        probe = self._odc_probe(model)
        try:
            for batch in step.microbatches:
                if "input_tokens" in self._odc_sums:
                    self._odc_sums["input_tokens"] += self._odc_input_tokens(batch)
                if probe is not None:
                    self._odc_autocap.start(self._odc_batch_tokens(batch))
                total = total + super().training_step(model, batch, num_items)
        finally:
            self._odc_in_step = False
            if probe is not None:
                probe.remove()
        # After this rank's last backward, before the Trainer clips and takes the grad norm.
        torch_odc.minibatch_barrier()
        self._odc_step_in_progress = None
        if probe is not None:
            self._odc_autocap.finish_step(self._odc_handle)
        if keys:
            self._odc_record_metrics(dict(zip(keys, self._odc_all_reduce(
                [self._odc_sums[k] for k in keys]), strict=True)))
        record = {"epoch": step.epoch, "step": step.step, "microbatches": list(step.counts),
                  **{k: int(v) for k, v in self._odc_totals.items()}}
        if step.cap is not None:
            record.update(cap=step.cap, plain_tokens=step.plain_tokens, padded_tokens=max(
                (self._odc_batch_tokens(b) for b in step.microbatches), default=0), **step.work,
                **self._odc_autocap.describe())
        self.odc_steps.append(record)
        return total.detach()

    # -- the derived cap -----------------------------------------------------------------------

    def _odc_materialize(self, step: ODCStep) -> None:
        """Packs every rank's rows of a step planned for the derived cap into microbatches of
        at most the step's cap in padded tokens (every rank computes every rank's packing, the
        same way: the counts agree) and collates this rank's."""
        rows, free = self._odc_rows_of_dataset, self._odc_padding_free()
        step.cap = cap = self._odc_autocap.cap(step.plain_tokens)
        per_rank = [pack_padded(a, lambda mb: padded_tokens([rows[i] for i in mb], free), cap)
                    for a in step.assigned]
        mine = per_rank[self.args.process_index]
        step.microbatches = [step.collate([step.features[i] for i in mb]) for mb in mine]
        step.counts, step.indices = [len(p) for p in per_rank], mine
        step.features = None
        # Each rank's padded tokens in the step, under ODC and as the unmodified trainer would
        # run them (rank r: its consecutive microbatches r, r + W, ... of per_device rows): the
        # work each rank's step costs, from which benchmarks take the planner's bound.
        world, per_device = len(step.assigned), _compat.read(self, "_train_batch_size")
        order = [i for a in step.assigned for i in a]
        order.sort(key=step.order_position.__getitem__)
        chunks = [order[i:i + per_device] for i in range(0, len(order), per_device)]
        step.work = {
            "padded_per_rank": [sum(padded_tokens([rows[i] for i in mb], free) for mb in p)
                                for p in per_rank],
            "plain_padded_per_rank": [
                sum(padded_tokens([rows[i] for i in c], free) for c in chunks[r::world])
                for r in range(world)]}

    def _odc_probe(self, model):
        """While the derived cap is still measuring (the first step on GPUs): a forward hook
        on the model that tells _AutoCap where each microbatch's forward ends."""
        if not (self.odc.auto_cap and self._odc_autocap.measuring):
            return None
        return model.register_forward_hook(self._odc_autocap.after_forward)

    def _odc_batch_tokens(self, batch) -> int:
        """A collated microbatch's tokens as the model sees them (padding included)."""
        main = getattr(self.model, "main_input_name", "input_ids")
        t = batch.get(main) if hasattr(batch, "get") else None
        return int(t.numel()) if isinstance(t, torch.Tensor) else 0

    def _odc_check_position(self, step: ODCStep) -> None:
        """The step the loader handed out must be the one the Trainer is at: after a resume the
        loader skips the steps already trained (``skip_first_batches``) and is set to the
        resumed epoch. A mismatch would silently train on other sequences than the
        uninterrupted run."""
        per_epoch = self._odc_steps_per_epoch
        if not per_epoch or self.args.ignore_data_skip:  # resumes at the epoch's start
            return
        epoch, at = divmod(self.state.global_step, per_epoch)
        if (step.epoch, step.step) != (epoch, at):
            raise RuntimeError(
                f"torch_odc.integrations.hf: rank {self.args.process_index}: the step loader "
                f"handed out epoch {step.epoch} step {step.step}, but the Trainer is at global "
                f"step {self.state.global_step} (epoch {epoch}, step {at} of {per_epoch}): the "
                "loader was not positioned for the resumed run (skip_first_batches and "
                "set_epoch of transformers' resume path). Training on would silently use other "
                "sequences than the uninterrupted run.")

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, ODCStep):
            return sum(super(ODCTrainerMixin, self).floating_point_ops(b)
                       for b in inputs.microbatches)
        return super().floating_point_ops(inputs)
