"""torch_odc.integrations.hf with TRL's GRPOTrainer on 2 CPU ranks (FSDP2, AdamW, clipping on,
rollouts repacked per optimizer step into microbatches of uneven counts, zero included, with
and without moving rollouts between ranks), against the unmodified GRPOTrainer on the same
rollouts: one process with the same global batch, and, for the loss types and options whose
normalization depends on each rank's own microbatches (bnpo, the entropy bonus), the unmodified
trainer on 2 ranks (DDP over Gloo). Compared per step: loss, grad_norm and every metric TRL
logs; then the final parameters.

The same rollouts in every run: the test's GRPOTrainer subclass (used unchanged by the
references and the ODC runs) returns fixed completions per (prompt, generation index) instead
of sampling, and, where a step holds several TRL microbatches, hands out TRL's slices in a
fixed order that puts in the one-process run's slice k exactly the rows of the 2 ranks' slices
k (TRL shuffles each rank's generation batch with its own generator otherwise). Everything
else -- TRL's rewards, advantages, old and reference log-probs, the loss and metrics of the
references, the adapter's repacking, weights, barrier and metric reduction -- is the real code.
A tiny Llama built from a config, a word-level tokenizer built in memory: nothing is
downloaded. In the same launches, a vision-language case (the tiny Qwen2-VL of vlm_helpers.py,
every prompt with images) against the unmodified GRPOTrainer in one process, and the refusal of
a generation batch that mixes image and text-only prompts."""

import functools
import math
import os
import random
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")

from hf_helpers import ONE_GPU, assert_params_match, environ, full_params, set_rank_env
from multiproc import run_ranks

WORLD = 2
PER_DEVICE = 4  # rows per TRL microbatch and rank (the one-process reference: 8)
NUM_GEN = 4
STEPS = 3
VOCAB = 48
MAX_COMPLETION = 12
LR = 0.1  # plain SGD: a parameter's difference is lr times its gradient's (Adam would blow
MAX_GRAD_NORM = 0.5  # up float noise of near-zero gradient elements to ~lr)
CAP = 24  # max_tokens_per_microbatch: a few rows per microbatch
ATOL = 1e-6
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRL_EXPERIMENTAL_SILENCE": "1",
}

# name: (GRPOConfig overrides, ODC options, aligned slice order, reference)
#   reference "one": one process, same global batch; "ddp": unmodified TRL on 2 ranks.
CASES = {
    # The default loss; a step of 2 TRL microbatches; rank 0 runs no microbatch in step 0 (the
    # test's planner gives all rollouts to rank 1), LB-Mini moves rollouts in the others.
    "dapo": (
        {"loss_type": "dapo", "gradient_accumulation_steps": 2},
        {"rebalance": True},
        True,
        "one",
    ),
    # The KL term against a reference model; no moving (each rank packs its own rollouts).
    "grpo_beta": (
        {"loss_type": "grpo", "beta": 0.2, "gradient_accumulation_steps": 2},
        {"rebalance": False},
        True,
        "one",
    ),
    # Two optimizer steps per generation (old log-probs from the generation), TRL's own
    # shuffle and buffering (one TRL microbatch per step: its order does not matter).
    # The default planner (LB-Mini, its shares given to the ranks holding most of their rows).
    "dr_grpo_iter2": (
        {"loss_type": "dr_grpo", "num_iterations": 2, "epsilon": 0.05},
        {"rebalance": True, "planner": None},
        False,
        "one",
    ),
    # No cap given: each step's cap is the largest TRL microbatch's padded size (on CPU ranks
    # nothing is measured or subtracted), LB-Mini moves rows, each rank packs by padded size.
    "dapo_derived_cap": (
        {"loss_type": "dapo", "gradient_accumulation_steps": 2},
        {"rebalance": True, "planner": None, "max_tokens_per_microbatch": None},
        True,
        "one",
    ),
    # The derived cap with ODC's length padding: prompt and completion widths in multiples of
    # 8 (ODCConfig.pad_to_multiple_of; TRL pads to none), counted in the cap.
    "dapo_pad": (
        {"loss_type": "dapo", "gradient_accumulation_steps": 2},
        {
            "rebalance": True,
            "planner": None,
            "max_tokens_per_microbatch": None,
            "pad_to_multiple_of": 8,
        },
        True,
        "one",
    ),
    # A generation spanning 2 optimizer steps (steps_per_generation 4, 2 TRL microbatches per
    # step), sequence-level importance sampling, the KL term with its bias correction.
    "cispo_spg": (
        {
            "loss_type": "cispo",
            "steps_per_generation": 4,
            "gradient_accumulation_steps": 2,
            "importance_sampling_level": "sequence",
            "beta": 0.1,
            "use_bias_correction_kl": True,
            "epsilon_high": 1.02,
        },
        {"rebalance": True},
        True,
        "one",
    ),
    # A generation per TRL microbatch: one optimizer step spans 2 generation batches, each
    # normalized by its own token count.
    "dapo_gen_per_micro": (
        {"loss_type": "dapo", "steps_per_generation": 1, "gradient_accumulation_steps": 2},
        {"rebalance": True},
        True,
        "one",
    ),
    "luspo_seq": (
        {
            "loss_type": "luspo",
            "importance_sampling_level": "sequence",
            "num_iterations": 2,
            "gradient_accumulation_steps": 2,
        },
        {"rebalance": True},
        True,
        "one",
    ),
    "sapo_iter2": (
        {
            "loss_type": "sapo",
            "num_iterations": 2,
            "gradient_accumulation_steps": 2,
            "mask_truncated_completions": True,
        },
        {"rebalance": False},
        True,
        "one",
    ),
    # Normalized by each rank's own TRL microbatch (token count): only TRL on 2 ranks is the
    # reference. With the adaptive entropy bonus (normalized per microbatch as well).
    "bnpo_entropy": (
        {
            "loss_type": "bnpo",
            "gradient_accumulation_steps": 2,
            "num_iterations": 2,
            "epsilon": 0.05,
            "entropy_coef": 0.01,
            "use_adaptive_entropy": True,
            "entropy_target": 3.0,
        },
        {"rebalance": True},
        True,
        "ddp",
    ),
    # On-policy (VESPO's sequence weight sums the log-ratios of all tokens, which amplifies
    # float noise beyond 1e-6 of the loss off-policy), with a static entropy bonus.
    "vespo_entropy": (
        {"loss_type": "vespo", "gradient_accumulation_steps": 2, "entropy_coef": 0.02},
        {"rebalance": False},
        True,
        "ddp",
    ),
}


def prompts() -> list[str]:
    rng = random.Random("test_integrations_trl_grpo")
    return [
        " ".join(f"t{rng.randrange(2, VOCAB)}" for _ in range(rng.randint(2, 9))) for _ in range(24)
    ]


def completion(prompt_ids: list[int], j: int) -> list[int]:
    """The fixed completion of generation j of a prompt: 1 to MAX_COMPLETION tokens, ending with
    EOS (1) when shorter than the maximum (some are truncated)."""
    n = 1 + (sum(prompt_ids) * 5 + j * 7 + len(prompt_ids)) % MAX_COMPLETION
    body = [2 + (prompt_ids[0] * 3 + j * 11 + t * (j + 2)) % (VOCAB - 2) for t in range(n)]
    return body[:-1] + [1] if n < MAX_COMPLETION else body


def reward(completion_ids, **kwargs):
    return [(sum(c) % 7) / 7.0 + 0.05 * len(c) for c in completion_ids]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, "t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t1"
    )


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    )


@functools.cache
def model_dir() -> str:
    """The tiny Llama saved once, by the test process (not distributed: every rank of a group
    would leave the writing to rank 0): TRL builds the reference model for beta > 0 from the
    policy's path, so every run loads the model from there."""
    path = tempfile.mkdtemp(prefix="odc-grpo-model-")
    build_model().save_pretrained(path)
    return path


def fixed_trainer_class(sim_world: int, aligned: bool):
    """The test's GRPOTrainer: fixed completions; with `aligned`, TRL's slices in an order that
    makes the one-process run's slice k the union of the `sim_world` ranks' slices k."""
    from trl import GRPOTrainer

    class FixedGRPO(GRPOTrainer):
        def _generate_single_turn(
            self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
        ):
            # Groups are num_generations consecutive rows and every rank's batch starts a group.
            return [
                completion(list(p), i % num_generations) for i, p in enumerate(prompt_ids)
            ], None

        def _prepare_inputs(self, generation_batch):
            if not (aligned and self.model.training):
                return super()._prepare_inputs(generation_batch)
            spg = self.args.steps_per_generation
            if self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None:
                batch = self._generate_and_score_completions(generation_batch)
                n = batch["prompt_ids"].size(0)
                chunk = n // sim_world  # one rank's generation batch
                rows = chunk // spg  # one rank's TRL microbatch
                gen = torch.Generator().manual_seed(1000 + self._step)
                perm = torch.randperm(chunk, generator=gen).tolist()
                order = [
                    r * chunk + perm[k * rows + i]
                    for k in range(spg)
                    for r in range(sim_world)
                    for i in range(rows)
                ]
                width = rows * sim_world
                # A vision batch's pixel_values and image_grid_thw per rollout first (TRL's
                # own split, as its _prepare_inputs does before shuffling).
                from trl.trainer.utils import (
                    split_pixel_values_by_grid,
                    unsplit_pixel_values_by_grid,
                )

                batch = split_pixel_values_by_grid(batch)

                def pick(v, ids):
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        return v[ids]
                    return [v[i] for i in ids] if isinstance(v, list) else v

                self._buffered_inputs = [
                    unsplit_pixel_values_by_grid(
                        {
                            key: pick(v, order[k * width : (k + 1) * width])
                            for key, v in batch.items()
                        }
                    )
                    for k in range(spg)
                ]
            return self._buffered_inputs[self._step % spg]

    return FixedGRPO


def planner(lengths, world, step):
    """LB-Mini, except in step 0 with 2 ranks: every rollout on rank 1, rank 0 runs nothing."""
    from torch_odc import balance

    if world == 2 and step == 0:
        return [[], balance.plan(lengths, 1, CAP, mode="mini").microbatches[0]]
    return balance.plan(lengths, world, CAP, mode="mini").microbatches


def train(case: str, mode: str, path: str, cuda: bool = False) -> dict:
    """One run of `case`; mode "odc" (this rank of the odc group), "one" (one process) or
    "ddp" (this rank, unmodified TRL)."""
    import warnings

    import datasets
    from trl import GRPOConfig

    from torch_odc import balance
    from torch_odc.integrations.hf import ODCGRPOConfig, odc_trainer

    overrides, odc_options, aligned, _ = CASES[case]
    warnings.filterwarnings("ignore", category=balance.OversizedSequenceWarning)
    world = WORLD if mode == "one" else 1
    args = {
        "output_dir": tempfile.mkdtemp(prefix="odc-grpo-"),
        "max_steps": STEPS,
        "learning_rate": LR,
        "max_grad_norm": MAX_GRAD_NORM,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": not cuda,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": False,
        "num_generations": NUM_GEN,
        "max_completion_length": MAX_COMPLETION,
        "epsilon": 0.1,
        "per_device_train_batch_size": PER_DEVICE * world,
        **overrides,
    }
    extra = {}
    cls = fixed_trainer_class(world, aligned)
    if mode == "odc":
        args.update(fsdp=True, fsdp_config={"version": 2})
        extra["odc"] = ODCGRPOConfig(
            **{"max_tokens_per_microbatch": CAP, "planner": planner, **odc_options}
        )
        cls = odc_trainer(cls)
    trainer = cls(
        model=path,
        reward_funcs=reward,
        args=GRPOConfig(**args),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}),
        processing_class=tokenizer(),
        **extra,
    )
    trainer.train()
    return {
        "params": full_params(trainer.model),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "odc_steps": getattr(trainer, "odc_steps", None),
    }


# -- a vision-language model (tests/vlm_helpers.py: a tiny Qwen2-VL from a config) ---------------
# Every prompt with 1 or 2 images (TRL 1.16 cannot run a generation batch that mixes image and
# text-only prompts); LB-Mini with the patches in its cost and in the cap.
VLM_IMAGES = [1, 2, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1]
VLM_CAP = 90  # tokens plus patches: 1 to 3 rollouts a microbatch


def vlm_dataset():
    import datasets
    import vlm_helpers as V

    rows = V.rows(VLM_IMAGES, "grpo-vlm")
    return datasets.Dataset.from_dict(
        {"prompt": [[r["messages"][0]] for r in rows], "images": [r["images"] for r in rows]}
    )


def vlm_processor():
    import vlm_helpers as V

    proc = V.processor()
    proc.tokenizer.padding_side = "left"  # as TRL loads a processor itself
    return proc


def train_vlm(mode: str) -> dict:
    """The VLM case: dapo, 2 TRL microbatches a step; "odc" (this rank) or "one"."""
    import warnings

    import vlm_helpers as V
    from trl import GRPOConfig

    from torch_odc import balance
    from torch_odc.integrations.hf import ODCGRPOConfig, odc_trainer

    warnings.filterwarnings("ignore", category=balance.OversizedSequenceWarning)
    world = WORLD if mode == "one" else 1
    args = {
        "output_dir": tempfile.mkdtemp(prefix="odc-grpo-vlm-"),
        "max_steps": STEPS,
        "learning_rate": LR,
        "max_grad_norm": MAX_GRAD_NORM,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": False,
        "num_generations": 2,
        "max_completion_length": MAX_COMPLETION,
        "epsilon": 0.1,
        "loss_type": "dapo",
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2 * world,
    }
    extra = {}
    cls = fixed_trainer_class(world, True)
    if mode == "odc":
        args.update(fsdp=True, fsdp_config={"version": 2})
        extra["odc"] = ODCGRPOConfig(max_tokens_per_microbatch=VLM_CAP)
        cls = odc_trainer(cls)
    trainer = cls(
        model=V.build_model(),
        reward_funcs=reward,
        args=GRPOConfig(**args),
        train_dataset=vlm_dataset(),
        processing_class=vlm_processor(),
        **extra,
    )
    trainer.train()
    return {
        "params": full_params(trainer.model),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "odc_steps": getattr(trainer, "odc_steps", None),
    }


def vlm_mixed_refusal() -> str | None:
    """A generation batch with image and text-only prompts: the adapter's message (TRL's own
    processor call raises TypeError there)."""
    import datasets
    import vlm_helpers as V
    from trl import GRPOConfig

    from torch_odc.integrations.hf import ODCGRPOConfig, odc_trainer

    rows = V.rows([1, 0, 1, 0], "grpo-vlm-mixed")
    data = datasets.Dataset.from_dict(
        {"prompt": [[r["messages"][0]] for r in rows], "images": [r["images"] for r in rows]}
    )
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="odc-grpo-vlm-"),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        bf16=False,
        fsdp=True,
        fsdp_config={"version": 2},
    )
    trainer = odc_trainer(fixed_trainer_class(1, False))(
        model=V.build_model(),
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=vlm_processor(),
        odc=ODCGRPOConfig(max_tokens_per_microbatch=VLM_CAP),
    )
    trainer.model.train()
    try:
        trainer._prepare_inputs([dict(data[i]) for i in range(4)])
        return None
    except ValueError as err:
        return str(err)
    finally:
        trainer._odc_detach()


def _set_rank_env(rank, world):
    set_rank_env(rank, world, port=29561, env=OFFLINE)


def _odc_ranks(rank, world, cases, path, cuda=False):
    _set_rank_env(rank, world)
    out = {case: train(case, "odc", path, cuda) for case in cases}
    if not cuda:
        out["vlm"] = train_vlm("odc")
        out["refusals"] = refusals()
        out["refusals"]["vlm_mixed"] = vlm_mixed_refusal()
    return out


def _ddp_ranks(rank, world, cases, path):
    _set_rank_env(rank, world)
    return {case: train(case, "ddp", path) for case in cases}


def _one_process(rank, world, cases, path, cuda=False):
    import torch.distributed as dist

    dist.destroy_process_group()  # the unmodified trainer, one process, not distributed
    os.environ.update(OFFLINE)
    out = {case: train(case, "one", path, cuda) for case in cases}
    if not cuda:
        out["vlm"] = train_vlm("one")
    return out


def refusals() -> dict:
    """What the adapter refuses at construction: the message of each."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    out = {}
    for name, option in (
        ("top_entropy_quantile", {"top_entropy_quantile": 0.5}),
        ("include_num_input_tokens_seen", {"include_num_input_tokens_seen": "all"}),
        ("fsdp", {"fsdp": "", "fsdp_config": None}),
    ):
        args = {
            "output_dir": tempfile.mkdtemp(prefix="odc-grpo-"),
            "use_cpu": True,
            "report_to": [],
            "per_device_train_batch_size": PER_DEVICE,
            "num_generations": NUM_GEN,
            "max_completion_length": MAX_COMPLETION,
            "fsdp": True,
            "fsdp_config": {"version": 2},
            **option,
        }
        try:
            odc_trainer(GRPOTrainer)(
                model=build_model(),
                reward_funcs=reward,
                args=GRPOConfig(**args),
                train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}),
                processing_class=tokenizer(),
                odc=ODCConfig(max_tokens_per_microbatch=CAP),
            )
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    # At the first step: a field in TRL's batch that the adapter cannot lay out per rollout.
    base = fixed_trainer_class(1, False)

    class ExtraField(base):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            out["pixel_values"] = torch.zeros(len(inputs), 3)
            return out

    args = {
        "output_dir": tempfile.mkdtemp(prefix="odc-grpo-"),
        "use_cpu": True,
        "max_steps": 1,
        "report_to": [],
        "per_device_train_batch_size": PER_DEVICE,
        "save_strategy": "no",
        "num_generations": NUM_GEN,
        "max_completion_length": MAX_COMPLETION,
        "fsdp": True,
        "fsdp_config": {"version": 2},
    }
    trainer = odc_trainer(ExtraField)(
        model=build_model(),
        reward_funcs=reward,
        args=GRPOConfig(**args),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts()}),
        processing_class=tokenizer(),
        odc=ODCConfig(max_tokens_per_microbatch=CAP),
    )
    try:
        trainer.train()
        out["pixel_values"] = None
    except ValueError as err:
        out["pixel_values"] = str(err)
        trainer._odc_detach()
    return out


@functools.cache
def runs():
    one = tuple(c for c, v in CASES.items() if v[3] == "one")
    ddp = tuple(c for c, v in CASES.items() if v[3] == "ddp")
    path = model_dir()
    reference = run_ranks(1, _one_process, one, path, backend="gloo", timeout=600)[0]
    reference.update(run_ranks(WORLD, _ddp_ranks, ddp, path, backend="gloo", timeout=600)[0])
    odc = run_ranks(WORLD, _odc_ranks, tuple(CASES), path, timeout=900)
    return reference, odc


GPU_CASES = ("dapo", "grpo_beta")  # one-process references (NCCL refuses 2 ranks on one GPU)


@functools.cache
def gpu_runs():
    """The reference on the GPU, the 2 ODC ranks sharing it: accelerate does the FSDP2 wrapping
    itself there; the trainer's few CUDA collectives and the rollout exchange go through Gloo
    (ODC_CUDA_COLLECTIVES=gloo: NCCL refuses two ranks on one device)."""
    path = model_dir()
    with environ(ONE_GPU):
        reference = run_ranks(
            1, _one_process, GPU_CASES, path, True, backend="gloo", timeout=600, cuda=True
        )[0]
    odc = run_ranks(
        WORLD,
        _odc_ranks,
        GPU_CASES,
        path,
        True,
        timeout=900,
        cuda=True,
        env={"ODC_CUDA_COLLECTIVES": "gloo"},
    )
    return reference, odc


SKIP_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_with_odc_matches_unmodified_trl(case):
    check(case, *runs())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (2 ranks share one)")
@pytest.mark.xdist_group("trl_grpo_gpu_runs")  # one gpu_runs() for both cases (tests/conftest.py)
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_grpo_with_odc_matches_unmodified_trl(case):
    check(case, *gpu_runs())


def test_grpo_vlm_with_odc_matches_unmodified_trl():
    """A tiny Qwen2-VL, every prompt with images: each rollout's patches and grid travel with it
    (LB-Mini moves rollouts), microbatches concatenate exactly their rows' images, the cost
    and cap count patches; equal to the unmodified GRPOTrainer in one process."""
    import vlm_helpers as V

    reference, odc = runs()
    want = reference["vlm"]
    initial = dict(V.build_model().named_parameters())
    for rank, out in enumerate(r["vlm"] for r in odc):
        steps = out["odc_steps"]
        assert len(steps) == STEPS, steps
        counts = [s["microbatches"] for s in steps]
        assert any(c[0] != c[1] for c in counts), counts
        assert sum(s["moved"] for s in steps) > 0, steps
        assert_params_match(want, out, initial, rank, ATOL)
        for got, ref in zip(out["logs"], want["logs"], strict=True):
            assert set(got) == set(ref), sorted(set(got) ^ set(ref))
            for key, value in ref.items():
                if key not in SKIP_KEYS:
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (
                        rank,
                        key,
                        got[key],
                        value,
                    )


def test_grpo_vlm_refuses_mixed_image_and_text_only_prompts():
    _, odc = runs()
    for out in odc:
        got = out["refusals"]["vlm_mixed"]
        assert got is not None and "text-only" in got and "TypeError" in got, got


def check(case, reference, odc):
    want = reference[case]
    initial = dict(build_model().named_parameters())
    for rank, out in enumerate(r[case] for r in odc):
        steps = out["odc_steps"]
        assert len(steps) == STEPS, steps
        # No accumulator memory through generation (free_gradient_memory at each step's start).
        assert all(s["gradient_memory_freed"] for s in steps), steps
        counts = [s["microbatches"] for s in steps]
        for s in steps:  # this rank's host seconds by part, one entry per microbatch it ran
            host = s["host_seconds"]
            assert set(host) == {
                "free",
                "rows",
                "exchange",
                "restore",
                "weights",
                "microbatches",
                "barrier",
                "metrics",
            }, host
            assert len(host["microbatches"]) == s["microbatches"][rank], (host, s)
            assert all(v >= 0 for v in host["microbatches"]), host
            assert all(v >= 0 for k, v in host.items() if k != "microbatches"), host
        options = CASES[case][1]
        if options["rebalance"] and "planner" not in options:  # the test's planner, step 0
            assert counts[0][0] == 0 and counts[0][1] > 0, counts
            assert steps[0]["moved"] == steps[0]["rollouts"][1] // 2, steps
        if options["rebalance"]:
            assert sum(s["moved"] for s in steps) > 0, steps
        if "planner" not in options:  # uneven microbatch counts (LB-Mini's may come out even)
            assert any(c[0] != c[1] for c in counts), counts
        if options.get("max_tokens_per_microbatch", CAP) is None:
            for s in steps:  # the derived cap: TRL's largest microbatch, never exceeded
                assert s["cap"] == s["plain_tokens"] > 0, s
                assert s["padded_tokens"] <= s["cap"], s
                # The plan's padded tokens per microbatch are the collated tensors' (this
                # rank's largest is the largest it ran), every rank's in all its padded_per_rank.
                mine = s["microbatch_padded_per_rank"][rank]
                assert [len(m) for m in s["microbatch_padded_per_rank"]] == s["microbatches"], s
                assert max(mine, default=0) == s["padded_tokens"], s
                assert [sum(m) for m in s["microbatch_padded_per_rank"]] == s["padded_per_rank"]
        if options.get("pad_to_multiple_of"):  # every microbatch rows x (prompt + completion)
            pad = options["pad_to_multiple_of"]
            assert all(
                s["padded_tokens"] % pad == 0 and all(p % pad == 0 for p in s["padded_per_rank"])
                for s in steps
            ), steps
        assert_params_match(want, out, initial, rank, ATOL)
        assert len(out["logs"]) == len(want["logs"]) == STEPS
        # Losses within 1e-6 relative. On-policy GRPO losses cancel to ~0 (advantages sum to
        # zero per group, and are normalized to unit scale): there float32 resolves the sum of
        # unit-scale terms to ~1e-7 absolute, the floor of the comparison.
        for got, ref in zip(out["logs"], want["logs"], strict=True):
            assert set(got) == set(ref), sorted(set(got) ^ set(ref))
            for key, value in ref.items():
                if key in SKIP_KEYS:
                    continue
                if key == "loss":
                    assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), (
                        rank,
                        key,
                        got[key],
                        value,
                    )
                elif value is None:
                    assert got[key] is None, (rank, key, got[key])
                else:
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (
                        rank,
                        key,
                        got[key],
                        value,
                    )


@pytest.mark.parametrize("multiple", [1, 8, 48, 64, 128])
def test_left_padded_widths_avoid_the_cudnn_nan_lengths(multiple):
    """GRPO's microbatch widths: each a multiple of ``multiple`` covering its longest prompt and
    completion; on CUDA never 64 modulo 128 in all (pytorch/pytorch#196678), at fewer than 128
    extra columns; off CUDA exactly the rounded widths."""
    from torch_odc.step import left_padded_widths, round_up

    moved = 0
    for prompt in range(1, 300, 7):
        for completion in range(0, 260, 3):
            plain = (round_up(prompt, multiple), round_up(max(1, completion), multiple))
            assert left_padded_widths(prompt, completion, multiple, cuda=False) == plain
            pw, cw = left_padded_widths(prompt, completion, multiple, cuda=True)
            assert pw == plain[0] and pw % multiple == 0 and cw % multiple == 0
            assert (pw + cw) % 128 != 64, (prompt, completion, multiple, pw, cw)
            assert plain[1] <= cw < plain[1] + 128
            moved += cw != plain[1]
    assert (moved > 0) == (multiple % 128 != 0)  # the guard is exercised, never at 128


@pytest.mark.parametrize("multiple", [1, 8, 48])
def test_left_padded_widths_round_the_length_with_prompt_columns(multiple):
    """ODC's length multiple (128 on CUDA by default): the completion keeps TRL's rounded width
    (the logits of the completion cost per column), left padding makes up the length, by
    fewer columns than the least common multiple."""
    from torch_odc.step import left_padded_widths, round_up

    step = math.lcm(multiple, 128)
    for prompt in range(1, 300, 7):
        for completion in range(0, 260, 3):
            plain = (round_up(prompt, multiple), round_up(max(1, completion), multiple))
            for cuda in (False, True):
                pw, cw = left_padded_widths(prompt, completion, multiple, cuda, 128)
                assert cw == plain[1] and pw % multiple == 0 and (pw + cw) % 128 == 0
                assert plain[0] <= pw < plain[0] + step, (prompt, completion, pw, cw)


def test_refusals_name_the_option():
    _, odc = runs()
    for out in odc:
        got = out["refusals"]
        assert "top_entropy_quantile" in got["top_entropy_quantile"], got
        assert "include_num_input_tokens_seen" in got["include_num_input_tokens_seen"], got
        assert "fsdp" in got["fsdp"], got
        assert "'pixel_values'" in got["pixel_values"], got
