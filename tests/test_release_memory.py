"""Memory given back between phases: ``model.to()`` on an attached model, and
``torch_odc.release_memory()`` / ``restore_memory()`` (docs/fsdp2-support.md, "Memory between
phases").

RL alternates a rollout, in which the trainer's model neither trains nor runs, and an update:
verl's ``param_offload`` is ``model.to("cpu")`` / ``model.to(device)`` around every phase switch.
Under ODC the sharded parameters live in ODC's shard caches, and FSDP2's ``_apply`` swaps the
tensor inside every sharded parameter (and its ``.grad``): nothing of ODC may hold a reference
that blocks the swap, and what ODC made of the old tensors must be made again. These tests run
real CPU process groups (shared memory) with uneven microbatch counts (zero included) and
compare against the same training without the phase switch and against a single process.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks
from odc_training import loss_of, reference, samples, sharded_model, split

# Microbatches per rank and minibatch; rank 0 runs none in minibatch 2.
PLAN = [[2, 1], [1, 3], [0, 2], [2, 2]]
LR = 0.1


def odc_segments() -> list[str]:
    """The shared-memory segments of ODC (region and accumulators) this process maps."""
    import re

    with open("/proc/self/maps") as f:
        return sorted(
            {
                line.split()[5]
                for line in f
                if len(line.split()) > 5 and re.search(r"/odc-[0-9]", line.split()[5])
            }
        )


def _train(rank, world, switch, device="cpu"):
    """PLAN under FSDP2 + ODC; `switch` says what runs between minibatches:

    * None: nothing (the run the others must equal);
    * "to": after minibatch 0's step, with every ``.grad`` still held, ``model.to(float64)``,
      ``model.to(float32)`` (every sharded parameter and ``.grad`` swapped), then zero_grad;
      after minibatch 1 (``.grad`` None) ``model.to("cpu")`` and the float64 round trip again;
    * "release": after minibatch 0's step, with ``.grad`` still held, ``release_memory()``,
      checks that nothing of ODC is mapped, zero_grad, ``restore_memory()``; after minibatch
      1, a forward without gradients (it starts the next minibatch), ``release_memory()`` and
      the float64 round trip on the released model, restored by each rank's next forward
      (rank 0, with no microbatch in minibatch 2: its barrier).
    """
    import torch_odc

    model = sharded_model(world, device)
    dev = next(model.parameters()).device
    handle = torch_odc.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = {"mapped_when_released": [], "region_when_released": [], "free_when_released": []}
    for mb, counts in enumerate(PLAN):
        seqs = split(counts, samples(mb, sum(counts)))
        tokens = sum(s.shape[1] - 1 for part in seqs for s in part)
        for seq in seqs[rank]:
            (loss_of(model, seq.to(dev)) * world / tokens).backward()
        torch_odc.minibatch_barrier()
        opt.step()
        if switch == "to" and mb == 0:
            model.to(torch.float64)
            model.to(torch.float32)
        if switch == "to" and mb == 1:
            opt.zero_grad()
            model.to("cpu")
            model.to(torch.float64)
            model.to(torch.float32)
            model.to(dev)
        if switch == "release" and mb in (0, 1):
            if mb == 1:
                opt.zero_grad()
                with torch.no_grad():  # log-probs of the next rollout: forwards only
                    model(samples(9, 2)[rank][:, :-1].to(dev))
            if dev.type == "cuda" and mb == 1:
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
                torch.distributed.barrier()
                before = torch.cuda.mem_get_info(dev)[0]
                torch.distributed.barrier()
            torch_odc.release_memory()
            if dev.type == "cuda" and mb == 1:
                # What the driver got back on this GPU, every rank's region and parameters,
                # once the model is on the CPU (verl's param_offload).
                model.to("cpu")
                torch.cuda.empty_cache()
                torch.distributed.barrier()
                out["free_when_released"].append(torch.cuda.mem_get_info(dev)[0] - before)
            out["mapped_when_released"].append(odc_segments())
            out["region_when_released"].append(torch_odc.stats()[0]["region_bytes"])
            assert handle.released
            if mb == 0:
                assert all(p.grad is not None for p in model.parameters())  # copies, kept
            if mb == 1:
                model.to(torch.float64)
                model.to(torch.float32)
                model.to("cpu")
                model.to(dev)
        opt.zero_grad()
        if switch == "release" and mb == 0:
            torch_odc.restore_memory()
            assert not handle.released
    out["released_at_end"] = handle.released
    out["mapped_after_restore"] = bool(odc_segments())
    out["fast_push"] = [k.fast_push for k in handle._keys if any(k.grad_numels)]
    out["region_bytes_attached"] = torch_odc.stats()[0]["region_bytes"]
    out["params"] = {
        k: v.full_tensor().detach().float().cpu() for k, v in model.state_dict().items()
    }
    handle.detach()
    return out


@pytest.fixture(scope="module")
def runs():
    return {switch: run_ranks(2, _train, switch) for switch in (None, "to", "release")}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize("switch", ["to", "release"])
def test_training_after_a_phase_switch_equals_training_without(runs, switch):
    """ODC's own accumulation order differs from run to run by ~1e-8 (two ranks push into one
    accumulator concurrently), so both runs are held to the same bound, and to a single process
    trained on the union of the data."""
    plain, switched = runs[None][0]["params"], runs[switch][0]["params"]
    ref = reference(PLAN, False, LR)
    assert _max_diff(plain, switched) < 1e-6
    assert _max_diff(switched, ref) < 2e-6
    assert _max_diff(plain, ref) < 2e-6
    # The C++ fast path came back with the new tensors on every key.
    assert all(all(r["fast_push"]) for r in runs[switch])


def test_release_gives_back_every_segment_and_restore_brings_them_back(runs):
    for rank_out in runs["release"]:
        assert rank_out["mapped_when_released"] == [[], []]
        assert rank_out["region_when_released"] == [0, 0]
        assert not rank_out["released_at_end"]
        assert rank_out["mapped_after_restore"]


def _misuse(rank, world):
    import torch_odc

    model = sharded_model(world, "cpu")
    handle = torch_odc.attach(model)
    errors = {}
    with torch.no_grad():
        model(samples(0, 1)[0][:, :-1])  # forwards only: nothing is lost by a release
    torch_odc.release_memory()
    errors["released_after_forward"] = handle.released
    loss_of(model, samples(0, world)[rank]).backward()  # restores, then pushes
    try:
        torch_odc.release_memory()
    except RuntimeError as e:
        errors["pushed"] = str(e)
    torch_odc.minibatch_barrier()
    torch_odc.release_memory()
    model.to(torch.float64)
    try:
        torch_odc.restore_memory()
    except RuntimeError as e:
        errors["dtype"] = str(e)
    model.to(torch.float32)
    torch_odc.restore_memory()
    handle.detach()
    return errors


def test_release_refuses_a_minibatch_with_gradients_and_restore_names_a_changed_model():
    for rank, errors in enumerate(run_ranks(2, _misuse)):
        assert errors["released_after_forward"]
        assert f"rank {rank}" in errors["pushed"]
        assert "holds gradients" in errors["pushed"] and "would be lost" in errors["pushed"]
        assert "float64" in errors["dtype"] and "re-attach" in errors["dtype"]


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_transport() -> bool:
    import torch_odc

    return torch_odc._C._has_cuda_transport()


@pytest.mark.skipif(GPUS < 1 or not _cuda_transport(), reason="needs a GPU and a CUDA build")
def test_gpu_release_returns_the_region_and_training_equals_training_without():
    """Two ranks on the first GPUs (sharing one where there is one): release_memory() gives the
    driver back at least every rank's region on that GPU, and the training equals the run
    without it and a single process."""
    plain = run_ranks(2, _train, None, "cuda", cuda=True)
    switched = run_ranks(2, _train, "release", "cuda", cuda=True)
    moved = run_ranks(2, _train, "to", "cuda", cuda=True)
    ref = reference(PLAN, False, LR)
    for a, b in ((plain, switched), (plain, moved)):
        assert _max_diff(a[0]["params"], b[0]["params"]) < 1e-5
        assert _max_diff(b[0]["params"], ref) < 1e-5
    regions = sum(r["region_bytes_attached"] for r in switched)
    per_gpu = regions if GPUS == 1 else regions // 2
    for r in switched:
        assert len(r["free_when_released"]) == 1
        assert r["free_when_released"][0] >= per_gpu, (r["free_when_released"], per_gpu)
