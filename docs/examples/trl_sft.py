"""SFT with TRL's SFTTrainer (or the plain transformers Trainer) on the "odc" backend, through
torch_odc.integrations.hf: ranks run different numbers of microbatches per optimizer step.

    torchrun --nproc-per-node 2 docs/examples/trl_sft.py                    # CPU or GPUs
    torchrun --nproc-per-node 2 docs/examples/trl_sft.py --size medium --steps 20
    torchrun --nproc-per-node 2 docs/examples/trl_sft.py --trainer hf --lora

The model is a LlamaForCausalLM built from a config (random initialization), the tokenizer a
word-level one built in memory, the data token sequences of long-tailed random lengths
(arithmetic progressions, so the loss goes down): nothing is downloaded. Every step prints, on
rank 0, each rank's microbatch count and the step's loss and grad norm; ``--out DIR`` writes
the per-step log as JSON and the loss curve as a PNG.

What ODC adds to an SFTTrainer script is the process group and three lines:

    dist.init_process_group("odc")
    trainer = odc_trainer(SFTTrainer)(..., odc=ODCConfig(max_tokens_per_microbatch=...))
    # and fsdp=True, fsdp_config={"version": 2} in SFTConfig

GPUs: one per rank (NCCL serves the trainer's own collectives: grad norm, loss logging), or
two ranks sharing one GPU with ``ODC_CUDA_COLLECTIVES=gloo`` (NCCL refuses two ranks on one
device; Gloo then carries those few CUDA collectives through host memory).
"""

from __future__ import annotations

import argparse
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


def build_model(size: str, lora: bool, max_len: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **SIZES[size],
        max_position_embeddings=max(max_len, 64),
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=16,
                lora_alpha=32,
                lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                task_type="CAUSAL_LM",
            ),
        )
    return model


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, "t0")),
        pad_token="t0",
        eos_token="t1",
        bos_token="t1",
    )


def build_data(count: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    """Log-uniform lengths (many short, a few long: the shape of SFT and RL data), the same on
    every rank. Sequences are arithmetic progressions modulo the vocabulary."""
    rng = random.Random(f"trl_sft:{seed}")
    data = []
    for _ in range(count):
        n = min(max_len, int(min_len * (max_len / min_len) ** rng.random()))
        start, step = rng.randrange(2, vocab), rng.randrange(1, 9)
        data.append({"input_ids": [2 + (start + step * k) % (vocab - 2) for k in range(n)]})
    return data


def collate(features):
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trainer", choices=["sft", "hf"], default="sft")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps")
    ap.add_argument(
        "--per-device-batch",
        type=int,
        default=4,
        help="per_device_train_batch_size: a step holds this x accumulation x world sequences",
    )
    ap.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=None,
        help="a longer sequence gets a microbatch of its own; default: derived from "
        "the trainer's own microbatches (no more memory)",
    )
    ap.add_argument(
        "--no-odc",
        action="store_true",
        help="the unmodified trainer: accelerate's FSDP2 on an NCCL (GPU) or Gloo "
        "(CPU: accelerate then uses DDP) process group",
    )
    ap.add_argument(
        "--pad-to-multiple-of",
        type=int,
        default=None,
        help="ODCConfig.pad_to_multiple_of (default None: 64 on GPUs unless "
        "padding-free; 1: no extra padding)",
    )
    ap.add_argument(
        "--trl-pad-to-multiple-of",
        type=int,
        default=None,
        help="SFTConfig.pad_to_multiple_of, the trainer's own (default: TRL's, none off Neuron)",
    )
    ap.add_argument(
        "--padding-free",
        action="store_true",
        help="SFTConfig.padding_free=True: a microbatch's rows concatenated into one "
        "with position_ids (ODC plans it so too)",
    )
    ap.add_argument(
        "--attn",
        default="sdpa",
        help="the model's attn_implementation (sdpa, eager, flex_attention, ...)",
    )
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=None, help="directory for the JSON log and the loss PNG")
    step_probe.add_arguments(ap)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    use_odc = not args.no_odc
    # Before the training arguments: accelerate keeps the group.
    dist.init_process_group("odc" if use_odc else "nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from transformers import Trainer, TrainerCallback, TrainingArguments

    vocab = SIZES[args.size]["vocab_size"]
    per_step = args.per_device_batch * args.accumulation * world
    data = build_data(per_step * args.steps, vocab, args.min_len, args.max_len)
    model = build_model(args.size, args.lora, args.max_len, args.attn)
    common = {
        "output_dir": tempfile.mkdtemp(prefix="odc-trl-sft-"),
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
        "seed": 0,
        "train_sampling_strategy": "sequential",  # both modes see the same sequences per step
    }
    odc = (
        {
            "odc": ODCConfig(
                max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                pad_to_multiple_of=args.pad_to_multiple_of,
            )
        }
        if use_odc
        else {}
    )
    wrap = odc_trainer if use_odc else (lambda cls: cls)
    # Sequences longer than the cap run alone in a microbatch: expected here, not worth a warning.
    warnings.filterwarnings("ignore", category=balance.OversizedSequenceWarning)
    if args.trainer == "sft":
        import datasets
        from trl import SFTConfig, SFTTrainer

        trainer = wrap(SFTTrainer)(
            model=model,
            processing_class=build_tokenizer(vocab),
            train_dataset=datasets.Dataset.from_list(data),
            args=SFTConfig(
                **common,
                max_length=None,
                padding_free=args.padding_free,
                **(
                    {"pad_to_multiple_of": args.trl_pad_to_multiple_of}
                    if args.trl_pad_to_multiple_of is not None
                    else {}
                ),
                dataset_kwargs={"skip_prepare_dataset": True},
            ),
            **odc,
        )
    else:
        if args.padding_free or args.trl_pad_to_multiple_of is not None:
            raise SystemExit("--padding-free and --trl-pad-to-multiple-of are SFTTrainer's")
        trainer = wrap(Trainer)(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            data_collator=collate,
            **odc,
        )

    log, clock = [], [None]
    probe = step_probe.StepProbe(args.profile_steps, trace_dir=args.profile_trace)
    batches, peak_since = step_probe.BatchProbe(model), step_probe.PeakSince()

    class Report(TrainerCallback):
        def on_train_begin(self, _args, state, control, **kwargs):
            peak_since.start()  # both variants: the model sharded, before the first step

        def on_step_begin(self, _args, state, control, **kwargs):
            if clock[0] is None:
                clock[0] = time.perf_counter()

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs is None or "loss" not in logs:
                return
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            step = state.global_step
            entry = {
                "step": step,
                "seconds": now - clock[0],
                "sequences": per_step,
                "tokens": sum(
                    len(d["input_ids"]) for d in data[(step - 1) * per_step : step * per_step]
                ),
                **{k: v for k, v in logs.items() if isinstance(v, (int, float))},
            }
            if use_odc:
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
            probe.step(host=trainer.odc_steps[-1].get("host_seconds") if use_odc else None)
            batches.step()
            clock[0] = time.perf_counter()  # a profiled step's summary is not the next step's
            log.append(entry)
            if rank == 0:
                counts = (
                    f"microbatches per rank {entry['microbatches']}  "
                    if "microbatches" in entry
                    else ""
                )
                print(
                    f"step {entry['step']:3d}  {counts}loss {entry['loss']:.4f}  grad_norm "
                    f"{entry['grad_norm']:.3f}  {entry['seconds']:.2f} s",
                    flush=True,
                )

    trainer.add_callback(Report())
    trainer.train()
    peaks = peak_memory_gib(trainer)
    peaks_since = peak_since.gather_gib(trainer)
    for entry, probed, seen in zip(log, probe.gather_max(), batches.gather()):
        entry.update(probed, batches=seen)
    collator = trainer.data_collator
    # What reached the trainer: its arguments and collator as trained, ODC's multiple.
    config = {
        "odc": use_odc,
        "trainer": args.trainer,
        "pad_to_multiple_of": getattr(trainer.args, "pad_to_multiple_of", None),
        "padding_free": bool(getattr(trainer.args, "padding_free", False)),
        "collator": type(collator).__name__,
        "collator_pad_to_multiple_of": getattr(collator, "pad_to_multiple_of", None),
        "collator_padding_free": getattr(collator, "padding_free", None),
        **(
            {
                "odc_pad_to_multiple_of": getattr(trainer, "_odc_multiple", None),
                "max_tokens_per_microbatch": args.max_tokens_per_microbatch or "derived",
            }
            if use_odc
            else {}
        ),
    }
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        device = torch.cuda.get_device_name() if cuda else "cpu"
        meta = {
            "trainer": args.trainer,
            "size": args.size,
            "lora": args.lora,
            "world": world,
            "device": device,
            "torch": torch.__version__,
            "args": vars(args),
            "variant": "odc" if use_odc else "plain",
            "peak_memory_gib": peaks,
            "peak_since_train_begin_gib": peaks_since,
            "config": config,
            "attention": step_probe.attention_record(model),
        }
        with open(os.path.join(args.out, "trl_sft_log.json"), "w") as f:
            json.dump({"meta": meta, "steps": log}, f, indent=1)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot([e["step"] for e in log], [e["loss"] for e in log], marker="o")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("training loss (token mean)")
            ax.set_title(
                f"{args.trainer} {args.size}{' LoRA' if args.lora else ''}, "
                f"{world} ranks on {device}, "
                f"{'ODC + LB-Mini' if use_odc else 'plain'}",
                fontsize=9,
            )
            fig.tight_layout()
            fig.savefig(os.path.join(args.out, "trl_sft_loss.png"), dpi=120)
        except ImportError:
            pass
    # The trainer (and accelerate's DDP wrapper on CPU ranks) goes before its process group.
    trainer = None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
