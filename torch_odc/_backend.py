"""Registration of the "odc" c10d backend and creation of its inner backends."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_odc import _C

BACKEND_NAME = "odc"


def _make_gloo(store, rank: int, size: int, timeout):
    return dist.ProcessGroupGloo(dist.PrefixStore("odc/gloo/", store), rank, size, timeout)


def _nccl_factory(store, rank: int, size: int, timeout):
    """Returns a callable that creates the inner NCCL backend, or None without CUDA/NCCL.

    ``ODC_CUDA_COLLECTIVES=gloo``: Gloo (through host memory) serves CUDA tensors instead, for
    ranks that share one GPU, which NCCL refuses; a framework's few collectives per step (a grad
    norm, a loss gather) then still run there. FSDP2's all-gathers and reduce-scatters of an
    attached model do not use it."""
    import os

    if not torch.cuda.is_available():
        return None
    if os.environ.get("ODC_CUDA_COLLECTIVES", "nccl") == "gloo":
        return lambda: dist.ProcessGroupGloo(dist.PrefixStore("odc/gloo-cuda/", store), rank, size,
                                             timeout)
    if not dist.is_nccl_available():
        return None

    def create():
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("odc/nccl/", store), rank, size, opts)

    return create


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
        _nccl_factory(store, rank, size, timeout),
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
