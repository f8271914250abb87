"""LoRA SFT of a Hugging Face causal LM on the "odc" backend: FSDP2 per decoder layer plus the
root, LB-Mini microbatch plans on variable-length sequences, bf16 mixed precision on GPUs.

    torchrun --nproc-per-node 2 docs/examples/hf_lora_sft.py                  # CPU or GPUs
    torchrun --nproc-per-node 2 docs/examples/hf_lora_sft.py --size medium --minibatches 8
    torchrun --nproc-per-node 2 docs/examples/hf_lora_sft.py --no-attach      # FSDP2 collectives

The model is a ``LlamaForCausalLM`` built from a config (random initialization, nothing
downloaded) with ``peft`` LoRA adapters on the attention projections; the data are token
sequences of random lengths (arithmetic progressions, so the loss can go down). Each minibatch is
the same list of sequences on every rank (drawn from a shared seed), so
``torch_odc.balance.plan_for_rank`` gives every rank its microbatches and the global token count
without communication. Ranks run different numbers of microbatches (zero included) and meet once
per minibatch in ``torch_odc.minibatch_barrier()``.

Needs ``transformers`` and ``peft`` (versions tested: see docs/integrations/trl.md). GPUs: one per
rank, or ranks sharing one GPU (CUDA IPC works between processes on the same device). Without
GPUs every rank runs on CPU (fp32) over shared memory.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_odc
from torch_odc import balance

# Model sizes (LlamaConfig arguments). "tiny" is what the CPU test trains.
SIZES = {
    "tiny": {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    },
    "small": {
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
    "medium": {
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
    },
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
IGNORE = -100


def build_model(size: str = "tiny", lora: bool = True, seed: int = 0, lora_rank: int = 8):
    """The same randomly initialized model on every rank (and in a reference process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SIZES[size], attn_implementation="sdpa"))
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora_rank,
            lora_alpha=2 * lora_rank,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, config)
        # peft initializes lora_B to zeros, so the first step would only move B. Give B small
        # random values so that every adapter weight trains from the start (a test sees more).
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
    return model


def decoder_layers(model):
    """The model's decoder layers, through the peft wrapper when there is one."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model.layers


def shard(model, mesh, bf16: bool):
    """fully_shard each decoder layer, then the root (FSDP2's usual wrapping)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if bf16:  # bf16 compute and all-gathers, fp32 gradient reduction
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def minibatch(index: int, count: int, vocab: int, min_len: int, max_len: int, seed: int = 0):
    """The minibatch's sequences (1-D token tensors), identical on every rank: arithmetic
    progressions modulo the vocabulary with a random start and step, so that the next token is
    learnable from the two before it and the loss goes down."""
    rng = random.Random(f"hf_lora_sft:{seed}:{index}")
    seqs = []
    for _ in range(count):
        n, start, step = rng.randint(min_len, max_len), rng.randrange(vocab), rng.randrange(1, 8)
        seqs.append((start + step * torch.arange(n)) % vocab)
    return seqs


def collate(seqs, device):
    """Right-padded inputs, attention mask and next-token labels (pads ignored)."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = s
        mask[row, : len(s)] = 1
        labels[row, : len(s) - 1] = s[1:]
    return ids.to(device), mask.to(device), labels.to(device)


def summed_token_loss(model, seqs, device):
    """Cross entropy summed over every predicted token of the sequences."""
    ids, mask, labels = collate(seqs, device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def full_params(model) -> dict:
    """Every parameter, unsharded, in fp32 on CPU (a collective over the shard group)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().float().cpu().clone()
    return out


def train(
    rank: int,
    world: int,
    *,
    size: str = "tiny",
    lora: bool = True,
    minibatches: int = 4,
    sequences: int = 8,
    min_len: int = 8,
    max_len: int = 48,
    max_tokens_per_microbatch: int = 96,
    plans=None,
    attach: bool = True,
    device: str | None = None,
    bf16: bool | None = None,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    seed: int = 0,
    return_params: bool = False,
    log=None,
) -> dict:
    """Trains on this rank; call it on every rank of an initialized process group.

    ``plans[mb][r]`` (optional) is rank r's list of microbatches in minibatch mb, each a list of
    indices into the minibatch's sequences; by default LB-Mini plans them (``mode="micro"``,
    equal counts per rank, with ``attach=False``: FSDP2's collectives need equal counts).
    Returns the global mean loss per minibatch, this rank's microbatch counts and, with
    ``return_params``, every parameter unsharded.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = (
        torch.device(device, torch.cuda.current_device())
        if device == "cuda"
        else (torch.device("cpu"))
    )
    bf16 = (device == "cuda") if bf16 is None else bf16
    model = build_model(size, lora, seed).to(dev)
    model = shard(model, init_device_mesh(device, (world,)), bf16)
    handle = torch_odc.attach(model) if attach else None

    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = (
        torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
        if optimizer == "adamw"
        else torch.optim.SGD(trainable, lr=lr, momentum=0.9)
    )
    vocab = SIZES[size]["vocab_size"]
    losses, counts = [], []
    for mb in range(minibatches):
        seqs = minibatch(mb, sequences, vocab, min_len, max_len, seed)
        lengths = [len(s) for s in seqs]
        loss_tokens = [n - 1 for n in lengths]  # every token but the first is predicted
        if plans is None:
            share = balance.plan_for_rank(
                lengths,
                world,
                rank,
                max_tokens_per_microbatch,
                mode="mini" if attach else "micro",
                loss_tokens=loss_tokens,
            )
            mine, num_tokens = share.microbatches, share.num_tokens
            scale = share.loss_scale()  # FSDP2 averages over ranks: world / num_tokens
        else:
            mine, num_tokens = plans[mb][rank], sum(loss_tokens)
            scale = world / num_tokens
        total = torch.zeros((), device=dev)
        for micro in mine:
            if not micro:
                raise ValueError(f"rank {rank}: an empty microbatch in minibatch {mb}")
            loss = summed_token_loss(model, [seqs[i] for i in micro], dev) * scale
            loss.backward()
            total += loss.detach()
        if attach:
            torch_odc.minibatch_barrier()  # .grad is reduced over all ranks from here on
        opt.step()
        opt.zero_grad()
        # Metrics: one collective per minibatch, after the barrier. A CPU tensor goes to Gloo,
        # which also works for ranks that share one GPU (NCCL refuses that).
        total = torch.tensor([total.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world)
        counts.append(len(mine))
        if log is not None:
            log(f"minibatch {mb}: loss {losses[-1]:.4f}, microbatches on this rank {len(mine)}")
    result = {"losses": losses, "counts": counts}
    if return_params:
        result["params"] = full_params(model)
        result["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    if handle is not None:
        result["stats"] = handle.stats()
        handle.detach()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=16, help="sequences per minibatch, all ranks")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=120)
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-lora", action="store_true", help="train every weight instead")
    ap.add_argument("--no-attach", action="store_true", help="plain FSDP2 collectives")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend="odc")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        out = train(
            rank,
            world,
            size=args.size,
            lora=not args.no_lora,
            minibatches=args.minibatches,
            sequences=args.sequences,
            min_len=args.min_len,
            max_len=args.max_len,
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            attach=not args.no_attach,
            lr=args.lr,
            log=(lambda s: print(f"[rank {rank}] {s}", flush=True)),
        )
        if rank == 0:
            print(f"losses: {[round(x, 4) for x in out['losses']]}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
