"""Registration of the "odc" c10d backend and creation of its inner backends."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from torch_odc import _C

BACKEND_NAME = "odc"


def _make_gloo(store, rank: int, size: int, timeout):
    return dist.ProcessGroupGloo(dist.PrefixStore("odc/gloo/", store), rank, size, timeout)


CUDA_COLLECTIVES = ("auto", "nccl", "gloo")


def _cuda_collectives_mode() -> str:
    import os

    mode = os.environ.get("ODC_CUDA_COLLECTIVES", "auto")
    if mode not in CUDA_COLLECTIVES:
        raise ValueError(
            f"torch_odc: ODC_CUDA_COLLECTIVES={mode!r}: use auto (the default: NCCL, or Gloo for "
            "a group with two ranks on one GPU), nccl or gloo"
        )
    return mode


def _cuda_collectives_for(
    store,
    rank: int,
    size: int,
    ranks: list[int],
    device: str,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> str:
    """ODC_CUDA_COLLECTIVES=auto: "nccl", or "gloo" where two ranks of the group are on one GPU
    (NCCL refuses two ranks of a communicator on one device). Collective over the group through
    its store: every rank publishes its device (`device`, a GPU UUID) and reads the others', so
    every rank of the group decides the same. Waits at most `timeout` (the group's) for the
    others, then raises naming the ranks that did not come."""
    import warnings

    ranks = list(ranks) if len(ranks) == size else list(range(size))  # global ranks
    placement = dist.PrefixStore("odc/cuda-device/", store)
    placement.set(str(rank), device)
    others = [str(r) for r in range(size) if r != rank]
    try:
        if others:
            placement.wait(others, timeout)
    except Exception as exc:  # the store's timeout (DistStoreError) or a dead store
        try:
            missing = [ranks[int(r)] for r in others if not placement.check([r])]
        except Exception:  # noqa: BLE001 - the store itself is gone
            missing = "unknown (the store did not answer)"
        raise RuntimeError(
            f"torch_odc: rank {ranks[rank]}: the process group of ranks {ranks} ran its first "
            "CUDA collective, which picks its inner backend from every rank's GPU "
            "(ODC_CUDA_COLLECTIVES=auto: NCCL, or Gloo where two ranks share a GPU), and ranks "
            f"{missing} made no CUDA collective of this group within {timeout}. Every rank of a "
            "group makes its first CUDA collective together (as NCCL's own first one needs), "
            "or set ODC_CUDA_COLLECTIVES=nccl or =gloo to choose without asking the others."
        ) from exc
    devices = [device if r == rank else placement.get(str(r)).decode() for r in range(size)]
    by_device: dict[str, list[int]] = {}
    for r, d in enumerate(devices):
        by_device.setdefault(d, []).append(ranks[r])
    shared = [group for group in by_device.values() if len(group) > 1]
    if not shared:
        return "nccl"
    warnings.warn(
        f"torch_odc: ranks {' and '.join(str(g) for g in shared)} of the process group of ranks "
        f"{ranks} share a GPU, which NCCL refuses: this group's CUDA "
        "collectives run over Gloo (through host memory). ODC_CUDA_COLLECTIVES=gloo or =nccl "
        "chooses without this check.",
        stacklevel=2,
    )
    return "gloo"


def _cuda_factory(store, rank: int, size: int, timeout, ranks: list[int]):
    """Returns a callable that creates the inner backend for CUDA tensors (called at the group's
    first CUDA collective), or None without CUDA/NCCL.

    ``ODC_CUDA_COLLECTIVES`` picks it: ``auto`` (default) NCCL, unless two ranks of this group
    are on one GPU (checked at that first collective), which NCCL refuses: then Gloo (through
    host memory) serves this group's CUDA tensors, so a framework's few collectives per step (a
    grad norm, a loss gather) still run there. Per group: in an HSDP mesh whose shard groups
    each share one GPU, the shard groups get Gloo and the replicate groups (across GPUs) NCCL.
    ``nccl`` / ``gloo`` force one for every group. FSDP2's all-gathers and reduce-scatters of an
    attached model do not use it."""
    mode = _cuda_collectives_mode()
    if not torch.cuda.is_available():
        return None

    def gloo():
        return dist.ProcessGroupGloo(dist.PrefixStore("odc/gloo-cuda/", store), rank, size, timeout)

    if mode == "gloo":
        return gloo
    if not dist.is_nccl_available():
        return None

    def nccl():
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("odc/nccl/", store), rank, size, opts)

    if mode == "nccl":
        return nccl

    def auto():
        device = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        choice = _cuda_collectives_for(store, rank, size, ranks, device, timeout)
        return gloo() if choice == "gloo" else nccl()

    return auto


def _attempt_store(store):
    """The store with a prefix per torchrun attempt. Under torchrun the workers use the agent's
    store, which a restart (--max-restarts) reuses without clearing: the new workers would read
    the dead attempt's keys (its gloo addresses, its shared-memory names). Every key ODC and its
    inner backends write goes under this attempt's prefix instead."""
    import os

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"odc/attempt-{attempt}/", store)
    return store


def _create_backend(backend_opts, pg_options) -> _C.OdcBackend:
    """c10d plugin entry point (extended API): one backend object serves cpu and cuda."""
    store = _attempt_store(backend_opts.store)
    rank, size, timeout = backend_opts.group_rank, backend_opts.group_size, backend_opts.timeout
    return _C.OdcBackend(
        store,
        rank,
        size,
        timeout,
        _make_gloo(store, rank, size, timeout),
        _cuda_factory(store, rank, size, timeout, list(backend_opts.global_ranks_in_group)),
    )


def register() -> None:
    """Registers "odc" with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
    )


def odc_backend(group=None) -> _C.OdcBackend:
    """The OdcBackend object of `group` (default: the default process group)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    device = torch.device("cpu")
    backend = pg._get_backend(device)
    if not isinstance(backend, _C.OdcBackend):
        raise RuntimeError(  # noqa: TRY004 -- a misconfigured group, not a bad argument
            f"torch_odc: the process group's backend is {type(backend).__name__}, not odc. "
            'Initialize with dist.init_process_group(backend="odc") and do not set '
            "TORCH_DISTRIBUTED_DEBUG=DETAIL (its wrapper hides the backend)."
        )
    return backend
