"""python -m torch_odc.demo: FSDP2 over the "odc" backend on variable-length sequences.

Spawns its own local ranks (every GPU when there are at least two, else 4 CPU ranks), trains a
small decoder-only transformer with per-layer ``fully_shard`` plus root on synthetic sequences of
varying length, and prints the loss and wall time of each minibatch.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    """A small GPT-style decoder: embeddings, pre-norm blocks, tied-free LM head."""

    def __init__(self, vocab: int = 512, dim: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def shard_model(model: nn.Module, mesh, **fsdp_kwargs) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    return fully_shard(model, mesh=mesh, **fsdp_kwargs)


def sequence_lengths(minibatch: int, rank: int, count: int, lo: int, hi: int, seed: int = 0):
    """Seeded long-tailed sequence lengths in [lo, hi] for one rank's microbatches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + minibatch * 1009 + rank)
    mu = math.log(lo * 2)
    raw = torch.empty(count).log_normal_(mu, 0.8, generator=gen)
    return [int(x) for x in raw.clamp(lo, hi).tolist()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(rank: int, args, port: int, results) -> None:
    import torch_odc  # noqa: F401  (registers "odc")
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, args.world_size, rank == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh(device.type, (args.world_size,))
        model = TinyDecoder(args.vocab, args.dim, args.layers, args.heads, args.max_len).to(device)
        model = shard_model(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for mb in range(args.minibatches):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            lengths = sequence_lengths(mb, rank, args.microbatches, args.min_len, args.max_len)
            tokens_total, loss_sum = 0, 0.0
            gen = torch.Generator().manual_seed(mb * 7919 + rank)
            for length in lengths:
                seq = torch.randint(0, args.vocab, (1, length + 1), generator=gen).to(device)
                logits = model(seq[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten(), reduction="sum")
                (loss / (args.microbatches * args.max_len)).backward()
                loss_sum += loss.item()
                tokens_total += length
            opt.step()
            opt.zero_grad()
            stats = torch.tensor([loss_sum, float(tokens_total)], device=device)
            dist.all_reduce(stats)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if rank == 0:
                results.put((mb, stats[0].item() / stats[1].item(), int(stats[1].item()), elapsed))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus >= 2 else "cpu")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to spawn (default: every GPU, or 4 on CPU)")
    parser.add_argument("--backend", default="odc")
    parser.add_argument("--minibatches", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4, help="sequences per rank each minibatch")
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = gpus if args.device == "cuda" else 4

    print(f"torch-odc demo: FSDP2 over '{args.backend}', {args.world_size} {args.device} ranks, "
          f"{args.microbatches} variable-length sequences per rank per minibatch "
          f"(torch {torch.__version__})", flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_train, args=(args, _free_port(), results), nprocs=args.world_size,
                       start_method="spawn", join=True)
    rows = sorted(results.get() for _ in range(args.minibatches))
    print(f"{'minibatch':>9} {'loss/token':>11} {'tokens':>8} {'time (s)':>9}")
    for mb, loss, tokens, elapsed in rows:
        print(f"{mb:>9} {loss:>11.4f} {tokens:>8} {elapsed:>9.3f}")


if __name__ == "__main__":
    main()
