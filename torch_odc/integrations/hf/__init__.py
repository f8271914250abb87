"""ODC inside the Hugging Face ``Trainer`` and TRL's trainers: LB-Mini plans per optimizer
step, any number of microbatches per rank (zero included), one barrier per step.

    import torch_odc
    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    dist.init_process_group("odc")          # before TrainingArguments / SFTConfig
    args = SFTConfig(..., fsdp=True, fsdp_config={"version": 2})
    trainer = odc_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds)
    # odc=ODCConfig(...) changes a default: the cap, the cost model, the planner
    trainer.train()

Layout: the step core (:mod:`torch_odc.step`) holds what is no trainer's (rows, plan, row
exchange, padded-token arithmetic, derived cap, metric reduction); :mod:`._core` is the
Trainer's side of it (the step loader, barrier placement, attach/detach, the CPU-rank
sharding); one thin adapter per trainer (:mod:`.sft`, :mod:`.grpo`, :mod:`.dpo`). :func:`odc_trainer` picks the adapter from the trainer class. :mod:`._compat` lists every name of
transformers, accelerate and TRL the adapters use beyond the public API (the compatibility
manifest, checked at construction).
"""

from __future__ import annotations

from ._config import ODCConfig
from ._core import ODCTrainerMixin
from ._steps import ODCStep
from .dpo import ODCDPOTrainerMixin
from .grpo import ODCGRPOConfig, ODCGRPOTrainerMixin
from .sft import ODCSFTTrainerMixin

__all__ = [
    "ODCConfig",
    "ODCDPOTrainerMixin",
    "ODCGRPOConfig",
    "ODCGRPOTrainerMixin",
    "ODCSFTTrainerMixin",
    "ODCStep",
    "ODCTrainerMixin",
    "odc_trainer",
    "peak_memory_gib",
]


def _adapter(trainer_class: type) -> type:
    """The most specific adapter for ``trainer_class`` (TRL's trainers are optional)."""
    try:
        from trl import DPOTrainer, GRPOTrainer, SFTTrainer
    except ImportError:
        return ODCTrainerMixin
    if issubclass(trainer_class, GRPOTrainer):
        return ODCGRPOTrainerMixin
    if issubclass(trainer_class, SFTTrainer):
        return ODCSFTTrainerMixin
    if issubclass(trainer_class, DPOTrainer):
        return ODCDPOTrainerMixin
    return ODCTrainerMixin


def peak_memory_gib(trainer) -> list:
    """After training, every rank's peak device memory in GiB (None on CPU ranks), one gather:
    torch's allocator peak plus what ODC held beside it (``trainer.odc_memory_bytes``, which
    ``torch.cuda.max_memory_allocated()`` does not count; 0 for an unmodified trainer), at the
    phase where their sum was largest. The figure to compare ODC with the trainer it replaces."""
    import torch

    from torch_odc import step as core

    peak = None
    if torch.cuda.is_available():
        # An ODC trainer that returned memory between phases (the GRPO adapter frees its
        # gradient accumulators for generation) noted each phase's peak (odc_peak_bytes) and
        # restarted the allocator's statistics there.
        peak = (
            max(
                torch.cuda.max_memory_allocated() + getattr(trainer, "odc_memory_bytes", 0),
                getattr(trainer, "odc_peak_bytes", 0),
            )
            / 2**30
        )
    return core.gather_objects(peak)


def odc_trainer(trainer_class: type) -> type:
    """``trainer_class`` with ODC mixed in: ``odc_trainer(Trainer)``, ``odc_trainer(SFTTrainer)``,
    ``odc_trainer(GRPOTrainer)``, ``odc_trainer(DPOTrainer)`` (or a subclass of one). The result
    takes ``odc=ODCConfig(...)`` as well."""
    from transformers import Trainer

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"odc_trainer: {trainer_class!r} is not a transformers.Trainer subclass")
    mixin = _adapter(trainer_class)
    return type(f"ODC{trainer_class.__name__}", (mixin, trainer_class), {})
