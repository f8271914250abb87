"""The calls accelerate, transformers, TRL, torchtitan and verl make (tests/framework_cases.py:
TABLE, each entry citing its source) give on "odc" what they give on gloo (CPU tensors) and on
nccl (CUDA tensors, skipped without 2 GPUs): the same tensors, or the same exception type."""

import pytest
import torch
from collective_cases import assert_case
from framework_cases import (
    CHECKED_LINES,
    EXPECTED_GLOO_DIFFERENCES,
    GLOO_REJECTS,
    NCCL_REJECTS,
    TABLE,
    TORCH_LINE,
    VERSION_DEPENDENT,
    run_table,
)
from multiproc import run_ranks

NAMES = [e.name for e in TABLE]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _run(world, device_kind, ref_backend, tmp_path):
    # One run_ranks per world size: the whole table on odc, then on the reference backend. The
    # CPU table runs in processes without CUDA (CPU ranks, also on a GPU machine), where
    # dist.barrier(device_ids=...) is a CPU barrier.
    cuda = device_kind == "cuda"
    return world, run_ranks(
        world,
        run_table,
        device_kind,
        ref_backend,
        str(tmp_path),
        cuda=cuda,
        timeout=600,
        env=None if cuda else {"CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def cpu_report(request, tmp_path_factory):
    return _run(request.param, "cpu", "gloo", tmp_path_factory.mktemp("fw-cpu"))


@pytest.mark.parametrize("name", NAMES)
def test_framework_call_matches_gloo(cpu_report, name):
    world, per_rank = cpu_report
    if name in VERSION_DEPENDENT and TORCH_LINE not in CHECKED_LINES:
        # A torch line CI does not run (framework_cases.py): odc equals gloo, or (monitored
        # barrier) torch refused it by name on odc.
        for rank, rep in enumerate(per_rank):
            diff, kind = rep[name]
            assert diff is None or (
                name == "monitored_barrier_default_group" and kind == "error"
            ), f"world {world} rank {rank} {name}: {rep[name]}"
        return
    if name in EXPECTED_GLOO_DIFFERENCES:
        # monitored_barrier: torch refuses it by backend name, on odc as on nccl. The flat
        # all_gather_into_tensor output: odc takes it as nccl does (accelerate relies on it).
        for rank, rep in enumerate(per_rank):
            diff, kind = rep[name]
            assert diff is not None and kind == EXPECTED_GLOO_DIFFERENCES[name], (
                f"world {world} rank {rank} {name}: {rep[name]}"
            )
        return
    assert_case(world, per_rank, name, GLOO_REJECTS)


@pytest.fixture(
    scope="module", params=[w for w in (2, 4) if w <= GPUS] or [2], ids=lambda w: f"world{w}"
)
def gpu_report(request, tmp_path_factory):
    if GPUS < 2:
        pytest.skip("needs at least 2 CUDA GPUs (nccl reference)")
    return _run(request.param, "cuda", "nccl", tmp_path_factory.mktemp("fw-gpu"))


@pytest.mark.parametrize("name", NAMES)
def test_gpu_framework_call_matches_nccl(gpu_report, name):
    world, per_rank = gpu_report
    assert_case(world, per_rank, name, NCCL_REJECTS)
