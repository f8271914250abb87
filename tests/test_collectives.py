"""Every forwarded collective on "odc" gives the same result (or the same error) as on gloo."""

import os

import pytest
import torch
import torch.distributed as dist
from collective_cases import assert_case, cases, compare_all
from multiproc import run_ranks

# Operations gloo itself rejects (odc must reject them the same way); all others must succeed.
GLOO_REJECTS = {"allreduce_premul_sum", "all_to_all_list"}
CASE_NAMES = sorted(cases(torch.device("cpu")))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def report(request):
    world = request.param
    return world, run_ranks(world, compare_all, "cpu", "gloo")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_forwarded_collective_matches_gloo(report, name):
    world, per_rank = report
    assert_case(world, per_rank, name, GLOO_REJECTS)


def _backend_facts(rank, world):
    import torch_odc

    pg = dist.group.WORLD
    backend = torch_odc.odc_backend(pg)
    facts = {
        "name": dist.get_backend(pg),
        "backend_name": pg._get_backend(torch.device("cpu")).name(),
        "same_object_for_cuda_key": pg._get_backend(torch.device("cuda")) is backend
        if hasattr(pg, "_get_backend")
        else None,
        "cuda_backend_created": backend.cuda_backend is not None,
    }
    threads = len(os.listdir("/proc/self/task"))
    dist.destroy_process_group()
    facts["shutdown_after_destroy"] = backend.is_shutdown
    # The inner gloo backend's worker threads are joined by the shutdown, not left running into
    # interpreter exit (where a worker releasing a finished op's tensors aborts the process).
    facts["threads_joined"] = threads - len(os.listdir("/proc/self/task"))
    return facts


def test_backend_identity_and_shutdown():
    for facts in run_ranks(2, _backend_facts):
        assert facts["name"] == "odc"
        assert facts["backend_name"] == "odc"
        assert facts["same_object_for_cuda_key"] is True
        assert facts["cuda_backend_created"] is False  # CPU-only use never creates NCCL
        assert facts["shutdown_after_destroy"] is True
        assert facts["threads_joined"] >= 2, facts  # gloo's two worker threads at least


def _abort_facts(rank, world):
    import torch_odc

    backend = torch_odc.odc_backend(dist.group.WORLD)
    t = torch.ones(1)
    dist.all_reduce(t)
    threads = len(os.listdir("/proc/self/task"))
    dist.distributed_c10d._abort_process_group()
    facts = {
        "sum": t.item(),
        "shutdown_after_abort": backend.is_shutdown,
        "threads_joined": threads - len(os.listdir("/proc/self/task")),
    }
    try:
        backend.allreduce([torch.ones(1)]).wait()
        facts["after_abort"] = "no error"
    except RuntimeError as err:
        facts["after_abort"] = str(err)
    return facts


def test_abort_closes_inner_backends_and_later_calls_fail_clearly():
    for rank, facts in enumerate(run_ranks(2, _abort_facts)):
        assert facts["sum"] == 2.0
        assert facts["shutdown_after_abort"] is True
        assert facts["threads_joined"] >= 2, facts
        assert f"odc: rank {rank}: " in facts["after_abort"], facts
        assert "shut down or aborted" in facts["after_abort"], facts


def _subgroups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        out["evens"] = t.item()
        out["evens_backend"] = dist.get_backend(evens)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        out[dim] = t.item()
        out[dim + "_ranks"] = dist.get_process_group_ranks(g)
        out[dim + "_backend"] = dist.get_backend(g)
    return out


def test_new_group_and_2d_device_mesh():
    world = 4
    for rank, out in enumerate(run_ranks(world, _subgroups)):
        if rank % 2 == 0:
            assert out["evens"] == sum(r for r in range(world) if r % 2 == 0)
            assert out["evens_backend"] == "odc"
        for dim in ("dp", "tp"):
            assert rank in out[dim + "_ranks"]
            assert out[dim] == float(sum(out[dim + "_ranks"]))
            assert out[dim + "_backend"] == "odc"
        assert sorted(out["dp_ranks"]) == [rank % 2, rank % 2 + 2]
        assert sorted(out["tp_ranks"]) == [2 * (rank // 2), 2 * (rank // 2) + 1]


def _functional_all_gathers(rank, world, device):
    """DTensor.full_tensor() and the functional coalesced all-gather (what a full state dict
    and DTensor redistribution run), on this rank's device."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None
    mesh = init_device_mesh(device, (world,))
    full = torch.arange(6.0 * world * 4, device=dev).view(6 * world // 2, 8)
    shard = DTensor.from_local(full.chunk(world)[rank].clone(), mesh, [Shard(0)], run_check=False)
    whole = shard.full_tensor()
    inputs = [
        torch.full((3,), float(rank), device=dev),
        torch.full((1, 2), 10.0 + rank, device=dev),
    ]
    outs = [
        t.wait() if hasattr(t, "wait") else t
        for t in funcol.all_gather_into_tensor_coalesced(inputs, dist.group.WORLD)
    ]
    # accelerate's gather (TRL's reward gather): a (n, 1) input into a flat output, NCCL's rule.
    column = torch.full((4, 1), 20.0 + rank, device=dev)
    flat = torch.empty(world * 4, device=dev)
    dist.all_gather_into_tensor(flat, column)
    outs.append(flat)
    return whole.cpu(), full.cpu(), [o.cpu() for o in outs]


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["cpu", "cuda-gloo"])
def test_functional_all_gathers_and_full_tensor(device):
    """On CUDA tensors with ODC_CUDA_COLLECTIVES=gloo (ranks sharing a GPU: NCCL refuses them),
    Gloo's own coalesced all-gathers have no CUDA path (pytorch/pytorch#152645: a SIGSEGV);
    odc runs them as one Gloo all-gather per tensor; accelerate's gather into a flat output (which
    Gloo's shape check refuses) runs as flat views. The same calls on CPU ranks."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    world = 2
    env = {"ODC_CUDA_COLLECTIVES": "gloo"} if device == "cuda" else None
    for whole, full, outs in run_ranks(
        world, _functional_all_gathers, device, cuda=device == "cuda", env=env
    ):
        torch.testing.assert_close(whole, full, rtol=0, atol=0)
        assert outs[0].tolist() == [float(r) for r in range(world) for _ in range(3)]
        assert outs[1].shape == (world, 2)
        assert outs[1].tolist() == [[10.0 + r] * 2 for r in range(world)]
        assert outs[2].tolist() == [20.0 + r for r in range(world) for _ in range(4)]
