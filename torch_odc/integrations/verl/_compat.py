"""Every name of verl (and the few torch internals) that the verl adapter uses, in one place (as
``torch_odc/_fsdp2.py`` is for FSDP2).

What is listed: the FSDP engine's methods the "odc" engines override or call (private ones
included), the engine attributes they read, ``FSDPEngineConfig``'s fields and its
``__post_init__``, and every name imported from verl's modules (all of them inner modules:
``verl.workers.engine.utils``, ``verl.utils.tensordict_utils``, ...); from torch, the default
group's backend lookup (``_get_default_group``, ``ProcessGroup._get_backend``).

Porting to a new verl release means reading this file against it. The adapter

* imports verl's classes and functions through :func:`load` (a name that is gone raises
  :class:`UnsupportedVersion` naming it, the installed version and the version it was read in);
* calls :func:`require` first when an engine is built (``"engine"``) and when an
  ``ODCEngineConfig`` is made (``"config"``), so an unsupported release is refused before
  anything runs, never with an ``AttributeError`` mid-step;
* reaches verl's private methods through :func:`call`.

This module imports nothing of verl itself (``check`` imports what it checks), so the manifest
reads without verl installed. ``tests/test_compat.py`` checks every entry inside verl's
environment.
"""

from __future__ import annotations

from torch_odc.integrations._manifest import (
    CLASS,
    CONSTANT,
    FIELD,
    FUNCTION,
    INSTANCE,
    METHOD,
    MODULE,
    OVERRIDE,
    READ_BY,
    REPRODUCED,
    Entry,
    Manifest,
    UnsupportedVersion,
)

__all__ = [
    "ENTRIES",
    "MANIFEST",
    "UnsupportedVersion",
    "call",
    "check",
    "default_backend",
    "load",
    "require",
]

VERL = "0.9.1"
TORCH = "2.11.0"

ENGINE = "verl.workers.engine.fsdp.transformer_impl.FSDPEngine"
CONFIG = "verl.workers.config.FSDPEngineConfig"
TU = "verl.utils.tensordict_utils"
_E = ("engine",)


def _v(owner, name, kind, why, users=_E, params=()):
    return Entry("verl", owner, name, kind, VERL, why, users, tuple(params))


ENTRIES: tuple[Entry, ...] = (
    # -- the engine configuration --
    _v(
        "verl.workers.config",
        "FSDPEngineConfig",
        CLASS,
        "ODCEngineConfig's base: verl's FSDP engine options",
        ("config", "engine"),
    ),
    _v(
        CONFIG,
        "__post_init__",
        OVERRIDE,
        "verl's validation accepts only its own strategy names: it runs with strategy 'fsdp2'",
        ("config",),
    ),
    *(
        _v(CONFIG, name, FIELD, why, ("config", "engine"))
        for name, why in (
            ("strategy", "'odc' selects the engines; verl's FSDP engine sees 'fsdp2'"),
            ("forward_only", "a forward-only engine (the reference model) runs as verl's own"),
            (
                "ulysses_sequence_parallel_size",
                (
                    "an SP group is one data-parallel rank: its ranks "
                    "plan the same microbatches, checked once per mini-batch"
                ),
            ),
            (
                "fsdp_size",
                ("below the world size: verl's 2-D ddp x fsdp mesh, rebuilt over odc (HSDP)"),
            ),
            ("offload_policy", "refused (CPU offload)"),
            ("param_offload", "refused"),
        )
    ),
    _v(
        "verl.workers.config.HFModelConfig",
        "enable_activation_offload",
        FIELD,
        "refused (not tried with ODC)",
    ),
    # -- the engines and their registry --
    _v(
        "verl.workers.engine.base",
        "EngineRegistry",
        CLASS,
        "the 'odc' engines are registered for the language and value models",
    ),
    _v(
        "verl.workers.engine.base.EngineRegistry",
        "register",
        METHOD,
        "registers the engines under strategy 'odc'",
        params=("model_type", "backend", "device"),
    ),
    _v(
        "verl.workers.engine.fsdp.transformer_impl",
        "FSDPEngineWithLMHead",
        CLASS,
        "the actor / SFT engine the 'odc' engine subclasses",
    ),
    _v(
        "verl.workers.engine.fsdp.transformer_impl",
        "FSDPEngineWithValueHead",
        CLASS,
        "the critic engine the 'odc' engine subclasses",
    ),
    _v(
        ENGINE,
        "_init_device_mesh",
        OVERRIDE,
        "FSDP2 shards over an odc process group when verl's default group is not odc",
    ),
    _v(
        ENGINE,
        "_build_module",
        OVERRIDE,
        "a Qwen2-VL family model: its text-only microbatches run without verl's dummy vision "
        "forward (on this engine's model instance)",
    ),
    _v(
        ENGINE,
        "_build_fsdp_module",
        OVERRIDE,
        "torch_odc.attach right after verl's FSDP2 wrapping",
        params=("module",),
    ),
    _v(
        ENGINE,
        "forward_backward_batch",
        OVERRIDE,
        "reproduced after verl 0.9.1's, with each rank's own microbatch count (no MAX over "
        "ranks) and LB-Mini across ranks",
        params=("data", "loss_function", "forward_only"),
    ),
    _v(ENGINE, "optimizer_step", OVERRIDE, "the minibatch barrier before verl's clipping"),
    _v(
        "verl.workers.engine.base.BaseEngine",
        "train_batch",
        OVERRIDE,
        "reduces the per-microbatch metrics once per step",
        params=("data", "loss_function"),
    ),
    _v(
        ENGINE,
        "_gradient_sync_context",
        METHOD,
        "defers FSDP2's gradient reduction to the rank's last microbatch, as verl does",
        params=("is_last_micro_batch",),
    ),
    _v(
        ENGINE,
        "forward_step",
        METHOD,
        "one microbatch's forward and loss",
        params=("micro_batch", "loss_function", "forward_only"),
    ),
    _v(ENGINE, "get_data_parallel_group", METHOD, "the loss denominators' all-reduce group"),
    _v(ENGINE, "get_data_parallel_size", METHOD, "verl's losses multiply by it"),
    *(
        _v(ENGINE, name, INSTANCE, why)
        for name, why in (
            (
                "device_mesh",
                (
                    "verl's FSDP mesh (1-D, or 2-D ddp x fsdp), rebuilt over odc groups "
                    "(verl's own group is not odc)"
                ),
            ),
            ("ulysses_sequence_parallel_size", "the SP size: the token cap's factor, the SP check"),
            ("ulysses_parallel_group", "the SP group whose ranks must plan the same microbatches"),
            ("module", "the FSDP2 model (the 'flops' cost's parameter count)"),
            ("model_config", "the model's configuration (the 'flops' cost)"),
            ("scaler", "verl's GradScaler, when there is one (read with the default None)"),
        )
    ),
    # -- verl's microbatching and metrics --
    _v(
        "verl.workers.engine.utils",
        "prepare_micro_batches",
        FUNCTION,
        "verl's packing of a rank's rows, without the MAX over ranks",
        params=("data", "dp_group", "same_micro_num_in_dp"),
    ),
    _v(
        "verl.workers.engine.utils",
        "sp_size",
        READ_BY,
        "the SP size set on the mini-batch: prepare_micro_batches scales the token cap by it",
    ),
    _v(
        "verl.workers.engine.utils",
        "postprocess_batch_func",
        FUNCTION,
        "the microbatch outputs back in row order",
        params=("output_lst", "indices", "data"),
    ),
    _v("verl.utils", "tensordict_utils", MODULE, "verl's TensorDict helpers"),
    *(
        _v(TU, name, FUNCTION, "the mini-batch's rows and metadata", params=params)
        for name, params in (
            ("assign_non_tensor", ()),
            ("get_non_tensor_data", ("data", "key", "default")),
            ("index_select_tensor_dict", ()),
            ("concat_tensordict", ()),
            ("assign_non_tensor_data", ()),
            ("maybe_fix_3d_position_ids", ("data",)),
        )
    ),
    _v(
        "verl.utils.metric",
        "Metric",
        CLASS,
        "per-microbatch metrics reduced to one value per rank",
        params=("aggregation", "value"),
    ),
    _v("verl.utils.metric", "AggregationType", CLASS, "how each metric is aggregated"),
    _v(
        "verl.utils.metric.Metric",
        "aggregate_dp",
        REPRODUCED,
        "verl aggregates the per-rank values over the data-parallel ranks: the reduction "
        "leaves one value per rank that it turns into the aggregate over every microbatch",
    ),
    _v("verl.utils.metric.Metric", "values", INSTANCE, "the per-microbatch values"),
    _v("verl.utils.metric.Metric", "aggregation", INSTANCE, "the metric's aggregation"),
    _v(
        "verl.utils.seqlen_balancing",
        "calculate_workload",
        FUNCTION,
        "odc_cost='verl': verl's own workload model",
    ),
    # -- vision-language models (the Qwen2-VL family) --
    _v(
        "verl.models.transformers.qwen2_vl",
        "qwen2_vl_base_forward",
        FUNCTION,
        "verl's Qwen2-VL / Qwen2.5-VL model forward (installed on the classes by verl's monkey "
        "patch): called for microbatches with images or videos",
        params=(
            "input_ids",
            "attention_mask",
            "labels",
            "pixel_values",
            "pixel_values_videos",
            "image_grid_thw",
            "video_grid_thw",
        ),
    ),
    _v(
        "verl.models.transformers.qwen2_vl",
        "_get_input_embeds",
        REPRODUCED,
        "its path without images or videos, less the dummy vision forward on zeros",
        params=("model", "input_ids", "attention_mask", "pixel_values", "pixel_values_videos"),
    ),
    _v(
        "verl.utils.model",
        "_VARLEN_MULTI_MODAL_KEYS",
        CONSTANT,
        "multi-modal fields verl pads per microbatch: refused",
    ),
    # -- the CPU platform (tests, the example) --
    _v("verl.plugin.platform", "PlatformBase", CLASS, "the CPU platform's base", ("platform",)),
    _v(
        "verl.plugin.platform",
        "PlatformRegistry",
        CLASS,
        "registers the CPU platform",
        ("platform",),
    ),
    _v(
        "verl.plugin.platform.PlatformRegistry",
        "register",
        METHOD,
        "registers the CPU platform",
        ("platform",),
        params=("platform",),
    ),
    _v("verl.plugin.platform", "get_platform", FUNCTION, "the platform verl chose", ("platform",)),
    # -- torch internals the engine reads --
    Entry(
        "torch",
        "torch.distributed.distributed_c10d",
        "_get_default_group",
        FUNCTION,
        TORCH,
        "whether verl's default group already runs over odc",
        _E,
    ),
    Entry(
        "torch",
        "torch.distributed.ProcessGroup",
        "_get_backend",
        METHOD,
        TORCH,
        "the default group's CPU backend (an OdcBackend under odc)",
        _E,
    ),
)

MANIFEST = Manifest("torch_odc.integrations.verl", ENTRIES)

check = MANIFEST.check
require = MANIFEST.require
call = MANIFEST.call
load = MANIFEST.load


def default_backend(device):
    """The default process group's backend for ``device`` (torch internals, listed above)."""
    group = load("torch.distributed.distributed_c10d", "_get_default_group")()
    return call(group, "_get_backend", device)
