"""Runs a function in real process groups: N spawned processes, one rank each.

Every rank calls ``fn(rank, world_size, *args)`` after ``init_process_group`` over a FileStore;
``run_ranks`` returns the per-rank results, or raises with the traceback of every failing rank.
A hung group is killed after ``timeout`` seconds and reported as such, never left behind.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import queue
import sys
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(
    rank, world_size, backend, store_path, fn, args, results, device_per_rank, env, pg_timeout
):
    os.environ.update(env)
    # A rank that crashes (SIGSEGV, SIGABRT) prints its Python stack to stderr, which pytest
    # shows with the failure ("ranks [r] exited with codes [-11] without a result").
    faulthandler.enable()
    try:
        import torch
        import torch.distributed as dist

        # torch was imported (with this module) before `env` applied: set its intra-op threads
        # here, or every rank runs OpenMP workers that spin against the other ranks' threads.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

        import torch_odc  # noqa: F401  (registers "odc")

        if device_per_rank:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with us.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    world_size,
    fn,
    *args,
    backend="odc",
    timeout=180.0,
    cuda=False,
    env=None,
    pg_timeout=60.0,
    may_die=(),
):
    """Runs fn on world_size ranks of a fresh process group; returns [result of rank r].

    pg_timeout is the process group's timeout (what every ODC wait honours). Ranks in may_die
    may exit without a result (a test that kills them): their result is None.

    A run in which a rank failed while Gloo connected its TCP mesh (a process group being made:
    "Gloo connectFullMesh failed ... Connection closed by peer", seen about once per CI run on
    loopback, in init_process_group or a new_group, before the test's own code could decide
    anything) runs once more in fresh processes; every other failure fails the test."""
    for attempt in (1, 2):
        try:
            return _run_ranks_once(
                world_size, fn, args, backend, timeout, cuda, env, pg_timeout, may_die
            )
        except AssertionError as err:
            if attempt == 2 or _GLOO_MESH_FAILURE not in str(err):
                raise
            print(
                f"run_ranks: Gloo's mesh setup failed ({_GLOO_MESH_FAILURE}); running "
                f"{getattr(fn, '__name__', fn)} once more",
                file=sys.stderr,
                flush=True,
            )


_GLOO_MESH_FAILURE = "Gloo connectFullMesh failed"


def _run_ranks_once(world_size, fn, args, backend, timeout, cuda, env, pg_timeout, may_die):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="odc-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, store_path, fn, args, results, cuda, env, pg_timeout),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome, failures = {}, []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(set(outcome) | {r for r in may_die if not procs[r].is_alive()}) < world_size:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outcome))
                    failures.append(f"ranks {missing} did not finish within {timeout:.0f} s")
                    break
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [
                        r
                        for r, p in enumerate(procs)
                        if r not in outcome and r not in may_die and not p.is_alive()
                    ]
                    # A rank that died without reporting (segfault, os._exit) cannot answer.
                    if dead and results.empty():
                        failures.append(
                            f"ranks {dead} exited with codes "
                            f"{[procs[r].exitcode for r in dead]} without a result"
                        )
                        break
                    continue
                outcome[rank] = pickle.loads(value) if ok else value
                if not ok:
                    failures.append(f"rank {rank} failed:\n{value}")
                    # Peers of a failed rank may hang in a collective: give them a moment only.
                    deadline = min(
                        deadline, datetime.datetime.now() + datetime.timedelta(seconds=15)
                    )
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome.get(r) for r in range(world_size)]
