"""The killed/hung peer flow shared by the CPU and GPU failure tests, and its checks."""

from __future__ import annotations

import os

PG_TIMEOUT = 3.0
MICROBATCHES = 3


def odc_shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("odc-")}


def fail_in_second_minibatch(rank, world, how, eager, device="cpu"):
    """One good minibatch, then rank 1 dies (`kill`) or stops (`hang`) before its second; rank 0
    queues MICROBATCHES microbatches of it (on GPUs 8+ device waits each) and the barrier.
    Returns rank 0's error and the seconds from the start of its second minibatch to it."""
    import signal
    import time

    import torch
    from odc_training import loss_of, samples, sharded_model

    import torch_odc

    cuda = device == "cuda"
    model = sharded_model(world, device)
    dev = next(model.parameters()).device
    torch_odc.attach(model, eager_publish=eager)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seq in samples(0, 2):
        loss_of(model, seq.to(dev)).backward()
    torch_odc.minibatch_barrier()
    opt.step()
    opt.zero_grad()
    if cuda:
        torch.cuda.synchronize()
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(2 * PG_TIMEOUT + (2 if cuda else 0))  # hung: alive, never publishes
        return None
    start = time.perf_counter()
    try:
        for seq in samples(1, MICROBATCHES):
            loss_of(model, seq.to(dev)).backward()
        torch_odc.minibatch_barrier()
    except RuntimeError as err:
        return str(err), time.perf_counter() - start
    return "no error", time.perf_counter() - start


def check_failure_report(how, eager, msg, elapsed, shm_before):
    """Rank 0's error names itself, the peer and the minibatch; a killed peer is reported by
    liveness within seconds, a hung one at 0.98-1.1x the timeout; nothing left in /dev/shm."""
    print(f"{how} {'eager' if eager else 'lazy'}: rank 0 raised after {elapsed:.3f} s: {msg}")
    assert "odc: rank 0" in msg and "peer rank 1" in msg and "minibatch 2" in msg, msg
    if how == "kill":
        assert "exited" in msg, msg
        assert elapsed < 5.0, (elapsed, msg)
    else:
        assert "timed out" in msg, msg
        assert PG_TIMEOUT * 0.98 <= elapsed <= PG_TIMEOUT * 1.1, (elapsed, msg)
    assert odc_shm_names() <= shm_before, "shared-memory regions left in /dev/shm"
