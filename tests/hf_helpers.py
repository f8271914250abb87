"""Shared by the Hugging Face / TRL integration tests: the offline environment, a rank's
launcher environment, and a model's parameters gathered whole."""

from __future__ import annotations

import contextlib
import os

import torch

OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# A one-process reference on a machine with several GPUs sees one: the Trainer wraps a model in
# nn.DataParallel when one process sees several (and TRL's trainers refuse that).
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}


@contextlib.contextmanager
def environ(env: dict | None):
    """`env` in this process's environment, inherited by the ranks it spawns (set before they
    start, so before anything in them initializes CUDA), then restored."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def set_rank_env(rank: int, world: int, port: int, env: dict | None = None) -> None:
    """What torchrun would set for this rank (accelerate reads it), plus ``env`` (default
    OFFLINE)."""
    os.environ.update(
        OFFLINE if env is None else env,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def full_params(model) -> dict:
    """Every parameter, unsharded, on CPU (a copy). FSDP2 shards dim 0 in rank order, so the
    full tensor is the concatenation of the ranks' local shards; they travel as CPU objects
    (Gloo), also when the ranks share one GPU (NCCL refuses that). A DDP model is unwrapped."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model = getattr(model, "module", model)
    local = {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }
    sharded = {n for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if not sharded:
        return local
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, {n: local[n] for n in sharded})
    return {n: torch.cat([s[n] for s in shards]) if n in sharded else t for n, t in local.items()}


def progressions(seed: str, count: int, vocab: int) -> list[list[int]]:
    """``count`` token sequences of lengths 5..30: arithmetic progressions (learnable) over
    ids 2..vocab-1, drawn from ``random.Random(seed)``."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n, start, step = rng.randint(5, 30), rng.randrange(2, vocab), rng.randrange(1, 5)
        out.append([2 + (start + step * k) % (vocab - 2) for k in range(n)])
    return out


def fixed_or_lb_mini(fixed_plans: dict, lengths, world: int, step: int, cap: int = 40):
    """A test planner: the step's plan from ``fixed_plans`` where given, else LB-Mini's."""
    if step in fixed_plans:
        return fixed_plans[step]
    from torch_odc import balance

    return balance.plan(lengths, world, cap, mode="mini").microbatches


def assert_params_match(
    want: dict, out: dict, initial: dict, rank: int, atol: float, trainable=None
) -> None:
    """Every parameter of `out` within `atol` of the reference's (`want`); those outside
    `trainable` (when given) not moved from `initial`; and training moved the parameters by
    far more than `atol` (else the comparison would be weak)."""
    moved = 0.0
    for name, ref in want["params"].items():
        got = out["params"][name]
        torch.testing.assert_close(
            got, ref, rtol=0, atol=atol, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
        )
        if trainable is None or name in trainable:
            moved = max(moved, (ref - initial[name].detach()).abs().max().item())
        else:
            assert torch.equal(got, initial[name]), f"rank {rank}: frozen {name} moved"
    assert moved > 100 * atol, "training barely moved the parameters: the check is weak"
