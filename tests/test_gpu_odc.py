"""GPU on-demand mode (CUDA IPC transport): FSDP2 + attach with uneven microbatch counts per rank
(zero included) ends with the same parameters as FSDP2 over NCCL on the same samples.

Skipped without 2 GPUs; the 4-GPU cases without 4."""

import pytest
import torch
from multiproc import run_ranks
from odc_training import reference, slow_peer_first_microbatch, train_odc

import torch_odc

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS < 2 or not torch_odc._C._has_cuda_transport(), reason="needs 2 CUDA GPUs and a CUDA build"
)
LR = 0.1
BF16, FP32 = torch.bfloat16, torch.float32
# Uneven per-rank microbatch counts (zero included) and the even split of the same samples.
PLANS = {
    2: ([[2, 0], [3, 1], [1, 1]], [[1, 1], [2, 2], [1, 1]]),
    4: ([[1, 2, 0, 5], [3, 0, 1, 0], [0, 2, 1, 1]], [[2, 2, 2, 2], [1, 1, 1, 1], [1, 1, 1, 1]]),
}


@pytest.mark.parametrize(
    "world,mp,reshard,empty_root,atol,fused",
    [
        (2, None, True, False, 1e-5, True),
        (2, (BF16, FP32), False, True, 1e-3, True),
        (4, None, True, True, 1e-5, True),
        (4, (BF16, FP32), True, False, 1e-3, True),
        (4, (BF16, BF16), False, False, 1e-3, True),
        # The per-peer path (ODC_CUDA_FUSED=0): one wait, copy and push launch per peer.
        (2, (BF16, BF16), True, False, 1e-3, False),
        (4, None, True, True, 1e-5, False),
    ],
)
def test_gpu_odc_matches_fsdp2_over_nccl(world, mp, reshard, empty_root, atol, fused):
    if world > GPUS:
        pytest.skip(f"needs {world} GPUs")
    uneven, even = PLANS[world]
    odc = run_ranks(
        world,
        train_odc,
        uneven,
        empty_root,
        mp,
        reshard,
        LR,
        None,
        "cuda",
        True,
        backend="odc",
        cuda=True,
        env={"ODC_CUDA_FUSED": "1" if fused else "0"},
    )
    nccl = run_ranks(
        world,
        train_odc,
        even,
        empty_root,
        mp,
        reshard,
        LR,
        None,
        "cuda",
        False,
        backend="nccl",
        cuda=True,
    )
    cpu_ref = reference(uneven, empty_root, LR)  # the same samples, one process, fp32
    for rank in range(world):
        for name, want in nccl[rank][0].items():
            torch.testing.assert_close(
                odc[rank][0][name],
                want,
                rtol=0,
                atol=atol,
                msg=lambda m, n=name, r=rank: f"rank {r} {n} vs NCCL: {m}",
            )
            if mp is None:
                torch.testing.assert_close(odc[rank][0][name], cpu_ref[name], rtol=0, atol=1e-4)
        stats = odc[rank][1]["total"]
        assert stats["minibatches"] == len(uneven) and stats["bytes_fetched"] > 0


@pytest.mark.serial  # times rank 0's microbatch against rank 1's 2 s sleep
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
def test_gpu_first_forward_does_not_wait_for_a_peer_reaching_each_module(eager):
    """On GPUs the wait for a peer's publish is on the device: with eager publishing rank 0's
    microbatch (GPU work included) does not wait for rank 1, which sleeps 2 s before its last
    layer; published lazily it does. Both train like the one-process reference."""
    results = run_ranks(2, slow_peer_first_microbatch, eager, "cuda", backend="odc", cuda=True)
    elapsed0 = results[0][0]
    if eager:
        assert elapsed0 < 1.5, elapsed0  # rank 1 sleeps 2 s
    else:
        assert elapsed0 > 1.8, elapsed0
    want = reference([[1, 1], [1, 1]], False, LR)
    for rank in range(2):
        for name, ref in want.items():
            torch.testing.assert_close(
                results[rank][2][name],
                ref,
                rtol=0,
                atol=1e-4,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
