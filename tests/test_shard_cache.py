"""The shard cache holds the sharded parameters themselves (docs/architecture.md, "The shard
cache is the sharded parameters"): under bf16 / fp16 mixed precision a gather reads the owner's
fp32 shard and rounds it as it copies. What a layer computes with must be bit for bit what
FSDP2's own all-gather gives it (FSDP2 over Gloo, the independent reference), also after the
optimizer stepped the parameters in the cache, and after FSDP2 replaced them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from odc_training import loss_of, samples, sharded_model

import torch_odc

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LR = 0.1


def _capture(model) -> tuple[dict, list]:
    """Forward pre-hooks recording, per module with a weight, the unsharded weight its forward
    uses (FSDP2 has gathered it by then)."""
    seen: dict = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), torch.Tensor):
            hooks.append(
                module.register_forward_pre_hook(
                    lambda m, _, n=name: seen.__setitem__(n, m.weight.detach().clone())
                )
            )
    return seen, hooks


def _weights_seen(rank, world, mp_dtype, odc, reassign, device="cpu"):
    """Two minibatches of one microbatch per rank (FSDP2 plain needs equal counts), SGD between
    them: per minibatch the weights each layer computed with, the loss, and (ODC) the full fp32
    parameters at the second forward, independently gathered (FSDP2's full_tensor over the
    forwarding backend) and rounded by torch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import torch_odc

    model = sharded_model(
        world, device, mp_policy=MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=FP32)
    )
    dev = next(model.parameters()).device
    handle = torch_odc.attach(model) if odc else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {"weights": [], "losses": []}
    for mb in range(2):
        if mb == 1 and reassign:
            # Every parameter object replaced (FSDP2 re-pads them at its next lazy init): they
            # move into the cache again at the next publish.
            model.load_state_dict(
                {k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
        seen, hooks = _capture(model)
        loss = loss_of(model, samples(mb, world)[rank].to(dev))
        loss.backward()
        for h in hooks:
            h.remove()
        out["weights"].append({n: w.cpu() for n, w in seen.items()})
        out["losses"].append(loss.detach().clone())
        if odc:
            torch_odc.minibatch_barrier()
        if mb == 1:
            out["full"] = {
                n: p.full_tensor().detach().to(mp_dtype).cpu() for n, p in model.named_parameters()
            }
            if odc:
                out["memory"] = torch_odc.stats()[0]["memory"]
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.detach()
    dist.barrier()
    return out


@pytest.mark.parametrize(
    "mp_dtype,world,reassign",
    [(BF16, 2, False), (FP16, 4, False), (BF16, 4, True)],
    ids=["bf16-w2", "fp16-w4", "bf16-w4-replaced"],
)
def test_gathered_weights_are_fsdp2s_bit_for_bit(mp_dtype, world, reassign):
    odc = run_ranks(world, _weights_seen, mp_dtype, True, reassign)
    plain = run_ranks(world, _weights_seen, mp_dtype, False, reassign, backend="gloo")
    for rank in range(world):
        mine, ref = odc[rank], plain[rank]
        # The first minibatch: the same initial parameters, so FSDP2's own gather is the
        # reference, and so is the loss they give.
        assert mine["weights"][0].keys() == ref["weights"][0].keys()
        for name, w in ref["weights"][0].items():
            assert w.dtype == mp_dtype and torch.equal(mine["weights"][0][name], w), (rank, name)
        assert torch.equal(mine["losses"][0], ref["losses"][0]), rank
        # The second: the parameters the optimizer stepped in the cache, as torch rounds them.
        for name, w in mine["weights"][1].items():
            assert torch.equal(w, mine["full"][f"{name}.weight"]), (rank, name)
        memory = mine["memory"]
        assert memory["published_cache_bytes"] == 0 and memory["parameter_bytes"] > 0, memory


@pytest.mark.skipif(
    not torch.cuda.is_available() or not torch_odc._C._has_cuda_transport(),
    reason="needs a CUDA GPU (two ranks may share it) and a CUDA build",
)
@pytest.mark.parametrize("mp_dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_gathered_weights_are_torchs_rounding_bit_for_bit(mp_dtype):
    """The CUDA transport's narrowing gather kernel: what each layer computes with is torch's
    rounding of the fp32 parameters, at the start (every layer's initial weights) and after an
    optimizer step in the cache (independently gathered by full_tensor, rounded by torch)."""
    from odc_training import make_model

    initial = {n: p.detach().to(mp_dtype) for n, p in make_model(False).named_parameters()}
    for rank, out in enumerate(
        run_ranks(2, _weights_seen, mp_dtype, True, False, "cuda", cuda=True)
    ):
        for name, w in out["weights"][0].items():
            assert w.dtype == mp_dtype and torch.equal(w, initial[f"{name}.weight"]), (rank, name)
        for name, w in out["weights"][1].items():
            assert torch.equal(w, out["full"][f"{name}.weight"]), (rank, name)


def _meta_then_materialized(rank, world, plan):
    """fully_shard on the meta device, attach, then ``to_empty`` and the weights (torchtitan's
    order, with attach before materializing): the shards move into the caches at the first
    publish, and training equals the reference."""
    from odc_training import make_model, split
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch_odc

    full = make_model(False).state_dict()
    with torch.device("meta"):
        model = make_model(False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    handle = torch_odc.attach(model)
    model.to_empty(device="cpu")
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for mb, counts in enumerate(plan):
        seqs = samples(mb, sum(counts))
        tokens = sum(s.shape[1] - 1 for s in seqs)
        for seq in split(counts, seqs)[rank]:
            # FSDP2 averages over ranks: scale by world to get the reference's plain mean.
            (loss_of(model, seq) * world / tokens).backward()
        torch_odc.minibatch_barrier()
        opt.step()
        opt.zero_grad()
    memory = torch_odc.stats()[0]["memory"]
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    handle.detach()
    return params, memory


def test_attach_before_materializing_meta_parameters():
    from odc_training import reference

    plan = [[2, 1], [0, 3]]
    want = reference(plan, False, LR)
    for params, memory in run_ranks(2, _meta_then_materialized, plan):
        assert memory["published_cache_bytes"] == 0 and memory["parameter_bytes"] > 0, memory
        for name, ref in want.items():
            torch.testing.assert_close(params[name], ref, rtol=0, atol=1e-5, msg=name)
