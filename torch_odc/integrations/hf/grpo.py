"""The TRL ``GRPOTrainer`` adapter: TRL generates, scores and buffers the rollouts as it always
does; per optimizer step the adapter repacks them into microbatches of at most
``max_tokens_per_microbatch`` unpadded tokens, optionally after moving rollouts between ranks
so that every rank's step costs the same (LB-Mini over the step's rollouts), and gives every
token the weight TRL's own microbatch would have given it. docs/integrations/trl-grpo.md
has the whole story.

How a step runs. The Trainer's loop still calls ``training_step`` once per TRL microbatch
(``gradient_accumulation_steps`` calls per optimizer step); each call lets TRL hand out its
slice (``_prepare_inputs``: generation every ``steps_per_generation * num_iterations`` calls,
TRL's shuffle and split) and keeps it. At the step's last call the rank:

1. turns the kept slices into rows (prompt, completion, advantages, old/reference/sampling
   log-probs, tool mask) and notes, per slice, what TRL's loss normalizes by (its rows, its
   loss tokens, the generation batch's token count);
2. with ``rebalance`` on, through the step core (:mod:`torch_odc.step`): every row's length
   and the slices' normalizers gathered (``gather_rows``: one ``all_gather_object``), the same
   LB-Mini plan on every rank (``plan_step``), and ``StepRows.exchange`` moving the rows (all their
   tensors, one all-to-all of their bytes) to the ranks the plan names; off: packs its own
   rows;
3. runs its microbatches (any number, zero included), padding trimmed per microbatch, through
   the Trainer's ``training_step``: each is a :class:`torch_odc.step.Microbatch`, TRL's tensors
   plus per-row weights that reproduce TRL's normalization for the row's own TRL slice (below),
   which ``compute_loss`` recognizes;
4. calls :func:`torch_odc.minibatch_barrier` (the Trainer clips right after), then reduces the
   metrics TRL gathers in every microbatch (KL, entropy, clip ratios, policy loss) once, per
   TRL microbatch index, and appends them as TRL would have.

The weights. TRL's gradient for one optimizer step is (1/W) sum over ranks and TRL microbatches
of the gradient of that microbatch's loss (W ranks; FSDP2 and ODC average over ranks). For each
``loss_type`` (TRL 1.16, ``GRPOTrainer._compute_loss``) a row i of TRL slice s (B_s rows, N_s
loss tokens, of a generation batch with N_gen loss tokens over all ranks), in a step of g TRL
microbatches, contributes sum_t l_it times:

    grpo, sapo       1 / (W B_s g max(n_i, 1))     (n_i: the row's loss tokens)
    bnpo             1 / (W g max(N_s, 1))
    dr_grpo          1 / (W B_s g max_completion_length)
    luspo            1 / (W B_s g)
    dapo, cispo,     steps_per_generation / (g max(N_gen, 1))
    vespo

where l_it is TRL's per-token loss (clipped or soft-gated ratio times advantage, plus beta times
the KL term, with the off-policy mask; every factor of it a function of the row alone). The
entropy bonus subtracts entropy_coef / (W g max(N_s, 1)) times the row's entropy sum. Each rank
returns W times its rows' share, so the average over ranks is TRL's loss and the gradient is
TRL's, wherever the rows ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import torch

import torch_odc
from torch_odc import step as core
from torch_odc._clock import _profiling

from . import _compat
from ._config import ODCConfig
from ._core import ODCTrainerMixin

__all__ = ["ODCGRPOConfig", "ODCGRPOTrainerMixin"]

WHERE = "torch_odc.integrations.hf (GRPOTrainer)"
# The loss and metric code below follows GRPOTrainer._compute_loss of this TRL line: any other is
# refused at construction (the pin in the compatibility manifest, _compat.PINS).
VERIFIED_TRL = _compat.VERIFIED_TRL_GRPO

# What a TRL slice may hold, by how its rows are laid out. Anything else is refused: the adapter
# would not know how to trim, move or weight it.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # left-padded
COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
)  # right-padded
ROW_KEYS = ("advantages",)  # (B,), or (B, T) completion-aligned from a subclass
STEP_KEYS = ("num_items_in_batch",)  # the generation batch's loss tokens over all ranks
# A vision-language model of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): TRL 1.16's slice also
# carries the ragged pixel_values (one row per patch) split per image by image_grid_thw,
# num_images (a list: images per rollout) and mm_token_type_ids (prompt + completion columns;
# 1 at the prompt's image tokens). Other families' fields (image_sizes, pixel_attention_mask,
# spatial_shapes, num_tiles, token_type_ids, image_position_ids) are refused by name.
VISION_KEYS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
# The vision tensors of a row, as _Rows holds them: its images' patches (rows, patches, D) and
# grids (rows, images, 3), zero-padded; per row (images, patches) under _VISION.
_VISION = "\0odc_vision"

SEQUENCE_MEAN_LOSSES = ("grpo", "sapo")
LOSS_TYPES = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo", "dapo", "cispo", "vespo")
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # log clip_ratio/*

# Per-slice metric sums (reduced once per step; a slice = one TRL microbatch index).
SUMS = (
    "kl",
    "entropy",
    "token_count",
    "low",
    "high",
    "region",
    "clip_count",
    "cispo",
    "phi",
    "row_count",
    "policy",
)


@dataclasses.dataclass
class ODCGRPOConfig(ODCConfig):
    """:class:`ODCConfig` plus the GRPO adapter's own switch.

    Attributes:
        rebalance: after generation, move rollouts between ranks so that every rank's step
            costs the same under ``cost`` (LB-Mini over the step's rollouts of all ranks: one
            all-gather of the lengths, one all-to-all of the rows). Off: every rank packs its
            own rollouts. A plain :class:`ODCConfig` means on.

    ``planner(lengths, world_size, step)`` replaces LB-Mini as in :class:`ODCConfig`; with
    ``rebalance`` off it is called with this rank's lengths and a world of 1.
    """

    rebalance: bool = True


# The rows' meta travels beside TRL's tensors under a name no TRL key has.
_META = "\0odc_meta"


class _Rows:
    """A rank's rollouts of one step as rows: prompt tensors left-padded to one width,
    completion tensors right-padded to one width, and per row (source rank, TRL slice, prompt
    length, completion length, loss tokens)."""

    META = ("src", "slice", "prompt_len", "completion_len", "loss_tokens")

    def __init__(self, tensors: dict, meta: torch.Tensor):
        self.tensors, self.meta = tensors, meta

    def __len__(self) -> int:
        return self.meta.size(0)

    def lengths(self) -> list[int]:
        """Unpadded tokens per row (prompt + completion), plus its images' vision patches for a
        vision-language model: what a microbatch's cap counts."""
        n = self.meta[:, 2] + self.meta[:, 3]
        if _VISION in self.tensors:
            n = n + self.tensors[_VISION][:, 1]
        return n.clamp(min=1).tolist()

    def images(self) -> list[tuple[int, ...]] | None:
        """Per row the vision patches of each of its images (None without images)."""
        if _VISION not in self.tensors:
            return None
        grid = self.tensors["image_grid_thw"].prod(-1).tolist()
        return [
            tuple(g[:k]) for g, k in zip(grid, self.tensors[_VISION][:, 0].tolist(), strict=True)
        ]

    def shapes(self) -> list[tuple[int, int]]:
        """(prompt length, completion length) per row: a microbatch is padded to its longest
        prompt plus its longest completion (the derived cap's padded tokens)."""
        return [tuple(r) for r in self.meta[:, 2:4].tolist()]


class ODCGRPOTrainerMixin(ODCTrainerMixin):
    """For TRL's ``GRPOTrainer``: ``class T(ODCGRPOTrainerMixin, GRPOTrainer)`` (or
    ``odc_trainer(GRPOTrainer)``). Takes ``odc=ODCConfig(...)`` or ``ODCGRPOConfig(...)``.

    After training, ``odc_steps`` holds per optimizer step every rank's microbatch count and
    rollout count (after rebalancing) and how many rollouts moved."""

    _odc_compat_users = ("trainer", "grpo")
    _odc_where = WHERE

    # The Trainer keeps calling training_step once per TRL microbatch through TRL's own
    # dataloader (TRL's buffering counts those calls; lengths exist only after generation), and
    # the adapter runs the whole step at the last one.
    _odc_steps_from_dataset = False
    # pad_to_multiple_of=None on CUDA: GRPO's rows are left-padded, so 128 rather than the
    # collators' 64 (lengths 64 modulo 128 are where cuDNN's backward gives NaN, _steps.py).
    AUTO_MULTIPLE = 128

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._odc_slices: list[dict] = []
        self._odc_step_seconds = 0.0
        self._odc_acc: dict | None = None
        self._odc_freed = False  # the gradient memory was out through this step's generation
        self._odc_gm_mark = 0.0  # odc_gradient_memory_s at the last step's end
        self._odc_gm_parts: dict = {}  # the engine's split of it at the last step's end
        self._odc_host: dict = {}  # this step's host seconds by part (record's host_seconds)

    # -- set-up ------------------------------------------------------------------------------

    @staticmethod
    def _odc_default_config() -> ODCConfig:
        return ODCGRPOConfig()

    def _odc_check_loss(self) -> None:
        a = self.args
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"{WHERE}: loss_type={self.loss_type!r} is not supported "
                f"(supported: {', '.join(LOSS_TYPES)})"
            )
        if self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"{WHERE}: top_entropy_quantile={self.top_entropy_quantile} < 1: TRL keeps the "
                "tokens above an entropy quantile of each microbatch (gathered over the ranks' "
                "microbatches of the same index), which depends on how rollouts are split into "
                "microbatches. Set top_entropy_quantile=1.0."
            )
        if self.aux_loss_enabled:
            raise ValueError(
                f"{WHERE}: the MoE load-balancing loss (router_aux_loss_coef="
                f"{self.router_aux_loss_coef}) is a mean over each microbatch's routing, which "
                "depends on the split. Set router_aux_loss_coef=0."
            )
        if self.use_vllm:
            raise ValueError(
                f"{WHERE}: use_vllm=True is not supported yet (its importance "
                "sampling tensors are not verified here); generate with "
                "transformers (use_vllm=False)"
            )
        if a.include_num_input_tokens_seen not in ("no", False, None):
            raise ValueError(
                f"{WHERE}: include_num_input_tokens_seen: GRPOTrainer counts the "
                "prompt and completion tokens itself (logged as num_tokens); "
                "leave it at 'no'"
            )

    @property
    def _odc_rebalance(self) -> bool:
        return getattr(self.odc, "rebalance", True)

    # -- TRL's hooks during the adapter's microbatches -----------------------------------------

    def _prepare_inputs(self, inputs):
        if isinstance(inputs, core.Microbatch):  # a repacked microbatch: already on the device
            return inputs
        if self.model.training and _compat.read(self, "_is_vlm", False):
            every = self.args.steps_per_generation * self.num_iterations
            if (
                _compat.read(self, "_step") % every == 0
                or _compat.read(self, "_buffered_inputs") is None
            ):
                _refuse_mixed_images(inputs)  # this batch is the one TRL generates from
        return super()._prepare_inputs(inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if isinstance(inputs, core.Microbatch) and self.model.training:
            if return_outputs:
                raise ValueError("The GRPOTrainer does not support returning outputs")
            return self._odc_loss(model, inputs)
        if self._odc_in_step:  # TRL's own loss on the adapter's rows would be a wrong gradient
            raise RuntimeError(
                f"{WHERE}: compute_loss got a {type(inputs).__name__}, not the "
                "adapter's microbatch: something between training_step and "
                "compute_loss rebuilt the batch"
            )
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    # -- the step ------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if not self._odc_slices:
            # A step begins (the last one's optimizer step and zero_grad() ran): no gradient is
            # held until its first backward, so neither are ODC's accumulators, through
            # generation, as TRL holds no .grad there (docs/integrations/trl-grpo.md, "Memory").
            with _Phase(self._odc_host, "free"):
                self._odc_freed = self._odc_free_gradient_memory()
        # TRL's buffering, as GRPOTrainer.training_step would run it for this microbatch.
        self._odc_slices.append(self._prepare_inputs(inputs))
        _compat.write(self, "_step", _compat.read(self, "_step") + 1)
        if not self.accelerator.gradient_state.sync_gradients:
            self._odc_step_seconds += time.perf_counter() - start
            return torch.zeros((), device=self.args.device)
        slices, self._odc_slices = self._odc_slices, []
        loss = self._odc_run_step(model, slices)
        _compat.read(self, "_metrics")["train"]["step_time"].append(
            self._odc_step_seconds + time.perf_counter() - start
        )
        self._odc_step_seconds = 0.0
        return loss

    def _odc_run_step(self, model, slices: list[dict]) -> torch.Tensor:
        from transformers import Trainer

        g = len(slices)
        if g != self.current_gradient_accumulation_steps:
            raise RuntimeError(
                f"{WHERE}: step {self.state.global_step}: {g} TRL microbatches "
                "kept, the Trainer counts "
                f"{self.current_gradient_accumulation_steps}"
            )
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        step = self.state.global_step
        host, self._odc_host = self._odc_host, {}
        with _Phase(host, "rows"):
            rows, meta = self._odc_rows(slices, rank)
        # The unmodified trainer's microbatches are TRL's slices as they are: their tensors'
        # size is what the derived cap matches.
        sizes = [s["prompt_ids"].numel() + s["completion_ids"].numel() for s in slices]
        # The derived cap matches TRL's largest microbatch so far (its peak memory so far).
        self._odc_plain_max = plain = max(max(sizes), getattr(self, "_odc_plain_max", 0))
        self._odc_cap = self._odc_work = None
        self._odc_plain_work = [sum(sizes)]
        with _Phase(host, "exchange"):
            if self._odc_rebalance and world > 1:
                rows, meta, plan_counts, mine = self._odc_exchange(rows, meta, step, plain)
                counts, rollouts = plan_counts
            else:
                lengths = rows.lengths()
                plan = (
                    self._odc_plan(lengths, rows.shapes(), 1, step, plain, rows.images())
                    if lengths
                    else [[]]
                )
                self._odc_note_work(plan, rows.shapes())
                mine, counts, rollouts = plan[0], None, None
                meta = {(rank, k): v for k, v in meta.items()}
                self._odc_moved = 0
        # Every rank is here after the exchange (or the plan): the accumulators come back now,
        # not at each rank's first backward, where the ranks would wait for each other.
        with _Phase(host, "restore"):
            self._odc_restore_gradient_memory()
        with _Phase(host, "weights"):
            weights = self._odc_row_weights(rows, meta, g)
            # The rows' lengths on the host once: a microbatch's widths then need no wait for
            # the device (which would stall the launch of its forward until the last backward).
            shapes = rows.meta[:, 2:4].cpu()
        self._odc_acc = self._odc_new_accumulators(g, rows.meta.device)
        total = torch.zeros((), device=self.args.device)
        self._odc_in_step = True
        probe = self._odc_probe(model)
        padded = 0
        host["microbatches"] = []
        try:
            for micro in mine:
                with _Phase(host, "microbatches"):
                    batch = self._odc_microbatch(rows, weights, micro, shapes)
                    tokens = self._odc_batch_tokens(batch)
                    padded = max(padded, tokens)
                    if probe is not None:
                        self._odc_autocap.start(tokens)
                    total = total + Trainer.training_step(self, model, batch, None)
                    if probe is not None:
                        self._odc_autocap.stop()
        finally:
            self._odc_in_step = False
            if probe is not None:
                probe.remove()
        # After this rank's last backward, before the Trainer clips and takes the grad norm.
        with _Phase(host, "barrier"):
            torch_odc.minibatch_barrier()
        if probe is not None:
            self._odc_autocap.finish_step(self._odc_handle)
        with _Phase(host, "metrics"):
            counts, rollouts = self._odc_record_metrics(g, len(mine), len(rows), counts, rollouts)
        record = {
            "step": step,
            "microbatches": counts,
            "rollouts": rollouts,
            # this rank's host seconds by part (a part that waits for the device holds
            # the device's time): free (at the step's first TRL microbatch), rows,
            # exchange (lengths, plan, all-to-all), restore, weights, microbatches (one
            # each), barrier, metrics
            "host_seconds": host,
            "moved": self._odc_moved,
            "gradient_memory_freed": self._odc_freed,
            # free + restore of this step (host seconds; they synchronize with the device)
            "gradient_memory_s": self.odc_gradient_memory_s - self._odc_gm_mark,
            # of which the engine's parts (free, waits, allocating, mapping the peers')
            "gradient_memory_parts": self._odc_gradient_memory_parts(),
        }
        self._odc_gm_mark = self.odc_gradient_memory_s
        if self._odc_cap is not None:
            # Each rank's padded tokens in the step under ODC (after the exchange; in all and
            # per microbatch, beside host_seconds' time per microbatch) and in TRL's own
            # microbatches: the work the benchmarks take the planner's bound from.
            record.update(
                cap=self._odc_cap[0],
                plain_tokens=self._odc_cap[1],
                padded_tokens=padded,
                padded_per_rank=[sum(w) for w in self._odc_work],
                microbatch_padded_per_rank=self._odc_work,
                plain_padded_per_rank=self._odc_plain_work,
                **self._odc_autocap.describe(),
            )
        self.odc_steps.append(record)
        return total.detach()

    def _odc_batch_tokens(self, batch) -> int:
        return int(batch["prompt_ids"].numel() + batch["completion_ids"].numel())

    def _odc_padded(self, shapes) -> int:
        """A microbatch's tokens once laid out as _odc_microbatch does: its longest prompt plus
        its longest completion (as ``_odc_widths`` gives them), per row."""
        return core.left_padded_tokens(shapes, *self._odc_width_args())

    def _odc_gradient_memory_parts(self) -> dict:
        """The engine's host seconds in free / restore since the last call, by part."""
        now = self._odc_handle.stats()["gradient_memory"] if self._odc_handle else {}
        parts = {k: v - self._odc_gm_parts.get(k, 0) for k, v in now.items() if k.endswith("_s")}
        self._odc_gm_parts = now
        return parts

    def _odc_widths(self, prompt: int, completion: int) -> tuple[int, int]:
        """A microbatch's prompt and completion widths from its longest of each: at least one
        completion column, each rounded up to TRL's ``pad_to_multiple_of``, and the length
        (prompt plus completion, by more left padding) to ``ODCConfig.pad_to_multiple_of``
        (None: ``AUTO_MULTIPLE`` on CUDA, else 1); never 64 modulo 128 on CUDA
        (``left_padded_widths``)."""
        return core.left_padded_widths(prompt, completion, *self._odc_width_args())

    def _odc_width_args(self) -> tuple[int, bool, int]:
        """(TRL's pad_to_multiple_of, on CUDA, ODC's length multiple) for the widths."""
        want = self.odc.pad_to_multiple_of
        cuda = self.args.device.type == "cuda"
        if want is None:
            want = self.AUTO_MULTIPLE if cuda else 1
        return self.pad_to_multiple_of or 1, cuda, want

    def _odc_plan(self, lengths, shapes, world: int, step: int, plain: int, images=None) -> list:
        """The step's plan (per rank, its microbatches as positions into ``lengths``): the
        user's planner or LB-Mini at the configured cap; with the derived cap, LB-Mini assigns
        the rows to ranks and each rank's rows are packed into microbatches of at most the
        step's cap in padded tokens (``plain``: the largest TRL microbatch of the step)."""
        planner = self.odc.planner or core.LBMini.from_config(self.odc)
        if images is not None and self.odc.auto_cap:
            raise ValueError(
                f"{WHERE}: the derived cap (max_tokens_per_microbatch=None) is not worked out "
                "for rollouts with images (TRL's microbatch memory then grows with its vision "
                "patches as well as its tokens); set ODCConfig.max_tokens_per_microbatch: it "
                "caps a microbatch's unpadded tokens plus its vision patches"
            )
        where = f"{WHERE}: step {step}"
        if not self.odc.auto_cap:
            costs = None
            if images is not None and self.odc.planner is None:
                # LB-Mini's cost: a row's tokens and each of its images as a sequence of its
                # patches under the same cost model (as the SFT adapter's rows with images).
                costs = core.row_costs(
                    [(n - sum(im),) for n, im in zip(lengths, images, strict=True)],
                    self.odc.cost,
                    self.odc.cost_args,
                    images,
                )
            return core.plan_step(lengths, world, planner, step=step, costs=costs, where=where)
        cap = self._odc_autocap.cap(plain)
        self._odc_cap = (cap, plain)
        # LB-Mini assigns the rows to ranks (at a cap no row exceeds); each rank's share is then
        # packed under the step's cap in padded tokens.
        plan = core.plan_step(
            lengths, world, planner, step=step, cap=max(plain, max(lengths)), where=where
        )
        return core.pack_shares(
            plan, lambda i: (1, tuple(shapes[i])), lambda dims: sum(self._odc_widths(*dims)), cap
        )

    def _odc_note_work(self, plan, shapes) -> None:
        """Each rank's padded tokens per microbatch under the step's final plan (derived cap
        only)."""
        if self._odc_cap is not None:
            self._odc_work = [[self._odc_padded([shapes[i] for i in mb]) for mb in p] for p in plan]

    # -- rows ----------------------------------------------------------------------------------

    def _odc_pad_value(self, key: str) -> int:
        if key in ("prompt_ids", "completion_ids"):
            return _compat.read(self, "_tokenizer").pad_token_id
        return 1 if key == "tool_mask" else 0  # TRL pads tool_mask with 1 (masked by the rest)

    def _odc_layout(self, first: dict) -> list[tuple[str, str]]:
        """(key, kind) of every tensor a slice carries; kind: prompt, completion, row."""
        layout = []
        vision = [key for key in VISION_KEYS if first.get(key) is not None]
        if vision:
            missing = [key for key in VISION_KEYS if key not in vision]
            if missing:
                raise ValueError(
                    f"{WHERE}: TRL's microbatch carries {vision} without {missing}: not the "
                    "layout of the Qwen2-VL family's processors (ragged pixel_values split per "
                    "image by image_grid_thw, num_images, mm_token_type_ids), the only one the "
                    "adapter lays out per rollout"
                )
        for key, value in first.items():
            if value is None or key in STEP_KEYS or key in VISION_KEYS:
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(  # noqa: TRY004  (an unsupported batch layout, as the others)
                    f"{WHERE}: TRL's microbatch carries {key!r} (a {type(value).__name__}), "
                    "which the adapter cannot repack; it lays out only "
                    f"{PROMPT_KEYS + COMPLETION_KEYS + ROW_KEYS + STEP_KEYS + VISION_KEYS}"
                )
            if key in PROMPT_KEYS:
                layout.append((key, "prompt"))
            elif key in COMPLETION_KEYS or (key in ROW_KEYS and value.dim() == 2):
                layout.append((key, "completion"))
            elif key in ROW_KEYS and value.dim() == 1:
                layout.append((key, "row"))
            else:
                raise ValueError(
                    f"{WHERE}: TRL's microbatch carries {key!r}, which the adapter cannot repack "
                    "(another vision-language family's field, vLLM importance sampling or a "
                    "subclass's own field); it lays out only "
                    f"{PROMPT_KEYS + COMPLETION_KEYS + ROW_KEYS + STEP_KEYS} and the Qwen2-VL "
                    f"family's {VISION_KEYS}"
                )
        for need in (
            "prompt_ids",
            "prompt_mask",
            "completion_ids",
            "completion_mask",
            "advantages",
        ):
            if need not in first:
                raise ValueError(f"{WHERE}: TRL's microbatch has no {need!r}")
        if vision:
            layout += [
                ("mm_token_type_ids", "prompt"),
                ("pixel_values", "patches"),
                ("image_grid_thw", "images"),
                (_VISION, "row"),
            ]
        return layout

    def _odc_rows(self, slices: list[dict], rank: int):
        """The step's slices as one _Rows, and per slice k what TRL normalizes by:
        meta[k] = (rows, loss tokens, the generation batch's loss tokens, completion width 1)."""
        layout = self._odc_layout(slices[0])
        keys = [key for key, _ in layout]
        for s in slices[1:]:
            other = [key for key, _ in self._odc_layout(s)]
            if other != keys and (_VISION in other) != (_VISION in keys):
                raise ValueError(
                    f"{WHERE}: this rank's TRL microbatches of one step are some with images "
                    "and some text-only (generation batches of image prompts and of text-only "
                    "prompts): a repacked microbatch would mix them, and a text-only rollout's "
                    "positions would then be computed as in an image batch, not as TRL computes "
                    "them; not served. Keep every generation batch of a vision-language run "
                    "with images in every prompt, or with none in any."
                )
            if other != keys:
                raise ValueError(f"{WHERE}: TRL's microbatches of one step carry different keys")
        slices = [self._odc_vision_rows(s) if _VISION in keys else s for s in slices]
        widths = {
            "prompt": max(s["prompt_ids"].size(1) for s in slices),
            "completion": max(s["completion_ids"].size(1) for s in slices),
        }
        if _VISION in keys:
            widths["patches"] = max(s["pixel_values"].size(1) for s in slices)
            widths["images"] = max(s["image_grid_thw"].size(1) for s in slices)
        tensors = {key: [] for key, _ in layout}
        metas, slice_meta = [], {}
        for k, s in enumerate(slices):
            pmask, cmask = s["prompt_mask"], s["completion_mask"]
            loss_mask = cmask if s.get("tool_mask") is None else cmask * s["tool_mask"]
            plen, clen = pmask.sum(-1), cmask.sum(-1)
            P, C = pmask.size(1), cmask.size(1)
            # TRL's layout: prompts left-padded, completions right-padded, masks contiguous.
            left = torch.arange(P, device=pmask.device) >= (P - plen)[:, None]
            right = torch.arange(C, device=cmask.device) < clen[:, None]
            if not (torch.equal(pmask != 0, left) and torch.equal(cmask != 0, right)):
                raise ValueError(
                    f"{WHERE}: a rollout's prompt mask is not a left padding or its "
                    "completion mask not a right padding; cannot trim it"
                )
            n = pmask.size(0)
            ngen = s.get("num_items_in_batch")
            slice_meta[k] = (n, int(loss_mask.sum()), -1 if ngen is None else int(ngen), C == 1)
            for key, kind in layout:
                t = s[key]
                if kind == "prompt":
                    t = _fit(t, widths["prompt"], "left", self._odc_pad_value(key))
                elif kind == "completion":
                    t = _fit(t, widths["completion"], "right", self._odc_pad_value(key))
                elif kind in ("patches", "images"):
                    t = _fit_rows(t, widths[kind])
                tensors[key].append(t)
            metas.append(
                torch.stack(
                    [
                        torch.full_like(plen, rank),
                        torch.full_like(plen, k),
                        plen,
                        clen,
                        loss_mask.sum(-1).to(plen.dtype),
                    ],
                    dim=1,
                )
            )
        rows = _Rows({key: torch.cat(v) for key, v in tensors.items()}, torch.cat(metas).long())
        self._odc_layout_cache = layout
        return rows, slice_meta

    def _odc_vision_rows(self, s: dict) -> dict:
        """A TRL slice of a vision-language model with its vision fields per rollout:
        ``pixel_values`` (rows, patches, D) and ``image_grid_thw`` (rows, images, 3), each row's
        own in order and zero-padded; ``mm_token_type_ids`` cut to the prompt's columns (TRL
        appends zeros for the completion's, checked here); ``_VISION`` (rows, 2): each row's
        images and patches. Checked against TRL's layout: image k has prod(image_grid_thw[k])
        pixel rows, rollout i has num_images[i] images (at least one), and the prompt's image
        tokens are exactly where mm_token_type_ids is 1 (prompts left-padded as prompt_ids)."""
        n = s["prompt_ids"].size(0)
        counts = [int(c) for c in s["num_images"]]
        grid, pixels, mm = s["image_grid_thw"], s["pixel_values"], s["mm_token_type_ids"]
        if len(counts) != n or sum(counts) != grid.size(0) or grid.dim() != 2:
            raise ValueError(
                f"{WHERE}: num_images {counts} does not split image_grid_thw of "
                f"shape {tuple(grid.shape)} over {n} rollouts"
            )
        if min(counts, default=1) < 1:
            raise ValueError(
                f"{WHERE}: a rollout without an image in a batch with images "
                f"(num_images {counts}): mixed image / text-only rollouts are not "
                "served"
            )
        patches = [int(x) for x in grid.prod(-1).tolist()]
        if pixels.dim() != 2 or pixels.size(0) != sum(patches):
            raise ValueError(
                f"{WHERE}: pixel_values of shape {tuple(pixels.shape)} for "
                f"{sum(patches)} patches (image_grid_thw): not the Qwen2-VL layout "
                "(one pixel_values row per patch)"
            )
        P, C = s["prompt_ids"].size(1), s["completion_ids"].size(1)
        if mm.shape != (n, P + C) or bool(mm[:, P:].any()):
            raise ValueError(
                f"{WHERE}: mm_token_type_ids of shape {tuple(mm.shape)} is not the "
                "prompt's types followed by zeros for the completion (images in a "
                "completion, from tools, are not served)"
            )
        image_token = _compat.read(self, "_image_pad_token_id")
        prompt_mm = mm[:, :P]
        if (
            image_token is None
            or not torch.equal(prompt_mm != 0, s["prompt_ids"] == image_token)
            or bool((prompt_mm > 1).any())
        ):
            raise ValueError(
                f"{WHERE}: mm_token_type_ids does not mark exactly the prompt's "
                "image tokens (or marks videos): the processor pads on the other "
                "side than TRL's left-padded prompt_ids (set the processor's "
                "tokenizer padding_side='left'), or the prompt holds videos"
            )
        per_row = torch.tensor(
            [
                sum(patches[a : a + c])
                for a, c in zip(itertools.accumulate([0, *counts[:-1]]), counts, strict=True)
            ]
        )
        width, most = int(per_row.max()), max(counts)
        pix = pixels.new_zeros((n, width, pixels.size(1)))
        grids = grid.new_zeros((n, most, 3))
        at_pix = at_img = 0
        for i, c in enumerate(counts):
            m = int(per_row[i])
            pix[i, :m] = pixels[at_pix : at_pix + m]
            grids[i, :c] = grid[at_img : at_img + c]
            at_pix, at_img = at_pix + m, at_img + c
        device = s["prompt_ids"].device
        vision = torch.stack([torch.tensor(counts), per_row], dim=1).to(device)
        return {
            **{k: v for k, v in s.items() if k not in VISION_KEYS},
            "mm_token_type_ids": prompt_mm,
            "pixel_values": pix,
            "image_grid_thw": grids,
            _VISION: vision,
        }

    def _odc_exchange(self, rows: _Rows, slice_meta: dict, step: int, plain: int):
        """LB-Mini over every rank's rows of the step; the rows move to the ranks it names
        (the step core's gather_rows, plan_step and StepRows.exchange). Returns the rows this rank
        runs, the slices' normalizers of every rank, ((microbatches per rank), (rollouts per
        rank)) and this rank's microbatches as positions into its rows."""
        world = self.accelerator.num_processes
        layout = self._odc_layout_cache
        info = {
            "shapes": rows.shapes(),
            "plain": plain,
            "plain_work": self._odc_plain_work[0],
            "slices": slice_meta,
            "layout": [(k, kind, str(rows.tensors[k].dtype)) for k, kind in layout],
            "prompt": rows.tensors["prompt_ids"].size(1),
            "completion": rows.tensors["completion_ids"].size(1),
            "patches": (
                rows.tensors["pixel_values"].shape[1:] if "pixel_values" in rows.tensors else None
            ),
            "images": (
                rows.tensors["image_grid_thw"].size(1) if "image_grid_thw" in rows.tensors else None
            ),
        }
        # The one exchange of lengths (and of what every rank's plan needs besides).
        gathered = core.gather_rows(rows.lengths(), images=rows.images(), extra=info)
        infos = gathered.extras
        for r, other in enumerate(infos):
            if (other["images"] is None) != (infos[0]["images"] is None):
                raise ValueError(
                    f"{WHERE}: step {step}: rank {r}'s rollouts "
                    f"{'have no' if other['images'] is None else 'have'} images, rank 0's "
                    f"{'none' if infos[0]['images'] is None else 'have'}: moving rollouts "
                    "would mix image and text-only rollouts in a microbatch, not served. "
                    "ODCGRPOConfig(rebalance=False) runs each rank's own rollouts (each "
                    "microbatch then as TRL's own)."
                )
            if other["layout"] != infos[0]["layout"]:
                raise ValueError(
                    f"{WHERE}: step {step}: rank {r}'s rollouts carry "
                    f"{other['layout']}, rank 0's {infos[0]['layout']}"
                )
        lengths = gathered.lengths
        shapes = [tuple(x) for other in infos for x in other["shapes"]]
        images = gathered.images
        plan = self._odc_plan(
            lengths, shapes, world, step, max(other["plain"] for other in infos), images
        )
        self._odc_plain_work = [other["plain_work"] for other in infos]
        # Every rank's prompts and completions padded to the step's widest, so that rows of
        # every rank share one layout on the wire.
        P = max(other["prompt"] for other in infos)
        C = max(other["completion"] for other in infos)
        tensors = {}
        for key, kind in layout:
            t = rows.tensors[key]
            if kind == "prompt":
                t = _fit(t, P, "left", self._odc_pad_value(key))
            elif kind == "completion":
                t = _fit(t, C, "right", self._odc_pad_value(key))
            elif kind == "patches":
                if len({tuple(other["patches"][1:]) for other in infos}) != 1:
                    raise ValueError(
                        f"{WHERE}: step {step}: the ranks' pixel_values differ in "
                        f"their patch size: {[o['patches'] for o in infos]}"
                    )
                t = _fit_rows(t, max(other["patches"][0] for other in infos))
            elif kind == "images":
                t = _fit_rows(t, max(other["images"] for other in infos))
            tensors[key] = t
        tensors[_META] = rows.meta
        # LB-Mini's rank labels are arbitrary: keep rows in place where the plan allows.
        exchanged = gathered.exchange(
            tensors,
            plan,
            keep_in_place=self.odc.planner is None,
            where=f"{WHERE}: step {step}",
        )
        self._odc_note_work(exchanged.plan, shapes)
        self._odc_moved = exchanged.moved
        new = _Rows({key: exchanged.rows[key] for key, _ in layout}, exchanged.rows[_META])
        meta = {(r, k): v for r, other in enumerate(infos) for k, v in other["slices"].items()}
        plan = exchanged.plan
        counts = ([len(p) for p in plan], [sum(len(m) for m in p) for p in plan])
        return new, meta, counts, exchanged.microbatches

    def _odc_row_weights(self, rows: _Rows, slice_meta: dict, g: int) -> dict:
        """Per row: a (weight of its token losses in TRL's step loss), e (of its entropy sum, the
        entropy bonus), p (of its token losses in TRL's logged policy_loss, times W)."""
        world = self.accelerator.num_processes
        n = len(rows)
        a = torch.zeros(n, dtype=torch.float64)
        e = torch.zeros(n, dtype=torch.float64)
        p = torch.zeros(n, dtype=torch.float64)
        narrow = torch.zeros(n, dtype=torch.bool)
        meta = rows.meta.cpu().tolist()
        coef = self._odc_entropy_coef()
        S, lmax = self.args.steps_per_generation, self.max_completion_length
        for i, (src, k, _, _, n_i) in enumerate(meta):
            B, N, ngen, is_narrow = slice_meta[(src, k)]
            lt = self.loss_type
            if lt in SEQUENCE_MEAN_LOSSES:
                w = 1.0 / (world * B * g * max(n_i, 1))
            elif lt == "bnpo":
                w = 1.0 / (world * g * max(N, 1))
            elif lt == "dr_grpo":
                w = 1.0 / (world * B * lmax * g)
            elif lt == "luspo":
                w = 1.0 / (world * B * g)
            else:  # dapo, cispo, vespo: the generation batch's token count
                if ngen < 0:
                    raise ValueError(f"{WHERE}: loss_type={lt!r} needs num_items_in_batch")
                w = S / (g * max(ngen, 1))
            a[i] = w
            p[i] = world * w * (1 if lt in ("dapo", "cispo", "vespo") else g)
            e[i] = coef / (world * g * max(N, 1))
            narrow[i] = bool(is_narrow)
        device = rows.meta.device
        return {
            "a": a.to(device),
            "e": e.to(device),
            "p": p.to(device),
            "narrow": narrow.to(device),
        }

    def _odc_entropy_coef(self) -> float:
        """The entropy bonus's coefficient for this step's microbatches (TRL fixes it at the end
        of the previous step); 0 without the bonus."""
        if not _compat.read(self, "_entropy_bonus_enabled"):
            return 0.0
        if self.use_adaptive_entropy:
            last = _compat.read(self, "_last_world_entropy")
            return self.entropy_coef if last <= self.args.entropy_target else 0.0
        return self.entropy_coef

    def _odc_microbatch(
        self, rows: _Rows, weights: dict, micro: list[int], shapes: torch.Tensor
    ) -> core.Microbatch:
        """The rows at positions `micro`, padding trimmed to their longest prompt and
        completion (as ``_odc_widths`` gives them; ``shapes``: every row's prompt and
        completion length, on the host), with their weights (a, e, p and narrow, see
        ``_odc_row_weights``) and, under ``"slice"``, each row's TRL microbatch."""
        idx = torch.tensor(micro, device=rows.meta.device)
        meta = rows.meta[idx]
        longest = shapes[micro].amax(0).tolist()
        pw, cw = self._odc_widths(int(longest[0]), int(longest[1]))
        batch = {}
        for key, kind in self._odc_layout_cache:
            t = rows.tensors[key][idx]
            if kind == "prompt":
                t = _fit(t, pw, "left", self._odc_pad_value(key))
            elif kind == "completion":
                t = _fit(t, cw, "right", self._odc_pad_value(key))
            batch[key] = t
        if _VISION in batch:
            # The rows' images in row order, as TRL's slice holds them: each row's pixel rows
            # and grids concatenated (a row's own are the first of its padded ones).
            vision = batch.pop(_VISION).tolist()
            pixels, grids = batch.pop("pixel_values"), batch.pop("image_grid_thw")
            mm = batch.pop("mm_token_type_ids")
            if any(c for c, _ in vision):
                batch["pixel_values"] = torch.cat(
                    [pixels[i, :m] for i, (_, m) in enumerate(vision)]
                )
                batch["image_grid_thw"] = torch.cat(
                    [grids[i, :c] for i, (c, _) in enumerate(vision)]
                )
                batch["num_images"] = [c for c, _ in vision]
                batch["mm_token_type_ids"] = torch.cat([mm, mm.new_zeros((mm.size(0), cw))], dim=1)
            # else: no image, no vision forward (as TRL's text-only batch: no vision field)
        return core.Microbatch(
            batch,
            rows=micro,
            shape=(len(micro), pw, cw),
            weights={**{key: value[idx] for key, value in weights.items()}, "slice": meta[:, 1]},
        )

    # -- the loss ------------------------------------------------------------------------------

    def _odc_loss(self, model, inputs):
        """TRL 1.16's per-token loss (GRPOTrainer._compute_loss) with the adapter's per-row
        weights instead of TRL's per-microbatch normalization; metrics summed per TRL slice."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        vision = {key: inputs[key] for key in VISION_KEYS if key in inputs}
        if vision:
            # The LM head's lone FSDP unit (a vision-language model: accelerate finds no final
            # norm beside it), which TRL's fused head reads without calling it.
            self._odc_unshard_output_head()
        per_token_logps, entropies, _ = _compat.call(
            self,
            "_get_per_token_logps_and_entropies",
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            compute_entropy=True,
            **vision,
        )

        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old_per_token_logps = inputs.get("old_per_token_logps")
        old_per_token_logps = (
            per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
        )
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old_per_token_logps)
            off_policy_mask = self.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=sampling,
                mask=mask,
                off_policy_threshold=self.off_policy_mask_threshold,
            )
        log_ratio = per_token_logps - old_per_token_logps
        if self.importance_sampling_level == "token":
            log_importance_weights = log_ratio
        elif self.importance_sampling_level == "sequence":
            log_importance_weights = (
                (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
            ).unsqueeze(-1)
        else:
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level}")
        coef_1 = torch.exp(log_importance_weights)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if self.args.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        lt = self.loss_type
        if lt == "cispo":
            clamped_ratios = torch.clamp(coef_1, max=self.epsilon_high).detach()
            per_token_loss = -clamped_ratios * advantages * per_token_logps
        elif lt in CLIPPED_LOSSES:
            coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
            if self.args.delta is not None:
                coef_1 = torch.clamp(coef_1, max=self.args.delta)
            per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        elif lt == "sapo":
            temperatures = torch.where(
                advantages > 0, self.args.sapo_temperature_pos, self.args.sapo_temperature_neg
            )
            per_token_loss = -(
                torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
            )
        elif lt == "vespo":
            phi_seq = self.get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=log_ratio,
                mask=mask,
                importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                k_pos=self.args.vespo_k_pos,
                lambda_pos=self.args.vespo_lambda_pos,
                k_neg=self.args.vespo_k_neg,
                lambda_neg=self.args.vespo_lambda_neg,
            )
            per_token_loss = -phi_seq * advantages * per_token_logps
        else:
            raise ValueError(f"Unknown loss type: {lt}")
        if self.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask
        if self.beta != 0.0:
            per_token_loss = per_token_loss + self.beta * per_token_kl

        world = self.accelerator.num_processes
        fmask = mask.to(per_token_loss.dtype)
        row_loss = (per_token_loss * fmask).sum(-1)
        loss = (row_loss * inputs.weights["a"].to(row_loss.dtype)).sum()
        if _compat.read(self, "_entropy_bonus_enabled"):
            row_entropy = (entropies * fmask).sum(-1)
            loss = loss - (row_entropy * inputs.weights["e"].to(row_entropy.dtype)).sum()
        loss = loss * world

        with torch.no_grad():
            acc, k = self._odc_acc, inputs.weights["slice"]
            narrow = inputs.weights["narrow"]
            fm = fmask.double()

            def per_row(x, per_sequence=False):
                """TRL's global_masked_mean terms of one row: (sum, count). TRL sums a (B, 1)
                tensor unmasked and counts rows: per-sequence tensors, and token tensors of a
                TRL slice that had one completion column ("narrow")."""
                x = x.double()
                if per_sequence:
                    return x[:, 0], torch.ones_like(x[:, 0])
                num = torch.where(narrow, x[:, 0], (x * fm).sum(-1))
                den = torch.where(narrow, torch.ones_like(num), fm.sum(-1))
                return num, den

            def seq_mean(x, per_sequence=False):  # TRL's masked_seq_mean
                x = x.double()
                if per_sequence:
                    return x[:, 0]
                return torch.where(narrow, x[:, 0], (x * fm).sum(-1) / fm.sum(-1))

            def add(name, values):
                acc["sums"][:, SUMS.index(name)].index_add_(0, k, values)

            if self.beta != 0.0:
                num, den = per_row(per_token_kl)
                add("kl", num)
            num, den = per_row(entropies)
            add("entropy", num)
            add("token_count", den)
            seq = self.importance_sampling_level == "sequence"  # coef_1 is (B, 1)
            if lt in CLIPPED_LOSSES:
                is_low = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
                is_high = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
                for name, x in (("low", is_low), ("high", is_high), ("region", is_low | is_high)):
                    num, den = per_row(x.float(), seq)
                    add(name, num)
                add("clip_count", den)
                low = seq_mean(is_low.float(), seq)
                high = seq_mean(is_high.float(), seq)
                inf = torch.full_like(low, math.inf)
                acc["mins"][:, 0].scatter_reduce_(0, k, torch.where(low.isnan(), inf, low), "amin")
                acc["mins"][:, 1].scatter_reduce_(
                    0, k, torch.where(high.isnan(), inf, -high), "amin"
                )
            elif lt == "cispo":
                num, den = per_row(((coef_1 > self.epsilon_high) & (advantages > 0)).float(), seq)
                add("cispo", num)
                add("clip_count", den)
            elif lt == "vespo":
                num, den = per_row(phi_seq, True)
                add("phi", num)
                add("row_count", den)
            if _compat.read(self, "_entropy_bonus_enabled"):
                add("policy", row_loss.detach().double() * inputs.weights["p"])
        return loss

    # -- metrics -------------------------------------------------------------------------------

    @staticmethod
    def _odc_new_accumulators(g: int, device) -> dict:
        return {
            "sums": torch.zeros(g, len(SUMS), dtype=torch.float64, device=device),
            "mins": torch.full((g, 2), math.inf, dtype=torch.float64, device=device),
        }

    def _odc_record_metrics(self, g: int, my_micro: int, my_rows: int, counts, rollouts):
        """After the barrier: one all-reduce of the per-slice sums (and, without rebalancing,
        of every rank's counts), one MIN all-reduce of the clip-ratio extremes when the loss
        logs them; the values appended per TRL microbatch index as TRL appends them."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        acc = self._odc_acc
        self._odc_acc = None
        values = acc["sums"].cpu().flatten().tolist()
        if counts is None:
            mine = [0.0] * (2 * world)
            mine[rank], mine[world + rank] = float(my_micro), float(my_rows)
            values += mine
        reduced = core.all_reduce_sums(values)
        if counts is None:
            counts = [int(c) for c in reduced[g * len(SUMS) : g * len(SUMS) + world]]
            rollouts = [int(c) for c in reduced[g * len(SUMS) + world :]]
        sums = torch.tensor(reduced[: g * len(SUMS)], dtype=torch.float64).view(g, len(SUMS))
        lt, metrics = self.loss_type, _compat.read(self, "_metrics")["train"]
        if lt in CLIPPED_LOSSES:
            t = core.all_reduce_min(acc["mins"].cpu().flatten().tolist())
            extremes = torch.tensor(t, dtype=torch.float64).view(g, 2)
        col = {name: sums[:, i].tolist() for i, name in enumerate(SUMS)}

        def ratio(num, den):
            return num / max(den, 1.0)

        for s in range(g):
            if _compat.read(self, "_entropy_bonus_enabled"):
                metrics["policy_loss"].append(col["policy"][s] / world)
            if self.beta != 0.0:
                metrics["kl"].append(ratio(col["kl"][s], col["token_count"][s]))
            metrics["entropy"].append(ratio(col["entropy"][s], col["token_count"][s]))
            if lt in CLIPPED_LOSSES:
                for name in ("low", "high", "region"):
                    metrics[f"clip_ratio/{name}_mean"].append(
                        ratio(col[name][s], col["clip_count"][s])
                    )
                low, neg_high = extremes[s].tolist()
                metrics["clip_ratio/low_min"].append(low if low != math.inf else math.nan)
                metrics["clip_ratio/high_max"].append(
                    -neg_high if neg_high != math.inf else math.nan
                )
            elif lt == "cispo":
                metrics["cispo_clip_ratio"].append(ratio(col["cispo"][s], col["clip_count"][s]))
            elif lt == "vespo":
                metrics["vespo/phi_seq_mean"].append(ratio(col["phi"][s], col["row_count"][s]))
        if _compat.read(self, "_entropy_bonus_enabled"):
            if self.use_adaptive_entropy:
                # TRL's window-global entropy: every microbatch of the step, all ranks.
                world_entropy = sum(col["entropy"]) / max(sum(col["token_count"]), 1.0)
                a = self.args
                if world_entropy <= a.entropy_target:
                    self.entropy_coef = min(
                        self.entropy_coef + a.entropy_coef_delta, a.entropy_coef_max
                    )
                else:
                    self.entropy_coef = max(
                        self.entropy_coef - a.entropy_coef_delta, a.entropy_coef_min
                    )
                _compat.write(self, "_last_world_entropy", world_entropy)
            metrics["entropy_coef"].append(self.entropy_coef)
        return counts, rollouts


class _Phase:
    """Times a part of the step into ``host`` (host seconds; a list part gets one entry per
    use) and, while the profiler records, marks it as ``odc::grpo_<part>``."""

    __slots__ = ("host", "part", "range", "start")

    def __init__(self, host: dict, part: str):
        self.host, self.part, self.range = host, part, None

    def __enter__(self):
        if _profiling():
            self.range = torch.profiler.record_function(f"odc::grpo_{self.part}")
            self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        seconds = time.perf_counter() - self.start
        if self.range is not None:
            self.range.__exit__(*exc)
        if isinstance(self.host.get(self.part), list):
            self.host[self.part].append(seconds)
        else:
            self.host[self.part] = self.host.get(self.part, 0.0) + seconds


def _refuse_mixed_images(batch) -> None:
    """A vision-language model's generation batch (the dataset's rows, as TRL's
    ``_generate_and_score_completions`` reads them) with image prompts and text-only prompts
    together is refused, naming the cause: TRL 1.16 hands the processor a ``None`` image list
    for the text-only rows, which raises TypeError, so no unmodified run defines the
    gradient."""
    if not isinstance(batch, list) or not batch or not isinstance(batch[0], dict):
        return

    def has_images(row) -> bool:
        if row.get("images"):
            return True
        if row.get("image") is not None:
            return True
        prompt = row.get("prompt")
        return isinstance(prompt, list) and any(
            isinstance(m, dict)
            and isinstance(m.get("content"), list)
            and any(isinstance(c, dict) and c.get("type") == "image" for c in m["content"])
            for m in prompt
        )

    flags = [has_images(row) for row in batch]
    if any(flags) and not all(flags):
        raise ValueError(
            f"{WHERE}: a generation batch holds {sum(flags)} prompts with images and "
            f"{len(flags) - sum(flags)} text-only prompts. TRL 1.16's GRPOTrainer passes None "
            "images for the text-only prompts to the processor, which raises TypeError (the "
            "unmodified trainer cannot run this batch either), and the adapter does not "
            "redefine TRL's processing: not served. Give every prompt of a vision-language "
            "run an image, or train on the image and the text-only prompts separately."
        )


def _fit_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (rows, w, ...) zero-padded to (rows, width, ...) (a row's images or patches: its own
    come first)."""
    if t.size(1) == width:
        return t
    if t.size(1) > width:
        raise ValueError(f"{WHERE}: cannot cut a row's images or patches ({t.size(1)} > {width})")
    return torch.cat([t, t.new_zeros((t.size(0), width - t.size(1), *t.shape[2:]))], dim=1)


def _fit(t: torch.Tensor, width: int, side: str, value) -> torch.Tensor:
    """t (rows, w) cut or padded to (rows, width): on the left for prompts (their tokens end at
    the right), on the right for completions."""
    w = t.size(1)
    if w == width:
        return t
    if w > width:
        return t[:, w - width :] if side == "left" else t[:, :width]
    pad = t.new_full((t.size(0), width - w), value)
    return torch.cat([pad, t] if side == "left" else [t, pad], dim=1)
