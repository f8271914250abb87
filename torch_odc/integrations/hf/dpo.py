"""The TRL ``DPOTrainer`` adapter: preference pairs planned by LB-Mini, each pair weighted so the
loss is the mean over the step's pairs however they were split, TRL's per-microbatch metric
gathers turned into local sums reduced once per step (planning, barrier and reduction are the
core's, :mod:`._core`).

What plain TRL computes for a step (read in TRL 1.16.0's ``DPOTrainer._compute_loss`` and
transformers 5.23's ``Trainer.training_step``): every microbatch's loss is, per loss type, the
mean over the microbatch's pairs of a per-pair loss, times the type's weight; the Trainer
divides it by the number of accumulated microbatches (``loss_is_scaled_for_ga = False``) and
FSDP2 averages the ranks' gradients. With equal microbatches of b pairs (TRL's batches) that is
``sum_t w_t * mean over the step's B pairs of l_t(pair)``. Here a microbatch's loss is
``world * sum_t w_t * sum over its pairs of l_t(pair) / B`` (FSDP2's and ODC's division by the
world size takes the ``world`` back out), which gives that same gradient for any split, a rank
with no microbatch included.

For the per-pair loss types that is TRL's own loss of the microbatch (a mean over its m pairs)
times ``world * m / B``: the adapter calls TRL's ``_compute_loss`` and scales it, with TRL's
per-microbatch metric gathers made local (``_LocalGathers``) and TRL's local values turned into
sums for the step's reduction. With ``sft`` among the loss types (a token mean over the
microbatch's chosen tokens beside per-pair means) no single scale is exact: the adapter then
reproduces TRL 1.16's loss (``_odc_reproduced_loss``, listed in the compatibility manifest).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from . import _compat
from ._core import ODCTrainerMixin
from ._steps import ODCStep

__all__ = ["PAIRWISE_LOSS_TYPES", "ODCDPOTrainerMixin"]

_WHERE = "torch_odc.integrations.hf (DPOTrainer)"

# TRL 1.16's loss types whose loss is a function of one pair only.
PAIRWISE_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
    "sigmoid_norm",
)
# Types that couple the pairs of a microbatch: their value depends on how pairs are split.
_COUPLED = {
    "aot": "sorts the microbatch's log-ratio differences and pairs them up in sorted order",
    "aot_unpaired": "sorts the microbatch's chosen and rejected log-ratios separately",
}
# The token mean of the chosen completions' NLL: ODC divides by the step's chosen tokens.
_TOKEN_MEAN = ("sft",)

_NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")

# TRL's per-microbatch metrics (DPOTrainer._compute_loss, appended once per call) as the
# adapter's sums: (its key in _METRIC_KEYS, the count TRL's local value is a mean over).
_TRL_METRICS = {
    "entropy": ("entropy", "completion_tokens"),
    "logits/chosen": ("chosen_logits", "chosen_tokens"),
    "logits/rejected": ("rejected_logits", "rejected_tokens"),
    "mean_token_accuracy": ("chosen_correct", "chosen_tokens"),
    "rewards/chosen": ("rewards_chosen", "pairs"),
    "rewards/rejected": ("rewards_rejected", "pairs"),
    "rewards/accuracies": ("rewards_accuracies", "pairs"),
    "rewards/margins": ("rewards_margins", "pairs"),
    "logps/chosen": ("logps_chosen", "pairs"),
    "logps/rejected": ("logps_rejected", "pairs"),
}

_METRIC_KEYS = (
    "pairs",
    "completion_tokens",
    "entropy",
    "attention_tokens",
    "chosen_tokens",
    "chosen_logits",
    "rejected_tokens",
    "rejected_logits",
    "chosen_correct",
    "rewards_chosen",
    "rewards_rejected",
    "rewards_accuracies",
    "rewards_margins",
    "logps_chosen",
    "logps_rejected",
)


class _LocalGathers:
    """The trainer's accelerator during one call of TRL's loss in a training microbatch: its
    metric gathers (``gather``, ``gather_for_metrics``) return this rank's tensor, so that TRL's
    loss runs no collective that ranks with different microbatch counts cannot all call (TRL's
    metrics are then this microbatch's, which the adapter sums and reduces once per step);
    everything else is the accelerator's."""

    def __init__(self, accelerator):
        self._accelerator = accelerator

    def gather(self, tensor):
        return tensor

    def gather_for_metrics(self, data, *args, **kwargs):
        return data

    def __getattr__(self, name):
        return getattr(self._accelerator, name)


def _check_loss_types(loss_types, use_weighting: bool) -> None:
    for name in loss_types:
        if name in _COUPLED:
            raise ValueError(
                f"{_WHERE}: loss_type {name!r} {_COUPLED[name]}, so its loss depends on which "
                "pairs share a microbatch and ODC's plan would change the gradient. Use a "
                f"per-pair loss type ({', '.join(PAIRWISE_LOSS_TYPES)}) or plain TRL."
            )
        if name not in PAIRWISE_LOSS_TYPES and name not in _TOKEN_MEAN:
            raise ValueError(
                f"{_WHERE}: loss_type {name!r} is not known to this adapter (written for TRL "
                f"1.16's types: {', '.join(PAIRWISE_LOSS_TYPES + _TOKEN_MEAN)}); whether it "
                "couples the pairs of a microbatch is unknown, so it is refused."
            )
    if use_weighting and "sft" in loss_types:
        raise ValueError(
            f"{_WHERE}: use_weighting with loss_type 'sft': TRL multiplies the microbatch's "
            "token-mean SFT loss by the mean of the microbatch's pair weights, a product that "
            "depends on how pairs are split. Drop one of the two."
        )


def _constructor_args(cls, args, kwargs) -> dict:
    """The DPOTrainer constructor's arguments by name (for checks before it runs)."""
    from trl import DPOTrainer

    init = next(
        (
            c.__init__
            for c in cls.__mro__
            if issubclass(c, DPOTrainer) and not issubclass(c, ODCTrainerMixin)
        ),
        DPOTrainer.__init__,
    )
    kwargs = {k: v for k, v in kwargs.items() if k != "odc"}
    try:
        return inspect.signature(init).bind_partial(None, *args, **kwargs).arguments
    except TypeError:
        return kwargs


class ODCDPOTrainerMixin(ODCTrainerMixin):
    """For TRL's ``DPOTrainer``: ``class T(ODCDPOTrainerMixin, DPOTrainer)``.

    * A step's rows are preference pairs, planned by LB-Mini on the lengths of prompt + chosen
      and prompt + rejected (truncated at ``max_length``); a pair never leaves its microbatch.
      A vision dataset's pairs carry their images (collated per microbatch from the dataset's
      rows; their patches, twice, in the cost: see ``_vision``).
    * In training microbatches :meth:`compute_loss` weights every pair by ``1 / pairs in the
      step`` (``sft``: every chosen token by ``1 / chosen tokens in the step``), so the gradient
      and the logged loss are plain TRL's for the step: per-pair loss types call TRL's own loss
      and scale it (``_odc_scaled_loss``); with ``sft`` the adapter runs the same forwards as
      TRL (the policy, then the reference: precomputed log-probabilities, the PEFT model with
      its adapter disabled, or a reference model that is not sharded) and reproduces TRL's
      loss (``_odc_reproduced_loss``).
    * TRL's metrics (rewards, margins, accuracies, log-probs, logits, entropy, token accuracy,
      token count) are summed locally, all-reduced once per step after the barrier and logged
      under TRL's names with TRL's values.
    * Refused at construction: loss types that couple the pairs of a microbatch (``aot``,
      ``aot_unpaired``), ``use_weighting`` with ``sft``, the MoE auxiliary loss,
      ``sync_ref_model``, a reference model sharded with FSDP without
      ``precompute_ref_log_probs`` (its forward would be a collective in every microbatch),
      and ``precompute_ref_log_probs`` on several ranks with a dataset that is not on disk.
    """

    _odc_compat_users = ("trainer", "dpo")
    _odc_where = _WHERE

    def __init__(self, *args, **kwargs):
        _compat.require(self._odc_compat_users, self._odc_where)  # before the checks below
        bound = _constructor_args(type(self), args, kwargs)
        config = bound.get("args")
        if config is not None:
            # Before DPOTrainer tokenizes the data and precomputes reference log-probs.
            _check_loss_types(config.loss_type, config.use_weighting)
            if config.sync_ref_model:
                raise ValueError(
                    f"{_WHERE}: sync_ref_model is not supported (the reference "
                    "model would be mixed with the sharded policy every "
                    "ref_model_sync_steps)"
                )
            dataset = bound.get("train_dataset")
            if (
                config.precompute_ref_log_probs
                and config.world_size > 1
                and not getattr(dataset, "cache_files", None)
            ):
                raise ValueError(
                    f"{_WHERE}: precompute_ref_log_probs on {config.world_size} ranks needs a "
                    "training dataset on disk: TRL writes the reference log-probs next to the "
                    "dataset's cache files on rank 0 and every rank reads that file (an "
                    "in-memory dataset gets a different temporary file per rank). Save it "
                    "with dataset.save_to_disk(path) and pass datasets.load_from_disk(path)."
                )
        super().__init__(*args, **kwargs)

    # -- construction checks -------------------------------------------------------------------

    def _odc_check_loss(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        _check_loss_types(self.loss_types, self.use_weighting)
        if len(self.loss_weights) != len(self.loss_types):
            raise ValueError(
                f"{_WHERE}: {len(self.loss_weights)} loss_weights for "
                f"{len(self.loss_types)} loss types"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                f"{_WHERE}: the MoE auxiliary loss (router_aux_loss_coef) is a "
                "per-microbatch mean; not supported (set router_aux_loss_coef=0)"
            )
        if self.args.sync_ref_model:
            raise ValueError(f"{_WHERE}: sync_ref_model is not supported")
        if (
            not self.precompute_ref_logps
            and self.ref_model is not None
            and any(isinstance(m, FSDPModule) for m in self.ref_model.modules())
        ):
            raise ValueError(
                f"{_WHERE}: the reference model is sharded with FSDP, so its forward in every "
                "microbatch would be a collective that ranks with different microbatch counts "
                "cannot all call. Use precompute_ref_log_probs=True, or train a PEFT adapter "
                "(the reference is the model with the adapter disabled, no ref_model)."
            )

    # -- data ----------------------------------------------------------------------------------

    def _odc_vision(self) -> bool:
        return bool(_compat.read(self, "_is_vision_dataset"))

    def _odc_row_lengths(self, dataset) -> list[tuple[int, int]]:
        """Per pair, the lengths of prompt + chosen and prompt + rejected as the collator
        builds them (each truncated at ``max_length``). A vision dataset is not tokenized
        before training: each pair is collated alone once by the trainer's own collator, for
        both lengths and its images' patches (TRL runs a pair's images with the chosen and
        again with the rejected sequence: both copies count)."""
        self._odc_vision_rows = None
        if self._odc_vision():
            from . import _vision

            lengths, images = [], []
            for i in range(len(dataset)):
                pair, im = _vision.row_sizes(
                    self.data_collator([dataset[i]]),
                    f"{_WHERE}: training pair {i}",
                    _vision.PAIR_FIELDS,
                    sequences=2,
                )
                lengths.append(pair)
                images.append(im)
            self._odc_vision_rows = images
            return lengths
        columns = ("prompt_ids", "chosen_ids", "rejected_ids")
        names = getattr(dataset, "column_names", None)
        if names is not None and not set(columns) <= set(names):
            raise ValueError(
                f"{_WHERE}: the training dataset has no {columns} columns (got "
                f"{names}); pass a dataset that DPOTrainer tokenizes"
            )
        try:
            prompt, chosen, rejected = ([len(x) for x in dataset[c]] for c in columns)
        except (KeyError, TypeError):
            rows = [dataset[i] for i in range(len(dataset))]
            prompt, chosen, rejected = ([len(r[c]) for r in rows] for c in columns)
        cap = self.args.max_length if self.args.max_length is not None else math.inf
        return [
            (int(min(p + c, cap)), int(min(p + r, cap)))
            for p, c, r in zip(prompt, chosen, rejected, strict=True)
        ]

    def _odc_row_images(self, dataset):
        return getattr(self, "_odc_vision_rows", None)

    def _odc_microbatch_images(self, rows, images) -> list[int]:
        # TRL's vision preference collator takes the microbatch's images twice: every pair's
        # with the chosen rows, then every pair's again with the rejected rows.
        first = [n for i in rows for n in images[i][: len(images[i]) // 2]]
        return first + first

    def _odc_collator_pads(self, collator) -> bool:
        # TRL's vision preference collator refuses any pad_to_multiple_of.
        return not self._odc_vision() and super()._odc_collator_pads(collator)

    # -- the step ------------------------------------------------------------------------------

    def _odc_step_totals(self, step: ODCStep) -> dict[str, float]:
        pairs = sum(b["input_ids"].size(0) // 2 for b in step.microbatches)
        totals = {"pairs": pairs}
        if "sft" in self.loss_types:
            totals["chosen_tokens"] = sum(
                int(b["completion_mask"][..., 1:].chunk(2, dim=0)[0].sum())
                for b in step.microbatches
            )
        return totals

    def _odc_metric_keys(self) -> tuple[str, ...]:
        return (*super()._odc_metric_keys(), *_METRIC_KEYS)

    def _odc_record_metrics(self, sums: dict[str, float]) -> None:
        super()._odc_record_metrics(sums)
        m = _compat.read(self, "_metrics")["train"]

        def ratio(num, den):
            return sums[num] / sums[den] if sums[den] > 0 else 0.0

        # TRL's keys, in TRL's order, each the step's value.
        m["entropy"].append(ratio("entropy", "completion_tokens"))
        _compat.count_train_tokens(self, int(sums["attention_tokens"]))  # logs num_tokens
        m["logits/chosen"].append(ratio("chosen_logits", "chosen_tokens"))
        m["logits/rejected"].append(ratio("rejected_logits", "rejected_tokens"))
        m["mean_token_accuracy"].append(ratio("chosen_correct", "chosen_tokens"))
        for key in (
            "rewards/chosen",
            "rewards/rejected",
            "rewards/accuracies",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
        ):
            m[key].append(ratio(key.replace("/", "_"), "pairs"))

    def _odc_sequence_logps(self, per_token, shifted_mask):
        """Per row, the summed completion log-probabilities (LD-DPO: the tokens past the
        shorter completion of the pair weighted by ``ld_alpha``)."""
        if self.ld_alpha is None:
            return per_token.sum(dim=1)
        position = shifted_mask.cumsum(dim=1)
        lengths = shifted_mask.sum(dim=1).long()
        shared = torch.minimum(*lengths.chunk(2, dim=0)).repeat(2).unsqueeze(1)
        shared_part = (per_token * ((position > 0) & (position <= shared))).sum(dim=1)
        tail_part = (per_token * (position > shared)).sum(dim=1)
        return shared_part + self.ld_alpha * tail_part

    def _odc_reference_logps(self, model, model_kwargs, labels, inputs, seq_len):
        if self.precompute_ref_logps:
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        disable_gradient_checkpointing = _compat.load(
            "trl.models.utils", "disable_gradient_checkpointing"
        )
        use_adapter = _compat.load("trl.trainer.utils", "use_adapter")
        shifted = inputs["completion_mask"][..., 1:]
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
        ):
            if self.ref_model is None:  # a PEFT model (checked): the adapter off, or "ref" on
                unwrapped = self.accelerator.unwrap_model(self.model)
                name = "ref" if "ref" in unwrapped.peft_config else None
                with use_adapter(unwrapped, adapter_name=name):
                    out = model(**model_kwargs, labels=labels, fused_lm_head=True)
            else:
                out = self.ref_model(**model_kwargs, labels=labels, fused_lm_head=True)
        return self._odc_sequence_logps(out.log_probs[:, -seq_len:], shifted).chunk(2, dim=0)

    def _odc_scores(self, logratios):
        """The f-divergence's f'(ratio) as TRL's ``f_divergence_type`` defines it."""
        kind = self.f_divergence_type
        if kind == "reverse_kl":
            return logratios
        if kind == "forward_kl":
            return 1 - torch.exp(-logratios)
        if kind == "js_divergence":
            return math.log(2) + F.logsigmoid(logratios)
        if kind == "alpha_divergence":
            alpha = self.f_alpha_divergence_coef
            if abs(alpha - 1.0) < 1e-6:
                return logratios
            t = (alpha - 1.0) * logratios
            top = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}[t.dtype]
            return (torch.exp(torch.clamp(t.float(), max=top)) - 1.0).to(t.dtype) / (alpha - 1.0)
        raise ValueError(f"{_WHERE}: unknown f_divergence_type {kind!r}")

    def _odc_pair_loss(self, name, chosen_lr, rejected_lr, chosen_sc, rejected_sc, lengths):
        """One per-pair loss of TRL 1.16's ``loss_type`` ``name`` (a tensor over the pairs)."""
        beta, eps = self.beta, self.label_smoothing
        z = beta * (chosen_sc - rejected_sc)
        if name == "sigmoid":
            return -F.logsigmoid(z)
        if name == "hinge":
            return torch.relu(1 - z)
        if name in ("ipo", "sigmoid_norm"):  # scores per completion token (unshifted counts)
            chosen_len, rejected_len = lengths
            d = chosen_sc / chosen_len - rejected_sc / rejected_len
            return (d - 1 / (2 * beta)) ** 2 if name == "ipo" else -F.logsigmoid(beta * d)
        if name == "exo_pair":
            e = torch.tensor(eps, device=z.device)
            return torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-e)) + torch.sigmoid(-z) * (
                F.logsigmoid(-z) - torch.log(e)
            )
        if name == "robust":
            return ((-(1 - eps) * F.logsigmoid(z)) - (-eps * F.logsigmoid(-z))) / (1 - 2 * eps)
        chosen_r, rejected_r = beta * chosen_lr, beta * rejected_lr
        if name == "nca_pair":
            return (
                -F.logsigmoid(chosen_r)
                - 0.5 * F.logsigmoid(-chosen_r)
                - 0.5 * F.logsigmoid(-rejected_r)
            )
        if name == "bco_pair":
            return -F.logsigmoid(chosen_r) - F.logsigmoid(-rejected_r)
        if name == "sppo_hard":
            return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        if name == "apo_zero":
            return (1 - torch.sigmoid(chosen_r)) + torch.sigmoid(rejected_r)
        if name == "apo_down":
            return torch.sigmoid(chosen_r) + (1 - torch.sigmoid(beta * (chosen_lr - rejected_lr)))
        if name == "discopop":
            mix = torch.sigmoid(z / self.args.discopop_tau)
            return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
        raise ValueError(f"{_WHERE}: loss_type {name!r} is not a per-pair loss")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not (self._odc_in_step and self.model.training):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        if return_outputs:
            raise NotImplementedError(f"{_WHERE}: return_outputs in training")
        if "sft" in self.loss_types:
            return self._odc_reproduced_loss(model, inputs)
        return self._odc_scaled_loss(model, inputs)

    def _odc_scaled_loss(self, model, inputs):
        """TRL's own loss of the microbatch (per-pair loss types: a mean over its pairs) times
        ``world * pairs / (the step's pairs)``; TRL's metrics of the microbatch taken out of its
        log as sums (``_TRL_METRICS``), for the step's reduction."""
        metrics = _compat.read(self, "_metrics")["train"]
        before = {key: list(values) for key, values in metrics.items()}
        tokens = _compat.read(self, "_total_train_tokens")
        self._odc_unshard_output_head()  # the fused LM head reads its weight directly
        accelerator = self.accelerator
        self.accelerator = _LocalGathers(accelerator)
        try:
            loss = _compat.call(self, "_compute_loss", model, inputs, return_outputs=False)
        finally:
            self.accelerator = accelerator
            # TRL's token count and its log as before: the adapter counts and logs them once
            # per step (_odc_record_metrics).
            _compat.write(self, "_total_train_tokens", tokens)
            local = {
                key: values[len(before.get(key, ())) :]
                for key, values in metrics.items()
                if key in _TRL_METRICS
            }
            for key in list(metrics):
                if key in before:
                    metrics[key] = before[key]
                else:
                    del metrics[key]
        shifted = inputs["completion_mask"][..., 1:]
        chosen_mask, rejected_mask = shifted.chunk(2, dim=0)
        counts = {
            "pairs": inputs["input_ids"].size(0) // 2,
            "completion_tokens": float(shifted.sum()),
            "chosen_tokens": float(chosen_mask.sum()),
            "rejected_tokens": float(rejected_mask.sum()),
        }
        s = self._odc_sums
        for key, count in counts.items():
            s[key] += count
        s["attention_tokens"] += float(inputs["attention_mask"].sum())
        for key, (name, count) in _TRL_METRICS.items():
            (value,) = local[key]  # TRL appends each once per call
            s[name] += value * counts[count]
        world = self.accelerator.num_processes // self.get_tp_size()
        return loss * (world * counts["pairs"] / self._odc_totals["pairs"])

    def _odc_reproduced_loss(self, model, inputs):
        """TRL 1.16's ``_compute_loss`` reproduced with per-pair weights ``1 / (the step's
        pairs)`` and per-token weights ``1 / (the step's chosen tokens)`` for ``sft`` (which no
        single per-microbatch scale makes exact beside per-pair means); metrics as sums."""
        completion_mask = inputs["completion_mask"]
        shifted = completion_mask[..., 1:]
        seq_len = shifted.size(1)
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        self._odc_unshard_output_head()  # the fused LM head reads its weight directly
        out = model(**model_kwargs, labels=labels, fused_lm_head=True)
        per_token = out.log_probs[:, -seq_len:]
        chosen_logps, rejected_logps = self._odc_sequence_logps(per_token, shifted).chunk(2)
        ref_chosen, ref_rejected = self._odc_reference_logps(
            model, model_kwargs, labels, inputs, seq_len
        )
        chosen_lr, rejected_lr = chosen_logps - ref_chosen, rejected_logps - ref_rejected
        chosen_sc, rejected_sc = self._odc_scores(chosen_lr), self._odc_scores(rejected_lr)
        lengths = tuple(m.sum(dim=1).clamp(min=1.0) for m in completion_mask.chunk(2, dim=0))
        weights = None
        if self.use_weighting:  # WPO: a per-pair weight from the policy, no gradient
            with torch.no_grad():
                aligned = (per_token - out.log_sum_sq_probs[:, -seq_len:]) * shifted
            w = torch.exp(aligned.sum(dim=1) / shifted.sum(dim=1).clamp_min(1))
            weights = w.chunk(2, dim=0)[0] * w.chunk(2, dim=0)[1]

        # Every pair weighs 1 / (the step's pairs), every sft token 1 / (the step's chosen
        # tokens); times the world size, which FSDP2's (and ODC's) averaging divides out.
        world = self.accelerator.num_processes // self.get_tp_size()
        totals = self._odc_totals
        loss = torch.zeros((), device=per_token.device, dtype=per_token.dtype)
        for name, weight in zip(self.loss_types, self.loss_weights, strict=True):
            if name == "sft":
                chosen_tokens = per_token.chunk(2, dim=0)[0][shifted.chunk(2, dim=0)[0].bool()]
                loss = loss + weight * world * (-chosen_tokens.sum()) / max(
                    totals["chosen_tokens"], 1.0
                )
                continue
            per_pair = self._odc_pair_loss(
                name, chosen_lr, rejected_lr, chosen_sc, rejected_sc, lengths
            )
            if weights is not None:
                per_pair = per_pair * weights
            loss = loss + weight * world * per_pair.sum() / totals["pairs"]
        self._odc_add_metrics(
            inputs, out, shifted, seq_len, chosen_lr, rejected_lr, chosen_logps, rejected_logps
        )
        return loss

    @torch.no_grad()
    def _odc_add_metrics(
        self, inputs, out, shifted, seq_len, chosen_lr, rejected_lr, chosen_logps, rejected_logps
    ) -> None:
        s = self._odc_sums
        chosen_mask, rejected_mask = (m.bool() for m in shifted.chunk(2, dim=0))
        s["pairs"] += chosen_lr.size(0)
        s["completion_tokens"] += float(shifted.sum())
        s["entropy"] += float((out.entropy[:, -seq_len:] * shifted).sum())
        s["attention_tokens"] += float(inputs["attention_mask"].sum())
        chosen_logits, rejected_logits = out.mean_logits[:, -seq_len:].chunk(2, dim=0)
        s["chosen_tokens"] += float(chosen_mask.sum())
        s["chosen_logits"] += float(chosen_logits[chosen_mask].sum())
        s["rejected_tokens"] += float(rejected_mask.sum())
        s["rejected_logits"] += float(rejected_logits[rejected_mask].sum())
        s["chosen_correct"] += float(
            (out.is_top1[:, -seq_len:].chunk(2, dim=0)[0] & chosen_mask).sum()
        )
        chosen_r, rejected_r = self.beta * chosen_lr, self.beta * rejected_lr
        s["rewards_chosen"] += float(chosen_r.sum())
        s["rewards_rejected"] += float(rejected_r.sum())
        s["rewards_accuracies"] += float((chosen_r > rejected_r).sum())
        s["rewards_margins"] += float((chosen_r - rejected_r).sum())
        s["logps_chosen"] += float(chosen_logps.sum())
        s["logps_rejected"] += float(rejected_logps.sum())
