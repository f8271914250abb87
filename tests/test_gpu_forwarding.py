"""GPU: forwarded collectives on CUDA tensors match NCCL; FSDP2 over "odc" matches over "nccl".

Skipped without at least 2 GPUs. Run on a multi-GPU machine with: pytest tests -k gpu
"""

import pytest
import torch
from collective_cases import assert_case, cases, compare_all
from multiproc import run_ranks
from test_fsdp_forwarding import train_fsdp2

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA GPUs")
WORLDS = [w for w in (2, 4) if w <= GPUS]
CASE_NAMES = sorted(cases(torch.device("cuda")))
NCCL_REJECTS: set = set()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def gpu_report(request):
    world = request.param
    return world, run_ranks(world, compare_all, "cuda", "nccl", cuda=True)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_gpu_forwarded_collective_matches_nccl(gpu_report, name):
    world, per_rank = gpu_report
    assert_case(world, per_rank, name, NCCL_REJECTS)


def _lazy_cuda_backend(rank, world):
    import torch.distributed as dist

    import torch_odc

    backend = torch_odc.odc_backend()
    before = backend.cuda_backend is not None
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return before, backend.cuda_backend is not None, t.sum().item()


def test_gpu_nccl_inner_backend_is_created_lazily():
    for before, after, total in run_ranks(2, _lazy_cuda_backend, cuda=True):
        assert (before, after, total) == (False, True, 8.0)


@pytest.mark.parametrize("world", WORLDS)
def test_gpu_fsdp2_over_odc_matches_nccl(world):
    args = ("cuda", 3, 3, True)
    odc = run_ranks(world, train_fsdp2, *args, backend="odc", cuda=True)
    ref = run_ranks(world, train_fsdp2, *args, backend="nccl", cuda=True)
    for rank in range(world):
        for name, want in ref[rank][0].items():
            torch.testing.assert_close(odc[rank][0][name], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(odc[rank][1], ref[rank][1], rtol=1e-6, atol=1e-6)
