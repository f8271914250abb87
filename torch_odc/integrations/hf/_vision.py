"""Rows with images in the Hugging Face adapters: what a collated vision-language row carries,
and the check that a collated microbatch carries exactly its rows' images.

TRL's vision collators (``DataCollatorForVisionLanguageModeling``, and DPO's
``DataCollatorForVisionPreference``, which runs each pair's images twice: with the chosen and
with the rejected sequence) process a microbatch's images when they collate it, from
the dataset's rows (PIL images beside the text): a row read from the dataset holds its images,
so they travel with the row to whichever microbatch and rank the plan gives it, and the
collator turns exactly that microbatch's rows into its ``pixel_values``. What the plan needs to
know of a row is measured once, before training, by collating the row alone (:func:`row_sizes`):
its tokens (the image placeholders expanded, truncation applied, as the collator does) and the
vision patches of each of its images.

Served: the fields of the Qwen2-VL family's processors (Qwen2-VL, Qwen2.5-VL):
``pixel_values`` is ragged, one row per patch, split per image by ``image_grid_thw`` (image k
has ``prod(image_grid_thw[k])`` patches), so a microbatch's images are its rows' images
concatenated in row order; ``mm_token_type_ids`` marks the image tokens of ``input_ids``. A
microbatch without an image has no ``pixel_values``, and the model runs no vision forward for
it (under ODC ranks need not run the same modules). Any other field (another family's
``image_sizes``, ``pixel_attention_mask``, ``token_type_ids``, dense ``pixel_values`` without
``image_grid_thw``, videos' ``pixel_values_videos`` / ``video_grid_thw``) is refused by name:
what a row of it costs and carries has not been worked out or tested.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "IMAGE_FIELDS",
    "PAIR_FIELDS",
    "TEXT_FIELDS",
    "check_microbatch",
    "image_patches",
    "row_sizes",
]

# A collated language-modeling row of the Qwen2-VL family's processors, and what TRL adds.
TEXT_FIELDS = frozenset({"input_ids", "attention_mask", "labels", "mm_token_type_ids"})
# A collated preference pair of TRL's DPOTrainer (chosen and rejected rows).
PAIR_FIELDS = frozenset({"input_ids", "attention_mask", "completion_mask", "mm_token_type_ids"})
IMAGE_FIELDS = frozenset({"pixel_values", "image_grid_thw"})

SERVED = (
    "Qwen2-VL / Qwen2.5-VL images: ragged pixel_values split per image by image_grid_thw "
    "(fields " + ", ".join(sorted(TEXT_FIELDS | IMAGE_FIELDS)) + ")"
)


def _refuse_unknown(batch: Mapping, where: str, text_fields=TEXT_FIELDS) -> None:
    unknown = sorted(set(batch) - set(text_fields) - IMAGE_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: the collated rows carry {unknown[0]!r}"
            + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else "")
            + ", a vision-language field ODC does not plan: how it splits per row and what it "
            f"costs are not worked out, so the gradient could not be kept exact. Served: "
            f"{SERVED}"
        )
    if "pixel_values" in batch and "image_grid_thw" not in batch:
        raise ValueError(
            f"{where}: the collated rows carry 'pixel_values' without 'image_grid_thw' (dense "
            f"per-image pixels, another model family's layout): not served. Served: {SERVED}"
        )


def image_patches(batch: Mapping, where: str) -> list[int]:
    """The vision patches of each image of a collated batch, in order (``[]`` without
    images), checked against its ``pixel_values`` rows."""
    grid = batch.get("image_grid_thw")
    pixels = batch.get("pixel_values")
    if grid is None:
        if pixels is not None:
            raise ValueError(f"{where}: 'pixel_values' without 'image_grid_thw'")
        return []
    grid = torch.as_tensor(grid)
    if grid.dim() != 2 or grid.shape[-1] != 3:
        raise ValueError(
            f"{where}: 'image_grid_thw' of shape {tuple(grid.shape)}, expected (images, 3)"
        )
    patches = [int(n) for n in grid.prod(-1).tolist()]
    rows = 0 if pixels is None else int(pixels.shape[0])
    if rows != sum(patches):
        raise ValueError(
            f"{where}: 'pixel_values' holds {rows} patches, 'image_grid_thw' names "
            f"{sum(patches)}: not the Qwen2-VL layout (one pixel_values row per "
            "patch)"
        )
    return patches


def row_sizes(batch: Mapping, where: str, text_fields=TEXT_FIELDS, sequences: int = 1) -> tuple:
    """A row collated alone: (its tokens, the vision patches of each of its images). The
    tokens are the row's unpadded length (the attention mask's ones, else the width). A row of
    several ``sequences`` (a preference pair: chosen, rejected) gives a tuple of their lengths
    instead."""
    _refuse_unknown(batch, where, text_fields)
    ids = batch["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != sequences:
        raise ValueError(
            f"{where}: a row collated alone gave input_ids of shape "
            f"{tuple(ids.shape)}, expected {sequences} sequence(s)"
        )
    mask = batch.get("attention_mask")
    lengths = (
        tuple(int(n) for n in mask.sum(dim=1))
        if mask is not None
        else (int(ids.shape[1]),) * sequences
    )
    return (lengths[0] if sequences == 1 else lengths), tuple(image_patches(batch, where))


def check_microbatch(batch: Mapping, want: Sequence[int], where: str) -> None:
    """A collated microbatch carries exactly the images planned for it (``want``: the patches
    of each of its rows' images, in row order)."""
    got = image_patches(batch, where)
    if got != list(want):
        raise RuntimeError(
            f"{where}: a microbatch's collated images ({len(got)} images, patches {got[:8]}) "
            f"are not its rows' ({len(want)} images, patches {list(want)[:8]}): the collator "
            "did not give each row its own images as it did for the row alone"
        )
