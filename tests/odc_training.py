"""Shared by the on-demand tests: a model, its samples, FSDP2 training with ODC, and the
single-process reference trained on the union of every rank's samples."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from torch_odc.demo import TinyDecoder

VOCAB, DIM, LAYERS, HEADS, MAXLEN = 97, 30, 2, 3, 40  # dims not divisible by 4 ranks


class Wrapper(nn.Module):
    """A root that owns no parameters of its own."""

    def __init__(self):
        super().__init__()
        self.inner = TinyDecoder(VOCAB, DIM, LAYERS, HEADS, MAXLEN)

    def forward(self, tokens):
        return self.inner(tokens)


def make_model(root_without_params: bool) -> nn.Module:
    torch.manual_seed(1234)
    return Wrapper() if root_without_params else TinyDecoder(VOCAB, DIM, LAYERS, HEADS, MAXLEN)


def samples(minibatch: int, count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + minibatch)
    lengths = torch.randint(5, MAXLEN - 1, (count,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (1, n + 1), generator=gen) for n in lengths]


def split(counts: list[int], seqs: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out, start = [], 0
    for c in counts:
        out.append(seqs[start : start + c])
        start += c
    return out


def loss_of(model, seq):
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten(), reduction="sum")


def reference(plan: list[list[int]], root_without_params: bool, lr: float) -> dict:
    """One process, fp32: the gradient of the mean token loss over all ranks' samples."""
    model = make_model(root_without_params)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for mb, counts in enumerate(plan):
        seqs = samples(mb, sum(counts))
        tokens = sum(s.shape[1] - 1 for s in seqs)
        for seq in seqs:
            (loss_of(model, seq) / tokens).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded_model(world, device="cpu", root_without_params=False, **fsdp_kwargs):
    """The test model on `device`, each decoder layer and the root under fully_shard over a 1-D
    mesh of `world` ranks (the inner decoder too when the root owns no parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else (torch.device("cpu"))
    )
    model = make_model(root_without_params).to(dev)
    kwargs = {"mesh": init_device_mesh(device, (world,)), **fsdp_kwargs}
    decoder = model.inner if root_without_params else model
    for layer in decoder.layers:
        fully_shard(layer, **kwargs)
    if root_without_params:
        fully_shard(decoder, **kwargs)
    return fully_shard(model, **kwargs)


def train_odc(
    rank,
    world,
    plan,
    root_without_params,
    mp,
    reshard_after_forward,
    lr,
    sleep_in=None,
    device="cpu",
    attach=True,
    local_shards=False,
    reassign_after=None,
    free_memory=False,
):
    """FSDP2 + torch_odc.attach; rank r runs plan[mb][r] microbatches in minibatch mb.

    With attach=False this is plain FSDP2 over the group's backend (every rank must then run
    the same number of microbatches). Returns the full parameters (an all-gather), or with
    local_shards=True this rank's dim-0 shards, no collective (join them with `join_shards`).
    reassign_after=mb: after minibatch mb's step, ``load_state_dict(assign=True)`` replaces every
    parameter object (FSDP2 resets its sharded parameters) and a new optimizer takes the old
    one's state; the stats then also say which keys push through the C++ fast path.
    free_memory=True: after each step, torch_odc.free_gradient_memory() and a forward without
    gradients (a rollout: keyed gathers while the accumulators are out), then restore_gradient_
    memory() after even minibatches, the engine's own restore at the first push or the barrier
    after odd ones; the stats then say, per minibatch, whether the accumulators were returned
    (none reported, none of this rank's accumulator segments mapped any more)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import torch_odc

    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp[0], reduce_dtype=mp[1])
    model = sharded_model(world, device, root_without_params, **kwargs)
    dev = next(model.parameters()).device
    handle = torch_odc.attach(model) if attach else None
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    timeline, freed = [], []
    for mb, counts in enumerate(plan):
        seqs = split(counts, samples(mb, sum(counts)))
        tokens = sum(s.shape[1] - 1 for part in seqs for s in part)
        for i, seq in enumerate(seqs[rank]):
            if sleep_in is not None and sleep_in == (mb, rank, i):
                time.sleep(3.0)
            # FSDP2 averages over ranks (ReduceOp.AVG): scale by world to get the plain mean.
            (loss_of(model, seq.to(dev)) * world / tokens).backward()
        timeline.append(("barrier_enter", mb, time.time()))
        if attach:
            torch_odc.minibatch_barrier()
        timeline.append(("barrier_exit", mb, time.time()))
        opt.step()
        opt.zero_grad()
        if free_memory:
            torch_odc.free_gradient_memory()
            freed.append(
                torch_odc.stats()[0]["memory"]["accumulator_bytes"] == 0
                and not accumulator_segments_mapped()
            )
            with torch.no_grad():
                model(samples(mb, 1)[0][:, :-1].to(dev))
            if mb % 2 == 0:
                torch_odc.restore_gradient_memory()
        if mb == reassign_after:
            model.load_state_dict(model.state_dict(), assign=True)
            state = opt.state_dict()
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
            opt.load_state_dict(state)
    if local_shards:
        full = {k: v.to_local().detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        full = {k: v.full_tensor().detach().float().cpu() for k, v in model.state_dict().items()}
    stats = handle.stats() if attach else None
    if attach and reassign_after is not None:
        stats["fast_push"] = [k.fast_push for k in handle._keys if any(k.grad_numels)]
        stats["fast_params_current"] = all(
            p is fp.sharded_param
            for k in handle._keys
            if k.fast_push
            for p, fp in zip(k._fast_params, k._all_fps, strict=True)
        )
    if free_memory:
        stats["freed"] = freed
    if attach:
        handle.detach()
    dist.barrier()
    return full, stats, timeline


def accumulator_segments_mapped() -> list[str]:
    """The shared-memory accumulator segments (``/odc-...-a<generation>``) this process maps."""
    import re

    with open("/proc/self/maps") as f:
        return [
            line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
            for line in f
            if re.search(r"/odc-[0-9]+-[0-9]+-r[0-9]+-a[0-9]+", line)
        ]


def slow_peer_first_microbatch(rank, world, eager, device="cpu"):
    """Two minibatches of one microbatch per rank; in the second, rank 1 sleeps 2 s before its
    last layer's forward (a long first microbatch). Returns this rank's seconds for its second
    microbatch (device work included), its publish wait there and the full parameters."""
    import torch.distributed as dist

    import torch_odc

    cuda = device == "cuda"
    model = sharded_model(world, device)
    dev = next(model.parameters()).device
    handle = torch_odc.attach(model, eager_publish=eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # as `reference`
    elapsed = 0.0
    for mb in range(2):
        hook = None
        if rank == 1 and mb == 1:  # before FSDP2's own pre-forward, which all-gathers the layer
            hook = model.layers[-1].register_forward_pre_hook(
                lambda *_: time.sleep(2.0), prepend=True
            )
        seqs = samples(mb, world)
        tokens = sum(s.shape[1] - 1 for s in seqs)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        (loss_of(model, seqs[rank].to(dev)) * world / tokens).backward()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if hook is not None:
            hook.remove()
        torch_odc.minibatch_barrier()
        opt.step()
        opt.zero_grad()
    wait = handle.stats()["last"]["publish_wait_s"]
    full = {k: v.full_tensor().detach().float().cpu() for k, v in model.state_dict().items()}
    handle.detach()
    dist.barrier()
    return elapsed, wait, full


def join_shards(per_rank):
    """The full parameters from every rank's `train_odc(..., local_shards=True)` result."""
    return {k: torch.cat([r[0][k] for r in per_rank]) for k in per_rank[0][0]}


def profiled_minibatch(rank, world, counts):
    """One ODC minibatch under the PyTorch profiler (CPU activities); returns the names of the
    ``odc::`` ranges it recorded."""
    import torch.distributed as dist

    import torch_odc

    model = sharded_model(world)
    handle = torch_odc.attach(model)
    seqs = split(counts, samples(0, sum(counts)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for seq in seqs[rank]:
            loss_of(model, seq).backward()
        torch_odc.minibatch_barrier()
    handle.detach()
    dist.barrier()
    return sorted({e.name for e in prof.events() if e.name.startswith("odc::")})
