"""A rank SIGKILLed mid-training under ``torchrun --max-restarts=1``: the surviving rank gets
ODC's dead-peer error, the agent restarts both workers, the new attempt resumes from the last
DCP checkpoint (model + optimizer) and ends with the parameters of an uninterrupted run of the
same script; nothing of either attempt is left in /dev/shm.

Both runs are tests/restart_train.py on 2 CPU ranks over the "odc" backend, with per-rank
microbatch counts that differ in every step. Tolerance: ODC adds the pushes of both ranks into
an owner's fp32 accumulator in arrival order, so with several microbatches per rank the sum's
rounding depends on timing: two uninterrupted runs already differ by up to 1.2e-7 (measured on
2 CPU cores, torch 2.11; with one microbatch per rank, where the order cannot matter, the
restarted run is bit-identical). ATOL is 2e-6, and the test checks that every step moves the
parameters by far more, so a replayed or skipped step, or lost optimizer state, would fail it.

Runs with torchrun's defaults: torchrun reuses the agent's TCPStore for the restarted workers
without a per-attempt prefix (torch 2.11 and 2.15; pytorch#135712), so a plain "gloo" job's
restart reads the dead attempt's keys and fails in connectFullMesh. The odc backend puts every key
of its own and of its inner backends under a per-attempt prefix (torch_odc/_backend.py), so this
job restarts cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from failure_cases import odc_shm_names

import torch_odc

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "restart_train.py")
KILL_STEP = 3  # checkpoints after steps 1, 3, 5: the restart resumes at step 2
ATOL = 2e-6


def torchrun(out: str, kill_step: int | None, limit_s: float = 150.0) -> float:
    """Runs the script under torchrun (max one restart) writing into `out`; returns seconds."""
    os.makedirs(out)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.5",
        SCRIPT,
        "--out",
        out,
    ]
    if kill_step is not None:
        cmd += ["--kill-step", str(kill_step)]
    # The workers import the torch_odc this test imported.
    root = os.path.dirname(os.path.dirname(os.path.abspath(torch_odc.__file__)))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    log_path = os.path.join(out, "torchrun.log")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        # Own session: on a timeout the agent and its workers are killed together.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    elapsed = time.perf_counter() - start
    with open(log_path) as f:
        log_text = f.read()
    assert rc == 0, f"torchrun {'timed out' if rc is None else f'exited {rc}'}:\n{log_text[-6000:]}"
    return elapsed


def records(out: str) -> dict[tuple[int, int], dict]:
    """(attempt, rank) -> what that worker process wrote about itself."""
    got = {}
    for name in os.listdir(out):
        if name.startswith("attempt") and name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                rec = json.load(f)
            got[rec["attempt"], rec["rank"]] = rec
    return got


def leftover_regions(recs: list[dict]) -> list[str]:
    """/dev/shm regions named after one of these processes (/odc-<token>-<pid>-r<rank>)."""
    mine = {f"-{r['pid']}-r{r['rank']}" for r in recs}
    return sorted(n for n in odc_shm_names() if any(n.endswith(m) for m in mine))


@pytest.mark.timeout(360)
def test_killed_rank_restarts_from_checkpoint_with_uninterrupted_parameters(tmp_path):
    ref_s = torchrun(str(tmp_path / "ref"), None)
    killed_s = torchrun(str(tmp_path / "killed"), KILL_STEP)

    ref, run = records(str(tmp_path / "ref")), records(str(tmp_path / "killed"))
    # The uninterrupted run: one attempt, every step.
    assert sorted(ref) == [(0, 0), (0, 1)], sorted(ref)
    assert all(r["steps_done"] == list(range(6)) and "done" in r for r in ref.values()), ref
    # The killed run: two attempts; the second resumed from the checkpoint after step 1.
    assert sorted(run) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(run)
    victim, survivor = run[0, 1], run[0, 0]
    assert "killed" in victim and "done" not in victim and "done" not in survivor, run
    assert victim["steps_done"] == [0, 1, 2], victim
    for rank in (0, 1):
        again = run[1, rank]
        assert again["resumed_at_step"] == 2 and again["steps_done"] == [2, 3, 4, 5], again
        assert "done" in again and "error" not in again, again
    # The survivor either got ODC's dead-peer error within seconds (well before the 10 s
    # process-group timeout) or was torn down by the agent first (no error recorded).
    if "error" in survivor:
        assert "peer rank 1" in survivor["error"], survivor["error"]
        assert survivor["error_time"] - victim["killed"] < 5.0, survivor
    killed_at = victim["killed"]
    restarted = min(run[1, r]["start"] for r in (0, 1))
    pg_ready = max(run[1, r]["pg_ready"] for r in (0, 1))
    resumed = max(run[1, r]["resumed"] for r in (0, 1))
    print(
        f"uninterrupted run {ref_s:.1f} s, killed + restarted run {killed_s:.1f} s; "
        f"survivor: {survivor.get('error', 'torn down by the agent')} "
        f"({survivor.get('error_time', killed_at) - killed_at:.3f} s after the kill); "
        f"after the kill: new workers started {restarted - killed_at:.2f} s, group ready "
        f"{pg_ready - killed_at:.2f} s, checkpoint loaded {resumed - killed_at:.2f} s"
    )

    # Same parameters as the uninterrupted run (ATOL: see the module docstring), and far from
    # what one step more or less, or lost momentum, would give.
    want = torch.load(tmp_path / "ref" / "final.pt")
    got = torch.load(tmp_path / "killed" / "final.pt")
    assert sorted(got) == sorted(want)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    same = all(torch.equal(got[k], want[k]) for k in want)
    smallest_step = min(max(ref[0, r]["update_max"][s] for r in (0, 1)) for s in range(6))
    print(
        f"max |restarted - uninterrupted| {diff:.2e} (bit-identical: {same}); smallest "
        f"step update {smallest_step:.2e}"
    )
    assert smallest_step > 100 * ATOL, smallest_step
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], rtol=0, atol=ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )

    # Nothing of any of the 6 processes is left in /dev/shm.
    assert leftover_regions([*ref.values(), *run.values()]) == []
