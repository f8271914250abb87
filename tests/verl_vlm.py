"""A tiny Qwen2-VL for the verl cases (tests/verl_cases.py), built offline from a config, and
rollout rows with images, videos or neither, as verl 0.9.1's agent loop hands them to the update.

* :func:`build_model`: Qwen2-VL with 2 text layers and a 2-block vision tower (the sizes of
  tests/vlm_helpers.py's builder; token ids of its own: 64 words, then the 4 vision tokens),
  random weights from seed 0, saved to a directory verl loads.
* :func:`make_batch`: per row a prompt (words, then ``<|vision_start|> <|image_pad|>*n
  <|vision_end|>`` per image or video, ``n = prod(grid) / 4``) left-padded, a response
  right-padded, M-RoPE position ids (verl's ``get_rope_index``; text positions first, as the
  agent loop stacks them), and ``multi_modal_inputs`` as the agent loop builds it: random
  ``pixel_values`` (one row per patch) with ``image_grid_thw`` and ``images_seqlens``, or
  ``pixel_values_videos`` with ``video_grid_thw``; ``{}`` for a text-only row. Converted by
  verl's ``left_right_2_no_padding``.
* :func:`install_dummy_fix`: verl 0.9.1's dummy vision forward for text-only microbatches
  (``models/transformers/qwen2_vl.py::_get_input_embeds``) calls ``.mean()`` on the vision
  tower's output, which transformers 5 returns as an output object: every text-only microbatch
  raises ``AttributeError``. For verl's own engine (the reference) the test replaces that
  function by the same one with the tower's output unpacked as verl's image path unpacks it
  (``unpack_visual_output``), and counts its dummy forwards. The "odc" engine never reaches it.
"""

from __future__ import annotations

import typing

import torch

WORDS = 64  # ids 0 <pad>, 1 <eos>, 2..63 words; then the vision tokens
IMAGE_PAD, VISION_START, VISION_END, VIDEO_PAD = WORDS, WORDS + 1, WORDS + 2, WORDS + 3
PATCH, MERGE, TEMPORAL, CHANNELS = 4, 2, 2, 3
PATCH_DIM = CHANNELS * TEMPORAL * PATCH * PATCH
PROMPT = 40  # prompt width (left-padded)
RESPONSE = 24  # response width (right-padded)

DUMMY_CALLS = {"dummy": 0}


def build_model(path: str, family: str = "qwen2_vl") -> None:
    import transformers

    text = {
        "vocab_size": WORDS + 4,
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
        "in_channels": CHANNELS,
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
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)


class _Processor:
    """What verl's ``get_rope_index`` reads of a processor."""

    class image_processor:
        merge_size = MERGE

    class tokenizer:
        ids: typing.ClassVar = {
            "<|image_pad|>": IMAGE_PAD,
            "<|video_pad|>": VIDEO_PAD,
            "<|vision_start|>": VISION_START,
            "<|vision_end|>": VISION_END,
        }

        @classmethod
        def convert_tokens_to_ids(cls, token):
            return cls.ids[token]


def row(words: int, response: int, images=(), video=None) -> dict:
    """A row's shape: ``words`` prompt words, then one placeholder run per image (grids
    ``(h, w)`` in patches) and per video (``(t, h, w)``), and ``response`` tokens."""
    return {"words": words, "response": response, "images": list(images), "video": video}


def tokens(spec: dict) -> int:
    vision = [h * w for h, w in spec["images"]]
    if spec["video"] is not None:
        vision.append(spec["video"][0] * spec["video"][1] * spec["video"][2])
    return spec["words"] + sum(n // MERGE**2 + 2 for n in vision) + spec["response"]


def patches(spec: dict) -> int:
    n = sum(h * w for h, w in spec["images"])
    if spec["video"] is not None:
        n += spec["video"][0] * spec["video"][1] * spec["video"][2]
    return n


def calls() -> list:
    """The rows of the VLM cases: per call of train_mini_batch, per rank, 4 rows."""
    r = row
    # Per call, per rank, 4 rows (2 mini-batches of 2). Call 0: rank 0's first mini-batch needs
    # 2 microbatches (an image row, a text-only one), rank 1's one (an image row with a text
    # row; verl pads it to 2: the text row alone); the second mini-batch has no image on any
    # rank (2 and 1 microbatches). Call 1: a video row with a text row on rank 0 (1
    # microbatch) while rank 1 runs a row of 2 images and a text-only one (2); then rank 0 two
    # text-only microbatches, rank 1 one with two image rows. (A rank's rows have images or a
    # video, not both: verl's FSDP2 runs the vision tower once per modality of a microbatch, and
    # a microbatch with both beside one with either aborts on mismatched collectives.)
    return [
        [
            [r(6, 20, images=[(8, 8)]), r(6, 24), r(6, 24), r(16, 24)],
            [r(4, 6, images=[(4, 4)]), r(4, 5), r(4, 6), r(4, 8)],
        ],
        [
            [r(4, 10, video=(2, 4, 4)), r(10, 20), r(6, 22), r(16, 24)],
            [
                r(4, 14, images=[(4, 4), (8, 8)]),
                r(6, 20),
                r(4, 6, images=[(8, 8)]),
                r(8, 8, images=[(4, 8)]),
            ],
        ],
    ]


def make_batch(specs: list[dict], seed: int):
    """The rows of ``specs`` as verl's trainer hands them to the update (see the module
    docstring)."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.models.transformers.qwen2_vl import get_rope_index
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    n = len(specs)
    prompts = torch.zeros(n, PROMPT, dtype=torch.long)
    responses = torch.zeros(n, RESPONSE, dtype=torch.long)
    attention = torch.zeros(n, PROMPT + RESPONSE, dtype=torch.long)
    position_ids = torch.zeros(n, 4, PROMPT + RESPONSE, dtype=torch.long)
    inputs = []
    for i, spec in enumerate(specs):
        prompt = torch.randint(2, WORDS, (spec["words"],), generator=g).tolist()
        mm, grids = {}, []
        for h, w in spec["images"]:
            prompt += [VISION_START] + [IMAGE_PAD] * (h * w // MERGE**2) + [VISION_END]
            grids.append([1, h, w])
        if grids:
            grid = torch.tensor(grids)
            mm = {
                "pixel_values": torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g),
                "image_grid_thw": grid,
                "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]),
            }
        video = None
        if spec["video"] is not None:
            t, h, w = spec["video"]
            prompt += [VISION_START] + [VIDEO_PAD] * (t * h * w // MERGE**2) + [VISION_END]
            video = torch.tensor([[t, h, w]])
            mm.update(
                pixel_values_videos=torch.randn(t * h * w, PATCH_DIM, generator=g),
                video_grid_thw=video,
            )
        assert len(prompt) <= PROMPT and spec["response"] <= RESPONSE, spec
        p, r = len(prompt), spec["response"]
        prompts[i, PROMPT - p :] = torch.tensor(prompt)
        responses[i, :r] = torch.randint(2, WORDS, (r,), generator=g)
        attention[i, PROMPT - p : PROMPT + r] = 1
        ids = torch.cat([prompts[i], responses[i]])
        vision = get_rope_index(
            _Processor,
            ids,
            image_grid_thw=mm.get("image_grid_thw"),
            video_grid_thw=video,
            attention_mask=attention[i],
        )
        text = torch.ones(PROMPT + RESPONSE, dtype=torch.long)
        text[attention[i].bool()] = torch.arange(p + r)
        position_ids[i] = torch.cat([text[None], vision])
        inputs.append(mm)
    response_mask = attention[:, PROMPT:].clone()
    base = -torch.log(torch.tensor(float(WORDS + 4)))
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": base + 0.2 * torch.randn(n, RESPONSE, generator=g),
            "ref_log_prob": base + 0.2 * torch.randn(n, RESPONSE, generator=g),
            "advantages": torch.randn(n, RESPONSE, generator=g),
        },
        batch_size=[n],
    )
    td = left_right_2_no_padding(td)
    td["multi_modal_inputs"] = NonTensorStack.from_list([NonTensorData(d) for d in inputs])
    tu.assign_non_tensor(td, temperature=1.0)
    return td


def install_dummy_fix() -> None:
    """verl's ``_get_input_embeds`` with its dummy vision forward working on transformers 5
    (see the module docstring); the path with images or videos is verl's own."""
    from verl.models.transformers import qwen2_vl
    from verl.utils.transformers_compat import unpack_visual_output

    original = getattr(qwen2_vl._get_input_embeds, "verl_original", qwen2_vl._get_input_embeds)

    def _get_input_embeds(
        model,
        input_ids,
        attention_mask=None,
        pixel_values=None,
        pixel_values_videos=None,
        image_grid_thw=None,
        video_grid_thw=None,
    ):
        if pixel_values is not None or pixel_values_videos is not None:
            return original(
                model,
                input_ids,
                attention_mask,
                pixel_values,
                pixel_values_videos,
                image_grid_thw,
                video_grid_thw,
            )
        DUMMY_CALLS["dummy"] += 1
        inputs_embeds = model.get_input_embeddings()(input_ids)
        config = model.config.vision_config
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        zeros = torch.zeros((16, patch_dim), dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        grid = torch.tensor([[1, 4, 4]], dtype=torch.long, device=inputs_embeds.device)
        image_embeds, _ = unpack_visual_output(model.visual(zeros, grid_thw=grid))
        inputs_embeds = inputs_embeds + 0.0 * image_embeds.mean()
        if attention_mask is not None:
            attention_mask = attention_mask.to(inputs_embeds.device)
        return inputs_embeds, attention_mask

    _get_input_embeds.verl_original = original
    qwen2_vl._get_input_embeds = _get_input_embeds


def count_vision_forwards(worker) -> dict:
    """A forward hook on the worker's vision tower counting its calls (the dummy's included)."""
    counts = {"vision": 0}
    for name, module in worker.engine.module.named_modules():
        if name.endswith("visual"):
            module.register_forward_hook(
                lambda *_: counts.__setitem__("vision", counts["vision"] + 1)
            )
            return counts
    raise AssertionError("no vision tower")
