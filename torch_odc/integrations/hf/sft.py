"""The TRL ``SFTTrainer`` adapter: TRL's per-microbatch metric gathers become local sums
reduced once per step (the step planning and the barrier are the core's, :mod:`._core`)."""

from __future__ import annotations

import torch

from . import _compat
from ._core import ODCTrainerMixin

__all__ = ["ODCSFTTrainerMixin"]


class ODCSFTTrainerMixin(ODCTrainerMixin):
    """For TRL's ``SFTTrainer``: ``class T(ODCSFTTrainerMixin, SFTTrainer)``.

    TRL's ``compute_loss`` gathers its metrics (entropy, token accuracy, token count) in every
    microbatch, a collective that ranks with different microbatch counts cannot all call. In
    training microbatches this computes the same loss from the same fused LM head outputs and
    sums the metrics locally; they are all-reduced once per step after the barrier and logged
    as TRL logs them. Evaluation uses TRL's own ``compute_loss``."""

    _odc_compat_users = ("trainer", "sft")
    _odc_where = "torch_odc.integrations.hf (SFTTrainer)"

    def _odc_check_loss(self) -> None:
        where = "torch_odc.integrations.hf (SFTTrainer)"
        if self.compute_loss_func is not None or self.label_smoother is not None:
            raise ValueError(f"{where}: compute_loss_func and label smoothing are not supported")
        if self.aux_loss_enabled:
            raise ValueError(
                f"{where}: the MoE auxiliary loss (router_aux_loss_coef) is a "
                "per-microbatch mean; not supported"
            )
        if self.args.loss_type not in ("nll", "dft"):
            raise ValueError(f"{where}: loss_type={self.args.loss_type!r} is not supported")

    def _odc_padding_free(self) -> bool:
        return bool(getattr(self.args, "padding_free", False))

    # -- vision-language datasets (rows with images; see _vision) -------------------------------

    def _odc_vision(self) -> bool:
        return bool(_compat.read(self, "_is_vision_dataset", False))

    def _odc_row_lengths(self, dataset) -> list[tuple[int, ...]]:
        # A vision dataset is not tokenized before training (TRL's collator processes the
        # images per batch): each row is collated alone once, by the trainer's own collator,
        # for its tokens (image placeholders expanded, truncation applied) and its images'
        # patches. Exact for any row whose collation does not depend on its batchmates (the
        # check per microbatch, _odc_check_images, holds the collator to it).
        self._odc_vision_rows = None
        if not self._odc_vision():
            return super()._odc_row_lengths(dataset)
        from . import _vision

        lengths, images = [], []
        for i in range(len(dataset)):
            n, im = _vision.row_sizes(
                self.data_collator([dataset[i]]), f"{self._odc_where}: training row {i}"
            )
            lengths.append((n,))
            images.append(im)
        self._odc_vision_rows = images
        return lengths

    def _odc_row_images(self, dataset):
        return getattr(self, "_odc_vision_rows", None)

    def _odc_collator_pads(self, collator) -> bool:
        # TRL's vision collator refuses pad_to_multiple_of for prompt-completion rows.
        if self._odc_vision() and "prompt" in next(iter(self.train_dataset)):
            return False
        return super()._odc_collator_pads(collator)

    def _odc_metric_keys(self) -> tuple[str, ...]:
        return (*super()._odc_metric_keys(), "valid", "entropy", "correct", "tokens")

    def _odc_record_metrics(self, sums: dict[str, float]) -> None:
        super()._odc_record_metrics(sums)
        metrics, valid = _compat.read(self, "_metrics")["train"], sums["valid"]
        metrics["entropy"].append(sums["entropy"] / valid if valid > 0 else 0.0)
        metrics["mean_token_accuracy"].append(sums["correct"] / valid if valid > 0 else 0.0)
        _compat.count_train_tokens(self, int(sums["tokens"]))  # and logs num_tokens

    def _odc_checkpoint_state(self) -> dict:
        # TRL's num_tokens is a running total kept on the trainer (TRL itself restarts it at
        # zero on resume); the per-step averages are logged every logging_steps.
        return {
            **super()._odc_checkpoint_state(),
            "total_train_tokens": _compat.read(self, "_total_train_tokens"),
        }

    def _odc_restore_checkpoint_state(self, state: dict) -> None:
        super()._odc_restore_checkpoint_state(state)
        _compat.write(self, "_total_train_tokens", int(state["total_train_tokens"]))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (self._odc_in_step and self.model.training):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if return_outputs:
            raise NotImplementedError("torch_odc.integrations.hf: return_outputs in training")
        self._odc_unshard_output_head()  # the fused LM head reads its weight directly
        inputs["use_cache"] = False
        outputs = model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero where the label is ignored
        if self.args.loss_type == "dft":
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        loss = per_token_loss.sum() / torch.as_tensor(num_items_in_batch).clamp(min=1)
        # num_items_in_batch counts every rank's tokens and FSDP2 averages over ranks.
        loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        sums = self._odc_sums
        with torch.no_grad():
            sums["valid"] += float(outputs.label_mask.sum())
            sums["entropy"] += float(outputs.entropy.sum())
            sums["correct"] += float(outputs.is_top1.sum())
        if "attention_mask" in inputs:
            sums["tokens"] += float(inputs["attention_mask"].sum())
        elif "position_ids" in inputs:
            sums["tokens"] += float(inputs["position_ids"].size(1))
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        return loss
