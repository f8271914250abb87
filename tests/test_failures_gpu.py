"""Failures on GPUs (CUDA IPC transport) end in seconds, not hours: with several microbatches of
device waits queued (eager and lazy publishing), a SIGKILLed peer is reported within 5 s (the
watchdog sees its life lock) and a hung one at 1.0-1.1x the process group's timeout (one
deadline per operation, one abort word for all); the error names the peer; abort() with a
device wait pending returns within seconds. Two ranks may share one GPU (CUDA IPC works
between processes on one device), so this runs on 1-GPU machines. Skipped without CUDA."""

import pytest
import torch
from failure_cases import PG_TIMEOUT, check_failure_report, fail_in_second_minibatch, odc_shm_names
from multiproc import run_ranks

import torch_odc

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available() or not torch_odc._C._has_cuda_transport(),
        reason="needs a CUDA GPU and a CUDA build",
    ),
    # Durations against the timeout and /dev/shm before/after: not beside other tests.
    pytest.mark.serial,
]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_gpu_a_dead_or_hung_peer_is_reported_fast_naming_it(how, eager):
    before = odc_shm_names()
    results = run_ranks(
        2,
        fail_in_second_minibatch,
        how,
        eager,
        "cuda",
        cuda=True,
        pg_timeout=PG_TIMEOUT,
        may_die=(1,),
    )
    msg, elapsed = results[0]
    check_failure_report(how, eager, msg, elapsed, before)


def _abort_with_a_wait_pending(rank, world):
    """Rank 1 never publishes in minibatch 1 (it sleeps 12 s, alive); rank 0 runs a microbatch,
    whose device waits spin (its host may block behind them, e.g. in a synchronizing copy), and
    a thread aborts the process group after 1 s, as a launcher's watchdog would. Returns the
    seconds from the abort until rank 0's microbatch is over and the GPU idle."""
    import threading
    import time

    from odc_training import loss_of, samples, sharded_model

    from torch_odc._backend import odc_backend

    model = sharded_model(world, "cuda")
    dev = next(model.parameters()).device
    torch_odc.attach(model, eager_publish=False)
    if rank == 1:
        time.sleep(12)
        return None
    backend, aborted = odc_backend(), []
    timer = threading.Timer(1.0, lambda: (aborted.append(time.perf_counter()), backend.abort()))
    timer.start()
    try:
        loss_of(model, samples(0, 1)[0].to(dev)).backward()
        torch.cuda.synchronize()
    except RuntimeError:
        pass  # what the aborted waits raise
    timer.join()
    torch.cuda.synchronize()  # every ODC kernel has returned
    return time.perf_counter() - aborted[0]


def test_gpu_abort_with_a_pending_device_wait_returns_within_seconds():
    elapsed = run_ranks(2, _abort_with_a_wait_pending, cuda=True, pg_timeout=60.0)[0]
    print(f"abort: rank 0's microbatch over {elapsed:.3f} s after abort()")
    assert elapsed < 5.0, elapsed  # the peer stays alive 11 s longer: only the abort ends it


def _support(rank, world):
    from torch_odc._backend import odc_backend

    return odc_backend()._cuda_transport_problem(torch.cuda.current_device())


def test_gpu_support_check_accepts_this_machine():
    """Peer access with native atomics between the ranks' GPUs (or one shared GPU), and kernels
    for their architecture: the check the CUDA transport runs at attach."""
    problems = run_ranks(2, _support, cuda=True)
    assert problems == ["", ""], problems
