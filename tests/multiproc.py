"""Runs a function in real process groups: N spawned processes, one rank each.

Every rank calls ``fn(rank, world_size, *args)`` after ``init_process_group`` over a FileStore;
``run_ranks`` returns the per-rank results, or raises with the traceback of every failing rank.
A hung group is killed after ``timeout`` seconds and reported as such, never left behind.

Warm ranks: a call on CPU ranks runs in processes kept from an earlier call of the same world
size and environment (a new process group over a new FileStore each time, torch's generator
reseeded as a new process has it), so the suite pays python's and torch's start-up once per
pool rather than once per case (a few seconds of CPU a rank). A process takes the next call
only when its last one left it as a new one would be: every rank returned, no process group is
left, no ODC region is still mapped (after a garbage collection), torch's default dtype, grad
mode, deterministic setting and thread count are the defaults, nothing was compiled (dynamo,
compiled autograd), os.environ and the threads are unchanged, and no trainer framework
(transformers, TRL, accelerate, peft, verl, datasets) was imported; otherwise its pool is
closed and the next call starts new processes. Calls that expect a rank to die or a short
process-group timeout (failure tests), and GPU calls, always start new processes;
ODC_TEST_FRESH_RANKS=1 starts new processes for every call.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import queue
import sys
import tempfile
import traceback

import torch.multiprocessing as mp


def _call(rank, world_size, backend, store_path, fn, args, pg_timeout):
    """fn(rank, world_size, *args) in a new process group over the FileStore at store_path."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        return fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker(
    rank, world_size, backend, store_path, fn, args, results, device_per_rank, env, pg_timeout
):
    os.environ.update(env)
    # A rank that crashes (SIGSEGV, SIGABRT) prints its Python stack to stderr, which pytest
    # shows with the failure ("ranks [r] exited with codes [-11] without a result").
    faulthandler.enable()
    try:
        import torch

        # torch was imported (with this module) before `env` applied: set its intra-op threads
        # here, or every rank runs OpenMP workers that spin against the other ranks' threads.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

        import torch_odc  # noqa: F401  (registers "odc")

        if device_per_rank:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        value = _call(rank, world_size, backend, store_path, fn, args, pg_timeout)
        # Plain pickle: tensors travel by value, not as shared-memory handles that die with us.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))


# What a process must look like after a call to take the next one (see the module docstring).
_FRAMEWORKS = ("transformers", "trl", "accelerate", "peft", "verl", "datasets")
# Set by torch itself at first use (its inductor cache under the run's TMPDIR), the same in
# every process of the run: not a difference from a fresh process.
_LAZY_ENV = ("TORCHINDUCTOR_CACHE_DIR",)


def _environ():
    return {k: v for k, v in os.environ.items() if k not in _LAZY_ENV}


def _threads(threading):
    # The feeder thread of the results queue starts at this process's first answer.
    return sorted(t.name for t in threading.enumerate() if t.name != "QueueFeederThread")


def _odc_regions_mapped():
    """Whether this process still maps an ODC shared-memory region (``/odc-...``)."""
    with open("/proc/self/maps") as f:
        return any("/odc-" in line for line in f)


def _state(torch):
    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(),
        _compiled(),
    )


def _compiled():
    """Whether a call compiled anything (torch.compile, compiled autograd): dynamo's caches and
    FSDP2's compiled-autograd flag (read at each lazy init, kept by a backward that raised
    inside compiled autograd) outlive the call."""
    utils = sys.modules.get("torch._dynamo.utils")
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    common = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_common")
    return bool(
        (utils is not None and utils.counters.get("frames"))
        or (ca is not None and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region))
        or (common is not None and getattr(common, "_compiled_autograd_enabled", False))
    )


def _pooled_worker(rank, env, jobs, results):
    """One warm rank: runs the calls sent on `jobs` until told to stop or until a call leaves
    the process other than a fresh one would be (then it reports so and exits)."""
    os.environ.update(env)
    faulthandler.enable()
    import threading

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import torch_odc  # noqa: F401  (registers "odc")

    seed = torch.initial_seed()
    fresh = (_state(torch), _environ(), _threads(threading))
    while True:
        job = jobs.get()
        if job is None:
            return
        job_id, world_size, backend, store_path, fn, args, pg_timeout = job
        torch.manual_seed(seed)  # what a new process's generator would give
        try:
            value = _call(rank, world_size, backend, store_path, fn, args, pg_timeout)
            payload, ok = pickle.dumps(value), True
            del value
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            payload, ok = traceback.format_exc(), False
        # The call's garbage goes now (a model and its handle hold each other, and with them
        # what views ODC's regions): a new process has none.
        gc.collect()
        reusable = (
            ok
            and not dist.is_initialized()
            and not _odc_regions_mapped()
            and (_state(torch), _environ(), _threads(threading)) == fresh
            and not any(name in sys.modules for name in _FRAMEWORKS)
        )
        results.put((job_id, rank, ok, payload, reusable))
        if not reusable:
            return


class _Pool:
    """world_size warm ranks sharing one environment (see the module docstring)."""

    def __init__(self, world_size, env):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.procs = [
            ctx.Process(
                target=_pooled_worker, args=(r, env, self.jobs[r], self.results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def close(self, wait=5.0):
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self.procs:
            p.join(timeout=wait)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS = {}  # (world_size, env items) -> _Pool, at most _MAX_POOLS, the latest used last
_MAX_POOLS = 3  # world sizes 1, 2 and 4
_job_ids = iter(range(1, 1 << 62))


def _pooled(world_size, env):
    key = (world_size, tuple(sorted(env.items())))
    pool = _POOLS.pop(key, None)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(wait=0)
        pool = _Pool(world_size, env)
    _POOLS[key] = pool
    while len(_POOLS) > _MAX_POOLS:
        _POOLS.pop(next(iter(_POOLS))).close()
    return key, pool


def _run_ranks_pooled(world_size, fn, args, backend, timeout, env, pg_timeout):
    key, pool = _pooled(world_size, env)
    job_id = next(_job_ids)
    outcome, failures, reusable = {}, [], True
    with tempfile.TemporaryDirectory(prefix="odc-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        for q in pool.jobs:
            q.put((job_id, world_size, backend, store_path, fn, args, pg_timeout))
        failures = _collect(pool.procs, pool.results, outcome, timeout, (), job_id)
        if failures or len(outcome) < world_size:
            reusable = False
        else:
            reusable = all(flag for _, flag in outcome.values())
    if not reusable:
        _POOLS.pop(key, None)
        pool.close()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome[r][0] for r in range(world_size)]


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
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    warm = (
        not cuda
        and not may_die
        and pg_timeout >= 60.0
        and os.environ.get("ODC_TEST_FRESH_RANKS") != "1"
    )
    for attempt in (1, 2):
        try:
            if warm:
                return _run_ranks_pooled(world_size, fn, args, backend, timeout, env, pg_timeout)
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
        outcome = {}
        try:
            failures = _collect(procs, results, outcome, timeout, may_die, None)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome[r][0] if r in outcome else None for r in range(world_size)]


def _collect(procs, results, outcome, timeout, may_die, job_id):
    """Waits for every rank's result (outcome[rank] = (value, reusable)); returns the failures.
    Results of the pooled workers carry job_id first (checked) and whether the process may take
    the next call last; those of one-shot workers neither."""
    world_size = len(procs)
    failures = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while len(set(outcome) | {r for r in may_die if not procs[r].is_alive()}) < world_size:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outcome))
            failures.append(f"ranks {missing} did not finish within {timeout:.0f} s")
            break
        try:
            message = results.get(timeout=min(remaining, 1.0))
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
        if job_id is None:
            (rank, ok, value), reusable = message, False
        else:
            got_id, rank, ok, value, reusable = message
            assert got_id == job_id, f"rank {rank} answered call {got_id}, not {job_id}"
        outcome[rank] = (pickle.loads(value) if ok else value, reusable)
        if not ok:
            failures.append(f"rank {rank} failed:\n{value}")
            # Peers of a failed rank may hang in a collective: give them a moment only.
            deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=15))
    return failures
