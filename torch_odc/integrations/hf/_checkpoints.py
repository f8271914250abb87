"""The Trainer's own checkpoints under ODC, one path on CPU and GPU ranks alike: the checkpoint
methods of :class:`ODCTrainerMixin` (each one the Trainer's, called by its save and resume
code) and the accelerate wrappers they need."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import _compat

__all__ = ["ODCCheckpointMixin"]


class _WithPlugin:
    """An accelerate state object with the FSDP plugin set; everything else the real one's."""

    def __init__(self, state, plugin):
        self._state, self.fsdp_plugin = state, plugin

    def __getattr__(self, name):
        return getattr(self._state, name)


def _off_local_rank_device(accelerator) -> bool:
    """Whether this rank's GPU is not ``cuda:<local rank>`` (ranks sharing one GPU)."""
    return (
        torch.cuda.is_available()
        and torch.cuda.is_initialized()
        and torch.cuda.current_device() != accelerator.local_process_index
    )


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


class ODCCheckpointMixin:
    """The checkpoint half of :class:`ODCTrainerMixin` (which sets the attributes used here:
    ``_odc_step_in_progress``, ``_odc_callback_name``, ``_odc_fsdp_plugin_cpu``,
    ``_odc_model_checkpoint``)."""

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
            "rank after the barrier and the optimizer step."
        )

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

            options = StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True
            )
            state_dict = get_model_state_dict(self.model, options=options)
            _compat.call(
                self,
                "_save",
                output_dir if output_dir is not None else self.args.output_dir,
                state_dict=state_dict,
            )
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
            load_fsdp_model(
                self.odc_fsdp_plugin,
                self._odc_fsdp_accelerator(),
                model if model is not None else self.model,
                resume_from_checkpoint,
                **get_fsdp_ckpt_kwargs(),
            )
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
            _compat.load("transformers.trainer", name)
            for name in (
                "OPTIMIZER_NAME",
                "OPTIMIZER_NAME_BIN",
                "SCHEDULER_NAME",
                "get_fsdp_ckpt_kwargs",
            )
        )

        # As the Trainer: a checkpoint without optimizer state (save_only_model) loads the model.
        names = os.listdir(checkpoint)
        has_optimizer = OPTIMIZER_NAME_BIN in names or any(
            n.startswith(OPTIMIZER_NAME_BIN.split(".")[0])
            and os.path.isdir(os.path.join(checkpoint, n))
            for n in names
        )
        if not (has_optimizer and SCHEDULER_NAME in names):
            if OPTIMIZER_NAME in names:
                raise ValueError(
                    f"torch_odc.integrations.hf: {checkpoint} holds a non-FSDP "
                    "optimizer state; it cannot resume an FSDP2 model"
                )
            return None
        load_fsdp_optimizer(
            self.odc_fsdp_plugin,
            self._odc_fsdp_accelerator(),
            self.optimizer,
            self.model,
            checkpoint,
            **get_fsdp_ckpt_kwargs(),
        )
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        )
        return None

    def _load_best_model(self) -> None:
        if not self._odc_sharded():
            return super()._load_best_model()
        load_fsdp_model = _compat.load("accelerate.utils", "load_fsdp_model")
        get_fsdp_ckpt_kwargs = _compat.load("transformers.trainer", "get_fsdp_ckpt_kwargs")
        load_fsdp_model(
            self.odc_fsdp_plugin,
            self._odc_fsdp_accelerator(),
            self.model,
            self.state.best_model_checkpoint,
            **get_fsdp_ckpt_kwargs(),
        )
        return None

    def _odc_checkpoint_state(self) -> dict:
        """What the adapter carries across a save and resume besides the Trainer's own state
        (model, optimizer, scheduler, RNG, TrainerState with the global step and
        ``num_input_tokens_seen``): JSON values, the same on every rank (rank 0's are written,
        into trainer_state.json's ``stateful_callbacks``). Adapters add theirs."""
        return {}

    def _odc_restore_checkpoint_state(self, state: dict) -> None:
        """Restores what :meth:`_odc_checkpoint_state` returned, when resuming."""

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        out = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is not None:
            saved = self.state.stateful_callbacks.get(self._odc_callback_name)
            if isinstance(saved, list):
                saved = saved[0]
            if saved is None or "odc" not in saved.get("attributes", {}):
                import warnings

                warnings.warn(
                    f"torch_odc.integrations.hf: {resume_from_checkpoint} has no ODC "
                    "state (not saved by odc_trainer): metrics the trainer "
                    "accumulates across steps restart from zero",
                    stacklevel=2,
                )
            else:
                self._odc_restore_checkpoint_state(saved["attributes"]["odc"])
        return out
