"""DPO with TRL's DPOTrainer on the "odc" backend, through torch_odc.integrations.hf: preference
pairs planned by LB-Mini, ranks run different numbers of microbatches per optimizer step.

    torchrun --nproc-per-node 2 docs/examples/trl_dpo.py                    # CPU or GPUs
    torchrun --nproc-per-node 2 docs/examples/trl_dpo.py --ref peft --loss-type ipo
    torchrun --nproc-per-node 2 docs/examples/trl_dpo.py --size medium --steps 20 --out results
    torchrun --nproc-per-node 2 docs/examples/trl_dpo.py --no-odc           # plain TRL (FSDP2)

The model is a LlamaForCausalLM built from a config (random initialization), the tokenizer a
word-level one built in memory, the pairs synthetic: prompts and completions of long-tailed
random lengths, the chosen completion continuing the prompt's arithmetic progression, the
rejected one random words (so the reward margin grows). Nothing is downloaded. Every step
prints, on rank 0, each rank's microbatch count, the loss, the reward margin and accuracy and
the step's time; ``--out DIR`` writes the per-step log as JSON and the curves as a PNG.

What ODC adds to a DPOTrainer script is the process group and three lines:

    dist.init_process_group("odc")
    trainer = odc_trainer(DPOTrainer)(..., odc=ODCConfig(max_tokens_per_microbatch=...))
    # and fsdp=True, fsdp_config={"version": 2} in DPOConfig

The reference model (``--ref``):

* ``precompute`` (default): TRL computes the reference log-probabilities of every pair before
  training (``precompute_ref_log_probs``) with a copy of the initial model; with several ranks
  TRL needs the dataset on disk, so rank 0 saves it to a temporary directory first.
* ``peft``: a LoRA adapter is trained; the reference is the model with the adapter disabled.
* ``model``: a separate reference model. On GPUs accelerate shards it with FSDP2, so its
  forward would be a collective in every microbatch: ODC refuses it there (CPU ranks keep a
  full copy per rank, which works).

GPUs: one per rank (NCCL serves the trainer's own collectives), or two ranks sharing one GPU
with ``ODC_CUDA_COLLECTIVES=gloo``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import tempfile
import time
import warnings

import _step_probe as step_probe
import torch
import torch.distributed as dist

import torch_odc  # noqa: F401  (registers "odc")
from torch_odc import balance
from torch_odc.integrations.hf import ODCConfig, odc_trainer, peak_memory_gib

SIZES = {  # LlamaConfig arguments
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "medium": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 19,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}


def build_model(size: str, max_positions: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=max(max_positions, 64),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


def build_tokenizer(vocab_size: int):
    """Word-level: word ``w<i>`` is token i; ``<pad>`` is 0 and ``</s>`` (EOS) is 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, "<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, int(low * (high / low) ** rng.random()))


def build_pairs(
    count: int,
    vocab: int,
    prompt_len: tuple[int, int],
    completion_len: tuple[int, int],
    seed: int = 0,
) -> list[dict]:
    """Preference pairs with log-uniform prompt and completion lengths (many short, a few
    long), the same on every rank. Text, as DPOTrainer expects it: it tokenizes them itself."""
    rng = random.Random(f"trl_dpo:{seed}")

    def text(tokens):
        return " ".join(f"w{t}" for t in tokens)

    pairs = []
    for _ in range(count):
        start, step = rng.randrange(2, vocab), rng.randrange(1, 9)
        n = log_uniform(rng, *prompt_len)
        chosen = [
            2 + (start + step * (n + k)) % (vocab - 2)
            for k in range(log_uniform(rng, *completion_len))
        ]
        rejected = [rng.randrange(2, vocab) for _ in range(log_uniform(rng, *completion_len))]
        pairs.append(
            {
                "prompt": text(2 + (start + step * k) % (vocab - 2) for k in range(n)),
                "chosen": " " + text(chosen) + "</s>",
                "rejected": " " + text(rejected) + "</s>",
            }
        )
    return pairs


def pair_tokens(dataset) -> list[int]:
    """Non-padding tokens of each tokenized pair: prompt + chosen and prompt + rejected."""
    prompt, chosen, rejected = (dataset[c] for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
    return [2 * len(p) + len(c) + len(r) for p, c, r in zip(prompt, chosen, rejected, strict=True)]


def shared_tempdir(rank: int) -> str:
    """A directory every rank of this host sees (rank 0 makes it)."""
    path = [tempfile.mkdtemp(prefix="odc-trl-dpo-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


def build_trainer(args, odc: bool, rank: int, world: int):
    """The DPOTrainer of this configuration: ``odc_trainer(DPOTrainer)`` or TRL's own."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    vocab = SIZES[args.size]["vocab_size"]
    per_step = args.per_device_batch * args.accumulation * world
    pairs = build_pairs(
        per_step * args.steps,
        vocab,
        (args.min_prompt, args.max_prompt),
        (args.min_completion, args.max_completion),
        seed=args.seed,
    )
    dataset = datasets.Dataset.from_list(pairs)
    max_positions = args.max_prompt + args.max_completion + 1
    model = build_model(args.size, max_positions, args.attn)
    ref_model, peft_config = None, None
    config = {
        "output_dir": tempfile.mkdtemp(prefix="odc-trl-dpo-out-"),
        "max_steps": args.steps,
        "per_device_train_batch_size": args.per_device_batch,
        "gradient_accumulation_steps": args.accumulation,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": not cuda,
        "bf16": cuda,
        "fsdp": True,
        "fsdp_config": {"version": 2},
        "seed": args.seed,
        "train_sampling_strategy": "sequential",  # both modes see the same pairs per step
        "loss_type": args.loss_type.split(","),
        "beta": args.beta,
        "max_length": None,
        **(
            {"pad_to_multiple_of": args.trl_pad_to_multiple_of}
            if args.trl_pad_to_multiple_of is not None
            else {}
        ),
    }
    if args.ref == "precompute":
        # TRL writes the reference log-probs next to the dataset's cache files on rank 0 and
        # every rank reads them: the dataset must be on disk. Under FSDP TRL would load the
        # reference from the model's name, which a model built from a config has not: pass
        # a copy of the initial model.
        path = os.path.join(shared_tempdir(rank), "pairs")
        if rank == 0:
            dataset.save_to_disk(path)
        dist.barrier()
        dataset = datasets.load_from_disk(path)
        config["precompute_ref_log_probs"] = True
        ref_model = copy.deepcopy(model)
    elif args.ref == "peft":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        )
    else:
        ref_model = copy.deepcopy(model)
    cls, extra = DPOTrainer, {}
    if odc:
        cls = odc_trainer(DPOTrainer)
        extra["odc"] = ODCConfig(
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )
    return cls(
        model=model,
        ref_model=ref_model,
        args=DPOConfig(**config),
        train_dataset=dataset,
        processing_class=build_tokenizer(vocab),
        peft_config=peft_config,
        **extra,
    )


def train(args, odc: bool) -> dict:
    """Trains on this rank (the process group is initialized); returns the per-step log and
    what describes the run."""
    from transformers import PrinterCallback, TrainerCallback

    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = build_trainer(args, odc, rank, world)
    tokens = pair_tokens(trainer.train_dataset)
    per_step = args.per_device_batch * args.accumulation * world
    log, clock = [], [None]
    probe = step_probe.StepProbe(args.profile_steps, trace_dir=args.profile_trace)
    batches, peak_since = step_probe.BatchProbe(trainer.model), step_probe.PeakSince()

    class Report(TrainerCallback):
        def on_train_begin(self, _args, state, control, **kwargs):
            peak_since.start()  # both variants: the model sharded, before the first step

        def on_step_begin(self, _args, state, control, **kwargs):
            if clock[0] is None:
                clock[0] = time.perf_counter()

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs is None or "loss" not in logs:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            step = state.global_step
            entry = {
                "step": step,
                "seconds": now - clock[0],
                "pairs": per_step,
                "tokens": sum(tokens[(step - 1) * per_step : step * per_step]),
                **{k: v for k, v in logs.items() if isinstance(v, (int, float))},
            }
            if odc:
                record = trainer.odc_steps[-1]
                entry.update(
                    {
                        k: record[k]
                        for k in (
                            "microbatches",
                            "cap",
                            "padded_per_rank",
                            "plain_padded_per_rank",
                            "bytes_per_token",
                            "odc_extra_bytes",
                            "plain_tokens",
                            "padded_tokens",
                            "slope_bytes_per_token",
                            "margin_bytes",
                            "points",
                        )
                        if k in record
                    }
                )
            probe.step(host=trainer.odc_steps[-1].get("host_seconds") if odc else None)
            batches.step()
            clock[0] = time.perf_counter()  # a profiled step's summary is not the next step's
            log.append(entry)
            if rank == 0:
                counts = f"microbatches per rank {entry['microbatches']}  " if odc else ""
                print(
                    f"step {step:3d}  {counts}loss {entry['loss']:.4f}  margin "
                    f"{entry['rewards/margins']:+.4f}  accuracy "
                    f"{entry['rewards/accuracies']:.2f}  {entry['seconds']:.2f} s",
                    flush=True,
                )

    trainer.add_callback(Report())
    trainer.remove_callback(PrinterCallback)  # Report prints the step's line instead
    trainer.train()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    # On CPU ranks accelerate turns FSDP into DDP for plain TRL (ODC shards the model itself).
    wrapping = (
        "FSDP2 + ODC"
        if odc
        else "FSDP2"
        if trainer.is_fsdp_enabled
        else f"{trainer.accelerator.distributed_type} (accelerate dropped FSDP)"
    )
    meta = {
        "mode": "odc" if odc else "plain",
        "wrapping": wrapping,
        "size": args.size,
        "ref": args.ref,
        "loss_type": args.loss_type,
        "world": world,
        "device": device,
        "torch": torch.__version__,
        "pairs_per_step": per_step,
        "args": vars(args),
        "peak_memory_gib": peak_memory_gib(trainer),
        "peak_since_train_begin_gib": peak_since.gather_gib(trainer),
        "attention": step_probe.attention_record(trainer.model),
        # What reached the trainer: its arguments and collator as trained, ODC's multiple.
        "config": {
            "odc": odc,
            "pad_to_multiple_of": trainer.args.pad_to_multiple_of,
            "collator": type(trainer.data_collator).__name__,
            "collator_pad_to_multiple_of": getattr(
                trainer.data_collator, "pad_to_multiple_of", None
            ),
            **(
                {
                    "odc_pad_to_multiple_of": getattr(trainer, "_odc_multiple", None),
                    "max_tokens_per_microbatch": args.max_tokens_per_microbatch or "derived",
                }
                if odc
                else {}
            ),
        },
    }
    for entry, probed, seen in zip(log, probe.gather_max(), batches.gather()):
        entry.update(probed, batches=seen)
    return {"meta": meta, "steps": log}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--ref", choices=["precompute", "peft", "model"], default="precompute")
    ap.add_argument(
        "--loss-type",
        default="sigmoid",
        help="DPOConfig.loss_type, comma-separated for a combination",
    )
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps")
    ap.add_argument(
        "--per-device-batch",
        type=int,
        default=4,
        help="per_device_train_batch_size: a step holds this x accumulation x world pairs",
    )
    ap.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-completion", type=int, default=8)
    ap.add_argument("--max-completion", type=int, default=512)
    ap.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=None,
        help="LB-Mini's cap on a microbatch's pair tokens (a longer pair runs alone); "
        "default: derived from TRL's own microbatches (no more memory)",
    )
    ap.add_argument(
        "--pad-to-multiple-of",
        type=int,
        default=None,
        help="ODCConfig.pad_to_multiple_of (default None: 64 on GPUs; 1: off)",
    )
    ap.add_argument(
        "--trl-pad-to-multiple-of",
        type=int,
        default=None,
        help="DPOConfig.pad_to_multiple_of, the trainer's own (default: TRL's, none off Neuron)",
    )
    ap.add_argument("--attn", default="sdpa", help="the model's attn_implementation")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-odc",
        action="store_true",
        help="plain TRL: DPOTrainer with accelerate's FSDP2 on an NCCL (GPU) or Gloo "
        "(CPU: accelerate then uses DDP) process group",
    )
    ap.add_argument("--out", default=None, help="directory for the JSON log and the PNG")
    step_probe.add_arguments(ap)
    return ap


def init_process_group(odc: bool) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    # Before the training arguments: accelerate keeps a process group that exists.
    dist.init_process_group("odc" if odc else ("nccl" if cuda else "gloo"))


def plot(log: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = log["steps"]
    meta = log["meta"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [e["step"] for e in steps]
    axes[0].plot(x, [e["loss"] for e in steps], marker="o")
    axes[0].set_ylabel("DPO loss")
    axes[1].plot(x, [e["rewards/margins"] for e in steps], marker="o", label="margin")
    axes[1].plot(x, [e["rewards/accuracies"] for e in steps], marker="s", label="accuracy")
    axes[1].legend()
    for ax in axes:
        ax.set_xlabel("optimizer step")
    fig.suptitle(
        f"DPO {meta['size']} ({meta['loss_type']}, ref {meta['ref']}), "
        f"{meta['world']} ranks on {meta['device']}, {meta['mode']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parser().parse_args()
    odc = not args.no_odc
    init_process_group(odc)
    # Pairs longer than the cap run alone in a microbatch: expected here, not worth a warning.
    warnings.filterwarnings("ignore", category=balance.OversizedSequenceWarning)
    log = train(args, odc)
    if dist.get_rank() == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "trl_dpo_log.json"), "w") as f:
            json.dump(log, f, indent=1)
        plot(log, os.path.join(args.out, "trl_dpo.png"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
