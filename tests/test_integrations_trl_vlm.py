"""A vision-language model under torch_odc.integrations.hf's TRL SFTTrainer and DPOTrainer
adapters, on 2 CPU ranks: a tiny Qwen2-VL built from a config (random weights, fp32, nothing
downloaded; see vlm_helpers.py), conversations (SFT) or preference pairs (DPO) with 0, 1 or 2
images each.

One launch of 2 ranks runs seven trainings of 3 steps (6 rows a step) one after another:

* ``plain``: the unmodified TRL SFTTrainer on 2 ranks (on CPU ranks accelerate gives it DDP),
  every row with images, so that every rank's microbatch has images: the setting the unmodified
  trainer can run (plain FSDP2 aborts when one rank's microbatch has images and another's none).
* ``images``: the ODC SFTTrainer on the same data with its defaults (LB-Mini with patches in the
  cost, the derived cap as a frontier of (padded tokens, patches)). Its parameters, logged
  metrics and every step's gradient equal ``plain``'s.
* ``mixed`` (Qwen2-VL) and ``mixed25`` (Qwen2.5-VL, whose vision tower attends within windows
  in one block): the ODC SFTTrainer on mixed rows with fixed plans: step 0 counts [2, 1] where
  rank 1's microbatch is text-only (it runs no vision forward), step 1 counts [0, 3] (rank 0
  runs nothing; rank 1 runs a text-only and two image microbatches), step 2 LB-Mini with an
  explicit cap over tokens plus patches. Every step's gradient (after the barrier and
  clipping) and its logged loss and grad norm equal a single-process reference computed here,
  in the test process, at the same parameters: the whole step in one batch collated by TRL's
  collator, the loss from the model's own logits (not TRL's fused head), clipped as torch clips.
* ``dpo_plain``, ``dpo_images``, ``dpo_mixed``: the same three for DPOTrainer (sigmoid loss, a
  separate reference model), the reference's DPO loss written out from the logits.

Plus the planning pieces without ranks: a row's patches in its cost, the frontier cap, and the
refusal of vision fields other than Qwen2-VL's, named."""

from __future__ import annotations

import functools
import math
import tempfile
import time

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("PIL")

import vlm_helpers as V
from hf_helpers import full_params, set_rank_env
from multiproc import run_ranks

WORLD = 2
PER_DEVICE = 3
STEPS = 3
PER_STEP = PER_DEVICE * WORLD
LR = 1e-2
# Below every step's norm here (SFT 2-5; DPO ~0.3-0.6): clipping acts in every step.
MAX_GRAD_NORM = {False: 1.0, True: 0.2}
# Images per row, 3 steps of 6 rows in dataset order (train_sampling_strategy="sequential").
ALL_IMAGES = [1, 2, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 2]
MIXED = [1, 0, 2, 0, 1, 0, 0, 1, 0, 2, 1, 0, 2, 0, 0, 1, 0, 1]
# plan[step][rank]: microbatches as positions into the step's 6 rows; step 2 is LB-Mini's.
FIXED_PLANS = {
    0: [[[0, 2], [4]], [[1, 3, 5]]],  # rank 1: one text-only microbatch
    1: [[], [[0, 2, 5], [1], [3, 4]]],  # rank 0: none; rank 1: text-only, image, image
}
WANT_COUNTS = [[2, 1], [0, 3]]
CAP = {False: 120, True: 240}  # the mixed runs' explicit cap (SFT, DPO): tokens plus patches
# The trainings of the launch, in order: SFT, then DPO (dpo_*).
FAMILY = {
    "plain": "qwen2_vl",
    "images": "qwen2_vl",
    "mixed": "qwen2_vl",
    "mixed25": "qwen2_5_vl",
    "dpo_plain": "qwen2_vl",
    "dpo_images": "qwen2_vl",
    "dpo_mixed": "qwen2_vl",
}
DPO_LR = 2e-2
BETA = 0.1  # DPOConfig's default beta (loss_type sigmoid)
# fp32 on CPU: the same sums in another order. A microbatch lost, run twice, or a row's images
# given to another row would move gradients by ~1e-2.
GRAD_ATOL, GRAD_RTOL = 2e-6, 1e-5
PARAM_ATOL = 1e-5  # after 3 AdamW steps (as the other SFT tests)


def expected_row(row) -> tuple[int, int, list[int]]:
    """A row's tokens, patches and patches per image, worked out from the image sizes and the
    template, not by the adapter: each image resized by Qwen2-VL's smart_resize to multiples
    of PATCH * MERGE pixels, one patch per PATCH x PATCH pixels, and in the text
    <|vision_start|> + patches / MERGE**2 image tokens + <|vision_end|>."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patches = []
    for image in row["images"]:
        w, h = image.size
        rh, rw = smart_resize(
            h, w, factor=V.PATCH * V.MERGE, min_pixels=V.MIN_PIXELS, max_pixels=V.MAX_PIXELS
        )
        patches.append((rh // V.PATCH) * (rw // V.PATCH))
    words = sum(len(m["content"].split()) for m in row["messages"])
    return words + sum(2 + p // V.MERGE**2 for p in patches), sum(patches), patches


def expected_pair(pair) -> tuple[tuple[int, int], int]:
    """A preference pair's two lengths (prompt + chosen, prompt + rejected) and the patches
    its forward runs: the prompt's images with each of the two sequences."""
    prompt = {"images": pair["images"], "messages": pair["prompt"]}
    tokens, patches, _ = expected_row(prompt)
    return (
        (
            tokens + len(pair["chosen"][0]["content"].split()),
            tokens + len(pair["rejected"][0]["content"].split()),
        ),
        2 * patches,
    )


def _step_rows(dpo: bool, step: int):
    data = V.pairs(MIXED) if dpo else V.rows(MIXED)
    return data[step * PER_STEP : (step + 1) * PER_STEP]


def planner(lengths, world, step, dpo=False):
    from hf_helpers import fixed_or_lb_mini

    # The lengths the adapter plans by: each row's tokens (a pair's two sequences) plus the
    # patches of the images it runs.
    if dpo:
        want = [sum(t) + p for t, p in map(expected_pair, _step_rows(True, step))]
    else:
        want = [t + p for t, p, _ in map(expected_row, _step_rows(False, step))]
    assert list(lengths) == want, (step, list(lengths), want)
    return fixed_or_lb_mini(FIXED_PLANS, lengths, world, step, cap=CAP[dpo])


def dpo_planner(lengths, world, step):
    return planner(lengths, world, step, dpo=True)


def full_grads(model) -> dict:
    """Every parameter's gradient, unsharded, on CPU (None where it has none)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = getattr(model, "module", model)
    local = {}
    for n, p in model.named_parameters():
        g = p.grad
        local[n] = (
            None
            if g is None
            else (g.to_local() if isinstance(g, DTensor) else g).detach().cpu().clone()
        )
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if not sharded:
        return local
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, {n: local[n] for n in sharded})
    out = {}
    for n, g in local.items():
        if n not in sharded:
            out[n] = g
        else:
            parts = [s[n] for s in shards]
            assert all((x is None) == (parts[0] is None) for x in parts), n
            out[n] = None if parts[0] is None else torch.cat(parts)
    return out


def _train(kind: str, cuda: bool = False) -> dict:
    import datasets
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    dpo = kind.startswith("dpo_")
    name = kind.removeprefix("dpo_")
    odc = name != "plain"
    mixed = name.startswith("mixed")
    family = FAMILY[kind]
    images = MIXED if mixed else ALL_IMAGES
    data = datasets.Dataset.from_list(V.pairs(images) if dpo else V.rows(images))
    model = V.build_model(family)
    captured = []
    vision_calls = [0]
    model.model.visual.register_forward_hook(
        lambda *_: vision_calls.__setitem__(0, vision_calls[0] + 1)
    )

    class Capture(TrainerCallback):
        """After the barrier and the clipping, before the optimizer: the step's gradient, the
        parameters it was taken at, and this rank's vision forwards in the step."""

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            captured.append(
                {
                    "grads": full_grads(trainer.model),
                    "params": full_params(trainer.model),
                    "vision_calls": vision_calls[0],
                }
            )
            vision_calls[0] = 0

    args = (DPOConfig if dpo else SFTConfig)(
        output_dir=tempfile.mkdtemp(prefix="odc-vlm-"),
        num_train_epochs=1,
        learning_rate=DPO_LR if dpo else LR,
        max_grad_norm=MAX_GRAD_NORM[dpo],
        optim="adamw_torch",
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not cuda,
        train_sampling_strategy="sequential",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        bf16=False,
        per_device_train_batch_size=PER_DEVICE,
        max_length=None,
        **({"fsdp": True, "fsdp_config": {"version": 2}} if odc else {}),
    )
    extra = {}
    if name == "images":
        extra["odc"] = ODCConfig()  # the defaults: LB-Mini, the derived cap
    elif mixed:
        extra["odc"] = ODCConfig(
            max_tokens_per_microbatch=CAP[dpo], planner=dpo_planner if dpo else planner
        )
    if dpo:  # a separate reference model: on CPU ranks an unsharded copy per rank
        extra["ref_model"] = V.build_model(family)
    base = DPOTrainer if dpo else SFTTrainer
    cls = odc_trainer(base) if odc else base
    trainer = cls(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=V.processor(family),
        callbacks=[Capture()],
        **extra,
    )
    start = time.perf_counter()
    trainer.train()
    return {
        "params": full_params(trainer.model),
        "captured": captured,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "odc_steps": getattr(trainer, "odc_steps", None),
        "seconds": time.perf_counter() - start,
    }


def _ranks(rank, world, kinds=None, cuda=False):
    set_rank_env(rank, world, port=29573 if cuda else 29571)
    if cuda:  # fp32 convolutions and matmuls (cuDNN's default is TF32), as the CPU reference
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return {kind: _train(kind, cuda) for kind in (kinds or FAMILY)}


@functools.cache
def runs():
    start = time.perf_counter()
    out = run_ranks(WORLD, _ranks, timeout=600)
    print(
        f"\n2-rank launch: {time.perf_counter() - start:.1f} s; trainings "
        + ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in out[0].items())
    )
    return out


@functools.cache
def gpu_runs():
    """The mixed Qwen2-VL SFT run on CUDA: 2 ranks on the first GPU (sharing it where there is
    one; Gloo for the trainer's few CUDA collectives there)."""
    return run_ranks(
        WORLD, _ranks, ["mixed"], True, timeout=600, cuda=True, env={"ODC_CUDA_COLLECTIVES": "gloo"}
    )


def _max_diff(a: dict, b: dict) -> float:
    return max((0.0 if x is None else (x - b[n]).abs().max().item()) for n, x in a.items())


def _check_grads(
    got: dict, want: dict, where: str, rtol: float = GRAD_RTOL, atol: float = GRAD_ATOL
) -> float:
    assert set(got) == set(want)
    worst = 0.0
    for name, ref in want.items():
        g = got[name]
        assert (g is None) == (ref is None), (where, name, g is None, ref is None)
        if ref is None:
            continue
        torch.testing.assert_close(
            g, ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{where} {n}: {m}"
        )
        worst = max(worst, (g - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_odc_equals_the_unmodified_trainer_when_every_microbatch_has_images(trainer):
    out = runs()
    dpo = trainer == "dpo"
    prefix = "dpo_" if dpo else ""
    plain = out[0][prefix + "plain"]
    worst_grad = worst_param = 0.0
    for rank in range(WORLD):
        got = out[rank][prefix + "images"]
        assert len(got["captured"]) == len(plain["captured"]) == STEPS
        for s, (g, w) in enumerate(zip(got["captured"], plain["captured"], strict=True)):
            worst_grad = max(
                worst_grad, _check_grads(g["grads"], w["grads"], f"rank {rank} step {s}")
            )
        for name, ref in plain["params"].items():
            torch.testing.assert_close(
                got["params"][name],
                ref,
                rtol=0,
                atol=PARAM_ATOL,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
        worst_param = max(worst_param, _max_diff(got["params"], plain["params"]))
        initial = {n: p.detach() for n, p in V.build_model().named_parameters()}
        assert _max_diff(plain["params"], initial) > 100 * PARAM_ATOL  # training moved them
        assert len(got["logs"]) == len(plain["logs"]) == STEPS
        for mine, ref in zip(got["logs"], plain["logs"], strict=True):
            assert set(mine) == set(ref), (sorted(mine), sorted(ref))
            for key, value in ref.items():
                # DPO's rewards and margins: differences of log-probs times beta, float32 to
                # ~1e-6 absolute (as in test_integrations_trl_dpo.py).
                assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-6 if dpo else 1e-7), (
                    rank,
                    key,
                    mine[key],
                    value,
                )
        assert all(h["grad_norm"] > MAX_GRAD_NORM[dpo] for h in got["logs"])  # clipped
        check_frontier(got["odc_steps"], dpo)
    print(
        f"{trainer} images vs unmodified TRL (2 ranks): max |grad diff| {worst_grad:.2e}, "
        f"max |param diff| after {STEPS} steps {worst_param:.2e} (counts "
        f"{[s['microbatches'] for s in out[0][prefix + 'images']['odc_steps']]})"
    )


def check_frontier(steps, dpo: bool):
    """The derived cap with images: the unmodified trainer's microbatches so far (PER_DEVICE
    consecutive rows: their padded tokens and patches) as a frontier, and every ODC
    microbatch within one of its points."""
    from torch_odc.step import frontier

    if dpo:  # (sequences' lengths, patches)
        rows = [expected_pair(r) for r in V.pairs(ALL_IMAGES)]
    else:
        rows = [((t,), p) for t, p, _ in map(expected_row, V.rows(ALL_IMAGES))]
    points = []
    for s, record in enumerate(steps):
        step = rows[s * PER_STEP : (s + 1) * PER_STEP]
        for i in range(0, PER_STEP, PER_DEVICE):
            group = step[i : i + PER_DEVICE]
            width = max(max(t) for t, _ in group)  # every sequence padded to the longest
            points.append((sum(len(t) for t, _ in group) * width, sum(p for _, p in group)))
        assert [tuple(p) for p in record["plain_frontier"]] == frontier(points), (s, record)
        assert record["cap_frontier"] == record["plain_frontier"]  # CPU: nothing subtracted
        assert record["microbatch_sizes"], record
        for tokens, patches in record["microbatch_sizes"]:
            assert any(tokens <= t and patches <= p for t, p in record["cap_frontier"]), record
        assert sum(record["patches_per_rank"]) == sum(p for _, p in step)
        assert sum(record["plain_patches_per_rank"]) == sum(p for _, p in step)


def _reference_step(params: dict, rows: list, family: str, dpo: bool) -> tuple[float, float, dict]:
    """One process, no ODC, no FSDP: the step's rows as one batch (TRL's vision collator), the
    loss from the model's own logits, the gradient clipped as torch.nn.utils.clip_grad_norm_
    clips. SFT: the model's own loss (the token mean over the step). DPO (sigmoid): the mean
    over the step's pairs of -logsigmoid(beta * (policy - reference log-ratio of chosen over
    rejected)), the completions' log-probs summed from the logits, the reference the initial
    model. Returns (loss, norm before clipping, gradients)."""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    model = V.build_model(family)
    model.load_state_dict(params)
    model.train()
    collator = (DataCollatorForVisionPreference if dpo else DataCollatorForVisionLanguageModeling)(
        processor=V.processor(family)
    )
    batch = collator(rows)
    if dpo:
        mask = batch.pop("completion_mask")[:, 1:]

        def completion_logps(m):
            logits = m(**batch).logits[:, :-1]
            tokens = logits.log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])
            return (tokens.squeeze(-1) * mask).sum(-1).chunk(2)

        with torch.no_grad():
            ref_chosen, ref_rejected = completion_logps(V.build_model(family).eval())
        chosen, rejected = completion_logps(model)
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        loss = -torch.nn.functional.logsigmoid(BETA * margin).mean()
    else:
        loss = model(**batch).loss
    loss.backward()
    grads = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values() if g is not None))
    coef = min(1.0, MAX_GRAD_NORM[dpo] / (norm + 1e-6))
    return (
        float(loss.detach()),
        norm,
        {n: None if g is None else g * coef for n, g in grads.items()},
    )


@pytest.mark.parametrize("kind", ["mixed", "mixed25", "dpo_mixed"])
def test_mixed_image_and_text_only_microbatches_equal_one_process(kind):
    _check_mixed(runs(), kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (2 ranks share one)")
def test_gpu_mixed_image_and_text_only_microbatches_equal_one_process():
    """The same on CUDA (the transport is CUDA IPC); the reference runs on CPU here, so the
    bounds allow for the GPU's kernels: 1e-4 relative, 1e-5 absolute."""
    _check_mixed(gpu_runs(), "mixed", rtol=1e-4, atol=1e-5)


def _check_mixed(out, kind: str, rtol: float = GRAD_RTOL, atol: float = GRAD_ATOL) -> None:
    dpo = kind.startswith("dpo_")
    worst = 0.0
    refs = [
        _reference_step(
            out[0][kind]["captured"][s]["params"], _step_rows(dpo, s), FAMILY[kind], dpo
        )
        for s in range(STEPS)
    ]
    for rank in range(WORLD):
        got = out[rank][kind]
        counts = [s["microbatches"] for s in got["odc_steps"]]
        assert counts[:2] == WANT_COUNTS, counts
        assert len(counts) == STEPS == len(got["captured"]) == len(got["logs"])
        for s, record in enumerate(got["odc_steps"]):
            # This rank ran the vision tower once per microbatch of its with an image, and
            # never for a text-only one (no dummy image).
            with_images = sum(any(MIXED[i] for i in mb) for mb in record["microbatch_rows"])
            assert got["captured"][s]["vision_calls"] == with_images, (rank, s, record)
            if (rank, s) == (1, 0):
                assert with_images == 0  # its only microbatch is text-only
            sizes = record["microbatch_sizes"]
            assert len(sizes) == counts[s][rank]
        for s, (loss, norm, ref) in enumerate(refs):
            cap = got["captured"][s]
            if rank:  # both ranks took the step at the same parameters
                assert _max_diff(cap["params"], out[0][kind]["captured"][s]["params"]) == 0
            worst = max(worst, _check_grads(cap["grads"], ref, f"rank {rank} step {s}", rtol, atol))
            assert got["logs"][s]["loss"] == pytest.approx(loss, rel=max(1e-6, rtol / 10)), (
                rank,
                s,
            )
            assert got["logs"][s]["grad_norm"] == pytest.approx(norm, rel=max(1e-5, rtol)), (
                rank,
                s,
            )
            assert norm > MAX_GRAD_NORM[dpo]
    print(
        f"{kind} ({FAMILY[kind]}) vs one process: max |grad diff| {worst:.2e} over {STEPS} "
        f"steps (counts {[s['microbatches'] for s in out[0][kind]['odc_steps']]})"
    )


# -- the planning pieces, without ranks ---------------------------------------------------------


def test_a_rows_patches_count_in_its_cost():
    from torch_odc.integrations.hf import ODCConfig
    from torch_odc.step import row_costs

    # tokens: a patch costs as a token; flops: each image as a sequence of its patches.
    c = ODCConfig()
    assert row_costs([(10,), (10,)], c.cost, c.cost_args, [(16, 4), ()]) == [30.0, 10.0]
    assert row_costs([(10,), (10,)], c.cost, c.cost_args) is None  # LB-Mini costs the lengths
    flops = ODCConfig(cost="flops")
    from torch_odc import balance

    one = balance.sequence_costs([10, 16, 4], "flops")
    assert row_costs([(10,)], flops.cost, flops.cost_args, [(16, 4)]) == [
        pytest.approx(math.fsum(one))
    ]


def test_the_derived_cap_with_images_is_a_frontier():
    from torch_odc.step import fits, frontier, pack_padded

    assert frontier([(10, 5), (8, 9), (10, 3), (7, 2), (12, 0)]) == [(8, 9), (10, 5), (12, 0)]
    cap = [(8, 9), (10, 5)]
    assert fits(cap, 8, 9) and fits(cap, 10, 5) and not fits(cap, 9, 6) and not fits(cap, 11, 0)
    assert fits(10, 10) and not fits(10, 10, 1)  # a token cap: rows without images
    # Rows (tokens, patches): padded to the longest, patches added.
    rows = {0: (4, 0), 1: (4, 8), 2: (2, 4), 3: (2, 0)}
    packed = pack_padded(
        list(rows), lambda i: (1, (rows[i][0],)), lambda d: d[0], [(8, 8)], lambda i: rows[i][1]
    )
    assert sorted(map(sorted, packed)) == [[0, 1], [2, 3]]  # 2 x 4 tokens and 8 patches, ...
    for mb in packed:
        assert fits([(8, 8)], len(mb) * max(rows[i][0] for i in mb), sum(rows[i][1] for i in mb))


@pytest.mark.parametrize(
    "field",
    [
        "image_sizes",
        "pixel_attention_mask",
        "token_type_ids",
        "pixel_values_videos",
        "video_grid_thw",
    ],
)
def test_another_families_vision_field_is_refused_by_name(field):
    from torch_odc.integrations.hf import _vision

    batch = {
        "input_ids": torch.ones(1, 5, dtype=torch.long),
        "attention_mask": torch.ones(1, 5, dtype=torch.long),
        "pixel_values": torch.zeros(16, 96),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        field: torch.zeros(1, 2),
    }
    with pytest.raises(ValueError, match=f"'{field}', a vision-language field ODC does not plan"):
        _vision.row_sizes(batch, "test")


def test_dense_pixel_values_are_refused_by_name():
    from torch_odc.integrations.hf import _vision

    batch = {
        "input_ids": torch.ones(1, 5, dtype=torch.long),
        "pixel_values": torch.zeros(1, 3, 8, 8),
    }
    with pytest.raises(ValueError, match="'pixel_values' without 'image_grid_thw'"):
        _vision.row_sizes(batch, "test")
    assert _vision.row_sizes(
        {
            "input_ids": torch.ones(1, 5, dtype=torch.long),
            "pixel_values": torch.zeros(20, 96),
            "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]]),
        },
        "test",
    ) == (5, (4, 16))
    with pytest.raises(RuntimeError, match="are not its rows'"):
        _vision.check_microbatch(
            {"pixel_values": torch.zeros(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])},
            [4, 12],
            "test",
        )
