"""HSDP under ODC: on-demand gathers and pushes inside each shard group, one all-reduce of the
accumulators per minibatch across replicas.

A (2 replicas x 2 shards) mesh on 4 CPU ranks with per-rank microbatch counts that differ across
shards and across replicas (zero included) ends like a float64 single process on the union of
the samples, and like FSDP2's own HSDP over collectives (equal counts there); fp32 and bf16
mixed precision; a divide factor. A (2 x 1) mesh keeps FSDP2's own path with a warning. Ranks of
one machine presented as several hosts (ODC_HOST_ID): a 1-D mesh over them keeps collective
semantics with a warning that shows the HSDP mesh to use; an HSDP mesh with one host per shard
group runs on demand.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from multiproc import run_ranks
from test_conformance import BF16, FP32, REL16, make_model, reference, train

UNEVEN = [[1, 2, 0, 3], [3, 0, 1, 1], [0, 0, 2, 1], [2, 2, 0, 0]]
EVEN = [[2, 2, 2, 2], [1, 1, 1, 1], [3, 3, 3, 3]]
MESH = (2, 2)


def _close(results, cfg, plan, world, tol=2e-5):
    want = reference(cfg, plan, world)
    init = {k: v.float() for k, v in make_model(cfg).state_dict().items()}
    moved = max((ref - init[k]).abs().max().item() for k, ref in want.items())
    atol = tol * moved if tol == REL16 else tol
    assert moved > 20 * atol
    for rank, got in enumerate(results):
        for key, ref in want.items():
            torch.testing.assert_close(got[key], ref, rtol=0, atol=atol,
                                       msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")


@pytest.mark.parametrize("name,cfg,tol", [
    # No-sync microbatches: set_requires_gradient_sync(True) on the last one must not turn
    # FSDP2's per-microbatch all-reduce across replicas back on (it hung with uneven counts).
    ("fp32", {"mesh": MESH, "branch": True, "no_sync": True}, 2e-5),
    ("bf16", {"mesh": MESH, "mp": (BF16, FP32)}, REL16),
    ("divide-factor-1", {"mesh": MESH, "divide_factor": 1.0}, 2e-5),
    # .grad kept across optimizer steps: the kept part stays out of the replicas' sum. With an
    # FSDP unit of two modules (one key).
    ("grads-kept-across-steps", {"mesh": MESH, "branch": True, "zero_grad": "keep",
                                 "norm": "affine", "units": [["norm", "head"]]}, 2e-5),
])
def test_hsdp_uneven_counts_across_shards_and_replicas_equal_the_reference(name, cfg, tol):
    _close(run_ranks(4, train, cfg, UNEVEN), cfg, UNEVEN, 4, tol)


def test_hsdp_odc_equals_fsdp2_hsdp_over_collectives():
    cfg = {"mesh": MESH}
    odc = run_ranks(4, train, cfg, EVEN)
    fsdp2 = run_ranks(4, train, {**cfg, "attach": False}, EVEN)
    for a, b in zip(odc, fsdp2, strict=True):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=2e-5)
    _close(odc, cfg, EVEN, 4)


def _with_host_ids(rank, world, cfg, plan, hosts):
    os.environ["ODC_HOST_ID"] = f"host{rank // (world // hosts)}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        params = train(rank, world, cfg, plan)
    return params, [str(w.message) for w in caught if "torch_odc" in str(w.message)]


def test_a_mesh_of_shard_groups_of_one_rank_keeps_fsdp2s_own_path():
    cfg = {"mesh": (2, 1)}
    plan = [[2, 2], [1, 1], [3, 3]]
    results = run_ranks(2, _with_host_ids, cfg, plan, 1)
    for _, caught in results:
        assert any("shard groups of one rank" in m for m in caught), caught
    _close([p for p, _ in results], cfg, plan, 2)


def test_a_1d_mesh_over_several_hosts_keeps_collectives_and_names_the_hsdp_mesh():
    results = run_ranks(4, _with_host_ids, {}, EVEN, 2)
    for _, caught in results:
        assert any("spans 2 hosts" in m and "(2, 2)" in m and '"replicate", "shard"' in m
                   for m in caught), caught
    _close([p for p, _ in results], {}, EVEN, 4)


def test_an_hsdp_mesh_with_one_host_per_shard_group_runs_on_demand():
    results = run_ranks(4, _with_host_ids, {"mesh": MESH}, UNEVEN, 2)
    for _, caught in results:
        assert caught == [], caught
    _close([p for p, _ in results], {"mesh": MESH}, UNEVEN, 4)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                    reason="needs 4 CUDA GPUs (one per rank: the replicas all-reduce over NCCL)")
@pytest.mark.parametrize("mp", [None, (BF16, FP32)], ids=["fp32", "bf16"])
def test_gpu_hsdp_2x2_uneven_counts_equal_the_reference(mp):
    cfg = {"mesh": MESH, "device": "cuda", "branch": True, "mp": mp}
    shards = run_ranks(4, train, cfg, UNEVEN, cuda=True)
    for replica in (shards[:2], shards[2:]):  # ranks 0-1 and 2-3 each hold the whole model
        got = {k: torch.cat([r[k] for r in replica]) for k in replica[0]}
        _close([got], cfg, UNEVEN, 4, REL16 if mp else 2e-5)
