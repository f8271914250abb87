"""Save and resume under ODC in the Hugging Face Trainer: TRL's SFTTrainer through
``odc_trainer`` on 2 ranks with uneven microbatch counts (zero included), checkpointing with the
Trainer's own machinery (save_strategy="steps", no override in the script), for both FSDP2
state dict types accelerate offers (fsdp_config state_dict_type FULL_STATE_DICT and
SHARDED_STATE_DICT).

An uninterrupted run of 6 steps (4 steps per epoch: the resumed run crosses into a new,
reshuffled epoch) saves at steps 3 and 6. A second run in a new process group (new processes)
resumes from (a copy of) checkpoint-3 with ``trainer.train(resume_from_checkpoint=...)`` in its
own output directory, with ``save_total_limit=1``: its step-6 save removes checkpoint-3. Its logged loss, grad norm, learning rate, epoch, entropy,
token accuracy and num_tokens of steps 4-6, its per-step plans (microbatch counts per rank,
label tokens) and its final parameters equal the uninterrupted run's (1e-6 relative; ODC adds
the pushes of both ranks into an owner's fp32 accumulator in arrival order, so two runs differ
by rounding only). The step-6 checkpoints of both runs hold the same model; with
FULL_STATE_DICT its model.safetensors is the trained model.

A save inside an optimizer step (between a rank's first microbatch and the barrier) is refused
before anything is written or any collective runs; ``control.should_save`` from a callback saves
after the step instead.

On GPUs the same runs go over NCCL with one GPU per rank, or with 2 ranks sharing one GPU
(``ODC_CUDA_COLLECTIVES=gloo``; NCCL refuses two ranks on one device): accelerate then does the
FSDP2 wrapping itself. They skip without GPUs."""

import functools
import json
import os
import random
import shutil
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")
pytest.importorskip("datasets")

from hf_helpers import environ, fixed_or_lb_mini, full_params, progressions, set_rank_env
from multiproc import run_ranks
from test_integrations_hf import build_model, collate, tokenizer

WORLD = 2
PER_DEVICE = 3  # 6 sequences per step
STEPS_PER_EPOCH = 4
SEQUENCES = PER_DEVICE * WORLD * STEPS_PER_EPOCH
MAX_STEPS = 6  # epoch 0: steps 1-4, epoch 1: steps 5-6
SAVE_AT = 3
VOCAB = 64
LR = 2e-2
MAX_GRAD_NORM = 0.05
RTOL = 1e-6
# plan[step in epoch][rank]: microbatches as positions into the step's 6 sequences; the other
# steps are LB-Mini's. Step 3 (the first after the resume) leaves rank 1 idle.
FIXED_PLANS = {
    0: [[[0, 1], [2], [3, 4]], [[5]]],
    1: [[], [[0], [1, 2], [3], [4, 5]]],
    3: [[[0, 1, 2], [3, 4, 5]], []],
}
STATE_DICT_TYPES = ["FULL_STATE_DICT", "SHARDED_STATE_DICT"]
_rng = random.Random("eval")
EVAL = [
    {"input_ids": [2 + _rng.randrange(VOCAB - 2) for _ in range(_rng.randint(5, 20))]}
    for _ in range(4)
]
BEST_IS_GREATER = False


def sequences() -> list[list[int]]:
    return progressions("test_integrations_hf_checkpoint", SEQUENCES, VOCAB)


def planner(lengths, world, step):
    return fixed_or_lb_mini(FIXED_PLANS, lengths, world, step)


def sft_args(output_dir: str, state_dict_type: str, cuda: bool, **extra):
    """The Trainer's defaults (random sampling seeded from seed, linear schedule, AdamW, the
    default checkpoint contents) except what the test needs to see: a learning rate and
    clipping that move the parameters, a log per step, the save schedule."""
    from trl import SFTConfig

    args = {
        "output_dir": output_dir,
        "max_steps": MAX_STEPS,
        "learning_rate": LR,
        "max_grad_norm": MAX_GRAD_NORM,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": SAVE_AT,
        "report_to": [],
        "use_cpu": not cuda,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "bf16": False,
        "per_device_train_batch_size": PER_DEVICE,
        "fsdp": True,
        "fsdp_config": {"version": 2, "state_dict_type": state_dict_type},
        "max_length": None,
        "dataset_kwargs": {"skip_prepare_dataset": True},
    }
    args.update(extra)
    return SFTConfig(**args)


def make_trainer(args, cls=None, callbacks=None):
    import datasets
    from trl import SFTTrainer

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    cls = cls or odc_trainer(SFTTrainer)
    return cls(
        model=build_model(False),
        processing_class=tokenizer(),
        args=args,
        train_dataset=datasets.Dataset.from_list([{"input_ids": s} for s in sequences()]),
        callbacks=callbacks,
        odc=ODCConfig(max_tokens_per_microbatch=40, planner=planner),
    )


def _set_rank_env(rank, world):
    set_rank_env(rank, world, port=29556)


def _train(rank, world, output_dir, state_dict_type, cuda, resume_from, extra):
    _set_rank_env(rank, world)
    trainer = make_trainer(sft_args(output_dir, state_dict_type, cuda, **extra))
    trainer.train(resume_from_checkpoint=resume_from)
    if resume_from is not None and state_dict_type == "SHARDED_STATE_DICT":
        # Checkpointed sharded, saved whole at the end (save_model writes no model with
        # SHARDED_STATE_DICT, as the Trainer under FSDP).
        trainer.odc_fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(os.path.join(output_dir, "final"))
    return {
        "params": full_params(trainer.model),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "odc_steps": trainer.odc_steps,
        "global_step": trainer.state.global_step,
        "total_train_tokens": trainer._total_train_tokens,
        "checkpoints": sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint-")),
    }


@functools.cache
def runs(state_dict_type: str, cuda: str = ""):
    """(uninterrupted, resumed, uninterrupted dir, resumed dir) for one state dict type; cuda
    "" (CPU), "nccl" (one GPU per rank) or "shared" (2 ranks on GPU 0)."""
    # Ranks sharing GPU 0: visible from the ranks' start (run_ranks puts rank r on GPU r % count);
    # their CUDA collectives go through Gloo (NCCL refuses two ranks on one GPU).
    env = {"ODC_CUDA_COLLECTIVES": "gloo", "CUDA_VISIBLE_DEVICES": "0"} if cuda == "shared" else {}
    first = tempfile.mkdtemp(prefix="odc-hf-ckpt-")
    second = tempfile.mkdtemp(prefix="odc-hf-resume-")
    kw = {"timeout": 600, "cuda": bool(cuda)}
    with environ(env):
        whole = run_ranks(WORLD, _train, first, state_dict_type, bool(cuda), None, {}, **kw)
        # The resumed run works in its own output directory holding a copy of checkpoint-3:
        # at step 6 it saves checkpoint-6 and save_total_limit=1 removes checkpoint-3.
        resume_from = os.path.join(second, f"checkpoint-{SAVE_AT}")
        shutil.copytree(os.path.join(first, f"checkpoint-{SAVE_AT}"), resume_from)
        resumed = run_ranks(
            WORLD,
            _train,
            second,
            state_dict_type,
            bool(cuda),
            resume_from,
            {"save_total_limit": 1},
            **kw,
        )
    return whole, resumed, first, second


def check(state_dict_type, whole, resumed, first, second):
    initial = dict(build_model(False).named_parameters())
    for rank in range(WORLD):
        want, got = whole[rank], resumed[rank]
        # The uninterrupted run: uneven counts with a zero in both directions, saved at 3, 6.
        counts = [s["microbatches"] for s in want["odc_steps"]]
        assert counts[:2] == [[3, 1], [0, 4]] and counts[3] == [2, 0], counts
        assert [(s["epoch"], s["step"]) for s in want["odc_steps"]] == [
            (0, 0),
            (0, 1),
            (0, 2),
            (0, 3),
            (1, 0),
            (1, 1),
        ]
        assert want["checkpoints"] == ["checkpoint-3", "checkpoint-6"], want["checkpoints"]
        # The resumed run trained steps 4-6 only, on the same plans; save_total_limit=1 kept
        # its last checkpoint only.
        # Every record's content but its timings (host_seconds).
        plans = [
            [{k: v for k, v in s.items() if k != "host_seconds"} for s in run["odc_steps"]]
            for run in (want, got)
        ]
        assert plans[1] == plans[0][SAVE_AT:], (got["odc_steps"], want)
        assert got["global_step"] == MAX_STEPS
        assert got["checkpoints"] == ["checkpoint-6"], got["checkpoints"]
        # Every logged value of every step (steps 1-3 come from the checkpoint's state).
        assert [h["step"] for h in got["logs"]] == list(range(1, MAX_STEPS + 1))
        for mine, ref in zip(got["logs"], want["logs"], strict=True):
            assert set(mine) == set(ref), (sorted(mine), sorted(ref))
            for key, value in ref.items():
                assert mine[key] == pytest.approx(value, rel=RTOL, abs=1e-9), (
                    rank,
                    mine["step"],
                    key,
                    mine[key],
                    value,
                )
        # TRL's num_tokens is a running total: it continued from the checkpoint.
        tokens = [h["num_tokens"] for h in want["logs"]]
        assert tokens == sorted(tokens) and tokens[SAVE_AT] > tokens[SAVE_AT - 1] > 0, tokens
        assert got["total_train_tokens"] == want["total_train_tokens"] == tokens[-1]
        assert all(h["grad_norm"] > MAX_GRAD_NORM for h in want["logs"])  # clipping acted
        moved = 0.0
        for name, ref in want["params"].items():
            close(got["params"][name], ref, f"rank {rank} {name}")
            moved = max(moved, (ref - initial[name].detach()).abs().max().item())
        assert moved > 1e-2, moved  # far above the tolerance: a lost step would show
    worst_log = max(
        abs(m[k] - r[k]) / max(abs(r[k]), 1e-12)
        for out, ref in zip(resumed, whole, strict=True)
        for m, r in zip(out["logs"], ref["logs"], strict=True)
        for k in r
    )
    worst_param = max(
        ((out["params"][n] - t).abs().max() / t.abs().max()).item()
        for out, ref in zip(resumed, whole, strict=True)
        for n, t in ref["params"].items()
    )
    print(
        f"{state_dict_type}: resumed vs uninterrupted, largest relative difference: logged "
        f"values {worst_log:.1e}, parameters {worst_param:.1e} (of the tensor's largest)"
    )
    final = whole[0]["params"]
    # The checkpoints: the Trainer's own files; the step-6 model of both runs is the same.
    listing = sorted(os.listdir(os.path.join(first, f"checkpoint-{SAVE_AT}")))
    for name in ("trainer_state.json", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert name in listing, listing
    if state_dict_type == "FULL_STATE_DICT":
        assert {"pytorch_model_fsdp.bin", "optimizer.bin", "model.safetensors"} <= set(listing)
        from safetensors.torch import load_file

        for run_dir in (first, second):
            saved = load_file(os.path.join(run_dir, f"checkpoint-{MAX_STEPS}", "model.safetensors"))
            assert sorted(saved) == sorted(final), (sorted(saved), sorted(final))
            for name, ref in final.items():
                close(saved[name], ref, f"{run_dir} checkpoint-{MAX_STEPS} {name}")
        want_sd = torch.load(os.path.join(first, "checkpoint-6", "pytorch_model_fsdp.bin"))
        got_sd = torch.load(os.path.join(second, "checkpoint-6", "pytorch_model_fsdp.bin"))
    else:
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(listing), listing
        assert "model.safetensors" not in listing, listing
        from safetensors.torch import load_file

        saved = load_file(os.path.join(second, "final", "model.safetensors"))
        assert sorted(saved) == sorted(final), (sorted(saved), sorted(final))
        for name, ref in final.items():
            close(saved[name], ref, f"final {name}")
        want_sd = _dcp_model(os.path.join(first, "checkpoint-6", "pytorch_model_fsdp_0"))
        got_sd = _dcp_model(os.path.join(second, "checkpoint-6", "pytorch_model_fsdp_0"))
    assert sorted(got_sd) == sorted(want_sd) and len(want_sd) == len(final)
    for name, ref in want_sd.items():
        close(got_sd[name], ref, f"resumed checkpoint-6 {name}")
        close(ref, final[name], f"checkpoint-6 {name}")
    with open(os.path.join(first, f"checkpoint-{SAVE_AT}", "trainer_state.json")) as f:
        saved_state = json.load(f)
    assert saved_state["global_step"] == SAVE_AT
    assert saved_state["stateful_callbacks"]["ODCTrainerCallback"]["attributes"]["odc"] == {
        "total_train_tokens": whole[0]["logs"][SAVE_AT - 1]["num_tokens"]
    }


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal within RTOL relative to the tensor's scale (elements near zero included)."""
    torch.testing.assert_close(
        got, want, rtol=RTOL, atol=RTOL * want.abs().max().item(), msg=lambda m: f"{what}: {m}"
    )


def _dcp_model(path: str) -> dict:
    """A DCP checkpoint of {"model": state dict} as full tensors, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tempfile.mkdtemp(prefix="odc-dcp-"), "model.pt")
    dcp_to_torch_save(path, out)
    return torch.load(out)["model"]


@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_save_and_resume_in_a_new_process_group_continues_the_uninterrupted_run(state_dict_type):
    check(state_dict_type, *runs(state_dict_type))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per rank, NCCL)")
@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_save_and_resume_on_two_gpus_over_nccl(state_dict_type):
    check(state_dict_type, *runs(state_dict_type, "nccl"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (2 ranks share it)")
@pytest.mark.parametrize("state_dict_type", STATE_DICT_TYPES)
def test_save_and_resume_with_two_ranks_sharing_one_gpu(state_dict_type):
    check(state_dict_type, *runs(state_dict_type, "shared"))


# ---- a save inside an optimizer step; the best model at the end ---------------------------------


def _save_inside_the_step(rank, world, output_dir):
    """The plain Trainer (full fine-tuning), 2 steps with an evaluation after each. In the
    first microbatch of step 1 each rank tries the Trainer's checkpoint save and save_model; a
    callback asks for a save after step 1 the Trainer's way (save_steps=2 saves after step 2).
    load_best_model_at_end loads the checkpoint with the better eval_loss."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    _set_rank_env(rank, world)
    refused = []

    class SavesInside(odc_trainer(Trainer)):
        def compute_loss(self, model, inputs, **kwargs):
            if self.state.global_step == 0 and self.model.training and not refused:
                for call in (lambda: self._save_checkpoint(model, None), self.save_model):
                    try:
                        call()
                        refused.append(None)
                    except RuntimeError as err:
                        refused.append(str(err))
            return super().compute_loss(model, inputs, **kwargs)

    class SaveAfterStepOne(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            control.should_save = state.global_step == 0

    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=2,
        learning_rate=LR,
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=BEST_IS_GREATER,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        per_device_train_batch_size=PER_DEVICE,
        fsdp=True,
        fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
    )
    trainer = SavesInside(
        model=build_model(False),
        args=args,
        data_collator=collate,
        train_dataset=[{"input_ids": s} for s in sequences()],
        eval_dataset=EVAL,
        callbacks=[SaveAfterStepOne()],
        odc=ODCConfig(max_tokens_per_microbatch=40, planner=planner),
    )
    trainer.train()
    return {
        "refused": refused,
        "params": full_params(trainer.model),
        "checkpoints": sorted(n for n in os.listdir(output_dir) if n.startswith("checkpoint")),
        "best": trainer.state.best_model_checkpoint,
        "eval_loss": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
        "counts": [s["microbatches"] for s in trainer.odc_steps],
    }


def test_saves_inside_a_step_are_refused_should_save_saves_after_it_the_best_model_loads():
    """Inside the step (rank 0 at the first of 3 microbatches, rank 1 at its only one) both
    saves raise, naming the rank, the step and what to do, before any file or collective; the
    run goes on. The callback's checkpoint-1 is written after the step. At the end the Trainer
    loads the best checkpoint (step 1's: with greater_is_better its larger eval_loss) into the
    sharded model: the final parameters are checkpoint-1's, not step 2's."""
    output_dir = tempfile.mkdtemp(prefix="odc-hf-inside-")
    results = run_ranks(WORLD, _save_inside_the_step, output_dir, timeout=300)
    best = os.path.join(output_dir, "checkpoint-1")
    step1 = _dcp_model(os.path.join(best, "pytorch_model_fsdp_0"))
    step2 = _dcp_model(os.path.join(output_dir, "checkpoint-2", "pytorch_model_fsdp_0"))
    for rank, out in enumerate(results):
        assert out["counts"] == [[3, 1], [0, 4]], out["counts"]
        assert len(out["refused"]) == 2 and all(out["refused"]), out["refused"]
        for err, what in zip(out["refused"], ("_save_checkpoint", "save_model"), strict=True):
            assert f"rank {rank}: " in err and what in err, err
            assert "inside optimizer step 1" in err and "[3, 1]" in err, err
            assert "minibatch_barrier()" in err and "control.should_save" in err, err
        # Nothing written inside the step; the callback's save came after step 1.
        assert out["checkpoints"] == ["checkpoint-1", "checkpoint-2"], out["checkpoints"]
        first, second = out["eval_loss"]
        assert (first > second) == BEST_IS_GREATER, out["eval_loss"]  # step 1 is the best
        assert out["best"] == best, out["best"]
        assert sorted(out["params"]) == sorted(step1)
        for name, ref in step1.items():
            assert torch.equal(out["params"][name], ref), name
        assert max((step2[n] - step1[n]).abs().max().item() for n in step1) > 1e-3
