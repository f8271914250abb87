"""Rows with images in verl's "odc" engine: the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL).

What verl 0.9.1 does with them (read in the wheel):

* A rollout row carries its vision inputs in the row field ``multi_modal_inputs`` (a
  ``NonTensorStack``, one dict per row; ``{}`` for a text-only row): the processor's ragged
  ``pixel_values`` (one row per patch) and ``image_grid_thw`` (image k has
  ``prod(image_grid_thw[k])`` patches), ``images_seqlens`` (the agent loop's per-image patch
  counts, for the MFU estimate), and for videos ``pixel_values_videos`` / ``video_grid_thw``
  (/ ``second_per_grid_ts``). ``input_ids`` holds the expanded placeholders
  (``prod(grid) / merge**2`` image tokens per image); ``position_ids`` are M-RoPE's
  (4, length) per row.
* The engine's ``prepare_model_inputs`` concatenates a microbatch's rows' fields in row order
  (``utils/model.py::extract_multi_modal_inputs``; ``mm_token_type_ids``, ``input_features``
  and ``feature_attention_mask`` are padded to the microbatch's longest row instead) and passes
  them to the model.
* verl replaces ``Qwen2VLModel.forward`` (and Qwen2.5-VL's) by its own
  (``models/transformers/qwen2_vl.py::qwen2_vl_base_forward``): when a microbatch has neither
  images nor videos, ``_get_input_embeds`` runs the vision tower on 16 zero patches and adds
  ``0.0 * mean`` of its output to the embeddings, so that every FSDP2 rank runs the vision
  tower's collectives in every microbatch. With transformers 5 that dummy raises
  (``'BaseModelOutputWithPooling' object has no attribute 'mean'``: the vision tower returns an
  output object, which verl's image path unpacks and the dummy does not), so verl 0.9.1 cannot
  run a text-only microbatch of these models at all.

What the "odc" engine changes: under ODC ranks need not run the same modules, so its model
runs no vision forward for a microbatch without images or videos (:func:`serve_without_dummy`
replaces the text-only path of verl's forward on this engine's model instance; the path with
images is verl's own). The dummy's contribution is zero (``x + 0.0 * m`` is ``x``; its gradient
is exactly zero), so nothing else changes, except that verl's vision parameters always have a
gradient (zero where no microbatch of any rank had an image, had the dummy run) where ODC's
then have none: after the barrier the engine gives them zeros (:func:`zero_missing_grads`),
so that an optimizer that steps on zero gradients (AdamW's decay and moments) steps as verl's
would.

A row's images travel with the row (its ``multi_modal_inputs`` is one of its fields), and
LB-Mini's cost counts each image's patches as well as the row's tokens (:func:`row_images`).
Fields whose per-row meaning or cost is not worked out are refused by name (:func:`check`).
"""

from __future__ import annotations

import types

import torch

from . import _compat

__all__ = [
    "FIELDS",
    "SERVED_MODELS",
    "check",
    "row_images",
    "serve_without_dummy",
    "undo",
    "zero_missing_grads",
]

KEY = "multi_modal_inputs"
SERVED_MODELS = ("qwen2_vl", "qwen2_5_vl")
# Per row, concatenated over a microbatch's rows by verl: (pixels, their grid) per modality.
_MODALITIES = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
FIELDS = frozenset(
    {
        "pixel_values",
        "image_grid_thw",
        "images_seqlens",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
    }
)


def _dicts(data) -> list[dict] | None:
    """The rows' multi-modal inputs (``{}`` for a row without), or None when the mini-batch
    has no such field."""
    if len(data) == 0 or KEY not in list(data.keys()):
        return None
    out = []
    for item in data.get(KEY):
        item = getattr(item, "data", item)  # NonTensorData
        out.append(dict(item) if item else {})
    return out


def row_images(data) -> list[tuple[int, ...]] | None:
    """Per row, the vision patches of each of its images and videos (``()`` for a text-only
    row), or None when the mini-batch carries no ``multi_modal_inputs``. A row's patches
    count in LB-Mini's cost beside its tokens. Call :func:`check` first."""
    rows = _dicts(data)
    if rows is None:
        return None
    out = []
    for row in rows:
        patches = []
        for _, grid in _MODALITIES:
            if row.get(grid) is not None:
                patches += [int(n) for n in torch.as_tensor(row[grid]).prod(-1).tolist()]
        out.append(tuple(patches))
    return out


def check(data, model_type: str) -> list[str]:
    """What this rank's rows carry that the engine does not serve (an empty list: nothing),
    one sentence per kind of problem, each naming the field."""
    rows = _dicts(data)
    if rows is None or not any(rows):
        return []
    problems: dict[str, str] = {}
    if model_type not in SERVED_MODELS:
        fields = sorted({k for row in rows for k in row})
        problems["model"] = (
            f"'{KEY}' rows (fields {fields}) for a model of type {model_type!r}: served for "
            f"{'/'.join(SERVED_MODELS)} (tested), whose verl forward the engine has read: that "
            "family's text-only path and per-row fields have not been checked under ODC"
        )
        return list(problems.values())
    varlen = _compat.load("verl.utils.model", "_VARLEN_MULTI_MODAL_KEYS")
    for row in rows:
        for key in sorted(set(row) - FIELDS):
            if key in varlen:
                why = (
                    "verl pads it to the longest row of each microbatch "
                    "(extract_multi_modal_inputs), so what the model sees depends on which "
                    "rows share a microbatch, and ODC's microbatches are not verl's"
                )
            else:
                why = (
                    "not a field of the Qwen2-VL family's rows: how it splits per row and "
                    "what it costs are not worked out"
                )
            problems.setdefault(key, f"'{KEY}' field {key!r}: {why}")
        for pixels, grid in _MODALITIES:
            if row.get(pixels) is None and row.get(grid) is None:
                continue
            if row.get(pixels) is None or row.get(grid) is None:
                problems.setdefault(
                    pixels,
                    f"'{KEY}' field {pixels!r} without {grid!r} (or "
                    "the other way round): not the Qwen2-VL layout",
                )
                continue
            g = torch.as_tensor(row[grid])
            n = int(row[pixels].shape[0])
            if g.dim() != 2 or g.shape[-1] != 3 or n != int(g.prod(-1).sum()):
                problems.setdefault(
                    pixels,
                    (
                        f"'{KEY}' field {pixels!r} holds {n} rows where {grid!r} "
                        f"{tuple(g.shape)} names {int(g.prod(-1).sum()) if g.dim() == 2 else '?'} "
                        "patches: not the Qwen2-VL layout (one row per patch, split per image by "
                        "its grid)"
                    ),
                )
    return list(problems.values())


def serve_without_dummy(module, counts: dict) -> list[torch.nn.Module]:
    """Replaces, on this model instance only, the text-only path of verl's Qwen2-VL forward
    (``qwen2_vl_base_forward``): a microbatch without images or videos runs no vision forward
    (verl's dummy on zeros adds exactly zero). A microbatch with them runs verl's forward as it
    is. ``counts`` (``"text_only"``, ``"with_vision"``) counts the forwards of each kind.
    Returns the models it served (empty for a model outside the family): :func:`undo` gives
    them verl's forward back, their ``visual`` are the vision towers.
    """
    verl_forward = _compat.load("verl.models.transformers.qwen2_vl", "qwen2_vl_base_forward")

    def forward(
        self,
        input_ids,
        attention_mask=None,
        labels=None,
        pixel_values=None,
        pixel_values_videos=None,
        image_grid_thw=None,
        video_grid_thw=None,
        **kwargs,
    ):
        if pixel_values is not None or pixel_values_videos is not None:
            counts["with_vision"] += 1
            return verl_forward(
                self,
                input_ids,
                attention_mask=attention_mask,
                labels=labels,
                pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                **kwargs,
            )
        # verl's _get_input_embeds without images or videos, less its dummy vision forward.
        counts["text_only"] += 1
        inputs_embeds = self.get_input_embeddings()(input_ids)
        if attention_mask is not None:
            attention_mask = attention_mask.to(inputs_embeds.device)
        return self.language_model(
            input_ids=None, inputs_embeds=inputs_embeds, attention_mask=attention_mask, **kwargs
        )

    served = []
    for inner in module.modules():
        if getattr(type(inner), "forward", None) is verl_forward:
            inner.forward = types.MethodType(forward, inner)
            served.append(inner)
    return served


def undo(served) -> None:
    """verl's own forward again (a fallback to verl's equal counts over FSDP2's collectives,
    where every rank must run the vision tower in every microbatch)."""
    for inner in served:
        del inner.forward


def zero_missing_grads(served) -> int:
    """Zero gradients for the vision towers' trainable parameters that got none in this
    mini-batch (no rank ran a microbatch with images), as verl's dummy forward leaves them.
    Returns how many parameters it gave one."""
    filled = 0
    for inner in served:
        for p in inner.visual.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                filled += 1
    return filled
