"""verl 0.9.1's PPO actor update on the "odc" engine strategy (torch_odc.integrations.verl),
next to verl's own FSDP2 engine on the same rollout batches.

    # in verl's environment (.ci/bootstrap test builds .venv/verl-<torch line>):
    PYTHONPATH=. .venv/verl-2.11/bin/python -m torch.distributed.run --nproc-per-node 2 \
        docs/examples/verl_ppo.py
    ... docs/examples/verl_ppo.py --strategy odc --balance mini      # LB-Mini across ranks
    ... docs/examples/verl_ppo.py --size medium --steps 8 --out results   # GPUs: one per rank

Each step is what verl's PPO trainer does with one rollout batch: its driver balances the batch
over the data-parallel ranks with equal sequence counts (``get_seqlen_balanced_partitions(...,
equal_size=True)``, as ``RayPPOTrainer._balance_batch``), and every rank runs
``TrainingWorker.train_mini_batch`` on its share with verl's ``ppo_loss`` (one mini-batch: one
optimizer step). The model is a Qwen2 built from a config (random weights), the rollouts are
token sequences with long-tailed response lengths, old log-probs and advantages are random:
nothing is downloaded. ``--strategy both`` (the default) runs verl's "fsdp2" engine and then the
"odc" engine from the same initial weights on the same batches, prints each step's time, each
rank's microbatch count and the logged loss and grad norm, and at the end the largest
parameter difference between the two (fp32: ~1e-7; bf16 mixed precision: rounding).

What changes for ODC in a verl configuration: ``actor.strategy=odc`` and the module imported in
the workers (``model.external_lib=torch_odc.integrations.verl``); here ``strategy="odc"`` in the
engine config. On CPU ranks verl needs a platform (``VERL_PLATFORM=cpu``, set here without
GPUs) and eager or sdpa attention (its default is flash-attention 2; sdpa here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

if not torch.cuda.is_available():  # before verl picks its platform
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")
os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")

import _step_probe as step_probe
import torch.distributed as dist

import torch_odc
import torch_odc.integrations.verl  # noqa: F401  (registers the "odc" engines)

SIZES = {  # Qwen2Config arguments
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
    # 1.1e9 parameters (the Llama-1B shape of benchmarks/bench_e2e.py as a Qwen2).
    "1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 19,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", choices=["both", "odc", "fsdp2"], default="both")
    p.add_argument(
        "--balance",
        choices=["local", "mini"],
        default="local",
        help="odc_balance of the odc engine",
    )
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the mean time")
    p.add_argument("--batch", type=int, default=16, help="rollouts per step, all ranks")
    p.add_argument("--prompt", type=int, default=16, help="longest prompt")
    p.add_argument("--response", type=int, default=96, help="longest response")
    p.add_argument("--max-tokens", type=int, default=128, help="max_token_len_per_gpu")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default=None,
        help="parameters in the forward (default: bf16 on GPUs, fp32 on CPU)",
    )
    p.add_argument(
        "--remove-padding",
        action="store_true",
        help="verl's use_remove_padding: each microbatch's rows packed into one with "
        "position_ids (under sdpa transformers masks each packed row to itself)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="directory for the JSON log")
    step_probe.add_arguments(p)
    p.add_argument(
        "--profile-device-only",
        action="store_true",
        help="profile kernels and copies only (a step of many host ops otherwise "
        "takes minutes to summarize)",
    )
    return p.parse_args()


def build_model(args, path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **SIZES[args.size],
        max_position_embeddings=args.prompt + args.response,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


def response_lengths(args, step: int) -> list[int]:
    """Long-tailed: most responses short, a few near the cap (log-normal)."""
    g = torch.Generator().manual_seed(1000 + step)
    raw = torch.exp(torch.randn(args.batch, generator=g) * 1.0) * args.response / 8
    return [int(min(args.response, max(2, x))) for x in raw.tolist()]


def rollout_batch(args, step: int):
    """One rollout batch as verl's trainer holds it before the update, in verl's no-padding
    layout (verl's own left_right_2_no_padding)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    vocab = SIZES[args.size]["vocab_size"]
    g = torch.Generator().manual_seed(step)
    responses = response_lengths(args, step)
    n, p_max, r_max = len(responses), args.prompt, args.response
    prompts = torch.zeros(n, p_max, dtype=torch.long)
    response_ids = torch.zeros(n, r_max, dtype=torch.long)
    attention = torch.zeros(n, p_max + r_max, dtype=torch.long)
    for i, r in enumerate(responses):
        p = int(torch.randint(2, p_max + 1, (1,), generator=g))
        prompts[i, p_max - p :] = torch.randint(3, vocab, (p,), generator=g)
        response_ids[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        attention[i, p_max - p : p_max + r] = 1
    base = -torch.log(torch.tensor(float(vocab)))
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": response_ids,
            "input_ids": torch.cat([prompts, response_ids], dim=1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": attention[:, p_max:].clone(),
            "old_log_probs": base + 0.1 * torch.randn(n, r_max, generator=g),
            "advantages": torch.randn(n, r_max, generator=g),
        },
        batch_size=[n],
    )
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0)
    return td, attention.sum(-1)


def dispatch(td, seqlens, world: int, rank: int):
    """verl's driver: equal-count balanced partitions (RayPPOTrainer._balance_batch), then an
    equal chunk per data-parallel rank."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    parts = get_seqlen_balanced_partitions(
        calculate_workload(seqlens).tolist(), world, equal_size=True
    )
    return tu.index_select_tensor_dict(td, sorted(parts[rank]))


def make_worker(args, strategy: str, path: str):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker

    from torch_odc.integrations.verl import ODCEngineConfig

    dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
    engine = {
        "strategy": strategy,
        "model_dtype": "fp32",
        "use_torch_compile": False,
        "mixed_precision": {"param_dtype": dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": args.max_tokens,
        "infer_max_token_len_per_gpu": args.max_tokens,
    }
    engine = (
        ODCEngineConfig(**engine, odc_balance=args.balance)
        if strategy == "odc"
        else FSDPEngineConfig(**engine)
    )
    config = TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(
            path=path,
            load_tokenizer=False,
            use_remove_padding=args.remove_padding,
            override_config={"attn_implementation": "sdpa"},
        ),
        engine_config=engine,
        optimizer_config=FSDPOptimizerConfig(
            lr=args.lr, weight_decay=0.0, clip_grad=1.0, total_training_steps=args.steps
        ),
        checkpoint_config=CheckpointConfig(),
    )
    torch.manual_seed(1)
    worker = TrainingWorker(config)
    worker.reset()
    return worker


def actor_loss():
    from functools import partial

    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig
    from verl.workers.utils.losses import ppo_loss

    config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        use_dynamic_bsz=True,
        fsdp_config=FSDPEngineConfig(strategy="fsdp2"),
    )
    return partial(ppo_loss, config)


def local_count(data) -> int:
    """The microbatches this rank's rows need (verl's own packing, no collective)."""
    from verl.workers.engine.utils import prepare_micro_batches

    return len(prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=False)[0])


def run(args, strategy: str, path: str, rank: int, world: int) -> dict:
    from verl.utils import tensordict_utils as tu

    worker = make_worker(args, strategy, path)
    worker.set_loss_fn(actor_loss())
    steps = []
    probe = step_probe.StepProbe(
        args.profile_steps, device_only=args.profile_device_only, trace_dir=args.profile_trace
    )
    for step in range(args.steps):
        td, seqlens = rollout_batch(args, step)
        data = dispatch(td, seqlens, world, rank)
        tu.assign_non_tensor(data, max_token_len_per_gpu=args.max_tokens)
        counts = [None] * world
        dist.all_gather_object(counts, local_count(data))
        dispatched = [None] * world  # each rank's tokens as verl's driver hands them out
        dist.all_gather_object(dispatched, int(sum(engine_row_lengths(data))))
        tu.assign_non_tensor(
            data,
            global_batch_size=len(td),
            mini_batch_size=len(td),
            epochs=1,
            seed=0,
            dataloader_kwargs={"shuffle": False},
        )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        out = worker.train_mini_batch(data)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        probe.step()
        metrics = tu.get(out, "metrics")
        odc = getattr(worker.engine, "odc_steps", [])
        ran, worked = [None] * world, [None] * world
        dist.all_gather_object(ran, odc[-1]["microbatches"] if odc else max(counts))
        dist.all_gather_object(worked, odc[-1]["tokens"] if odc else dispatched[rank])
        steps.append(
            {
                "step": step,
                "seconds": seconds,
                "needed": counts,
                "ran": ran,
                "microbatches": ran,
                "sequences": len(td),
                "tokens": int(seqlens.sum()),
                # each rank's tokens as it ran them and as verl's driver dispatched
                # them (the planner's bound: the slowest rank's, summed over steps)
                "padded_per_rank": worked,
                "plain_padded_per_rank": dispatched,
                # rows that changed rank, and LB-Mini's seconds (plan and exchange)
                "moved": odc[-1]["moved"] if odc else 0,
                "balance_seconds": odc[-1]["balance_seconds"] if odc else 0.0,
                "loss": float(metrics["loss"][0]),
                "grad_norm": float(metrics["grad_norm"][0]),
                "pg_loss": float(metrics["actor/pg_loss"][0]),
            }
        )
        if rank == 0:
            s = steps[-1]
            print(
                f"[{strategy:5}] step {step}: {seconds:7.3f} s  microbatches per rank "
                f"{s['ran']} (needed {s['needed']})  loss {s['loss']:+.6f}  "
                f"grad_norm {s['grad_norm']:.6f}",
                flush=True,
            )
    for s, probed in zip(steps, probe.gather_max()):
        s.update(probed)
    from torch.distributed.tensor import DTensor

    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
        for n, p in worker.engine.module.named_parameters()
    }
    handle = getattr(worker.engine, "odc_handle", None)
    peak = None
    if torch.cuda.is_available():
        # torch's allocator peak plus what ODC holds beside it (its shard cache, accumulators
        # and control words), which max_memory_allocated does not count.
        held = sum(handle.stats().get("memory", {}).values()) if handle is not None else 0
        peak = (torch.cuda.max_memory_allocated() + held) / 2**30
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if handle is not None:
        handle.detach()
    return {
        "steps": steps,
        "params": params,
        "peak_memory_gib": peaks,
        # what reached verl's engine (its model config's use_remove_padding, as it trained)
        "use_remove_padding": bool(worker.engine.use_remove_padding),
    }


def engine_row_lengths(data) -> list[int]:
    """Tokens of each row of a rank's share (the attention span verl packs by)."""
    input_ids = data["input_ids"]
    if input_ids.is_nested:
        return input_ids.offsets().diff().tolist()
    return data["attention_mask"].sum(dim=1).tolist()


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("verl", "torch", "transformers", "tensordict"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    args = parse()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        # (ranks sharing a GPU: LOCAL_RANK modulo the GPUs)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        # What verl's workers initialize; with ODC_CUDA_COLLECTIVES=gloo (ranks sharing a GPU,
        # which NCCL refuses, for profiling ODC's path on one GPU) CUDA tensors go through Gloo.
        cuda = "gloo" if os.environ.get("ODC_CUDA_COLLECTIVES") == "gloo" else "nccl"
        dist.init_process_group(f"cpu:gloo,cuda:{cuda}")
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo")
    # The model's files (hundreds of MB) go beside the run, not into --out (results only): one
    # folder per torchrun (its rendezvous port), removed at the end.
    path = os.path.join(
        tempfile.gettempdir(),
        f"verl_ppo_model_{args.size}_{os.environ.get('MASTER_PORT', os.getppid())}",
    )
    if rank == 0:
        build_model(args, path)
    dist.barrier()
    strategies = ["fsdp2", "odc"] if args.strategy == "both" else [args.strategy]
    results = {}
    for s in strategies:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        results[s] = run(args, s, path, rank, world)
    if rank == 0:
        summary = {}
        for s, r in results.items():
            timed = [x["seconds"] for x in r["steps"][args.warmup :]] or [float("nan")]
            summary[s] = sum(timed) / len(timed)
            print(
                f"{s}: {summary[s]:.3f} s per update step (mean of {len(timed)}), "
                f"microbatches per rank and step {[x['ran'] for x in r['steps']]}"
            )
        if len(results) == 2:
            diff = max(
                (results["odc"]["params"][n] - results["fsdp2"]["params"][n]).abs().max().item()
                for n in results["odc"]["params"]
            )
            print(f"largest parameter difference odc vs fsdp2 after {args.steps} steps: {diff:.3g}")
            summary["max_param_diff"] = diff
        if args.out and len(results) == 1:  # one strategy: the log benchmarks/bench_trl.py reads
            ((strategy, r),) = results.items()
            meta = {
                "strategy": strategy,
                "balance": args.balance,
                "world": world,
                "size": args.size,
                "args": vars(args),
                "peak_memory_gib": r["peak_memory_gib"],
                "use_remove_padding": r["use_remove_padding"],
                "versions": versions(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            }
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "verl_ppo_log.json"), "w") as f:
                json.dump({"meta": meta, "steps": r["steps"]}, f, indent=1)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"verl_ppo_{args.size}.json"), "w") as f:
                json.dump(
                    {
                        "args": vars(args),
                        "world": world,
                        "summary": summary,
                        "steps": {s: r["steps"] for s, r in results.items()},
                        "device": torch.cuda.get_device_name()
                        if torch.cuda.is_available()
                        else "cpu",
                        "torch": torch.__version__,
                    },
                    f,
                    indent=1,
                )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
