"""Every name of transformers, accelerate and TRL that the Hugging Face adapters use beyond the
documented API, in one place (as ``torch_odc/_fsdp2.py`` is for FSDP2).

What is listed: private (underscore) attributes and methods of the trainers that the adapters
read, set, call or override; names imported from a package's inner modules
(``transformers.trainer``, ``accelerate.utils``, ``trl.trainer.utils``, ...); TRL methods whose
computation the adapters reproduce, and the fields of TRL's fused LM head output they read.
Public hooks of ``transformers.Trainer`` (``training_step``, ``compute_loss``, ``log``,
``save_model``, ...) and the trainers' public configuration attributes are not listed.

Porting to a new release means reading this file against it. The adapters

* call :func:`require` first in their constructor (``ODCTrainerMixin.__init__``, with the
  adapter's users: ``"trainer"`` for all, ``"sft"``, ``"dpo"``, ``"grpo"``), so a release that
  lacks a listed name is refused before anything runs, naming the symbol, the installed version
  and the version it was read in;
* reach the listed names through :func:`read`, :func:`write`, :func:`call` and :func:`load` (an
  unlisted name is a ``KeyError``; ``tests/test_compat.py`` also checks the adapters' source).

The GRPO adapter reproduces ``GRPOTrainer._compute_loss`` of TRL 1.16 and is refused on any
other TRL line (:data:`PINS`). ``tests/test_compat.py`` checks every entry against the installed
packages.
"""

from __future__ import annotations

from torch_odc.integrations._manifest import (
    CLASS,
    CONSTANT,
    FIELD,
    FUNCTION,
    INSTANCE,
    METHOD,
    OVERRIDE,
    READ_BY,
    REPRODUCED,
    Entry,
    Manifest,
    Pin,
    UnsupportedVersion,
)

__all__ = [
    "ENTRIES",
    "MANIFEST",
    "PINS",
    "UnsupportedVersion",
    "call",
    "check",
    "count_train_tokens",
    "load",
    "read",
    "require",
    "write",
]

TRANSFORMERS = "5.23.0"
ACCELERATE = "1.15.0"
TRL = "1.16.0"
VERIFIED_TRL_GRPO = "1.16."  # the GRPO adapter's loss and metrics follow TRL 1.16's

_ALL = ("trainer",)  # the core (every adapter)
_TRL_COUNTERS = ("sft", "dpo")


def _t(owner, name, kind, why, users=_ALL, params=()):
    return Entry("transformers", owner, name, kind, TRANSFORMERS, why, users, tuple(params))


def _a(owner, name, kind, why, users=_ALL, params=()):
    return Entry("accelerate", owner, name, kind, ACCELERATE, why, users, tuple(params))


def _trl(owner, name, kind, why, users, params=()):
    return Entry("trl", owner, name, kind, TRL, why, users, tuple(params))


_TRAINER = "transformers.Trainer"

ENTRIES: tuple[Entry, ...] = (
    # -- transformers.Trainer: checkpoints (the core's FSDP2 save/resume on CPU and GPU ranks) --
    _t(
        _TRAINER,
        "_save_checkpoint",
        OVERRIDE,
        "refuses a save inside an optimizer step (before its barrier), then the Trainer's",
        params=("model", "trial"),
    ),
    _t(
        _TRAINER,
        "_save_optimizer_and_scheduler",
        OVERRIDE,
        "saves model and optimizer with accelerate's FSDP2 functions and the module's plugin",
        params=("output_dir",),
    ),
    _t(
        _TRAINER,
        "_load_from_checkpoint",
        OVERRIDE,
        "loads the sharded model with accelerate's FSDP2 function (CPU ranks: once sharded)",
        params=("resume_from_checkpoint", "model"),
    ),
    _t(
        _TRAINER,
        "_load_optimizer_and_scheduler",
        OVERRIDE,
        "loads the FSDP2 optimizer state and the scheduler as the Trainer's FSDP branch does",
        params=("checkpoint",),
    ),
    _t(
        _TRAINER,
        "_load_best_model",
        OVERRIDE,
        "loads the best checkpoint into the sharded model (load_best_model_at_end)",
    ),
    _t(
        _TRAINER,
        "_init_training_state",
        OVERRIDE,
        "restores the adapter's state from trainer_state.json when resuming",
        params=(
            "max_steps",
            "num_update_steps_per_epoch",
            "num_train_epochs",
            "resume_from_checkpoint",
            "trial",
        ),
    ),
    _t(
        _TRAINER,
        "_save",
        METHOD,
        "writes the full state dict gathered from the FSDP2 model (save_model)",
        params=("output_dir", "state_dict"),
    ),
    # -- transformers.Trainer: data and loss --
    _t(
        _TRAINER,
        "_get_collator_with_removed_columns",
        METHOD,
        "the trainer's own collator (unused columns removed) collates the planned microbatches",
        params=("data_collator", "description"),
    ),
    _t(
        _TRAINER,
        "_train_batch_size",
        INSTANCE,
        "the per-device batch: the step's sequences and the unmodified trainer's microbatches "
        "(the derived cap)",
    ),
    _t(
        _TRAINER,
        "_loss_shifts_labels",
        INSTANCE,
        "whether the model's loss shifts the labels: the label tokens counted per step "
        "(read with the default True)",
    ),
    _t(
        _TRAINER,
        "_initial_num_input_tokens_seen",
        INSTANCE,
        "the tokens seen before this session: the logged token throughput (default 0)",
    ),
    _t(
        "transformers.trainer",
        "get_fsdp_ckpt_kwargs",
        FUNCTION,
        "the keyword arguments the Trainer passes to accelerate's FSDP checkpoint functions",
    ),
    _t("transformers.trainer", "SCHEDULER_NAME", CONSTANT, "the scheduler's file in a checkpoint"),
    _t(
        "transformers.trainer",
        "OPTIMIZER_NAME",
        CONSTANT,
        "a non-FSDP optimizer file in a checkpoint (refused on resume)",
    ),
    _t(
        "transformers.trainer",
        "OPTIMIZER_NAME_BIN",
        CONSTANT,
        "the FSDP optimizer's file or directory in a checkpoint",
    ),
    _t(
        "transformers.trainer_callback",
        "ExportableState",
        CLASS,
        "the adapter's callback state saved in trainer_state.json (stateful_callbacks)",
    ),
    _t(
        "transformers.trainer_utils",
        "speed_metrics",
        FUNCTION,
        "the token throughput logged with num_input_tokens_seen (counted once per step)",
        params=("split", "start_time", "num_tokens"),
    ),
    # -- accelerate: FSDP2 on CPU ranks and checkpoints --
    _a(
        "accelerate.utils",
        "fsdp2_prepare_model",
        FUNCTION,
        "CPU ranks: the model is sharded with accelerate's own FSDP2 preparation "
        "(accelerate's MULTI_CPU job drops the FSDP plugin)",
        params=("accelerator", "model"),
    ),
    _a(
        "accelerate.utils",
        "FullyShardedDataParallelPlugin",
        CLASS,
        "CPU ranks: the plugin built from fsdp_config",
    ),
    _a(
        "accelerate.utils",
        "DistributedType",
        CLASS,
        "MULTI_CPU: the job whose model the adapter shards itself",
    ),
    _a("accelerate.utils", "save_fsdp_model", FUNCTION, "the Trainer's FSDP2 checkpoint save"),
    _a("accelerate.utils", "save_fsdp_optimizer", FUNCTION, "the Trainer's FSDP2 checkpoint save"),
    _a("accelerate.utils", "load_fsdp_model", FUNCTION, "the Trainer's FSDP2 checkpoint load"),
    _a("accelerate.utils", "load_fsdp_optimizer", FUNCTION, "the Trainer's FSDP2 checkpoint load"),
    _a(
        "accelerate.Accelerator",
        "_is_accelerate_prepared",
        READ_BY,
        "set on a model the adapter sharded itself: accelerate's prepare() then leaves it as is",
    ),
    # -- TRL: SFTTrainer and DPOTrainer metrics (summed locally, logged once per step) --
    *(
        _trl(f"trl.{cls}", name, INSTANCE, why, (user,))
        for cls, user in (("SFTTrainer", "sft"), ("DPOTrainer", "dpo"))
        for name, why in (
            ("_metrics", "the logged metrics the adapter appends once per step, as TRL would"),
            (
                "_total_train_tokens",
                "TRL's running token count (num_tokens), kept across a checkpoint by the adapter",
            ),
            ("_tp_size", "TRL divides the token count by it"),
        )
    ),
    _trl(
        "trl.DPOTrainer",
        "_is_vision_dataset",
        INSTANCE,
        "a vision dataset's pairs are measured by collating each alone (lengths and patches)",
        ("dpo",),
    ),
    _trl(
        "trl.SFTTrainer",
        "_is_vision_dataset",
        INSTANCE,
        "a vision dataset's rows are measured by collating each alone (tokens and patches)",
        ("sft",),
    ),
    _trl(
        "trl.DPOTrainer",
        "_compute_loss",
        REPRODUCED,
        "called in training microbatches when every loss type is per-pair (its loss, a mean "
        "over the microbatch's pairs, scaled by world x pairs / the step's pairs; its metric "
        "gathers local for the call, its logged values summed for the step); reproduced with "
        "loss_type 'sft' beside per-pair types (a token mean over the microbatch's chosen "
        "tokens: no single per-microbatch scale is exact): per-pair losses, f-divergence "
        "scores, ld_alpha, WPO weights, the reference forward and the metrics",
        ("dpo",),
        params=("model", "inputs", "return_outputs"),
    ),
    _trl(
        "trl.DPOTrainer",
        "gather_for_metrics",
        READ_BY,
        "_compute_loss gathers its metrics through the accelerator (gather_for_metrics, "
        "gather): the adapter hands it an accelerator whose gathers are local for that call",
        ("dpo",),
    ),
    _trl(
        "trl.models.utils",
        "disable_gradient_checkpointing",
        FUNCTION,
        "the reference forward, as TRL runs it",
        ("dpo",),
        params=("model", "gradient_checkpointing_kwargs"),
    ),
    _trl(
        "trl.trainer.utils",
        "use_adapter",
        FUNCTION,
        "the reference forward of a PEFT model (its adapter off, or 'ref')",
        ("dpo",),
        params=("model", "adapter_name"),
    ),
    # The fused LM head TRL patches into the model (add_fused_lm_head): model(...,
    # fused_lm_head=True) returns a FusedCausalLMOutput.
    *(
        _trl(
            "trl.trainer.utils.FusedCausalLMOutput",
            name,
            FIELD,
            "an output of the fused LM head the adapter's loss and metrics read",
            users,
        )
        for name, users in (
            ("log_probs", _TRL_COUNTERS),
            ("entropy", _TRL_COUNTERS),
            ("is_top1", _TRL_COUNTERS),
            ("label_mask", ("sft",)),
            ("mean_logits", ("dpo",)),
            ("log_sum_sq_probs", ("dpo",)),
        )
    ),
    # -- TRL: GRPOTrainer --
    _trl(
        "trl.GRPOTrainer",
        "_prepare_inputs",
        OVERRIDE,
        "TRL's generation and buffering hand out each microbatch's slice; the adapter's "
        "repacked microbatches pass through",
        ("grpo",),
        params=("generation_batch",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_step",
        INSTANCE,
        "TRL's microbatch counter (generation every steps_per_generation * num_iterations "
        "calls), advanced as GRPOTrainer.training_step does",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_buffered_inputs",
        INSTANCE,
        "the slices _prepare_inputs hands out by _step (read only to know, as TRL does, "
        "whether a call generates: a vision batch is checked before it)",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_metrics",
        INSTANCE,
        "the logged metrics the adapter appends once per step, per TRL microbatch",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer", "_tokenizer", INSTANCE, "the pad token of repacked rollouts", ("grpo",)
    ),
    _trl(
        "trl.GRPOTrainer",
        "_is_vlm",
        INSTANCE,
        "a vision-language model's generation batch is checked for mixed image / text-only "
        "prompts (TRL 1.16's processor call raises TypeError on them)",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_image_pad_token_id",
        INSTANCE,
        "the image token a vision rollout's mm_token_type_ids is checked against",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_entropy_bonus_enabled",
        INSTANCE,
        "whether the loss subtracts the entropy bonus",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_last_world_entropy",
        INSTANCE,
        "the adaptive entropy coefficient's state, updated once per step as TRL does",
        ("grpo",),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_get_per_token_logps_and_entropies",
        METHOD,
        "the policy's per-token log-probs and entropies of a repacked microbatch",
        ("grpo",),
        params=(
            "model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
            "compute_entropy",
            "pixel_values",
            "image_grid_thw",
            "num_images",
            "mm_token_type_ids",
        ),
    ),
    _trl(
        "trl.GRPOTrainer",
        "_compute_loss",
        REPRODUCED,
        "the adapter's loss reproduces its per-token loss and metrics with per-row weights: "
        "no per-microbatch scale of TRL's loss is exact where an ODC microbatch holds rows of "
        "several TRL microbatches (bnpo's and the entropy bonus's normalizers differ between "
        "them), TRL's metrics are per TRL microbatch, and its loss gathers them in every call",
        ("grpo",),
        params=("model", "inputs"),
    ),
    _trl(
        "trl.GRPOTrainer",
        "get_off_policy_mask",
        METHOD,
        "TRL's off-policy sequence mask, called as _compute_loss calls it",
        ("grpo",),
        params=(
            "advantages",
            "per_token_logps",
            "sampling_per_token_logps",
            "mask",
            "off_policy_threshold",
        ),
    ),
    _trl(
        "trl.GRPOTrainer",
        "get_gamma_weights",
        METHOD,
        "TRL's VESPO weights, called as _compute_loss calls it",
        ("grpo",),
        params=(
            "advantages",
            "log_ratio_per_token",
            "mask",
            "importance_sampling_ratio",
            "k_pos",
            "lambda_pos",
            "k_neg",
            "lambda_neg",
        ),
    ),
)

PINS: tuple[Pin, ...] = (
    Pin(
        "trl",
        VERIFIED_TRL_GRPO,
        "the GRPO adapter reproduces GRPOTrainer._compute_loss's loss and metrics of this line",
        ("grpo",),
    ),
)

MANIFEST = Manifest("torch_odc.integrations.hf", ENTRIES, PINS)

check = MANIFEST.check
require = MANIFEST.require
read = MANIFEST.read
write = MANIFEST.write
call = MANIFEST.call
load = MANIFEST.load


def count_train_tokens(trainer, tokens: int) -> int:
    """Adds ``tokens`` to TRL's running token count as SFTTrainer and DPOTrainer do (divided by
    ``_tp_size``), logs it as their ``num_tokens`` and returns the new total."""
    total = read(trainer, "_total_train_tokens") + tokens // read(trainer, "_tp_size")
    write(trainer, "_total_train_tokens", total)
    read(trainer, "_metrics")["train"]["num_tokens"] = [total]
    return total
