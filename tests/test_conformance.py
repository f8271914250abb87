"""Conformance: FSDP2 + torch_odc.attach gives exactly FSDP2's training in every configuration
post-training uses, or refuses at attach with a clear error.

Every case trains a small model over several minibatches with per-rank microbatch counts that
differ (zero included) and compares the final parameters with a single process trained in
float64 on the union of all ranks' samples, with the gradient FSDP2 would compute (its divide
factor included). The configurations: reduce dtype fp32 / bf16 / fp16, custom divide factors and
force-sum, frozen (LoRA-style) and conditionally used parameters, no-sync microbatches, gradient
clipping, tied weights, a DCP checkpoint mid-training with re-attach. 16-bit accumulation over
many microbatches is compared with FSDP2's own error. Options that on-demand mode cannot serve
are refused at attach; misuse raises before anything changes.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiproc import run_ranks
from torch import nn

VOCAB, DIM, LAYERS, MAXLEN, RANK = 37, 12, 2, 14, 3
LR = 0.2
REL16 = 0.03
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PLANS = {
    2: [[2, 1], [0, 3], [1, 2], [3, 0]],
    4: [[1, 2, 0, 3], [3, 0, 1, 1], [0, 0, 2, 1]],
}


class Block(nn.Module):
    def __init__(self, lora: bool, branch: bool, dim: int = DIM):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.lora_a = self.lora_b = None
        if lora:  # frozen base weights and trainable adapters under one fully_shard
            for p in (*self.lin1.parameters(), *self.lin2.parameters()):
                p.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(RANK, dim) * 0.3)
            self.lora_b = nn.Parameter(torch.randn(dim, RANK) * 0.3)
        # Used only for some samples: gets no gradient in some microbatches and on some ranks.
        self.branch = nn.Linear(dim, dim) if branch else None

    def forward(self, x, use_branch: bool):
        h = self.lin1(x)
        if self.lora_a is not None:
            h = h + (x @ self.lora_a.t()) @ self.lora_b.t()
        h = torch.tanh(h)
        if self.branch is not None and use_branch:
            h = h + torch.tanh(self.branch(h))
        return x + self.lin2(h)


class Net(nn.Module):
    def __init__(self, lora=False, branch=False, tied=False, norm=None, dim=DIM):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(lora, branch, dim) for _ in range(LAYERS))
        # A final norm as in Llama-style models ("affine": weight and bias; "plain": none).
        self.norm = nn.LayerNorm(dim, elementwise_affine=norm == "affine") if norm else None
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        if lora:
            self.emb.weight.requires_grad_(False)
            self.head.weight.requires_grad_(False)

    def forward(self, tokens):
        use_branch = tokens.shape[1] % 3 == 0
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, use_branch)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x)


def make_model(cfg) -> Net:
    torch.manual_seed(4321)
    model = Net(
        cfg.get("lora", False),
        cfg.get("branch", False),
        cfg.get("tied", False),
        cfg.get("norm"),
        cfg.get("dim", DIM),
    )
    for name in cfg.get("freeze", ()):  # whole modules frozen (requires_grad=False)
        model.get_submodule(name).requires_grad_(False)
    return model


def samples(minibatch: int, count: int, seed: int = 11) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000 * minibatch)
    lengths = torch.randint(3, MAXLEN, (count,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (1, n + 1), generator=gen) for n in lengths]


def loss_of(model, seq):
    logits = model(seq[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), seq[:, 1:].flatten(), reduction="sum")


def divide_factor(cfg, world) -> float:
    return cfg.get("divide_factor") or float(world)


def reference(cfg, plan, world, norms: list | None = None) -> dict:
    """One process in float64: each minibatch's gradient is FSDP2's (the per-rank losses below
    summed over ranks, divided by the divide factor). Appends each minibatch's gradient norm to
    `norms` if given."""
    model = make_model(cfg).double()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    scale = world / divide_factor(cfg, world)
    for mb, counts in enumerate(plan):
        seqs = samples(mb, sum(counts))
        tokens = sum(s.shape[1] - 1 for s in seqs)
        for seq in seqs:
            (loss_of(model, seq) * scale / tokens).backward()
        if cfg.get("rs_unused"):  # FSDP2 then reduce-scatters zeros for unused parameters
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        if norms is not None:
            norms.append(
                torch.nn.utils.get_total_norm(
                    [p.grad for p in model.parameters() if p.grad is not None]
                ).item()
            )
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        zero_grad(opt, cfg)
        if cfg.get("eval_forward"):  # an evaluation between minibatches: forward, no backward
            with torch.no_grad():
                model.eval()
                loss_of(model, samples(100 + mb, 1)[0].to(next(model.parameters()).device))
                model.train()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def zero_grad(opt, cfg) -> None:
    """As the case's training loop does: set_to_none (the default), in place, or not at all
    (gradients then add up across optimizer steps, in FSDP2 as in one process)."""
    how = cfg.get("zero_grad", "none")
    if how == "none":
        opt.zero_grad()
    elif how == "inplace":
        opt.zero_grad(set_to_none=False)


def sharded(cfg, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = cfg.get("device", "cpu")
    model = make_model(cfg).to(
        torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
    )
    # cfg["mesh"] = (replicas, shards): HSDP over a 2-D mesh; otherwise 1-D FSDP.
    mesh = (
        init_device_mesh(device, cfg["mesh"], mesh_dim_names=("replicate", "shard"))
        if cfg.get("mesh")
        else init_device_mesh(device, (world,))
    )
    kwargs = {"mesh": mesh, "reshard_after_forward": cfg.get("reshard_after_forward", True)}
    if cfg.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=cfg["mp"][0], reduce_dtype=cfg["mp"][1]
        )
    # cfg["units"]: lists of module names sharded together by one fully_shard call (one FSDP
    # unit spanning several modules); the blocks not named there get a unit each.
    grouped = {name for unit in cfg.get("units", ()) for name in unit}
    for i, block in enumerate(model.blocks):
        if f"blocks.{i}" not in grouped:
            fully_shard(block, **kwargs)
    for unit in cfg.get("units", ()):
        fully_shard([model.get_submodule(name) for name in unit], **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if cfg.get("divide_factor") and hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(cfg["divide_factor"])
        if cfg.get("force_sum") and hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
        if cfg.get("rs_unused") and hasattr(module, "set_reduce_scatter_unused_params"):
            module.set_reduce_scatter_unused_params(True)
    return model


def train(rank, world, cfg, plan):
    """FSDP2 + attach; rank r runs plan[mb][r] microbatches of minibatch mb. Returns the full
    parameters at the end (on GPUs this rank's dim-0 shards: two ranks may share one GPU, where
    NCCL, which an all-gather of CUDA tensors would use, refuses to run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import torch_odc

    def build():
        model = sharded(cfg, world)
        handle = (
            torch_odc.attach(model, eager_publish=cfg.get("eager", True))
            if cfg.get("attach", True)
            else None
        )
        opt = torch.optim.SGD(
            [p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9
        )
        return model, handle, opt

    model, handle, opt = build()
    for mb, counts in enumerate(plan):
        seqs = samples(mb, sum(counts))
        tokens = sum(s.shape[1] - 1 for s in seqs)
        start = sum(counts[:rank])
        mine = [s.to(next(model.parameters()).device) for s in seqs[start : start + counts[rank]]]
        for i, seq in enumerate(mine):
            if cfg.get("no_sync"):  # FSDP2's gradient accumulation without communication
                model.set_requires_gradient_sync(i == len(mine) - 1)
            (loss_of(model, seq) * world / tokens).backward()
        if handle is not None:
            torch_odc.minibatch_barrier()
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        zero_grad(opt, cfg)
        if cfg.get("eval_forward"):  # an evaluation between minibatches: forward, no backward
            with torch.no_grad():
                model.eval()
                loss_of(model, samples(100 + mb, 1)[0].to(next(model.parameters()).device))
                model.train()
        if cfg.get("dcp") and mb == 0:  # checkpoint, start over from it, re-attach
            path = os.path.join(cfg["dcp"], "ckpt")
            dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=path)
            if handle is not None:
                handle.detach()
            model, handle, opt = build()
            state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
            dcp.load(state, checkpoint_id=path)
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
    if cfg.get("device") == "cuda":
        full = {k: v.to_local().detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        full = {k: v.full_tensor().detach().float() for k, v in model.state_dict().items()}
    if handle is not None:
        handle.detach()
    return full


CASES = {
    # name: (config, world, tolerance against the float64 reference). fp32: absolute, on every
    # parameter. 16-bit compute: relative to the largest parameter update (bf16 has 3 digits).
    "fp32-w2": ({}, 2, 2e-5),
    # Blocks 128 wide: each rank's chunk of a block unit is 16512 elements, so the CUDA push runs
    # its bulk path (whole 4096-element tiles, 16-byte aligned) with an element tail; the
    # embedding's and head's chunks (2368) stay below a tile.
    "wide-fp32": ({"dim": 128}, 2, 2e-5),
    "wide-bf16-reduce-fp32": ({"dim": 128, "mp": (BF16, FP32)}, 2, REL16),
    "wide-bf16-reduce-bf16": ({"dim": 128, "mp": (BF16, None)}, 2, REL16),
    "fp32-w4": ({}, 4, 2e-5),
    "bf16-reduce-fp32": ({"mp": (BF16, FP32)}, 2, REL16),
    "bf16-reduce-bf16": ({"mp": (BF16, None)}, 4, REL16),
    "fp16-reduce-fp16": ({"mp": (FP16, None)}, 4, REL16),
    "divide-factor-1": ({"divide_factor": 1.0}, 2, 2e-5),
    "divide-factor-3-w4": ({"divide_factor": 3.0}, 4, 2e-5),
    "force-sum": ({"force_sum": True}, 4, 2e-5),
    "fp16-divide-factor-2": ({"mp": (FP16, None), "divide_factor": 2.0}, 4, REL16),
    "lora-frozen": ({"lora": True}, 2, 2e-5),
    "lora-frozen-bf16": ({"lora": True, "mp": (BF16, FP32)}, 4, REL16),
    "conditional-params": ({"branch": True}, 2, 2e-5),
    "conditional-params-w4": ({"branch": True}, 4, 2e-5),
    "no-sync": ({"no_sync": True, "branch": True}, 2, 2e-5),
    "clip": ({"clip": 0.05}, 2, 2e-5),
    "tied-weights": ({"tied": True}, 2, 2e-5),
    # A forward without backward after each optimizer step (an evaluation). FSDP2 reshards a
    # unit with reshard_after_forward=False (accelerate's [norm, lm_head]) only in post-backward,
    # which a rank with no microbatch in the next minibatch never runs; clipping over
    # model.parameters() then met the unsharded parameters. Also published lazily (no
    # unshard/reshard of every unit at the first forward).
    "eval-forward-between-minibatches": (
        {
            "eval_forward": True,
            "norm": "affine",
            "units": [["norm", "head"]],
            "reshard_after_forward": False,
            "clip": 0.05,
        },
        2,
        2e-5,
    ),
    "eval-forward-between-minibatches-w4": (
        {
            "eval_forward": True,
            "eager": False,
            "norm": "affine",
            "units": [["norm", "head"]],
            "reshard_after_forward": False,
            "clip": 0.05,
        },
        4,
        2e-5,
    ),
    "no-reshard": ({"reshard_after_forward": False, "branch": True}, 2, 2e-5),
    # .grad is a view of the accumulator after the barrier: zeroed in place, or kept (then the
    # next minibatch's gradient adds to it, parameters without one keep it).
    "zero-grad-in-place": ({"zero_grad": "inplace", "branch": True}, 2, 2e-5),
    "grads-kept-across-steps": ({"zero_grad": "keep", "branch": True}, 2, 2e-5),
    "grads-kept-across-steps-clip-w4": ({"zero_grad": "keep", "clip": 0.05}, 4, 2e-5),
    # FSDP units spanning several modules (one fully_shard call over a list): one key each.
    # torchtitan's [norm, output] and PyTorch's [layers[i], layers[i+1]]; accelerate's
    # [norm, lm_head] with reshard_after_forward=False; PyTorch's tied [tok_embeddings, output];
    # units without a trainable parameter (all frozen; no parameters at all).
    "unit-norm-head-and-block-pair-w4": (
        {"norm": "affine", "branch": True, "units": [["norm", "head"], ["blocks.0", "blocks.1"]]},
        4,
        2e-5,
    ),
    "unit-norm-head-no-reshard": (
        {"norm": "affine", "units": [["norm", "head"]], "reshard_after_forward": False},
        2,
        2e-5,
    ),
    "unit-norm-head-no-reshard-bf16-w4": (
        {
            "norm": "affine",
            "units": [["norm", "head"]],
            "reshard_after_forward": False,
            "mp": (BF16, FP32),
        },
        4,
        REL16,
    ),
    "unit-tied-emb-head": ({"tied": True, "units": [["emb", "head"]]}, 2, 2e-5),
    "unit-tied-emb-head-bf16-w4": (
        {"tied": True, "units": [["emb", "head"]], "mp": (BF16, FP32)},
        4,
        REL16,
    ),
    "unit-without-trainable-params": (
        {
            "norm": "plain",
            "freeze": ["blocks.1", "head"],
            "units": [["norm"], ["blocks.1", "head"]],
        },
        2,
        2e-5,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_odc_equals_reference(name):
    cfg, world, tol = CASES[name]
    plan = PLANS[world]
    results = run_ranks(world, train, cfg, plan)
    want = reference(cfg, plan, world)
    init = {k: v.float() for k, v in make_model(cfg).state_dict().items()}
    moved = max((ref - init[k]).abs().max().item() for k, ref in want.items())
    atol = tol * moved if tol == REL16 else tol
    assert moved > 20 * atol, "the reference barely moved: the comparison would prove nothing"
    for rank, got in enumerate(results):
        err = max((got[k] - ref).abs().max().item() for k, ref in want.items())
        print(f"{name} rank {rank}: max |ODC - reference| {err:.2e} (largest update {moved:.2e})")
        for key, ref in want.items():
            torch.testing.assert_close(
                got[key],
                ref,
                rtol=0,
                atol=atol,
                msg=lambda m, k=key, r=rank: f"{name} rank {r} {k}: {m}",
            )
            if cfg.get("lora") and "lora_" not in key:
                assert torch.equal(got[key], init[key]), f"frozen {key} changed"


GPU_CASES = [
    "fp32-w2",
    "wide-fp32",
    "wide-bf16-reduce-fp32",
    "wide-bf16-reduce-bf16",
    "bf16-reduce-fp32",
    "bf16-reduce-bf16",
    "fp16-divide-factor-2",
    "divide-factor-1",
    "lora-frozen",
    "conditional-params",
    "no-sync",
    "tied-weights",
    "grads-kept-across-steps",
    "unit-norm-head-and-block-pair-w4",
    "unit-norm-head-no-reshard-bf16-w4",
    "unit-tied-emb-head",
    "unit-without-trainable-params",
    "eval-forward-between-minibatches",
]


# The push's other path (on sm_90 the bulk path is the default): the wide cases again.
GPU_ELEMENT_PUSH_CASES = ["wide-fp32", "wide-bf16-reduce-fp32", "wide-bf16-reduce-bf16"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "name,push",
    [(n, "default") for n in GPU_CASES] + [(n, "element") for n in GPU_ELEMENT_PUSH_CASES],
)
def test_gpu_odc_equals_reference(name, push):
    """The same cases on GPUs (CUDA IPC transport), 2 ranks: on a 1-GPU machine they share it
    (CUDA IPC works between processes on one device). push=element: ODC_CUDA_PUSH=element."""
    import torch_odc

    if not torch_odc._C._has_cuda_transport():
        pytest.skip("this build has no CUDA transport")
    cfg, _, tol = CASES[name]
    cfg, world = {**cfg, "device": "cuda"}, 2
    env = {"ODC_CUDA_PUSH": "element"} if push == "element" else {}
    if cfg.get("clip") and torch.cuda.device_count() < world:
        # The ranks share a GPU: clipping's norm all-reduce of CUDA tensors goes through Gloo
        # (NCCL refuses two ranks on one device).
        env["ODC_CUDA_COLLECTIVES"] = "gloo"
    shards = run_ranks(world, train, cfg, PLANS[world], cuda=True, env=env)
    got = {k: torch.cat([r[k] for r in shards]) for k in shards[0]}
    want = reference(cfg, PLANS[world], world)
    init = {k: v.float() for k, v in make_model(cfg).state_dict().items()}
    moved = max((ref - init[k]).abs().max().item() for k, ref in want.items())
    atol = tol * moved if tol == REL16 else 2e-5
    err = max((got[k] - ref).abs().max().item() for k, ref in want.items())
    print(f"GPU {name}: max |ODC - reference| {err:.2e} (largest update {moved:.2e})")
    for key, ref in want.items():
        torch.testing.assert_close(
            got[key], ref, rtol=0, atol=atol, msg=lambda m, k=key: f"GPU {name} {k}: {m}"
        )


@pytest.mark.skipif(
    not hasattr(
        __import__("torch.distributed.fsdp").distributed.fsdp.FSDPModule,
        "set_reduce_scatter_unused_params",
    ),
    reason="FSDPModule.set_reduce_scatter_unused_params is new in torch 2.15",
)
def test_reduce_scatter_unused_params_sets_zero_gradients_like_fsdp2():
    """With set_reduce_scatter_unused_params(True) FSDP2 reduce-scatters zeros for trainable
    parameters without a gradient (so .grad is zeros, not None: momentum moves them)."""
    _two_ranks_equal_the_reference({"branch": True, "rs_unused": True})


def test_dcp_checkpoint_and_reattach_mid_training():
    """Also with a unit of two modules (one key across the detach and the re-attach)."""
    with tempfile.TemporaryDirectory(prefix="odc-dcp-") as tmp:
        _two_ranks_equal_the_reference(
            {"dcp": tmp, "branch": True, "norm": "affine", "units": [["norm", "head"]]}
        )


def _two_ranks_equal_the_reference(cfg):
    """2 CPU ranks on PLANS[2]: every parameter within 2e-5 of the float64 reference."""
    results = run_ranks(2, train, cfg, PLANS[2])
    want = reference(cfg, PLANS[2], 2)
    for got in results:
        for key, ref in want.items():
            torch.testing.assert_close(got[key], ref, rtol=0, atol=2e-5)


def _grads_after_one_minibatch(rank, world, cfg, count):
    """One minibatch of `count` microbatches per rank; this rank's full gradients (an
    all-gather of the sharded .grad), under ODC or FSDP2's collectives."""
    import torch_odc

    model = sharded(cfg, world)
    handle = torch_odc.attach(model) if cfg["attach"] else None
    seqs = samples(0, world * count, seed=5)
    tokens = sum(s.shape[1] - 1 for s in seqs)
    for seq in seqs[rank * count : (rank + 1) * count]:
        (loss_of(model, seq) * world / tokens).backward()
    if handle is not None:
        torch_odc.minibatch_barrier()
    grads = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
    if handle is not None:
        handle.detach()
    return grads


def _reference_grads(world, count, mp_dtype):
    """float64 gradients of the same minibatch, the model's compute in `mp_dtype` as under
    FSDP2's mixed precision (only the reduction and accumulation differ)."""
    model = make_model({}).to(mp_dtype)
    seqs = samples(0, world * count, seed=5)
    tokens = sum(s.shape[1] - 1 for s in seqs)
    grads = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for seq in seqs:
        model.zero_grad()
        (loss_of(model, seq) / tokens).backward()
        for n, p in model.named_parameters():
            grads[n] += p.grad.double()
    return grads


@pytest.mark.parametrize("mp_dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_16bit_reduction_over_many_microbatches_is_no_less_precise_than_fsdp2(mp_dtype):
    """128 microbatches per rank, reduce dtype = param dtype (16-bit): FSDP2 reduces each
    microbatch in 16 bits and accumulates .grad in fp32; ODC widens every push into an fp32
    accumulator and rounds once. Its error must not exceed FSDP2's."""
    world, count = 2, 128
    want = _reference_grads(world, count, mp_dtype)

    def error(grads):
        num = sum(((grads[n] - want[n]) ** 2).sum() for n in want)
        return (num / sum((want[n] ** 2).sum() for n in want)).sqrt().item()

    errors = {}
    for attach in (True, False):
        cfg = {"mp": (mp_dtype, None), "attach": attach}
        errors[attach] = error(run_ranks(world, _grads_after_one_minibatch, cfg, count)[0])
    odc, fsdp2 = errors[True], errors[False]
    print(
        f"relative gradient error, {count} microbatches per rank: ODC {odc:.2e}, FSDP2 {fsdp2:.2e}"
    )
    assert odc <= fsdp2 * 1.05 + 1e-7, (odc, fsdp2)


# ---- gradients read before the barrier -------------------------------------------------------


def _grad_reads_before_the_barrier(rank, world, cfg, plan, ckpt):
    """Trains `plan` with no-sync microbatches; after every microbatch tries the gradient reads
    trainers make before their optimizer step, and between the last microbatch and the barrier
    saves a DCP checkpoint where every rank ran microbatches. Returns what each read raised,
    whether a rank without microbatches saw .grad None, per barrier the clipped norm (CPU) and
    this rank's sum of squared gradient shards, the parameters (on GPUs this rank's shards:
    the collectives of clipping, DCP and full_tensor need NCCL, which refuses 2 ranks on one
    GPU) and what a backward raised after zero_grad() dropped a kept gradient."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import torch_odc

    cuda = cfg.get("device") == "cuda"
    model = sharded(cfg, world)
    device = next(model.parameters()).device
    handle = torch_odc.attach(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    reads = {
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, 1.0),
        "grad.norm()": lambda: [p.grad.norm() for p in params if p.grad is not None],
        "get_total_norm": lambda: torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None]
        ),
        "zero_grad(set_to_none=False)": lambda: opt.zero_grad(set_to_none=False),
    }
    errors, idle_none, norms = [], [], []
    for mb, counts in enumerate(plan):
        seqs = [s.to(device) for s in samples(mb, sum(counts))]
        tokens = sum(s.shape[1] - 1 for s in seqs)
        start = sum(counts[:rank])
        mine = seqs[start : start + counts[rank]]
        for i, seq in enumerate(mine):
            model.set_requires_gradient_sync(i == len(mine) - 1)
            (loss_of(model, seq) * world / tokens).backward()
            for what, read in reads.items():
                try:
                    read()
                    errors.append((what, None))
                except RuntimeError as err:
                    errors.append((what, str(err)))
        if not mine:
            idle_none.append(all(p.grad is None for p in params))
        if all(counts) and not cuda:  # a collective: only where no rank is idle (an idle
            # rank publishes its shards at the barrier; its peers' forwards wait for them)
            state = dict(zip(("model", "optim"), get_state_dict(model, opt)))
            dcp.save(state, checkpoint_id=os.path.join(ckpt, f"mb{mb}"))
        torch_odc.minibatch_barrier()
        squares = sum(
            p.grad.to_local().double().pow(2).sum().item() for p in params if p.grad is not None
        )
        clipped = None if cuda else torch.nn.utils.clip_grad_norm_(params, 1e9).item()
        norms.append((clipped, squares))
        opt.step()
        if mb < len(plan) - 1:
            opt.zero_grad()
            with torch.no_grad():  # an evaluation forward starts the next minibatch ...
                model(seqs[0][:, :-1])
            opt.zero_grad()  # ... where dropping .grad (all None) changes nothing
    if cuda:
        params_out = {k: v.to_local().detach().float().cpu() for k, v in model.state_dict().items()}
    else:
        params_out = {k: v.full_tensor().detach().float() for k, v in model.state_dict().items()}
    # The last minibatch's .grad is kept (no zero_grad()): an evaluation forward, then
    # zero_grad() (torchtitan zeroes at the start of its next step), would drop a gradient
    # ODC keeps in the accumulator: the next backward raises.
    with torch.no_grad():
        model(seqs[0][:, :-1])
    opt.zero_grad()
    try:
        loss_of(model, seqs[0]).backward()
        dropped = None
    except RuntimeError as err:
        dropped = str(err)
    handle._attached = False  # leave the engine as it is; the group is torn down next
    return errors, idle_none, norms, params_out, dropped


def _check_grad_reads(results, cfg, plan):
    want_norms = []
    want = reference(cfg, plan, 2, norms=want_norms)
    for rank, (errors, idle_none, norms, _, dropped) in enumerate(results):
        print(f"rank {rank}: {errors[0][1]}")
        assert dropped is not None and "zero_grad()" in dropped, dropped
        assert len(errors) == 4 * sum(c[rank] for c in plan), errors
        for what, err in errors:
            assert err is not None, f"rank {rank}: {what} before the barrier did not raise"
            assert "torch_odc.minibatch_barrier()" in err and f"rank {rank}, minibatch" in err, err
        assert idle_none == [True] * sum(c[rank] == 0 for c in plan), idle_none
        clipped = [c for c, _ in norms]
        if clipped[0] is not None:
            torch.testing.assert_close(
                torch.tensor(clipped), torch.tensor(want_norms), rtol=1e-5, atol=0
            )
    summed = [sum(r[2][mb][1] for r in results) ** 0.5 for mb in range(len(plan))]
    torch.testing.assert_close(torch.tensor(summed), torch.tensor(want_norms), rtol=1e-5, atol=0)
    return want


def test_gradient_reads_before_the_barrier_raise_naming_it_and_work_after_it():
    """During a minibatch .grad holds a storage-less placeholder: clipping, grad norms and
    in-place zeroing raise, naming the barrier (no-sync microbatches included); a DCP save
    there works; a rank that ran no microbatch sees None. After the barrier the norms and the
    trained parameters equal the float64 reference. zero_grad() after an evaluation forward
    is harmless where nothing was kept, and raises where a kept gradient would be dropped."""
    cfg = {"branch": True, "norm": "affine", "units": [["norm", "head"]]}
    plan = [[3, 0], [1, 2]]
    with tempfile.TemporaryDirectory(prefix="odc-guard-") as tmp:
        results = run_ranks(2, _grad_reads_before_the_barrier, cfg, plan, tmp)
    want = _check_grad_reads(results, cfg, plan)
    for _, _, _, got, _ in results:
        for key, ref in want.items():
            torch.testing.assert_close(got[key], ref, rtol=0, atol=2e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_gradient_reads_before_the_barrier_raise():
    """The same on GPUs (CUDA IPC transport, 2 ranks; on one GPU they share it): without the
    CPU case's clipping and DCP save after the barrier (collectives NCCL runs)."""
    import torch_odc

    if not torch_odc._C._has_cuda_transport():
        pytest.skip("this build has no CUDA transport")
    cfg = {"branch": True, "norm": "affine", "units": [["norm", "head"]], "device": "cuda"}
    plan = [[3, 0], [1, 2]]
    results = run_ranks(2, _grad_reads_before_the_barrier, cfg, plan, "", cuda=True)
    want = _check_grad_reads(results, cfg, plan)
    got = {k: torch.cat([r[3][k] for r in results]) for k in results[0][3]}
    for key, ref in want.items():
        torch.testing.assert_close(got[key], ref, rtol=0, atol=2e-5)


# ---- options that on-demand mode refuses at attach, and misuse -------------------------------


def _attach_error(rank, world, kind):
    import torch_odc

    cfg = {"reshard_after_forward": 2} if kind == "reshard-int" else {}
    model = sharded(cfg, world)
    if kind == "optimizer-in-backward":
        model.blocks[0].lin1.weight.register_post_accumulate_grad_hook(lambda p: None)
    try:
        torch_odc.attach(model)
    except NotImplementedError as err:
        return str(err)
    return "attached"


@pytest.mark.parametrize(
    "kind,words",
    [
        ("reshard-int", "reshard_after_forward=<int>"),
        ("optimizer-in-backward", "post-accumulate-grad hooks"),
    ],
)
def test_unsupported_options_are_refused_at_attach_naming_module_and_option(kind, words):
    for msg in run_ranks(4, _attach_error, kind):
        assert words in msg and "torch_odc.attach: module '" in msg, msg


def _world_of_one(rank, world):

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_result = train(rank, world, {"branch": True}, [[2], [0], [3]])
    return train_result, [str(w.message) for w in caught if "torch_odc" in str(w.message)]


def test_a_world_of_one_rank_keeps_fsdp2s_own_path():
    ((got, caught),) = run_ranks(1, _world_of_one)
    assert any("one rank" in m for m in caught), caught
    want = reference({"branch": True}, [[2], [0], [3]], 1)
    for key, ref in want.items():
        torch.testing.assert_close(got[key], ref, rtol=0, atol=2e-5)


def _handle_state(rank, world):
    """What a handle says of itself after attach, after its barrier, and after detach."""
    import torch_odc

    model = sharded({}, world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = torch_odc.attach(model)
    attached = (handle.on_demand, handle.collective_reason)
    handle.barrier()  # on one rank: nothing to do (FSDP2's own path), and no error
    stats = handle.stats()
    handle.detach()
    return {
        "attached": attached,
        "stats_on_demand": stats.get("on_demand", True),
        "memory": stats["memory"],
        "detached": handle.on_demand,
    }


@pytest.mark.parametrize("world", [1, 2])
def test_a_handle_says_whether_odc_serves_it_on_demand(world):
    for got in run_ranks(world, _handle_state):
        on_demand, reason = got["attached"]
        if world == 1:
            assert not on_demand and "a group of one rank" in reason, got
            assert not got["stats_on_demand"] and got["memory"] == {}, got
        else:
            assert on_demand and reason is None and got["stats_on_demand"], got
            assert sum(got["memory"].values()) > 0, got
        assert got["detached"] is False, got


def _misuse(rank, world, kind):
    """Returns (error text or None, parameters unchanged by the refused call)."""
    import torch_odc

    model = sharded({}, world)
    handle = torch_odc.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seq = samples(0, 1)[0]
    loss_of(model, seq).backward()
    torch_odc.minibatch_barrier()
    opt.step()
    opt.zero_grad()
    before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
    error = None
    try:
        if kind == "double-barrier":
            loss_of(model, seq).backward()
            torch_odc.minibatch_barrier()
            torch_odc.minibatch_barrier()
        elif kind == "idle-rank-steps-early":
            # Minibatch 2: rank 1 runs no microbatch and steps before the barrier.
            if rank == 0:
                loss_of(model, seq).backward()
            else:
                opt.step()
    except RuntimeError as err:
        error = str(err)
    unchanged = all(torch.equal(before[k], v.to_local()) for k, v in model.state_dict().items())
    if kind == "idle-rank-steps-early" and rank == 0:
        try:
            torch_odc.minibatch_barrier()  # its peer never arrives: named after the timeout
        except RuntimeError as err:
            error = str(err)
    handle._attached = False  # leave the engine as it is; the group is torn down next
    return error, unchanged


def test_a_second_barrier_before_the_step_is_refused():
    for rank, (error, _) in enumerate(run_ranks(2, _misuse, "double-barrier")):
        assert error is not None and f"rank {rank}, minibatch 3" in error, error
        assert "second minibatch_barrier()" in error, error


def test_a_step_before_the_barrier_on_a_rank_without_microbatches_is_refused():
    (err0, _), (err1, unchanged) = run_ranks(2, _misuse, "idle-rank-steps-early", pg_timeout=3.0)
    assert err1 is not None and "rank 1, minibatch 2" in err1 and "optimizer.step()" in err1, err1
    assert unchanged, "the refused step changed parameters"
    assert err0 is not None and "peer rank 1" in err0, err0


def _metric_allreduce_in_loop(rank, world):
    import torch_odc

    model = sharded({}, world)
    handle = torch_odc.attach(model)
    counts = [3, 1]
    error = None
    try:
        for seq in samples(0, 4)[: counts[rank]]:
            loss = loss_of(model, seq)
            loss.backward()
            metric = loss.detach().clone()
            dist.all_reduce(metric)  # a per-microbatch metric, as several trainers log
        torch_odc.minibatch_barrier()
    except RuntimeError as err:
        error = str(err)
    handle._attached = False
    return error


def test_a_collective_inside_the_microbatch_loop_is_named_at_the_barrier():
    """Rank 0 runs 3 microbatches, rank 1 one: rank 0's second all-reduce pairs with nothing.
    Rank 1, waiting in the barrier, sees it at once (well before the 30 s timeout)."""
    import time

    start = time.monotonic()
    errors = run_ranks(2, _metric_allreduce_in_loop, pg_timeout=30.0, timeout=120.0)
    assert time.monotonic() - start < 25.0
    assert errors[1] is not None and "different numbers of collectives" in errors[1], errors[1]
    assert "ALLREDUCE" in errors[1] and "after torch_odc.minibatch_barrier()" in errors[1]
