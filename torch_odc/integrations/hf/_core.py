"""ODC inside the Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` (this module: set-up, data and
the step; ``_config`` the configuration, ``_steps`` the step loader, ``_checkpoints`` the
Trainer's checkpoints; the plan, the padded-token arithmetic, the derived cap and the metric
reduction are the step core's, :mod:`torch_odc.step`): LB-Mini plans per optimizer
step, any number of microbatches per rank (zero included), one barrier per step.

    import torch_odc
    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    dist.init_process_group("odc")          # before TrainingArguments / SFTConfig
    args = SFTConfig(..., fsdp=True, fsdp_config={"version": 2})
    trainer = odc_trainer(SFTTrainer)(model=model, args=args, train_dataset=ds)
    # odc=ODCConfig(...) changes a default: the cap, the cost model, the planner
    trainer.train()

What the returned subclass changes in the Trainer (docs/integrations/trl.md has the whole story):

* **One optimizer step = one item of the training dataloader**: the step's sequences are the
  next ``per_device_train_batch_size * gradient_accumulation_steps * world_size`` of the epoch's
  order (the Trainer's global batch; shuffled from ``data_seed``/``seed`` and the epoch, the same
  on every rank). LB-Mini (:func:`torch_odc.step.plan_step`) splits them over ranks by their lengths
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
import math
import time

import torch

import torch_odc
from torch_odc import step as core

from . import _compat
from ._checkpoints import ODCCheckpointMixin, _AcceleratorWithPlugin
from ._config import ODCConfig, Planner  # noqa: F401  (re-exported)
from ._steps import ODCStep, _only, _sequence_lengths, _StepData, _StepKeys, _StepLoader

__all__ = ["ODCConfig", "ODCStep", "ODCTrainerMixin"]

IGNORE_INDEX = -100


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
            "device_map unset (the adapter loads the model whole, device_map=None)"
        )
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


class ODCTrainerMixin(ODCCheckpointMixin):
    """Mixes ODC into a ``transformers.Trainer`` subclass: ``class T(ODCTrainerMixin, Trainer)``
    (or :func:`odc_trainer`). The constructor takes one keyword more, ``odc=ODCConfig(...)``.

    After training, ``odc_steps`` holds per optimizer step the microbatch count of every rank,
    the step's label tokens, and this rank's host seconds in the step's parts (``host_seconds``:
    collating, the loss totals' all-reduce, each microbatch's forward and backward as the
    host saw them, the barrier, the metrics' all-reduce; where the host waits on the device,
    the device's time shows in the part that waits)."""

    # The compatibility manifest's users this adapter needs (see _compat.require).
    _odc_compat_users: tuple[str, ...] = ("trainer",)
    _odc_where = "torch_odc.integrations.hf"
    # Whether the core plans each optimizer step from the dataset: its own dataloader yields
    # one ODCStep per step and the Trainer runs with gradient_accumulation_steps = 1. An adapter
    # whose rows exist only inside the trainer's step (GRPO's rollouts) sets False: the
    # trainer's own dataloader and accumulation stay.
    _odc_steps_from_dataset = True

    def __init__(self, *args, odc: ODCConfig | None = None, **kwargs):
        # First: a transformers / accelerate / TRL release without what the adapter uses is
        # refused here, naming it, not with an AttributeError mid-step.
        _compat.require(self._odc_compat_users, self._odc_where)
        if odc is None:
            odc = self._odc_default_config()
        if not isinstance(odc, ODCConfig):
            raise TypeError(
                "torch_odc.integrations.hf: odc= takes an ODCConfig (or None for "
                f"the defaults), got {type(odc).__name__}"
            )
        args, kwargs = _load_models_whole(type(self), args, kwargs)
        super().__init__(*args, **kwargs)
        self.odc = odc
        self._odc_autocap = core.AutoCap()
        self._odc_check_args()
        # The step's sequences: the Trainer's global batch (its "total train batch size").
        self._odc_sequences_per_step = (
            _compat.read(self, "_train_batch_size")
            * self.args.world_size
            * self.args.gradient_accumulation_steps
        )
        # The Trainer's loop draws one ODCStep per optimizer step; the counting of input tokens
        # (one gather per microbatch otherwise) moves into the step's metrics reduction.
        args = copy.copy(self.args)
        if self._odc_steps_from_dataset:
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
        # The run's peak so far, allocator plus ODC, per phase of what ODC held (_odc_note_peak).
        self.odc_peak_bytes = 0
        # Host seconds in free / restore of the gradient memory (the GRPO adapter), so far.
        self.odc_gradient_memory_s = 0.0
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
            raise ValueError(
                f"{where}: ODC serves FSDP2: set fsdp=True and "
                "fsdp_config={'version': 2} in the training arguments"
            )
        if plugin.get("cpu_offload"):
            raise ValueError(f"{where}: fsdp_config cpu_offload is not supported by ODC")
        if a.auto_find_batch_size:
            raise ValueError(
                f"{where}: auto_find_batch_size is not supported (the step's size is the plan's)"
            )
        if a.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(
                f"{where}: train_sampling_strategy={a.train_sampling_strategy!r}: "
                "ODC plans the step itself (LB-Mini); use 'random' or 'sequential'"
            )
        if getattr(self, "is_deepspeed_enabled", False) or a.parallelism_config is not None:
            raise ValueError(
                f"{where}: DeepSpeed and parallelism_config (TP/CP/SP) are not supported"
            )
        if not a.average_tokens_across_devices:
            raise ValueError(
                f"{where}: average_tokens_across_devices=False: ODC normalizes the "
                "loss by the step's token count over all ranks; set it to True"
            )
        self._odc_check_loss()

    def _odc_check_loss(self) -> None:
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            raise ValueError(
                "torch_odc.integrations.hf: the model's loss does not take num_items_in_batch "
                f"({type(self.model).__name__}.forward has no **kwargs), so the Trainer would "
                "average it per microbatch: the gradient would depend on how sequences are "
                "split. Pass a compute_loss_func that sums token losses and divides by "
                "num_items_in_batch."
            )

    def get_total_train_batch_size(self, args) -> int:
        n = getattr(self, "_odc_sequences_per_step", None)
        return n if n is not None else super().get_total_train_batch_size(args)

    def _odc_shards_itself(self) -> bool:
        DistributedType = _compat.load("accelerate.utils", "DistributedType")
        return (
            not self.is_fsdp_enabled
            and self.accelerator.distributed_type == DistributedType.MULTI_CPU
        )

    def create_optimizer(self, model=None):
        # The Trainer creates the optimizer right before accelerator.prepare(model, optimizer).
        # On CPU ranks accelerate would wrap the model in DDP: shard it here first, with
        # accelerate's own FSDP2 preparation, so that the optimizer holds the sharded parameters.
        if self._odc_shards_itself():
            self._odc_shard_like_accelerate()
        return super().create_optimizer(model)

    def _odc_shard_like_accelerate(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        FullyShardedDataParallelPlugin = _compat.load(
            "accelerate.utils", "FullyShardedDataParallelPlugin"
        )
        fsdp2_prepare_model = _compat.load("accelerate.utils", "fsdp2_prepare_model")

        if any(isinstance(m, FSDPModule) for m in self.model.modules()):
            return
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        if plugin.activation_checkpointing or plugin.cpu_ram_efficient_loading:
            raise ValueError(
                "torch_odc.integrations.hf: on CPU ranks the module shards the model "
                "itself, without fsdp_config activation_checkpointing or "
                "cpu_ram_efficient_loading"
            )
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
                "fsdp_config={'version': 2} in the training arguments"
            )
        handle = torch_odc.attach(self.model, eager_publish=self.odc.eager_publish)
        if not handle.on_demand and self.args.world_size > 1:
            # FSDP2's collectives would run in every microbatch, and this adapter's ranks run
            # different numbers of them: a hang, or gradients reduced over mismatched calls.
            raise RuntimeError(
                f"torch_odc.integrations.hf (rank {self.args.process_index}): ODC cannot serve "
                f"this model on demand here ({handle.collective_reason}), and the ODC trainer "
                "runs different numbers of microbatches per rank, which FSDP2's collectives "
                "cannot: train with the unmodified trainer in this setup"
            )
        self._odc_handle = handle

    def _odc_detach(self) -> None:
        if self._odc_handle is not None:
            # What ODC held beside torch's allocator (shard cache, accumulators, control words):
            # not in torch.cuda.max_memory_allocated(); a run's peak is the sum of both.
            self._odc_note_peak()
            memory = self._odc_handle.stats().get("memory", {})
            self.odc_memory_bytes = int(sum(memory.values()))
            self._odc_handle.detach()
            self._odc_handle = None

    def _odc_note_peak(self) -> None:
        """Before what ODC holds beside torch's allocator changes (free / restore of the gradient
        memory, detach): the peak of the phase that ends, allocator plus ODC, joins the run's
        (``odc_peak_bytes``), and the allocator's peak statistics restart for the next phase."""
        if self._odc_handle is None or not torch.cuda.is_available():
            return
        held = int(sum(self._odc_handle.stats().get("memory", {}).values()))
        self.odc_peak_bytes = max(
            getattr(self, "odc_peak_bytes", 0), torch.cuda.max_memory_allocated() + held
        )
        torch.cuda.reset_peak_memory_stats()

    def _odc_free_gradient_memory(self) -> bool:
        """Every rank, after the optimizer step and zero_grad(), before a phase without
        gradients (RL generation): the accumulators' memory goes back to the device until
        :meth:`_odc_restore_gradient_memory` (or the first backward). Whether it was freed."""
        if self._odc_handle is None:
            return False
        self._odc_note_peak()
        start = time.perf_counter()
        freed = self._odc_handle.free_gradient_memory()
        self.odc_gradient_memory_s += time.perf_counter() - start
        return freed

    def _odc_restore_gradient_memory(self) -> None:
        """Every rank, where the ranks meet anyway before the step's first backward."""
        if self._odc_handle is None:
            return
        self._odc_note_peak()
        start = time.perf_counter()
        self._odc_handle.restore_gradient_memory()
        self.odc_gradient_memory_s += time.perf_counter() - start

    # -- data ----------------------------------------------------------------------------------

    def _odc_row_lengths(self, dataset) -> list[tuple[int, ...]]:
        """Per training row, the token lengths of the sequences it becomes in a microbatch (one
        for a language-modeling row). A step's rows are planned by their summed length against
        the token cap, and by the sum of their sequences' costs; a row is never split.
        Adapters whose rows have no ``input_ids`` (preference pairs) override this."""
        key = getattr(self.model, "main_input_name", "input_ids")
        return [(n,) for n in _sequence_lengths(dataset, key)]

    def _odc_row_images(self, dataset) -> list[tuple[int, ...]] | None:
        """Per training row, the vision patches of each of its images (a vision-language
        dataset; ``()`` for a text-only row), or None for a dataset without images. Called
        after :meth:`_odc_row_lengths`. A row's images are planned with it: its patches count
        in its cost, against an explicit cap with its tokens, and in the derived cap's
        frontier (``_StepData.plain_up_to``); the collated microbatch must carry exactly them
        (:meth:`_odc_check_images`)."""
        return None

    def _odc_collator_pads(self, collator) -> bool:
        """Whether ``collator`` pads a microbatch's length to its ``pad_to_multiple_of``."""
        return hasattr(collator, "pad_to_multiple_of")

    def get_train_dataloader(self):
        if not self._odc_steps_from_dataset:
            return super().get_train_dataloader()
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise ValueError(
                "torch_odc.integrations.hf: the training dataset must have a length "
                "(LB-Mini plans each step from its sequences' lengths)"
            )
        rows = [tuple(int(n) for n in r) for r in self._odc_row_lengths(dataset)]
        if len(rows) != len(dataset):
            raise ValueError(
                f"torch_odc.integrations.hf: {len(rows)} row lengths for a training "
                f"dataset of {len(dataset)} rows"
            )
        images = self._odc_row_images(dataset)
        if images is not None:
            images = [tuple(int(n) for n in im) for im in images]
            if len(images) != len(rows):
                raise ValueError(
                    f"torch_odc.integrations.hf: {len(images)} rows' images for a "
                    f"training dataset of {len(rows)} rows"
                )
        patches = [sum(im) for im in images] if images is not None else None
        args, workers = self.args, self.args.dataloader_num_workers
        steps = _StepData(
            dataset,
            _compat.call(
                self,
                "_get_collator_with_removed_columns",
                self._odc_collator(),
                description="training",
            ),
            # LB-Mini's lengths (against an explicit cap): a row's tokens and vision patches.
            [sum(r) + (patches[k] if patches else 0) for k, r in enumerate(rows)],
            self._odc_sequences_per_step,
            args.world_size,
            args.process_index,
            self.odc.planner or core.LBMini.from_config(self.odc),
            shuffle=args.train_sampling_strategy == "random",
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
            costs=(
                core.row_costs(rows, self.odc.cost, self.odc.cost_args, images)
                if self.odc.planner is None
                else None
            ),
            **(
                {
                    "rows": rows,
                    "per_device": _compat.read(self, "_train_batch_size"),
                    "padding_free": self._odc_padding_free(),
                    "plain_multiple": self._odc_plain_multiple,
                    "patches": patches,
                }
                if self.odc.auto_cap
                else {}
            ),
        )
        self._odc_rows_of_dataset = rows
        self._odc_images_of_dataset = images
        self._odc_steps_per_epoch = steps.num_steps()
        return _StepLoader(
            steps,
            batch_sampler=_StepKeys(steps),
            collate_fn=_only,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=bool(workers and args.dataloader_persistent_workers),
            prefetch_factor=args.dataloader_prefetch_factor if workers else None,
        )

    def _odc_collator(self):
        """The trainer's collator for ODC's microbatches: a copy padding the sequence length up
        to ``ODCConfig.pad_to_multiple_of`` (see there), or the collator itself. Sets the
        multiples ODC's and the unmodified trainer's microbatches are padded to."""
        collator, free = self.data_collator, self._odc_padding_free()
        own = getattr(collator, "pad_to_multiple_of", None) or 1
        self._odc_plain_multiple = self._odc_multiple = 1 if free else own
        want = self.odc.pad_to_multiple_of
        if want is None:
            takes = self._odc_collator_pads(collator) and not free
            want = ODCConfig.AUTO_PAD_MULTIPLE if takes and self.args.device.type == "cuda" else 1
        if want == 1:
            return collator
        name = type(collator).__name__
        if free:
            raise ValueError(
                f"torch_odc.integrations.hf: ODCConfig.pad_to_multiple_of={want} "
                "with a padding-free collator (its rows are concatenated, not "
                "padded): leave it None"
            )
        if not self._odc_collator_pads(collator):
            raise ValueError(
                f"torch_odc.integrations.hf: ODCConfig.pad_to_multiple_of={want}, "
                f"but the data collator {name} takes no pad_to_multiple_of"
            )
        self._odc_multiple = multiple = math.lcm(own, want)
        if multiple != own:
            collator = copy.copy(collator)
            collator.pad_to_multiple_of = multiple
        return collator

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
            raise ValueError(
                "torch_odc.integrations.hf: a microbatch without 'labels': the "
                "step's token count (the loss's denominator) needs them"
            )
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
                seen = self.state.num_input_tokens_seen - _compat.read(
                    self, "_initial_num_input_tokens_seen", 0
                )
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
        backward, the barrier at the latest.

        A unit of the head alone whose weight trains (a vision-language model: accelerate looks
        for the final norm among the base model's children, and Qwen2-VL's is inside its
        language model) also needs ODC's own pre-forward of the unit, which a forward would
        run: it notes, once per minibatch, the unsharded parameters whose gradients the unit's
        reduce-scatter then pushes. Without it the reduce-scatter finds no parameter that got
        a gradient and stops ("reduce-scatter of FSDP unit 'lm_head' covers ... (none)")."""
        from torch.distributed.fsdp import FSDPModule

        head = self.accelerator.unwrap_model(self.model).get_output_embeddings()
        if isinstance(head, FSDPModule):
            head.unshard()
            if self._odc_handle is not None:
                torch_odc._attach.pre_forward_without_call(self._odc_handle, head)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not isinstance(inputs, ODCStep):
            raise TypeError(
                "torch_odc.integrations.hf: training_step expects an ODCStep from the "
                "module's own train dataloader, got " + type(inputs).__name__
            )
        step = inputs
        self._odc_check_position(step)
        clock = time.perf_counter()
        host: dict = {}

        def lap(part: str | None = None) -> float:
            nonlocal clock
            now = time.perf_counter()
            seconds, clock = now - clock, now
            if part is not None:
                host[part] = seconds
            return seconds

        if step.assigned is not None and step.microbatches is None:
            self._odc_materialize(step)
        self._odc_check_images(step)
        lap("collate")
        # Until the barrier returns, a checkpoint is refused (see _odc_check_save_point).
        self._odc_step_in_progress = step
        # The loss's denominators (the step's label tokens, ...) over all ranks, known before
        # the first forward (every rank calls this once per step, also with no microbatch).
        local = self._odc_step_totals(step)
        self._odc_totals = (
            dict(zip(local, core.all_reduce_sums(list(local.values())), strict=True))
            if local
            else {}
        )
        num_items = None
        if "label_tokens" in self._odc_totals:
            num_items = torch.tensor(
                self._odc_totals["label_tokens"], dtype=torch.float32, device=self.args.device
            )
        lap("totals")
        host["microbatches"] = []
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
                if probe is not None:
                    self._odc_autocap.stop()
                host["microbatches"].append(lap())
        finally:
            self._odc_in_step = False
            if probe is not None:
                probe.remove()
        # After this rank's last backward, before the Trainer clips and takes the grad norm.
        torch_odc.minibatch_barrier()
        lap("barrier")
        self._odc_step_in_progress = None
        if probe is not None:
            self._odc_autocap.finish_step(self._odc_handle)
        if keys:
            self._odc_record_metrics(
                dict(
                    zip(keys, core.all_reduce_sums([self._odc_sums[k] for k in keys]), strict=True)
                )
            )
        lap("metrics")
        record = {
            "epoch": step.epoch,
            "step": step.step,
            "microbatches": list(step.counts),
            **{k: int(v) for k, v in self._odc_totals.items()},
            "host_seconds": host,
        }
        if step.cap is not None:
            record.update(
                cap=step.cap,
                plain_tokens=step.plain_tokens,
                padded_tokens=max(
                    (self._odc_batch_tokens(b) for b in step.microbatches), default=0
                ),
                **step.work,
                **self._odc_autocap.describe(),
            )
            if step.cap_frontier is not None:
                record.update(cap_frontier=step.cap_frontier, plain_frontier=step.plain_frontier)
        if getattr(self, "_odc_images_of_dataset", None) is not None:
            from . import _vision

            # This rank's microbatches: their dataset rows, and as collated (padded tokens,
            # vision patches) each.
            record["microbatch_rows"] = [list(mb) for mb in step.indices]
            record["microbatch_sizes"] = [
                (self._odc_batch_tokens(b), sum(_vision.image_patches(b, self._odc_where)))
                for b in step.microbatches
            ]
        self.odc_steps.append(record)
        return total.detach()

    # -- the derived cap -----------------------------------------------------------------------

    def _odc_materialize(self, step: ODCStep) -> None:
        """Packs every rank's rows of a step planned for the derived cap into microbatches of
        at most the step's cap in padded tokens (every rank computes every rank's packing, the
        same way: the counts agree) and collates this rank's."""
        rows, free = self._odc_rows_of_dataset, self._odc_padding_free()
        odc, plain = self._odc_multiple, self._odc_plain_multiple
        images = self._odc_images_of_dataset
        patches = None
        if step.plain_frontier is not None:
            # Rows with images: no microbatch holds more padded tokens and more patches than
            # one of the unmodified trainer's so far (each point's tokens less ODC's extra).
            step.cap_frontier = cap = [
                (self._odc_autocap.cap(t), p) for t, p in step.plain_frontier
            ]
            step.cap = max(t for t, _ in cap)
            patches = [sum(im) for im in images]
        else:
            step.cap = cap = self._odc_autocap.cap(step.plain_tokens)
        per_rank = core.pack_shares(
            [[a] for a in step.assigned],
            lambda i: core.row_shape(rows[i], free),
            lambda dims: core.round_up(dims[0], odc) if dims else 1,
            cap,
            patches.__getitem__ if patches is not None else None,
        )
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
        chunks = [order[i : i + per_device] for i in range(0, len(order), per_device)]
        step.work = {
            "padded_per_rank": [
                sum(core.padded_tokens([rows[i] for i in mb], free, odc) for mb in p)
                for p in per_rank
            ],
            "plain_padded_per_rank": [
                sum(core.padded_tokens([rows[i] for i in c], free, plain) for c in chunks[r::world])
                for r in range(world)
            ],
        }
        if patches is not None:  # and the vision patches each rank's step runs
            step.work.update(
                patches_per_rank=[sum(patches[i] for i in a) for a in step.assigned],
                plain_patches_per_rank=[
                    sum(patches[i] for c in chunks[r::world] for i in c) for r in range(world)
                ],
            )

    def _odc_check_images(self, step: ODCStep) -> None:
        """Each collated microbatch carries exactly its rows' images, in order (what was
        planned for it): a row's images travel with the row to whichever microbatch and rank
        the plan gives it."""
        images = getattr(self, "_odc_images_of_dataset", None)
        if images is None:
            return
        from . import _vision

        for batch, mb in zip(step.microbatches, step.indices, strict=True):
            _vision.check_microbatch(
                batch,
                self._odc_microbatch_images(mb, images),
                f"{self._odc_where}: step {step.step}",
            )

    def _odc_microbatch_images(self, rows, images) -> list[int]:
        """The patches of each image a microbatch of ``rows`` (dataset indices, in order)
        carries once collated: its rows' images in row order."""
        return [n for i in rows for n in images[i]]

    def _odc_probe(self, model):
        """While the derived cap is still measuring (the first step on GPUs): a forward hook
        on the model that tells the derived cap (:class:`torch_odc.step.AutoCap`) where each microbatch's forward ends."""
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
                "sequences than the uninterrupted run."
            )

    def floating_point_ops(self, inputs) -> int:
        if isinstance(inputs, ODCStep):
            return sum(
                super(ODCTrainerMixin, self).floating_point_ops(b) for b in inputs.microbatches
            )
        return super().floating_point_ops(inputs)
