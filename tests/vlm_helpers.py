"""A tiny Qwen2-VL for the vision-language tests, built offline: the model from a config with
random weights, a word-level tokenizer with Qwen2-VL's vision tokens, the PIL image processor
(no torchvision here) and a processor made without a video processor (the default one imports
torchvision: a shim for CPU test runs only), a chat template, and rows of conversations with 0, 1
or 2 small random images each."""

from __future__ import annotations

import random

import torch

VOCAB = 64  # ids: <pad>, <eos>, then words w2..w63 (no word starts with a special token)
VISION_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
PATCH, MERGE, TEMPORAL = 4, 2, 2  # 4x4-pixel patches, 2x2 merged into one token
# Images of 8..32 pixels a side: 2x2..8x8 patches (4..64), resized to multiples of 8 pixels.
MIN_PIXELS, MAX_PIXELS = 8 * 8, 32 * 32
# A conversation's text, as Qwen2-VL's template lays images out (one placeholder per image,
# expanded by the processor to prod(image_grid_thw) / MERGE**2 tokens).
TEMPLATE = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ c['text'] }} {% endif %}"
    "{% endfor %}{% endfor %}"
)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    vocab.update({s: VOCAB + j for j, s in enumerate(VISION_TOKENS)})
    tok = Tokenizer(models.WordLevel(vocab, "<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<eos>"
    )
    out.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return out


FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def processor(family: str = "qwen2_vl"):
    """The family's processor with the PIL image processor and no video processor."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    base = {
        "qwen2_vl": transformers.Qwen2VLProcessor,
        "qwen2_5_vl": transformers.Qwen2_5_VLProcessor,
    }[family]

    class ImagesOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=None,
                chat_template=chat_template,
                **kwargs,
            )

    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    return ImagesOnlyProcessor(images, tokenizer(), chat_template=TEMPLATE)


def build_model(family: str = "qwen2_vl"):
    """Qwen2-VL (or Qwen2.5-VL) with 2 text layers (hidden 32, head_dim 8: mrope_section sums
    to 4) and a 2-block vision tower (Qwen2.5-VL: block 0 attends within windows of 2 x 2
    merged patches, block 1 over the whole image), random weights from seed 0, fp32."""
    import transformers

    tok = tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in VISION_TOKENS}
    text = {
        "vocab_size": VOCAB + len(VISION_TOKENS),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [1, 1, 2],
        },
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 1,
    }
    vision = {
        "depth": 2,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL,
        "in_channels": 3,
    }
    if family == "qwen2_vl":
        vision.update(embed_dim=16, hidden_size=32)
        config_class = transformers.Qwen2VLConfig
        model_class = transformers.Qwen2VLForConditionalGeneration
    else:
        vision.update(
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=32,
            window_size=2 * MERGE * PATCH,
            fullatt_block_indexes=[1],
        )
        config_class = transformers.Qwen2_5_VLConfig
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return model_class(config)


def rows(images_per_row, seed: str = "vlm") -> list[dict]:
    """One conversation per entry of ``images_per_row`` (that many images, each of a random
    size): a user turn and an assistant turn of arithmetic progressions over w2..w63."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    out = []
    for k in images_per_row:
        images = []
        for _ in range(k):
            h, w = rng.choice([8, 12, 16, 24, 32]), rng.choice([8, 16, 20, 32])
            pixels = np.random.default_rng(rng.randrange(1 << 30)).integers(
                0, 255, (h, w, 3), dtype=np.uint8
            )
            images.append(Image.fromarray(pixels))
        n, start, step = rng.randint(4, 14), rng.randrange(2, VOCAB), rng.randrange(1, 5)
        words = [f"w{2 + (start + step * j) % (VOCAB - 2)}" for j in range(n)]
        out.append(
            {
                "images": images,
                "messages": [
                    {"role": "user", "content": " ".join(words[: n // 2])},
                    {"role": "assistant", "content": " ".join(words[n // 2 :])},
                ],
            }
        )
    return out


def pairs(images_per_row, seed: str = "vlm-pairs") -> list[dict]:
    """Preference pairs for DPO: the rows of :func:`rows` as prompts (the user turn, with the
    images) and their assistant turns as the chosen completion; the rejected one is the same
    words reversed, cut or grown by a word (so the pair's lengths differ)."""
    out = []
    for k, row in enumerate(rows(images_per_row, seed)):
        chosen = row["messages"][1]["content"].split()
        rejected = list(reversed(chosen))[: max(1, len(chosen) - 1 + 2 * (k % 2))]
        if k % 2:
            rejected.append("w7")
        out.append(
            {
                "images": row["images"],
                "prompt": [row["messages"][0]],
                "chosen": [{"role": "assistant", "content": " ".join(chosen)}],
                "rejected": [{"role": "assistant", "content": " ".join(rejected)}],
            }
        )
    return out
