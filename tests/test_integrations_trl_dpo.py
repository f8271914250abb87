"""torch_odc.integrations.hf with TRL's DPOTrainer on 2 CPU ranks: the real DPOTrainer (accelerate's
FSDP2 wrapping, AdamW, clipping on) with uneven microbatch counts per rank (a rank with none
included), against the unmodified DPOTrainer in one process with the same global batch (one
microbatch of 6 pairs per step, no FSDP). Checks the loss (1e-6 relative), grad_norm, every
metric TRL logs (rewards, margins, accuracies, log-probs, logits, entropy, token accuracy,
token count) and the final parameters, for ``sigmoid`` with a separate reference model, ``ipo``
with a peft model (TRL's frozen "ref" adapter), ``sigmoid`` with ``peft_config`` (reference =
adapter disabled), ``precompute_ref_log_probs`` and a combined ``[sigmoid, bco_pair, sft]`` loss
with weights and ``ld_alpha`` planned by the default LB-Mini. Every loss type, the
f-divergences, ``ld_alpha``, WPO weighting and MPO are also checked per microbatch split (each
rank computes one split of the same 6 pairs on its own) against TRL's own loss, gradient and
metrics for the batch. The refusals are checked on the 2 ranks. GPU variants (one GPU per
rank) skip without 2 GPUs. A tiny Llama from a config, a word-level tokenizer built in
memory: nothing is downloaded."""

import functools
import os
import random
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")
pytest.importorskip("trl")

from hf_helpers import ONE_GPU, assert_params_match, environ, full_params, set_rank_env
from multiproc import run_ranks

WORLD = 2
PER_DEVICE = 3  # pairs per step = PER_DEVICE * WORLD (one-process reference: 6 per batch)
STEPS = 3
PAIRS = PER_DEVICE * WORLD * STEPS
VOCAB = 64
LR = 2e-2
MAX_GRAD_NORM = 0.01  # below every step's norm here: clipping acts in every step
ATOL = 1e-5
CAP = 60  # tokens per microbatch in LB-Mini's step (a pair: prompt twice + both completions)
# plan[step][rank]: microbatches as positions into the step's 6 pairs. Step 2 is LB-Mini's.
FIXED_PLANS = {
    0: [[[0, 1], [2], [3, 4]], [[5]]],
    1: [[], [[0], [1, 2], [3], [4, 5]]],  # rank 0 runs nothing
}
WANT_COUNTS = [[3, 1], [0, 4]]
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TQDM_DISABLE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}

# The training cases: DPOConfig overrides, the model and the reference. "lora": a peft model
# passed in (TRL copies its adapter into a frozen "ref" adapter, the reference); "peft_config":
# TRL adds a LoRA adapter, the reference is the model with the adapter disabled; "model": a
# separate reference model (not sharded: on CPU ranks accelerate leaves an evaluation-only
# model as it is); None without PEFT: the initial policy (precomputed).
CASES = {
    "sigmoid": {"config": {"loss_type": ["sigmoid"]}, "model": "full", "ref": "model"},
    "ipo_lora": {"config": {"loss_type": ["ipo"]}, "model": "lora", "ref": None},
    "sigmoid_peft_config": {
        "config": {"loss_type": ["sigmoid"]},
        "model": "peft_config",
        "ref": None,
    },
    "precompute": {
        "config": {"loss_type": ["sigmoid"], "precompute_ref_log_probs": True},
        "model": "full",
        "ref": None,
    },
    # Every step planned by the default LB-Mini, a pair costing its two sequences' FLOPs.
    "mpo_ld_lbmini": {
        "config": {
            "loss_type": ["sigmoid", "bco_pair", "sft"],
            "loss_weights": [0.8, 0.2, 1.0],
            "ld_alpha": 0.5,
        },
        "model": "full",
        "ref": "model",
        "planner": "lbmini",
    },
}
FLOPS = {"num_params": 5e4, "num_layers": 2, "hidden_size": 32}


def words(rng, n):
    return " ".join(f"w{rng.randrange(2, VOCAB)}" for _ in range(n))


def rows(count: int = PAIRS, seed: str = "dpo") -> list[dict]:
    """Prompts of 2..8 words; chosen completions continue an arithmetic progression (learnable),
    rejected ones are random; 1..12 words each, ending in the EOS token."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start, step = rng.randrange(2, VOCAB), rng.randrange(1, 5)
        prompt = [2 + (start + step * k) % (VOCAB - 2) for k in range(rng.randint(2, 8))]
        chosen = [
            2 + (start + step * (len(prompt) + k)) % (VOCAB - 2) for k in range(rng.randint(1, 12))
        ]
        out.append(
            {
                "prompt": " ".join(f"w{t}" for t in prompt),
                "chosen": " " + " ".join(f"w{t}" for t in chosen) + "</s>",
                "rejected": " " + words(rng, rng.randint(1, 12)) + "</s>",
            }
        )
    return out


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, "<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def build_model(kind: str = "full", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
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
    if kind == "lora":
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
        with torch.no_grad():  # peft zeroes lora_B: the policy then differs from the reference
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)
    return model


def planner(lengths, world, step):
    if step in FIXED_PLANS:
        return FIXED_PLANS[step]
    from torch_odc import balance

    return balance.plan(lengths, world, CAP, mode="mini").microbatches


def dpo_args(odc: bool, cuda: bool = False, **overrides):
    from trl import DPOConfig

    args = {
        "output_dir": tempfile.mkdtemp(prefix="odc-dpo-"),
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
        "per_device_train_batch_size": PER_DEVICE if odc else PER_DEVICE * WORLD,
        "beta": 0.1,
        # Adam's default 1e-8 turns float32 noise (~1e-10) in a gradient element that is
        # near zero into update differences of 1e-4; 1e-6 keeps them below 1e-6.
        "adam_epsilon": 1e-6,
    }
    if odc:
        args.update(fsdp=True, fsdp_config={"version": 2})
    args.update(overrides)
    return DPOConfig(**args)


def train(case: str, odc: bool, data_dir: str | None = None, cuda: bool = False) -> dict:
    """One DPO training run of `case`, with `odc` on this rank of the odc group, else alone;
    on CPU or the current GPU. Returns the full parameters (on CPU), the per-step logs and
    ODC's step records."""
    import datasets
    from trl import DPOTrainer

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    spec = CASES[case]
    if data_dir is not None:  # precompute_ref_log_probs on 2 ranks: the dataset on disk
        dataset = datasets.load_from_disk(data_dir)
    else:
        dataset = datasets.Dataset.from_list(rows())
    model = build_model("full" if spec["model"] == "peft_config" else spec["model"])
    ref = build_model("full", seed=1) if spec["ref"] == "model" else None
    if cuda and spec["config"].get("precompute_ref_log_probs"):
        # Under accelerate's FSDP (GPUs) TRL would load the precompute's reference from the
        # model's name; a copy of the initial policy is what it uses without FSDP.
        ref = build_model(spec["model"])
    cls = odc_trainer(DPOTrainer) if odc else DPOTrainer
    extra = {}
    if odc and spec.get("planner") == "lbmini":
        extra["odc"] = ODCConfig(max_tokens_per_microbatch=CAP, cost="flops", cost_args=FLOPS)
    elif odc:
        extra["odc"] = ODCConfig(max_tokens_per_microbatch=CAP, planner=planner)
    if spec["model"] == "peft_config":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        )
    trainer = cls(
        model=model,
        ref_model=ref,
        args=dpo_args(odc, cuda, **spec["config"]),
        train_dataset=dataset,
        processing_class=tokenizer(),
        **extra,
    )
    initial = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return {
        "params": full_params(trainer.model),
        "initial": initial,
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "odc_steps": getattr(trainer, "odc_steps", None),
    }


def _set_rank_env(rank, world):
    set_rank_env(rank, world, port=29556, env=OFFLINE)


# ---- the refusals ------------------------------------------------------------------------------

REFUSALS = {
    "aot": ({"loss_type": ["sigmoid", "aot"]}, "full", "'aot' sorts"),
    "aot_unpaired": ({"loss_type": ["aot_unpaired"]}, "full", "'aot_unpaired' sorts"),
    "sft_weighting": (
        {"loss_type": ["sigmoid", "sft"], "use_weighting": True},
        "full",
        "use_weighting with loss_type 'sft'",
    ),
    "sync_ref_model": ({"sync_ref_model": True}, "full", "sync_ref_model"),
    "precompute_in_memory": ({"precompute_ref_log_probs": True}, "full", "save_to_disk"),
}
# On GPUs accelerate shards a separate reference model (TRL's prepare_fsdp): its forward in
# every microbatch would be a collective.
GPU_REFUSALS = {
    "sharded_ref_model": ({"loss_type": ["sigmoid"]}, "full", "reference model is sharded"),
}


def _refusal(name: str, cuda: bool = False) -> str | None:
    import datasets
    from trl import DPOTrainer

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    overrides, kind, _ = {**REFUSALS, **GPU_REFUSALS}[name]
    ref = build_model("full", seed=1) if not overrides.get("precompute_ref_log_probs") else None
    try:
        odc_trainer(DPOTrainer)(
            model=build_model(kind),
            ref_model=ref,
            args=dpo_args(True, cuda, **overrides),
            train_dataset=datasets.Dataset.from_list(rows(8)),
            processing_class=tokenizer(),
            odc=ODCConfig(max_tokens_per_microbatch=CAP),
        )
    except ValueError as err:
        return str(err)
    return None


def _odc_ranks(rank, world, cases, data_dir, cuda=False):
    import datasets
    import torch.distributed as dist

    _set_rank_env(rank, world)
    if rank == 0:
        datasets.Dataset.from_list(rows()).save_to_disk(data_dir)
    dist.barrier()
    out = {
        case: train(
            case,
            odc=True,
            data_dir=data_dir if CASES[case]["config"].get("precompute_ref_log_probs") else None,
            cuda=cuda,
        )
        for case in cases
    }
    if cuda:
        out["refusals"] = {name: _refusal(name, cuda) for name in GPU_REFUSALS}
    else:
        out["refusals"] = {name: _refusal(name) for name in REFUSALS}
        out["splits"] = {
            name: odc_batch(SPLITS[rank], **spec) for name, spec in SPLIT_CASES.items()
        }
    return out


def _reference(rank, world, cases, cuda=False):
    import torch.distributed as dist

    dist.destroy_process_group()  # the unmodified trainer, one process, not distributed
    os.environ.update(OFFLINE)
    out = {case: train(case, odc=False, cuda=cuda) for case in cases}
    if not cuda:
        out["splits"] = {name: trl_batch(**spec) for name, spec in SPLIT_CASES.items()}
    return out


@functools.cache
def runs(cases: tuple = tuple(CASES), cuda: bool = False):
    # The trainer's own CUDA collectives (grad norm, loss and precompute gathers) go through
    # Gloo: the one-process reference and the ranks' comparison need no NCCL.
    env = {"ODC_CUDA_COLLECTIVES": "gloo"} if cuda else None
    with environ(ONE_GPU if cuda else None):
        reference = run_ranks(
            1, _reference, list(cases), cuda, backend="gloo", timeout=600, cuda=cuda
        )[0]
    with tempfile.TemporaryDirectory(prefix="odc-dpo-data-") as tmp:
        odc = run_ranks(
            WORLD,
            _odc_ranks,
            list(cases),
            os.path.join(tmp, "pairs"),
            cuda,
            timeout=600,
            cuda=cuda,
            env=env,
        )
    return reference, odc


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_with_odc_matches_plain_trl(case):
    check(case, *runs())


# GPU: accelerate wraps with FSDP2 itself; a separate reference model is refused there.
GPU_CASES = ["ipo_lora", "sigmoid_peft_config", "precompute"]


# Two GPUs: TRL's DPO prepares its dataset between accelerate's barriers, which name the device
# of LOCAL_RANK (device_ids=[1] on rank 1: an invalid ordinal on a one-GPU host).
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 GPUs (accelerate's barrier names the device of LOCAL_RANK)",
)
@pytest.mark.parametrize("case", GPU_CASES)
def test_dpo_with_odc_on_gpu_matches_plain_trl(case):
    reference, odc = runs((case,), cuda=True)  # one attach per process group on CUDA
    check(case, reference, odc)
    for rank, out in enumerate(odc):
        for name, (_, _, words_) in GPU_REFUSALS.items():
            err = out["refusals"][name]
            assert err is not None and words_ in err, (rank, name, err)


def check(case, reference, odc):
    want = reference[case]
    initial = want["initial"]
    for rank, out in enumerate(r[case] for r in odc):
        assert set(out["initial"]) == set(initial)
        for name, value in out["initial"].items():
            assert torch.equal(value, initial[name]), f"rank {rank}: initial {name} differs"
        counts = [s["microbatches"] for s in out["odc_steps"]]
        assert len(counts) == STEPS and all(sum(c) >= 2 for c in counts), counts
        if CASES[case].get("planner") != "lbmini":
            assert counts[:2] == WANT_COUNTS, counts
        else:
            assert counts == [c["microbatches"] for c in odc[0][case]["odc_steps"]]
        assert all(s["pairs"] == PER_DEVICE * WORLD for s in out["odc_steps"])
        assert out["trainable"] == want["trainable"]
        if CASES[case]["model"] != "full":
            assert all("lora_" in n and ".ref." not in n for n in out["trainable"]), out
        assert_params_match(want, out, initial, rank, ATOL, out["trainable"])
        assert len(out["logs"]) == len(want["logs"]) == STEPS
        for got, ref in zip(out["logs"], want["logs"], strict=True):
            assert set(got) == set(ref), (sorted(got), sorted(ref))
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6), (rank, got, ref)
            # rewards and margins are beta times differences of log-probabilities near -30:
            # float32 leaves them about 1e-6 apart (other padding, other summation order).
            for key, value in ref.items():
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), (rank, key, got, ref)
            assert got["grad_norm"] > MAX_GRAD_NORM  # clipping acted
        # The metrics are not trivially equal: the rewards move away from zero.
        assert any(abs(h["rewards/margins"]) > 1e-3 for h in want["logs"]), want["logs"]


def test_the_refusals_name_the_option():
    _, odc = runs()
    for rank, out in enumerate(odc):
        for name, (_, _, words_) in REFUSALS.items():
            err = out["refusals"][name]
            assert err is not None, f"rank {rank}: {name} was not refused"
            assert "torch_odc.integrations.hf (DPOTrainer)" in err and words_ in err, (name, err)


# ---- every loss type, any split, in one process --------------------------------------------------

SPLIT_PAIRS = 6
# Microbatches of the 6 pairs: rank r computes SPLITS[r] (all of them, on its own).
SPLITS = ([[0, 1, 2, 3, 4], [5]], [[3], [0, 5], [1, 2, 4]])
SPLIT_CASES = {
    **{
        t: {"loss_type": [t]}
        for t in (
            "sigmoid",
            "hinge",
            "ipo",
            "nca_pair",
            "bco_pair",
            "sppo_hard",
            "apo_zero",
            "apo_down",
            "discopop",
            "sigmoid_norm",
            "sft",
        )
    },
    "exo_pair": {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    "robust": {"loss_type": ["robust"], "label_smoothing": 0.1},
    "forward_kl": {"loss_type": ["sigmoid"], "f_divergence_type": "forward_kl"},
    "js_divergence": {"loss_type": ["hinge"], "f_divergence_type": "js_divergence"},
    "alpha_divergence": {
        "loss_type": ["ipo"],
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.3,
    },
    "ld_alpha": {"loss_type": ["sigmoid"], "ld_alpha": 0.3},
    "wpo": {"loss_type": ["nca_pair", "sigmoid"], "use_weighting": True},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
}


def _split_data():
    import datasets

    return datasets.Dataset.from_list(rows(SPLIT_PAIRS, seed="split"))


def trl_batch(**overrides) -> dict:
    """TRL's own loss, gradient and metrics for one batch of the 6 pairs (one process)."""
    from trl import DPOTrainer

    trainer = DPOTrainer(
        model=build_model(),
        ref_model=build_model("full", seed=1),
        args=dpo_args(False, per_device_train_batch_size=SPLIT_PAIRS, **overrides),
        train_dataset=_split_data(),
        processing_class=tokenizer(),
    )
    pairs = [trainer.train_dataset[i] for i in range(SPLIT_PAIRS)]
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(pairs))
    loss.backward()
    return {
        "loss": loss.item(),
        "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()},
        "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()},
    }


def odc_batch(split, **overrides) -> dict:
    """The adapter's loss (summed over the microbatches of `split`), gradient (accumulated) and
    metrics (reduced as after the barrier) for the same 6 pairs, on this rank alone: the model
    is not sharded here, so the world size (2) the loss carries for FSDP2's average stays in."""
    from trl import DPOTrainer

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    trainer = odc_trainer(DPOTrainer)(
        model=build_model(),
        ref_model=build_model("full", seed=1),
        args=dpo_args(True, **overrides),
        train_dataset=_split_data(),
        processing_class=tokenizer(),
        odc=ODCConfig(max_tokens_per_microbatch=CAP),
    )
    pairs = [trainer.train_dataset[i] for i in range(SPLIT_PAIRS)]
    batches = [trainer.data_collator([pairs[i] for i in mb]) for mb in split]
    trainer.model.train()
    step = type("Step", (), {"microbatches": batches})()
    trainer._odc_totals = {k: float(v) for k, v in trainer._odc_step_totals(step).items()}
    trainer._odc_sums = dict.fromkeys(trainer._odc_metric_keys(), 0.0)
    trainer._odc_in_step = True
    total = 0.0
    for batch in batches:
        part = trainer.compute_loss(trainer.model, batch)
        part.backward()
        total += part.item()
    trainer._odc_in_step = False
    trainer._odc_record_metrics(trainer._odc_sums)
    return {
        "loss": total,
        "metrics": {k: v[-1] for k, v in trainer._metrics["train"].items()},
        "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()},
    }


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_every_loss_type_is_trls_for_any_split(name):
    reference, odc = runs()
    want = reference["splits"][name]
    largest = max(g.abs().max().item() for g in want["grads"].values())
    assert largest > 1e-3, "no gradient: weak check"
    for rank, split in enumerate(SPLITS):
        got = odc[rank]["splits"][name]
        got = {
            **got,
            "loss": got["loss"] / WORLD,
            "grads": {n: g / WORLD for n, g in got["grads"].items()},
        }
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), (split, got["loss"])
        assert set(got["metrics"]) == set(want["metrics"])
        for key, value in want["metrics"].items():  # abs: as in the training test
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (split, key)
        # float32 sums in another order and over other padding: within 2e-5 of the largest
        # gradient element (discopop's exp(-z) comes closest, 5e-6); a pair weighted by its
        # microbatch's size instead of the step's would be off by a sixth.
        for param, grad in want["grads"].items():
            torch.testing.assert_close(
                got["grads"][param],
                grad,
                rtol=1e-5,
                atol=2e-5 * largest,
                msg=lambda m, p=param, s=split: f"{s} {p}: {m}",
            )


def test_lbmini_costs_a_pair_as_its_two_sequences():
    """The core plans a row of several sequences by their summed length against the token cap
    and by the sum of their costs; a nonlinear cost of the summed length would overstate a
    pair's attention cost."""
    from torch_odc import balance
    from torch_odc.integrations.hf import ODCConfig
    from torch_odc.step import LBMini, row_costs

    config = ODCConfig(max_tokens_per_microbatch=CAP, cost="flops", cost_args=FLOPS)
    rows = [(30, 12), (9, 40), (25, 25), (3, 4), (50, 8), (7, 7)]
    costs = row_costs(rows, config.cost, config.cost_args)
    assert costs == [
        pytest.approx(balance.flops_cost(a, **FLOPS) + balance.flops_cost(b, **FLOPS))
        for a, b in rows
    ]
    assert costs[0] < balance.flops_cost(42, **FLOPS)
    assert (
        row_costs([(5,), (7,)], config.cost, config.cost_args) is None
    )  # one sequence a row: LB-Mini costs it
    plan = LBMini.from_config(config)([sum(r) for r in rows], WORLD, 0, costs=costs)
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(len(rows)))
    for rank in plan:
        for mb in rank:
            assert len(mb) == 1 or sum(sum(rows[i]) for i in mb) <= CAP, (mb, rows)
