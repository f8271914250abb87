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
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    """A small GPT-style decoder: embeddings, pre-norm blocks, LM head.

    ``forward(tokens, doc_lens)`` runs packed documents: attention is causal within each
    document and positions restart at every document, so a packed microbatch computes exactly
    what its documents would compute one by one.
    """

    def __init__(
        self, vocab: int = 512, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 1024
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, doc_lens=None):
        mask = None
        if doc_lens is None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
        else:
            pos = torch.cat([torch.arange(n, device=tokens.device) for n in doc_lens])
            doc = torch.repeat_interleave(
                torch.arange(len(doc_lens), device=tokens.device),
                torch.tensor(doc_lens, device=tokens.device),
            )
            idx = torch.arange(tokens.shape[1], device=tokens.device)
            mask = (doc[:, None] == doc[None, :]) & (idx[None, :] <= idx[:, None])
        x = self.tok(tokens) + self.pos(pos)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.norm(x))


def shard_model(model: nn.Module, mesh, **fsdp_kwargs) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    return fully_shard(model, mesh=mesh, **fsdp_kwargs)


def sequence_lengths(minibatch: int, rank: int, count: int, lo: int, hi: int, seed: int = 0):
    """Seeded long-tailed sequence lengths in [lo, hi] (one rank's, or a minibatch's: rank=-1)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + minibatch * 1009 + rank)
    mu = math.log(lo * 2)
    raw = torch.empty(count).log_normal_(mu, 0.8, generator=gen)
    return [int(x) for x in raw.clamp(lo, hi).tolist()]


def sequence_tokens(minibatch: int, index: int, length: int, vocab: int) -> torch.Tensor:
    """The tokens of sequence `index` of a minibatch: the same whichever rank runs it."""
    gen = torch.Generator().manual_seed(minibatch * 100_003 + index)
    return torch.randint(0, vocab, (length + 1,), generator=gen)


def _train(rank: int, args, store_path: str, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import torch_odc
    from torch_odc import balance

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # ranks share the host's cores: one intra-op thread each, no oversubscription
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    store = dist.FileStore(store_path, args.world_size)
    dist.init_process_group(
        "odc",
        store=store,
        rank=rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=300),
    )
    world = args.world_size
    odc = args.mode == "odc"
    # A sequence over the cap gets a microbatch of its own: expected here, not worth a warning.
    warnings.simplefilter("ignore", balance.OversizedSequenceWarning)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh(device.type, (world,))
        model = TinyDecoder(args.vocab, args.dim, args.layers, args.heads, args.max_len).to(device)
        model = shard_model(model, mesh)
        handle = torch_odc.attach(model) if odc else None
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        for mb in range(args.minibatches):
            lengths = sequence_lengths(
                mb, -1, world * args.sequences_per_rank, args.min_len, args.max_len - 1
            )
            # LB-Mini when ranks synchronize once per minibatch, LB-Micro for collectives.
            p = balance.plan(
                lengths,
                world,
                args.max_tokens,
                mode="mini" if odc else "micro",
                cost="flops",
                num_params=1e6,
                num_layers=args.layers,
                hidden_size=args.dim,
            )
            total_tokens = sum(lengths)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in p.microbatches[rank]:
                if not micro:  # LB-Micro pads with empty microbatches: still one forward
                    micro_lens, inputs, targets = [1], torch.zeros(1, dtype=torch.long), None
                else:
                    seqs = [sequence_tokens(mb, i, lengths[i], args.vocab) for i in micro]
                    micro_lens = [lengths[i] for i in micro]
                    inputs = torch.cat([s[:-1] for s in seqs])
                    targets = torch.cat([s[1:] for s in seqs]).to(device)
                logits = model(inputs.to(device)[None], micro_lens)
                if targets is None:
                    loss = logits.sum() * 0.0
                else:
                    loss = F.cross_entropy(logits[0].float(), targets, reduction="sum")
                # FSDP2 averages gradients over ranks: scale by world for the mean token loss.
                (loss * world / total_tokens).backward()
                loss_sum += loss.detach()
            if device.type == "cuda":
                torch.cuda.synchronize()
            busy = time.perf_counter() - start
            if odc:
                torch_odc.minibatch_barrier()
            else:
                dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wait = time.perf_counter() - start - busy
            opt.step()
            opt.zero_grad()
            dist.all_reduce(loss_sum)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, (len(p.microbatches[rank]), busy, wait))
            if rank == 0:
                results.put(
                    (
                        mb,
                        loss_sum.item() / total_tokens,
                        total_tokens,
                        busy + wait,
                        per_rank,
                        p.makespan / p.lower_bound,
                    )
                )
        if handle is not None:
            handle.detach()
    finally:
        dist.destroy_process_group()


def run(args) -> list[tuple]:
    """Trains in a fresh group of spawned ranks; returns rank 0's rows, one per minibatch."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    # Rendezvous in a fresh file (no port to pick: demos running side by side cannot collide).
    with tempfile.TemporaryDirectory(prefix="odc-demo-") as tmp:
        mp.start_processes(
            _train,
            args=(args, os.path.join(tmp, "store"), results),
            nprocs=args.world_size,
            start_method="spawn",
            join=True,
        )
    return sorted((results.get() for _ in range(args.minibatches)), key=lambda r: r[0])


def _print_table(mode: str, rows) -> None:
    print(
        f"\n{mode}: FSDP2 over 'odc' "
        + (
            "with torch_odc.attach (LB-Mini plans)"
            if mode == "odc"
            else "with collective semantics (LB-Micro plans)"
        )
    )
    print(
        f"{'minibatch':>9} {'loss/token':>11} {'tokens':>7} {'time (s)':>9} {'plan/LB':>8}  "
        "per rank: microbatches busy/wait (s)"
    )
    for mb, loss, tokens, elapsed, per_rank, ratio in rows:
        ranks = "  ".join(f"r{r}:{n} {b:.2f}/{w:.2f}" for r, (n, b, w) in enumerate(per_rank))
        print(f"{mb:>9} {loss:>11.5f} {tokens:>7} {elapsed:>9.3f} {ratio:>8.3f}  {ranks}")


def main(argv=None) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode",
        choices=["odc", "collective", "both"],
        default="both",
        help="odc: attach + one barrier per minibatch; collective: plain FSDP2",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if gpus >= 2 else "cpu")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks to spawn (default: every GPU, or 4 on CPU)",
    )
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--sequences-per-rank", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128, help="token cap per microbatch")
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = gpus if args.device == "cuda" else 4
    if args.device == "cuda" and args.mode != "collective":
        import torch_odc

        if not torch_odc._C._has_cuda_transport():
            print(
                "note: this build has no CUDA transport; on GPUs attach() keeps collective "
                "semantics"
            )

    print(
        f"torch-odc demo: {args.world_size} {args.device} ranks, "
        f"{args.sequences_per_rank} variable-length sequences per rank per minibatch, "
        f"microbatch cap {args.max_tokens} tokens (torch {torch.__version__})",
        flush=True,
    )
    modes = ["collective", "odc"] if args.mode == "both" else [args.mode]
    losses = {}
    for mode in modes:
        rows = run(argparse.Namespace(**{**vars(args), "mode": mode}))
        _print_table(mode, rows)
        losses[mode] = [r[1] for r in rows]
    if len(losses) == 2:
        diff = max(abs(a - b) for a, b in zip(losses["odc"], losses["collective"]))
        print(f"\nlosses per minibatch, odc vs collective: max difference {diff:.2e}")


if __name__ == "__main__":
    main()
