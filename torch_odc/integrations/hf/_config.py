"""The adapters' configuration: :class:`ODCConfig` (how each optimizer step is planned)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ODCConfig", "Planner"]

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
            memory beside FSDP2's (a published copy of shards where the parameters cannot live
            in the shard cache, and control words) at the marginal peak bytes per token measured
            in the first step.
        cost: LB-Mini's cost model: ``"tokens"``, ``"flops"`` or a callable length -> cost,
            e.g. a fitted :class:`torch_odc.balance.TimeCost` (docs/balance.md).
        cost_args: keyword arguments of the cost model (``"flops"``: ``num_params``, ...).
        planner: replaces LB-Mini: ``planner(lengths, world_size, step)`` returns, per rank,
            its microbatches as lists of positions into ``lengths``; every rank must return the
            same plan. Checked to cover every sequence exactly once. Needs an explicit
            ``max_tokens_per_microbatch`` only if the planner reads it.
        eager_publish: passed to :func:`torch_odc.attach`.
        pad_to_multiple_of: each microbatch's sequence length is padded up to a multiple of
            this, through the trainer's collator (its ``pad_to_multiple_of``, which TRL's and
            Transformers' padding collators take; the padding is masked like any other and
            counted in the derived cap). ``None`` (the default): 64 on CUDA when the collator
            takes it and pads (not padding-free), else 1 (off). Why: ODC packs a varying number
            of rows per microbatch, so its microbatches meet more distinct shapes than the
            unmodified trainer's, and cuDNN's attention (PyTorch's SDPA on Hopper) builds a plan
            per shape, sometimes loading new kernels for seconds; lengths in multiples of 64
            meet far fewer (benchmarks/probes/sdpa_shapes.py; docs/benchmarks.md). GRPO: the length
            (prompt plus completion, made up by left padding; each width keeps TRL's own
            multiple); None there means 128 on CUDA (its rows are left-padded: see
            docs/integrations/trl.md), and on CUDA no microbatch is 64 modulo 128 tokens long.
    """

    max_tokens_per_microbatch: int | None = None
    cost: Any = "tokens"
    cost_args: dict = dataclasses.field(default_factory=dict)
    planner: Planner | None = None
    eager_publish: bool = True
    pad_to_multiple_of: int | None = None

    AUTO_PAD_MULTIPLE = 64  # pad_to_multiple_of=None on CUDA (see above)

    def __post_init__(self):
        cap = self.max_tokens_per_microbatch
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(
                "ODCConfig.max_tokens_per_microbatch must be a positive int or None "
                f"(derived from the trainer's own microbatches), got {cap!r}"
            )
        m = self.pad_to_multiple_of
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(
                "ODCConfig.pad_to_multiple_of must be a positive int (1: no extra "
                f"padding) or None (64 on CUDA), got {m!r}"
            )

    @property
    def auto_cap(self) -> bool:
        """Whether each step's cap is derived (no explicit cap, LB-Mini plans)."""
        return self.max_tokens_per_microbatch is None and self.planner is None
