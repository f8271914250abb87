"""Failures on CPU ranks (shared-memory transport) end fast and name the peer: a SIGKILLed peer is
reported within seconds and a hung one at the process group's timeout, however many operations
the survivor queued (several microbatches, eager and lazy publishing); nothing is left in
/dev/shm. The transport's own failure paths (spoofed segments, a rank dying during attach or
holding an accumulation lock) are tested in tests/cpp/test_shm_failures.cpp."""

import os

import pytest
from multiproc import run_ranks

PG_TIMEOUT = 3.0
MICROBATCHES = 3


def _odc_shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("odc-")}


def _fail_in_second_minibatch(rank, world, how, eager):
    """One good minibatch, then rank 1 dies (`kill`) or stops (`hang`) before its second;
    rank 0 runs MICROBATCHES microbatches of it. Returns rank 0's error and seconds to it."""
    import signal
    import time

    import torch
    from odc_training import loss_of, samples, sharded_model

    import torch_odc

    model = sharded_model(world)
    torch_odc.attach(model, eager_publish=eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seq in samples(0, 2):
        loss_of(model, seq).backward()
    torch_odc.minibatch_barrier()
    opt.step()
    opt.zero_grad()
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2 * PG_TIMEOUT)  # hung: alive, never publishes
        return None
    start = time.perf_counter()
    try:
        for seq in samples(1, MICROBATCHES):
            loss_of(model, seq).backward()
        torch_odc.minibatch_barrier()
    except RuntimeError as err:
        return str(err), time.perf_counter() - start
    return "no error", time.perf_counter() - start


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "lazy"])
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_peer_is_reported_fast_naming_it(how, eager):
    before = _odc_shm_names()
    results = run_ranks(2, _fail_in_second_minibatch, how, eager, pg_timeout=PG_TIMEOUT,
                        may_die=(1,))
    msg, elapsed = results[0]
    print(f"{how} {'eager' if eager else 'lazy'}: rank 0 raised after {elapsed:.3f} s: {msg}")
    assert "odc: rank 0" in msg and "peer rank 1" in msg and "minibatch 2" in msg, msg
    if how == "kill":
        assert "exited" in msg, msg
        assert elapsed < 5.0, (elapsed, msg)
        assert elapsed < PG_TIMEOUT / 2, (elapsed, msg)  # liveness, not the timeout
    else:
        assert "timed out" in msg, msg
        assert PG_TIMEOUT * 0.98 <= elapsed <= PG_TIMEOUT * 1.1, (elapsed, msg)
    assert _odc_shm_names() <= before, "shared-memory regions left in /dev/shm"
