"""torch_odc.integrations.hf on 2 CPU ranks: the real transformers Trainer and TRL SFTTrainer
(accelerate's FSDP2 wrapping, AdamW, clipping on) with uneven microbatch counts per rank (zero
included), against one process running the unmodified trainer on the same steps (no FSDP, one
microbatch per step). Checks the parameters (1e-5) and every logged metric per step: loss,
grad_norm, learning_rate and TRL's entropy, mean_token_accuracy and num_tokens. A tiny Llama
built from a config, a word-level tokenizer built in memory: nothing is downloaded."""

import functools
import math
import os
import random
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from hf_helpers import (
    OFFLINE,
    ONE_GPU,
    assert_params_match,
    environ,
    fixed_or_lb_mini,
    full_params,
    progressions,
    set_rank_env,
)
from multiproc import run_ranks

WORLD = 2
PER_DEVICE = 3  # sequences per step = PER_DEVICE * WORLD (one-process reference: 6 per batch)
STEPS = 3
SEQUENCES = PER_DEVICE * WORLD * STEPS
VOCAB = 64
LR = 2e-2
MAX_GRAD_NORM = 0.05  # below every step's norm here (LoRA ~0.1): clipping acts in every step
ATOL = 1e-5
# On GPUs the kernels' summation order follows the microbatch shapes, which the derived cap
# (the AUTO_KINDS) packs differently from the reference's; AdamW divides each gradient by its
# running RMS, so an embedding row that few tokens touch turns a 1e-7 gradient difference into
# ~1e-5 (seen: 1.1e-5 on one of 2048 elements). A microbatch lost or run twice moves every
# touched parameter by about the learning rate (2e-2).
ATOL_CUDA = 5e-5
PAD = 16  # ODCConfig.pad_to_multiple_of of the "sft_pad" kind
# plan[step][rank]: microbatches as positions into the step's 6 sequences. Step 2 is LB-Mini's.
FIXED_PLANS = {
    0: [[[0, 1], [2], [3, 4]], [[5]]],
    1: [[], [[0], [1, 2], [3], [4, 5]]],  # rank 0 runs nothing
}
WANT_COUNTS = [[3, 1], [0, 4]]
LORA_KINDS = ("lora", "sft_lora")
# No cap given: each step's cap follows from the trainer's own microbatches.
AUTO_KINDS = ("auto", "sft_auto", "sft_pad")


def sequences() -> list[list[int]]:
    """Token sequences of lengths 5..30: arithmetic progressions (learnable)."""
    return progressions("test_integrations_hf", SEQUENCES, VOCAB)


def planner(lengths, world, step):
    return fixed_or_lb_mini(FIXED_PLANS, lengths, world, step)


def build_model(lora: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
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
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=4,
                lora_alpha=8,
                lora_dropout=0.0,
                target_modules=["q_proj", "v_proj"],
                task_type="CAUSAL_LM",
            ),
        )
        with torch.no_grad():  # peft zeroes lora_B: give it values so every adapter trains
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    return model


def collate(features):
    """Right padding; labels are the inputs with pads ignored (the model shifts them)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
        pad_token="t0",
        eos_token="t1",
        bos_token="t1",
    )


def common_args(odc: bool, cuda: bool = False, per_device: int | None = None) -> dict:
    args = {
        "output_dir": tempfile.mkdtemp(prefix="odc-hf-"),
        "num_train_epochs": 1,
        "learning_rate": LR,
        "max_grad_norm": MAX_GRAD_NORM,
        "optim": "adamw_torch",
        "weight_decay": 0.01,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": not cuda,
        "train_sampling_strategy": "sequential",
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": False,
        "per_device_train_batch_size": per_device or (PER_DEVICE if odc else PER_DEVICE * WORLD),
    }
    if odc:
        args.update(fsdp=True, fsdp_config={"version": 2})
    return args


def train(kind: str, odc: bool, cuda: bool = False, per_device: int | None = None) -> dict:
    """One training run of `kind` ("full", "lora", "sft"); with `odc` on this rank of the odc
    group, else alone; on CPU or the current GPU. Returns the full parameters (on CPU), the log
    history and ODC's step counts."""
    from transformers import Trainer, TrainingArguments

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    data = [{"input_ids": s} for s in sequences()]
    model = build_model(lora=kind in LORA_KINDS)
    # The AUTO_KINDS run LB-Mini with the derived cap (ODCConfig's defaults).
    # sft_pad: ODC pads each microbatch's length to a multiple of PAD (through TRL's collator;
    # on GPUs the default does so to 64).
    config = (
        ODCConfig(pad_to_multiple_of=PAD)
        if kind == "sft_pad"
        else ODCConfig()
        if kind in AUTO_KINDS
        else ODCConfig(max_tokens_per_microbatch=40, planner=planner)
    )
    extra = {"odc": config} if odc else {}
    if kind in ("sft", "sft_lora", "sft_auto", "sft_pad"):
        import datasets
        from trl import SFTConfig, SFTTrainer

        cls = odc_trainer(SFTTrainer) if odc else SFTTrainer
        trainer = cls(
            model=model,
            processing_class=tokenizer(),
            train_dataset=datasets.Dataset.from_list(data),
            args=SFTConfig(
                **common_args(odc, cuda, per_device),
                max_length=None,
                dataset_kwargs={"skip_prepare_dataset": True},
            ),
            **extra,
        )
    else:
        cls = odc_trainer(Trainer) if odc else Trainer
        # Full fine-tuning also counts the input tokens seen (the Trainer gathers them per
        # microbatch; the module once per step).
        tokens = {"include_num_input_tokens_seen": "non_padding"} if kind == "full" else {}
        trainer = cls(
            model=model,
            args=TrainingArguments(**common_args(odc, cuda, per_device), **tokens),
            train_dataset=data,
            data_collator=collate,
            **extra,
        )
    trainer.train()
    params = full_params(trainer.model)
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "params": params,
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        "logs": steps,
        "odc_steps": getattr(trainer, "odc_steps", None),
    }


def _set_rank_env(rank, world):
    set_rank_env(rank, world, port=29555)


def _odc_ranks(rank, world, kinds, cuda=False):
    _set_rank_env(rank, world)
    return {kind: train(kind, odc=True, cuda=cuda) for kind in kinds}


def _reference(rank, world, kinds, cuda=False):
    import torch.distributed as dist

    dist.destroy_process_group()  # the unmodified trainer, one process, not distributed
    os.environ.update(OFFLINE)
    return {kind: train(kind, odc=False, cuda=cuda) for kind in kinds}


try:
    import trl  # noqa: F401

    # sft_lora: accelerate finds no final norm in a PEFT model and shards lm_head alone, a unit
    # TRL's fused LM head reads without calling it (the adapter unshards it per forward).
    KINDS = ["full", "lora", "sft", "sft_lora", "auto", "sft_auto", "sft_pad"]
except ImportError:  # the SFTTrainer case needs TRL
    KINDS = ["full", "lora", "auto"]


@functools.cache
def references(kinds: tuple = tuple(KINDS), cuda: bool = False):
    with environ(ONE_GPU if cuda else None):
        return run_ranks(1, _reference, list(kinds), cuda, backend="gloo", timeout=600, cuda=cuda)[
            0
        ]


@functools.cache
def runs(kinds: tuple = tuple(KINDS), cuda: bool = False):
    # On one GPU the 2 ranks share it: the Trainer's own CUDA collectives (grad norm, loss
    # gather) go through Gloo, since NCCL refuses two ranks on one device.
    env = {"ODC_CUDA_COLLECTIVES": "gloo"} if cuda else None
    reference = references(kinds, cuda)
    odc = run_ranks(WORLD, _odc_ranks, list(kinds), cuda, timeout=600, cuda=cuda, env=env)
    return reference, odc


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_with_odc_matches_the_one_process_trainer(kind):
    check(kind, *runs())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (2 ranks share one)")
@pytest.mark.parametrize("kind", KINDS)
def test_trainer_with_odc_on_gpu_matches_the_one_process_trainer(kind):
    """On GPUs accelerate does the FSDP2 wrapping itself (MULTI_GPU with its FSDP plugin)."""
    check(kind, *runs((kind,), cuda=True), cuda=True)  # one attach per process group on CUDA


def check(kind, reference, odc, cuda=False):
    want = reference[kind]
    initial = {n: p.detach() for n, p in build_model(kind in LORA_KINDS).named_parameters()}
    for rank, out in enumerate(r[kind] for r in odc):
        # Uneven counts with a zero, then LB-Mini's plan (the same on both ranks).
        counts = [s["microbatches"] for s in out["odc_steps"]]
        if kind in AUTO_KINDS:
            check_derived_cap(out["odc_steps"], cuda)
        else:
            assert counts[:2] == WANT_COUNTS, counts
        if kind == "sft_pad" or (kind == "sft_auto" and cuda):  # the collator padded for ODC
            pad = PAD if kind == "sft_pad" else 64
            assert all(
                s["padded_tokens"] % pad == 0
                and s["padded_tokens"] > 0
                and all(p % pad == 0 for p in s["padded_per_rank"])
                for s in out["odc_steps"]
            ), out["odc_steps"]
        assert len(counts) == STEPS and sum(counts[2]) >= 2, counts
        # This rank's host seconds: one figure per microbatch it ran.
        for s, c in zip(out["odc_steps"], counts, strict=True):
            host = s["host_seconds"]
            assert len(host["microbatches"]) == c[rank] and host["barrier"] >= 0, (host, c)
        assert out["trainable"] == want["trainable"]
        if kind in LORA_KINDS:
            assert all("lora_" in n for n in out["trainable"]), out["trainable"]
        atol = ATOL_CUDA if cuda and kind in AUTO_KINDS else ATOL
        assert_params_match(want, out, initial, rank, atol, out["trainable"])
        # Every logged metric of every step, as the unmodified trainer logs it.
        assert len(out["logs"]) == len(want["logs"]) == STEPS
        for got, ref in zip(out["logs"], want["logs"], strict=True):
            assert set(got) == set(ref), (sorted(got), sorted(ref))
            for key, value in ref.items():
                if key.startswith("train_"):  # speed metrics (with the tokens seen): timings
                    continue
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (rank, key, got, ref)
        if kind == "full":
            assert out["logs"][-1]["num_input_tokens_seen"] == sum(len(s) for s in sequences())
        assert all(h["grad_norm"] > MAX_GRAD_NORM for h in out["logs"])  # clipping acted


def check_derived_cap(steps, cuda=False):
    """Without a cap, every step's cap is the padded size of the largest microbatch the
    unmodified trainer runs in that step (PER_DEVICE consecutive sequences of the step, padded
    to the longest; on CPU ranks nothing is measured or subtracted; on GPUs the first step runs
    at half of it and later ones less ODC's cache), and no ODC microbatch holds more padded
    tokens than the unmodified trainer's largest."""
    seqs, per_step = sequences(), PER_DEVICE * WORLD
    plain = 0  # the unmodified trainer's largest microbatch so far (its peak so far)
    for s, record in enumerate(steps):
        step = [len(x) for x in seqs[s * per_step : (s + 1) * per_step]]  # sequential order
        plain = max(
            plain,
            *(
                len(step[i : i + PER_DEVICE]) * max(step[i : i + PER_DEVICE])
                for i in range(0, per_step, PER_DEVICE)
            ),
        )
        assert record["plain_tokens"] == plain, (s, record, step)
        if cuda:
            assert record["cap"] <= (plain // 2 if s == 0 else plain), (s, record)
            if s > 0:  # the first step measured the marginal peak bytes per token
                bpt = record["bytes_per_token"]
                assert (
                    0 < record["forward_bytes_per_token"] <= bpt <= record["peak_bytes_per_token"]
                ), record
                assert record["cap"] == max(1, plain - math.ceil(record["odc_extra_bytes"] / bpt))
        else:
            assert record["cap"] == plain, (s, record)
            assert record["padded_tokens"] <= record["cap"], record
        assert 0 < record["padded_tokens"] <= plain or record["microbatches"].count(0), record
        # Each rank's padded work under ODC and as the unmodified trainer runs it: both cover
        # the step's sequences; the plain one is PER_DEVICE-row groups padded to the longest.
        assert sum(record["plain_padded_per_rank"]) >= sum(step), record
        assert sum(record["padded_per_rank"]) >= sum(step), record


def _collective_per_microbatch(rank, world):
    """A compute_loss that all-reduces a metric in every microbatch: with counts [3, 1] the
    ranks' collective counts differ and ODC names it; nothing hangs."""
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from torch_odc.integrations.hf import ODCConfig, ODCTrainerMixin

    _set_rank_env(rank, world)

    class Chatty(ODCTrainerMixin, Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            loss = super().compute_loss(model, inputs, **kwargs)
            dist.all_reduce(loss.detach().clone())  # a per-microbatch metric gather
            return loss

    trainer = Chatty(
        model=build_model(False),
        args=TrainingArguments(**common_args(True)),
        train_dataset=[{"input_ids": s} for s in sequences()],
        data_collator=collate,
        odc=ODCConfig(max_tokens_per_microbatch=40, planner=planner),
    )
    try:
        trainer.train()
    except RuntimeError as err:
        trainer._odc_handle._attached = False  # leave the engine; the group is torn down next
        return str(err)
    return None


def test_a_collective_per_microbatch_in_compute_loss_is_named_not_hung():
    import time

    start = time.monotonic()
    errors = run_ranks(WORLD, _collective_per_microbatch, pg_timeout=30.0, timeout=240.0)
    assert time.monotonic() - start < 200.0
    assert errors[1] is not None and "different numbers of collectives" in errors[1], errors
    assert "ALLREDUCE" in errors[1], errors[1]


def _one_rank(rank, world, kind):
    import warnings

    _set_rank_env(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train(kind, odc=True, per_device=PER_DEVICE * WORLD)
    out["warned"] = [str(w.message) for w in caught if "torch_odc.attach" in str(w.message)]
    return out


@pytest.mark.parametrize("kind", [k for k in ("auto", "sft_auto") if k in KINDS])
def test_one_rank_trains_like_the_unmodified_trainer(kind):
    # torchrun --nproc-per-node 1: attach keeps FSDP2's path (nothing to communicate), the
    # barrier does nothing, and the ODC trainer's steps are the unmodified trainer's (sft_auto:
    # TRL's fused LM head, which reads lm_head's weight without calling it).
    want = references()[kind]
    out = run_ranks(1, _one_rank, kind)[0]
    assert any("a group of one rank" in w for w in out["warned"]), out["warned"]
    initial = {n: p.detach() for n, p in build_model(False).named_parameters()}
    assert_params_match(want, out, initial, 0, ATOL, out["trainable"])
    assert len(out["logs"]) == len(want["logs"]) == STEPS
    for got, ref in zip(out["logs"], want["logs"], strict=True):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (key, got, ref)


def _two_hosts(rank, world):
    _set_rank_env(rank, world)
    os.environ["ODC_HOST_ID"] = f"host{rank}"  # attach sees two hosts: no one-sided access
    try:
        train("full", odc=True)
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_on_two_hosts_are_refused_not_hung():
    # The ODC trainer runs uneven microbatch counts; under FSDP2's collectives they would hang.
    import time

    start = time.monotonic()
    errors = run_ranks(WORLD, _two_hosts, pg_timeout=30.0, timeout=240.0)
    assert time.monotonic() - start < 200.0
    for rank, err in enumerate(errors):
        assert err is not None and f"(rank {rank}): ODC cannot serve" in err, errors
        assert "spans 2 hosts" in err and "unmodified trainer" in err, err


# ---- evaluation while attached ------------------------------------------------------------------

# The Trainer weighs a distributed evaluation batch's loss by the batch's label tokens over all
# ranks: 2 ranks with one sequence each evaluate like one process with the two in one batch.
EVAL_SEQUENCES = 4


def _evaluate_every_step(odc: bool, kind: str) -> dict:
    """Full fine-tuning with an evaluation after every optimizer step, with the Trainer
    ("full") or TRL's SFTTrainer ("sft": its fused LM head never calls lm_head, so after an
    evaluation FSDP2 leaves the [norm, lm_head] unit mid-forward on torch 2.11)."""
    from transformers import Trainer, TrainingArguments

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    rng = random.Random("eval")
    evals = [
        {"input_ids": [2 + rng.randrange(VOCAB - 2) for _ in range(rng.randint(5, 20))]}
        for _ in range(EVAL_SEQUENCES)
    ]
    args = {
        **common_args(odc),
        "eval_strategy": "steps",
        "eval_steps": 1,
        # TRL's evaluation loss is each batch's token mean (no token count across ranks):
        # its one-process reference evaluates batches of one sequence as well.
        "per_device_eval_batch_size": 1 if odc or kind == "sft" else WORLD,
    }
    extra = {"odc": ODCConfig(max_tokens_per_microbatch=40, planner=planner)} if odc else {}
    if kind == "sft":
        import datasets
        from trl import SFTConfig, SFTTrainer

        cls = odc_trainer(SFTTrainer) if odc else SFTTrainer
        trainer = cls(
            model=build_model(False),
            processing_class=tokenizer(),
            train_dataset=datasets.Dataset.from_list([{"input_ids": s} for s in sequences()]),
            eval_dataset=datasets.Dataset.from_list(evals),
            args=SFTConfig(**args, max_length=None, dataset_kwargs={"skip_prepare_dataset": True}),
            **extra,
        )
    else:
        cls = odc_trainer(Trainer) if odc else Trainer
        trainer = cls(
            model=build_model(False),
            args=TrainingArguments(**args),
            train_dataset=[{"input_ids": s} for s in sequences()],
            eval_dataset=evals,
            data_collator=collate,
            **extra,
        )
    trainer.train()
    return {
        "params": full_params(trainer.model),
        "logs": trainer.state.log_history,
        "odc_steps": getattr(trainer, "odc_steps", None),
    }


def _evaluate_every_step_odc(rank, world, kind):
    _set_rank_env(rank, world)
    return _evaluate_every_step(True, kind)


def _evaluate_every_step_reference(rank, world, kind):
    import torch.distributed as dist

    dist.destroy_process_group()
    os.environ.update(OFFLINE)
    return _evaluate_every_step(False, kind)


@pytest.mark.parametrize("kind", ["full", "sft"] if "sft" in KINDS else ["full"])
def test_evaluation_after_every_step_while_attached_matches_the_one_process_trainer(kind):
    """eval_strategy="steps": an evaluation (forwards without backward) after every optimizer
    step, between two ODC minibatches, with counts [3, 1] then [0, 4]. FSDP2 keeps the root
    unsharded after a forward until a backward, which rank 0 (no microbatch in step 2) never
    ran: its clipping then saw the unsharded parameters (no .grad) and the ranks' norm
    collectives differed. Every logged loss, grad norm and evaluation loss, and the parameters,
    equal the one-process trainer's."""
    want = run_ranks(1, _evaluate_every_step_reference, kind, backend="gloo", timeout=600)[0]
    got = run_ranks(WORLD, _evaluate_every_step_odc, kind, timeout=600)

    def logged(logs, key):
        return [(h["step"], h[key]) for h in logs if key in h]

    assert [s for s, _ in logged(want["logs"], "eval_loss")] == [1, 2, 3]
    for rank, out in enumerate(got):
        assert [s["microbatches"] for s in out["odc_steps"]][:2] == WANT_COUNTS
        for key in ("loss", "grad_norm", "eval_loss"):
            mine, ref = logged(out["logs"], key), logged(want["logs"], key)
            assert [s for s, _ in mine] == [s for s, _ in ref], (rank, key, mine, ref)
            assert [v for _, v in mine] == pytest.approx([v for _, v in ref], rel=1e-5), (
                rank,
                key,
                mine,
                ref,
            )
        for name, ref in want["params"].items():
            torch.testing.assert_close(
                out["params"][name],
                ref,
                rtol=0,
                atol=ATOL,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )


@pytest.mark.parametrize("bad", [0, -64, 1.5, True, "64"])
def test_a_bad_pad_multiple_is_refused(bad):
    from torch_odc.integrations.hf import ODCConfig

    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        ODCConfig(pad_to_multiple_of=bad)
