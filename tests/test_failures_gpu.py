"""Failures on GPUs (CUDA IPC transport) end in seconds, not hours: with several microbatches of
device waits queued (eager and lazy publishing), a SIGKILLed peer is reported within 5 s (the
watchdog sees its life lock) and a hung one at 1.0-1.1x the process group's timeout (one
deadline per operation, one abort word for all); the error names the peer; abort() with a
device wait pending returns within seconds. Two ranks may share one GPU (CUDA IPC works
between processes on one device), so this runs on 1-GPU machines. Skipped without CUDA."""

import os

import pytest
import torch
from multiproc import run_ranks

import torch_odc

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch_odc._C._has_cuda_transport(),
    reason="needs a CUDA GPU and a CUDA build",
)
PG_TIMEOUT = 3.0
MICROBATCHES = 3


def _odc_shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("odc-")}


def _fail_in_second_minibatch(rank, world, how, eager):
    """One good minibatch, then rank 1 dies (`kill`) or stops (`hang`) before its second; rank 0
    queues MICROBATCHES microbatches (8+ device waits each) and the barrier. Returns rank 0's
    error and the seconds from the start of its second minibatch to the error."""
    import signal
    import time

    from odc_training import loss_of, samples, sharded_model

    model = sharded_model(world, "cuda")
    dev = next(model.parameters()).device
    torch_odc.attach(model, eager_publish=eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seq in samples(0, 2):
        loss_of(model, seq.to(dev)).backward()
    torch_odc.minibatch_barrier()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2 * PG_TIMEOUT + 2)  # hung: alive, never publishes
        return None
    start = time.perf_counter()
    try:
        for seq in samples(1, MICROBATCHES):
            loss_of(model, seq.to(dev)).backward()
        torch_odc.minibatch_barrier()
    except RuntimeError as err:
        return str(err), time.perf_counter() - start
    return "no error", time.perf_counter() - start


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_gpu_a_dead_or_hung_peer_is_reported_fast_naming_it(how, eager):
    before = _odc_shm_names()
    results = run_ranks(2, _fail_in_second_minibatch, how, eager, cuda=True,
                        pg_timeout=PG_TIMEOUT, may_die=(1,))
    msg, elapsed = results[0]
    print(f"{how} {'eager' if eager else 'lazy'}: rank 0 raised after {elapsed:.3f} s: {msg}")
    assert "odc: rank 0" in msg and "peer rank 1" in msg and "minibatch 2" in msg, msg
    if how == "kill":
        assert "exited" in msg, msg
        assert elapsed < 5.0, (elapsed, msg)
    else:
        assert "timed out" in msg, msg
        assert PG_TIMEOUT * 0.98 <= elapsed <= PG_TIMEOUT * 1.1, (elapsed, msg)
    assert _odc_shm_names() <= before, "shared-memory regions left in /dev/shm"


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
