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

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _capture(model) -> tuple[dict, list]:
    """Forward pre-hooks recording, per module with a weight, the unsharded weight its forward
    uses (FSDP2 has gathered it by then)."""
    seen: dict = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), torch.Tensor):
            hooks.append(module.register_forward_pre_hook(
                lambda m, _, n=name: seen.__setitem__(n, m.weight.detach().clone())))
    return seen, hooks


def _weights_seen(rank, world, mp_dtype, odc, reassign):
    """Two minibatches of one microbatch per rank (FSDP2 plain needs equal counts), SGD between
    them: per minibatch the weights each layer computed with, the loss, and (ODC) the full fp32
    parameters at the second forward, independently gathered (FSDP2's full_tensor over the
    forwarding backend) and rounded by torch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import torch_odc

    model = sharded_model(world, "cpu",
                          mp_policy=MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=FP32))
    handle = torch_odc.attach(model) if odc else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {"weights": [], "losses": []}
    for mb in range(2):
        if mb == 1 and reassign:
            # Every parameter object replaced (FSDP2 re-pads them at its next lazy init): they
            # move into the cache again at the next publish.
            model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()},
                                  assign=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
        seen, hooks = _capture(model)
        loss = loss_of(model, samples(mb, world)[rank])
        loss.backward()
        for h in hooks:
            h.remove()
        out["weights"].append(seen)
        out["losses"].append(loss.detach().clone())
        if odc:
            torch_odc.minibatch_barrier()
        if mb == 1:
            out["full"] = {n: p.full_tensor().detach().to(mp_dtype)
                           for n, p in model.named_parameters()}
            if odc:
                out["memory"] = torch_odc.stats()[0]["memory"]
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.detach()
    dist.barrier()
    return out


@pytest.mark.parametrize("mp_dtype,world,reassign", [(BF16, 2, False), (FP16, 4, False),
                                                      (BF16, 4, True)],
                         ids=["bf16-w2", "fp16-w4", "bf16-w4-replaced"])
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
