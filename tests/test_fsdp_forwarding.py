"""Unmodified FSDP2 over "odc" (no attach) trains exactly like FSDP2 over gloo."""

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_ranks

from torch_odc.demo import TinyDecoder, sequence_lengths, shard_model


def train_fsdp2(rank, world, device_kind, steps, microbatches, reshard_after_forward):
    from torch.distributed.device_mesh import init_device_mesh

    device = (
        torch.device(device_kind, torch.cuda.current_device())
        if device_kind == "cuda"
        else (torch.device("cpu"))
    )
    torch.manual_seed(0)
    model = TinyDecoder(vocab=97, dim=32, layers=3, heads=4, max_len=64).to(device)
    mesh = init_device_mesh(device_kind, (world,))
    model = shard_model(model, mesh, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + rank)
        for length in sequence_lengths(step, rank, microbatches, 4, 63):
            seq = torch.randint(0, 97, (1, length + 1), generator=gen).to(device)
            loss = F.cross_entropy(model(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())
            (loss / microbatches).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    full = {k: v.full_tensor().detach().cpu() for k, v in model.state_dict().items()}
    return full, losses


@pytest.mark.parametrize("world,reshard_after_forward", [(2, True), (2, False), (4, True)])
def test_fsdp2_over_odc_matches_gloo(world, reshard_after_forward):
    args = ("cpu", 4, 3, reshard_after_forward)
    odc = run_ranks(world, train_fsdp2, *args, backend="odc")
    ref = run_ranks(world, train_fsdp2, *args, backend="gloo")
    for rank in range(world):
        odc_params, odc_losses = odc[rank]
        ref_params, ref_losses = ref[rank]
        assert odc_losses == ref_losses
        assert odc_params.keys() == ref_params.keys()
        for name in ref_params:
            torch.testing.assert_close(
                odc_params[name],
                ref_params[name],
                rtol=0,
                atol=1e-6,
                msg=lambda m, n=name, r=rank: f"rank {r} param {n}: {m}",
            )
    # Training moved the parameters: the comparison is not between two untouched models.
    torch.manual_seed(0)
    init = TinyDecoder(vocab=97, dim=32, layers=3, heads=4, max_len=64).state_dict()
    assert any(not torch.equal(init[k], odc[0][0][k]) for k in init)
