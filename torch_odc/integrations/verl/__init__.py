"""ODC inside verl (0.9.1): its FSDP2 engine with any number of microbatches per rank.

Importing this module registers the engine strategy ``"odc"`` in verl's ``EngineRegistry`` for
the actor / SFT model (``language_model``) and the critic (``value_model``). Select it by
configuration, e.g. for the PPO trainer::

    actor_rollout_ref.model.external_lib=torch_odc.integrations.verl   # imported by each worker
    actor_rollout_ref.actor.strategy=odc
    critic.strategy=odc
    # optional: LB-Mini across the data-parallel ranks
    actor_rollout_ref.actor.fsdp_config._target_=torch_odc.integrations.verl.ODCEngineConfig
    +actor_rollout_ref.actor.fsdp_config.odc_balance=mini

or build a ``TrainingWorkerConfig`` with ``engine_config=ODCEngineConfig(strategy="odc", ...)``.
The engines are verl's ``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead`` with ODC attached
after verl's FSDP2 wrapping, the minibatch barrier before verl's clipping, per-rank microbatch
counts (no MAX over ranks) and metrics reduced once per step (``._engine`` has the details;
docs/integrations/verl.md the whole story). verl's 2-D ``fsdp_size`` mesh runs as ODC's HSDP, and
Ulysses sequence parallelism with each SP group planning its own microbatches; unsupported
settings (CPU offload, ...) are refused when the engine is built. A forward-only engine (verl's
reference model, whose strategy follows the actor's) is verl's FSDP2 engine.

For CPU ranks (tests, the example), :func:`use_cpu_platform` registers a CPU platform through
verl's ``PlatformRegistry``.
"""

from __future__ import annotations

from ._cpu import PlatformCPU, use_cpu_platform
from ._engine import (
    STRATEGY,
    ODCEngineConfig,
    ODCEngineMixin,
    ODCFSDPEngineWithLMHead,
    ODCFSDPEngineWithValueHead,
)

__all__ = [
    "STRATEGY",
    "ODCEngineConfig",
    "ODCEngineMixin",
    "ODCFSDPEngineWithLMHead",
    "ODCFSDPEngineWithValueHead",
    "PlatformCPU",
    "use_cpu_platform",
]
