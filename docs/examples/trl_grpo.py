"""GRPO with TRL's GRPOTrainer on the "odc" backend, through torch_odc.integrations.hf: TRL
generates (transformers' generate, no vLLM), scores and buffers the rollouts as usual; per
optimizer step the rollouts are moved between ranks so that every rank's update costs the same
(LB-Mini) and packed into microbatches of at most --max-tokens-per-microbatch tokens, so ranks
run different numbers of microbatches.

    torchrun --nproc-per-node 2 docs/examples/trl_grpo.py                  # CPU or GPUs
    torchrun --nproc-per-node 2 docs/examples/trl_grpo.py --size small --steps 20
    torchrun --nproc-per-node 2 docs/examples/trl_grpo.py --plain          # unmodified TRL

The model is a LlamaForCausalLM built from a config (random initialization), the tokenizer a
word-level one built in memory: nothing is downloaded. Prompts are arithmetic progressions of
long-tailed random lengths ("t5 t8 t11 ..."); the reward is the fraction of completion tokens
that continue the progression. A bias on the EOS logit (--mean-completion) makes completion
lengths vary (geometric) from the first step, as a trained model's do. Every step prints, on
rank 0, each rank's microbatch and rollout count, the rollouts moved between ranks, the step's
loss, reward and time; ``--out DIR`` writes the per-step log as JSON (what
benchmarks/bench_trl.py reads) and the reward curve as a PNG.

What ODC adds to a GRPOTrainer script is the process group and three lines:

    dist.init_process_group("odc")
    trainer = odc_trainer(GRPOTrainer)(..., odc=ODCGRPOConfig(max_tokens_per_microbatch=...))
    # and fsdp=True, fsdp_config={"version": 2} in GRPOConfig

``--plain`` runs the unmodified GRPOTrainer on an ordinary group (NCCL on GPUs: FSDP2 as
accelerate sets it up; Gloo on CPU, where accelerate uses DDP). Under plain FSDP2 every decoding
step all-gathers the parameters, a collective: ranks whose completions end first must keep
stepping until every rank is done, so the script turns on transformers' synchronized decoding
(``synced_gpus``) for it. Under ODC the gathers are one-sided reads and each rank stops when its
own completions end.

GPUs: one per rank, or two ranks sharing one GPU with ``ODC_CUDA_COLLECTIVES=gloo`` (NCCL
refuses two ranks on one device; Gloo then carries the trainer's few CUDA collectives).
"""

from __future__ import annotations

import argparse
import json
import math
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
from torch_odc.integrations.hf import ODCGRPOConfig, odc_trainer, peak_memory_gib

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
    # Llama-3.2-3B's layers with this vocabulary: 3.0e9 parameters. At 1B a GRPO microbatch of
    # a few thousand tokens is host-bound (docs/benchmarks.md); here its device time is ~2.7x.
    "3b": {
        "vocab_size": 32000,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
    },
}
EOS = 1


def build_model(size: str, max_len: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            **SIZES[size],
            max_position_embeddings=max(max_len, 64),
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=EOS,
            eos_token_id=EOS,
            attn_implementation=attn,
        )
    )


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="t0",
        eos_token=f"t{EOS}",
        bos_token=f"t{EOS}",
        padding_side="left",
    )


def build_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    """Arithmetic progressions modulo the vocabulary, of log-uniform lengths (many short, a few
    long), the same on every rank."""
    rng = random.Random(f"trl_grpo:{seed}")
    prompts = []
    for _ in range(count):
        n = min(max_len, int(min_len * (max_len / min_len) ** rng.random()))
        start, step = rng.randrange(2, vocab), rng.randrange(1, 9)
        prompts.append(" ".join(f"t{2 + (start + step * k) % (vocab - 2)}" for k in range(n)))
    return prompts


def make_reward(vocab: int):
    def progression(prompts, completion_ids, **kwargs):
        """The fraction of completion tokens that continue the prompt's progression."""
        out = []
        for prompt, ids in zip(prompts, completion_ids, strict=True):
            p = [int(t[1:]) - 2 for t in prompt.split()]
            step = (p[1] - p[0]) % (vocab - 2) if len(p) > 1 else 1
            want = [2 + (p[-1] + step * (k + 1)) % (vocab - 2) for k in range(len(ids))]
            out.append(sum(a == b for a, b in zip(ids, want)) / max(len(ids), 1))
        return out

    return progression


def eos_bias(vocab: int, mean_completion: float) -> float:
    """The EOS logit bias that ends a completion after ~mean_completion tokens when the other
    logits are about equal (a randomly initialized model): P(EOS) = 1 / mean."""
    p = 1.0 / max(mean_completion, 1.0)
    return math.log(p * (vocab - 1) / (1.0 - p))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps")
    ap.add_argument(
        "--per-device-batch",
        type=int,
        default=4,
        help="per_device_train_batch_size (rollouts per TRL microbatch and rank)",
    )
    ap.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-completion", type=int, default=128)
    ap.add_argument(
        "--mean-completion",
        type=float,
        default=32.0,
        help="EOS bias: completions end after about this many tokens",
    )
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--beta", type=float, default=0.0, help="KL coefficient (reference model)")
    ap.add_argument(
        "--max-tokens-per-microbatch",
        type=int,
        default=None,
        help="default: derived from TRL's own microbatches (no more memory)",
    )
    ap.add_argument(
        "--pad-to-multiple-of",
        type=int,
        default=None,
        help="ODCConfig.pad_to_multiple_of (default: 128 on GPUs; 1: no extra padding)",
    )
    ap.add_argument(
        "--trl-pad-to-multiple-of",
        type=int,
        default=None,
        help="GRPOConfig.pad_to_multiple_of, the trainer's own: prompt and completion "
        "widths each rounded up to it (default: TRL's, none off Neuron)",
    )
    ap.add_argument("--attn", default="sdpa", help="the model's attn_implementation")
    ap.add_argument(
        "--no-rebalance",
        action="store_true",
        help="each rank packs its own rollouts (no LB-Mini across ranks)",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="unmodified GRPOTrainer on an ordinary process group (the baseline)",
    )
    ap.add_argument(
        "--cudnn-sdpa",
        action="store_true",
        help="keep PyTorch's cuDNN attention on (off by default here: see below)",
    )
    ap.add_argument("--cpu", action="store_true", help="run on CPU even where GPUs exist")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out", default=None, help="directory for the JSON log and the reward PNG")
    step_probe.add_arguments(ap)
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
        if not args.cudnn_sdpa:
            # GRPO left-pads prompts, so some query rows see only padding. On H200 (torch
            # 2.11) cuDNN's attention backward gave NaN gradients for some such layouts, in
            # unmodified TRL too (benchmarks/probes/sdpa_left_pad.py); memory-efficient attention
            # takes the same masks without it. Both variants run with it off.
            torch.backends.cuda.enable_cudnn_sdp(False)
    # Before the training arguments: accelerate keeps the group.
    dist.init_process_group("odc" if not args.plain else "nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    import datasets
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    vocab = SIZES[args.size]["vocab_size"]
    per_step = args.per_device_batch * args.accumulation * world  # rollouts per step
    prompts = build_prompts(
        per_step // args.num_generations * args.steps, vocab, args.min_prompt, args.max_prompt
    )
    model = build_model(args.size, args.max_prompt + args.max_completion, args.attn)
    if args.plain and world > 1:
        # transformers' marker of a model it sharded itself: generate() then decodes with
        # synced_gpus (finished ranks keep running forwards until every rank is done).
        model._is_fsdp_managed_module = True
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="odc-trl-grpo-"),
        max_steps=args.steps,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.accumulation,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion,
        loss_type=args.loss_type,
        beta=args.beta,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not cuda,
        bf16=cuda,
        seed=0,
        disable_dropout=True,
        shuffle_dataset=False,
        generation_kwargs={"sequence_bias": {(EOS,): eos_bias(vocab, args.mean_completion)}},
        **(
            {"pad_to_multiple_of": args.trl_pad_to_multiple_of}
            if args.trl_pad_to_multiple_of is not None
            else {}
        ),
        # FSDP2 (with ODC, or plain on GPUs; plain on CPU ranks accelerate would use DDP).
        **({"fsdp": True, "fsdp_config": {"version": 2}} if cuda or not args.plain else {}),
    )
    phases = {"rollout": 0.0, "rollout_jit": 0.0, "rollout_peak": None}
    probe = step_probe.StepProbe(args.profile_steps, trace_dir=args.profile_trace)

    class Timed(GRPOTrainer):
        """Times TRL's rollout phase (generation, rewards, old and reference log-probs)."""

        def _generate_and_score_completions(self, inputs):
            if cuda:
                torch.cuda.synchronize()
            start, compiled = time.perf_counter(), probe.total
            with torch.profiler.record_function("trl::generate_and_score"):
                out = super()._generate_and_score_completions(inputs)
            if cuda:
                torch.cuda.synchronize()
            phases["rollout"] += time.perf_counter() - start
            phases["rollout_jit"] += probe.total - compiled
            if cuda:  # the allocator's running peak once the rollout phase is done (GiB)
                phases["rollout_peak"] = torch.cuda.max_memory_allocated() / 2**30
            return out

    common = {
        "model": model,
        "reward_funcs": make_reward(vocab),
        "args": config,
        "train_dataset": datasets.Dataset.from_dict({"prompt": prompts}),
        "processing_class": build_tokenizer(vocab),
    }
    warnings.filterwarnings("ignore", category=balance.OversizedSequenceWarning)
    if args.plain:
        trainer = Timed(**common)
    else:
        trainer = odc_trainer(Timed)(
            **common,
            odc=ODCGRPOConfig(
                max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                rebalance=not args.no_rebalance,
                pad_to_multiple_of=args.pad_to_multiple_of,
            ),
        )

    log, clock = [], [time.perf_counter(), 0]
    batches, peak_since = step_probe.BatchProbe(model), step_probe.PeakSince()

    class Report(TrainerCallback):
        def on_train_begin(self, _args, state, control, **kwargs):
            peak_since.start()  # both variants: the model sharded, before the first step

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs is None or "loss" not in logs:
                return
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            tokens = int(state.num_input_tokens_seen)
            entry = {
                "step": state.global_step,
                "seconds": now - clock[0],
                "rollout_seconds": phases["rollout"],
                "rollouts": per_step,
                "tokens": tokens - clock[1],
                # The allocator's running peak after this step's rollout phase and after
                # its update: which phase raised it. ODC's region is apart; the adapter
                # restarts the peak statistics where what it holds changes (at each
                # step's start and before its update), so under ODC each is that phase's.
                "rollout_allocator_peak_gib": phases["rollout_peak"],
                "allocator_peak_gib": (torch.cuda.max_memory_allocated() / 2**30 if cuda else None),
                **{k: v for k, v in logs.items() if isinstance(v, (int, float))},
            }
            if not args.plain and trainer.odc_steps:
                step = trainer.odc_steps[-1]
                entry.update(
                    microbatches=step["microbatches"],
                    rollouts_per_rank=step["rollouts"],
                    moved=step["moved"],
                    **{
                        k: step[k]
                        for k in (
                            "cap",
                            "padded_per_rank",
                            "microbatch_padded_per_rank",
                            "plain_padded_per_rank",
                            "bytes_per_token",
                            "odc_extra_bytes",
                            "plain_tokens",
                            "padded_tokens",
                            "slope_bytes_per_token",
                            "margin_bytes",
                            "points",
                            "gradient_memory_freed",
                            "gradient_memory_s",
                            "gradient_memory_parts",
                        )
                        if k in step
                    },
                )
            probe.step(
                rollout=phases["rollout_jit"],
                host=trainer.odc_steps[-1].get("host_seconds")
                if not args.plain and trainer.odc_steps
                else None,
            )
            batches.step()
            # From here: a profiled step's summary is not the next step's time.
            clock[0], clock[1] = time.perf_counter(), tokens
            phases["rollout"], phases["rollout_jit"] = 0.0, 0.0
            log.append(entry)
            if rank == 0:
                odc = (
                    f"microbatches {entry['microbatches']}  rollouts "
                    f"{entry['rollouts_per_rank']}  moved {entry['moved']}  "
                    if "microbatches" in entry
                    else ""
                )
                print(
                    f"step {entry['step']:3d}  {odc}loss {entry['loss']:+.4f}  grad norm "
                    f"{entry.get('grad_norm', float('nan')):.3g}  reward "
                    f"{entry.get('reward', float('nan')):.3f}  completion "
                    f"{entry.get('completions/mean_length', float('nan')):.0f}  "
                    f"{entry['seconds']:.2f} s (rollout {entry['rollout_seconds']:.2f} s)",
                    flush=True,
                )

    trainer.add_callback(Report())
    trainer.remove_callback(PrinterCallback)  # the Report line instead of the raw log dict
    trainer.train()
    peaks = peak_memory_gib(trainer)
    peaks_since = peak_since.gather_gib(trainer)
    for entry, probed, seen in zip(log, probe.gather_max(), batches.gather()):
        entry.update(probed, batches=seen)
    # What reached the trainer: TRL's multiple as trained, ODC's length multiple.
    odc_multiple = None
    if not args.plain:
        odc_multiple = args.pad_to_multiple_of or (trainer.AUTO_MULTIPLE if cuda else 1)
    config = {
        "odc": not args.plain,
        "pad_to_multiple_of": trainer.pad_to_multiple_of,
        **(
            {
                "odc_pad_to_multiple_of": odc_multiple,
                "rebalance": not args.no_rebalance,
                "max_tokens_per_microbatch": args.max_tokens_per_microbatch or "derived",
            }
            if not args.plain
            else {}
        ),
    }
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        device = torch.cuda.get_device_name() if cuda else "cpu"
        import transformers
        import trl

        meta = {
            "variant": "plain" if args.plain else "odc",
            "size": args.size,
            "world": world,
            "device": device,
            "torch": torch.__version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "args": vars(args),
            "peak_memory_gib": peaks,
            "peak_since_train_begin_gib": peaks_since,
            "config": config,
            "attention": step_probe.attention_record(model),
        }
        with open(os.path.join(args.out, "trl_grpo_log.json"), "w") as f:
            json.dump({"meta": meta, "steps": log}, f, indent=1)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot([e["step"] for e in log], [e.get("reward", math.nan) for e in log], marker="o")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("mean reward")
            ax.set_title(
                f"GRPO {args.size}, {world} ranks on {device}, "
                f"{'plain TRL' if args.plain else 'ODC + LB-Mini'}",
                fontsize=9,
            )
            fig.tight_layout()
            fig.savefig(os.path.join(args.out, "trl_grpo_reward.png"), dpi=120)
        except ImportError:
            pass
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
