"""FSDP2 attach, the minibatch barrier and stats: the Python face of the on-demand engine.

attach() installs, through FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
hooks, comm objects that tag each call with the module's key and then call the ordinary
``all_gather_into_tensor`` / ``reduce_scatter_tensor``; the odc backend sees the key and serves the
call from the engine (csrc/engine) instead of a collective.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_odc import _C
from torch_odc._backend import odc_backend

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_handles: list[Handle] = []


class _KeyedAllGather(AllGather):
    def __init__(self, handle: Handle, key: int):
        self._handle, self._key = handle, key

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        _C._set_keyed_call(self._key, self._handle._publishing)
        try:
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=async_op
            )
        finally:
            _C._set_keyed_call(-1)


class _KeyedReduceScatter(ReduceScatter):
    def __init__(self, key: int):
        self._key = key

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        _C._set_keyed_call(self._key)
        try:
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )
        finally:
            _C._set_keyed_call(-1)


@dataclass
class _Key:
    name: str
    module: FSDPModule
    param_group: object  # FSDP2's FSDPParamGroup of the module
    gather_dtype: torch.dtype
    reduce_dtype: torch.dtype
    numel: int
    prev_all_gather: object
    prev_reduce_scatter: object


def _describe_unsupported(param_group) -> str | None:
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import HSDPMeshInfo

    if isinstance(param_group.mesh_info, HSDPMeshInfo):
        return "HSDP (a 2-D mesh with replication) is not supported yet"
    for fp in param_group.fsdp_params:
        if getattr(fp, "offload_to_cpu", False):
            return "CPU offload (CPUOffloadPolicy) is not supported"
        if fp.fsdp_placement.dim != 0:
            return f"sharding on dim {fp.fsdp_placement.dim} (shard_placement_fn) is not supported"
        if hasattr(fp.sharded_param._local_tensor, "fsdp_pre_all_gather"):
            return "tensor subclasses with fsdp_pre_all_gather extensions are not supported"
    return None


class Handle:
    """The attachment of one FSDP2 model to the odc backend; see :func:`attach`."""

    def __init__(self, model, backend, keys: list[_Key], device: torch.device,
                 eager_publish: bool = True):
        self.model, self._backend, self._keys, self.device = model, backend, keys, device
        self._publishing = False
        self._attached = True
        self._eager = eager_publish
        self._publish_pending = eager_publish  # no forward has run in this minibatch yet
        self._hook = None
        self._step_hook = None
        self._param_ids = {id(p) for p in model.parameters()}

    @property
    def keys(self) -> list[str]:
        return [k.name for k in self._keys]

    def barrier(self) -> None:
        if not self._attached:
            raise RuntimeError("torch_odc: this model was detached")
        b = self._backend
        # (1) Publish what this rank has not published in this minibatch (a rank that ran no
        # microbatch, or attached with eager_publish=False).
        self._publish_unpublished()
        # (2) Wait until every rank has arrived: all pushes into our accumulators have landed.
        b._arrive()
        # (3) Finalize gradients from the accumulators, (4) zero them and start the next epoch.
        try:
            for index, key in enumerate(self._keys):
                if b._pushed(index):
                    _finalize(key, b._accumulator(index))
        finally:
            b._release()
            self._publish_pending = self._eager

    def _publish_unpublished(self) -> None:
        """Publishes every key this rank has not published in this minibatch, through FSDP2's
        own unshard() so the shard is exactly what a forward would all-gather (the gather
        itself is publish-only: it reads no peer). Keys go in the same order on every rank and
        a publish waits for nobody, so this cannot deadlock."""
        b = self._backend
        self._publishing = True
        try:
            for index, key in enumerate(self._keys):
                if not b._published(index):
                    key.module.unshard()
                    key.module.reshard()
        finally:
            self._publishing = False

    def _pre_forward(self, module, args) -> None:
        # The first forward of a minibatch publishes every shard up front. Published lazily (at
        # the owner's own all-gather of each module), a peer's first forward would wait at each
        # module for the owner to reach it: the first microbatch of every rank would advance
        # in lockstep with the slowest one, as under collectives (measured on 4 H200: up to
        # 0.23 s per minibatch on long-context SFT, docs/benchmarks.md).
        if self._publish_pending and self._attached:
            self._publish_pending = False
            with torch.profiler.record_function("odc::publish_all"):
                self._publish_unpublished()

    def _check_step(self, optimizer, args, kwargs) -> None:
        # An optimizer step over this model's parameters once this rank has published shards in
        # the minibatch in progress would leave peers reading the pre-step values (published
        # shards are not republished within a minibatch): a forward ran between
        # minibatch_barrier() and step(), or step() ran without the barrier.
        if not self._attached or not any(
            id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]
        ):
            return
        b = self._backend
        published = [k.name for i, k in enumerate(self._keys) if b._published(i)]
        if published:
            info = b._stats()
            raise RuntimeError(
                f"torch_odc: rank {info['rank']}: optimizer.step() in minibatch "
                f"{info['minibatch']} after this rank already published its shards of "
                f"{', '.join(published[:3])}{', ...' if len(published) > 3 else ''} for it: "
                "call torch_odc.minibatch_barrier() after the minibatch's last backward and "
                "before optimizer.step(), and run no forward in between"
            )

    def stats(self) -> dict:
        return self._backend._stats()

    def detach(self) -> None:
        """Restores FSDP2's own all-gather and reduce-scatter and releases the engine."""
        if not self._attached:
            return
        for hook in (self._hook, self._step_hook):
            if hook is not None:
                hook.remove()
        self._hook = self._step_hook = None
        for key in self._keys:
            key.module.set_custom_all_gather(key.prev_all_gather)
            key.module.set_custom_reduce_scatter(key.prev_reduce_scatter)
        self._backend._disconnect_engine()
        self._attached = False
        if self in _handles:
            _handles.remove(self)


def _finalize(key: _Key, accumulator: torch.Tensor) -> None:
    """Adds the reduced shard of every parameter of `key` to its .grad, as FSDP2 would."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    pg = key.param_group
    shard_group = pg.mesh_info.shard_process_group
    _, post_divide, _, _ = _get_gradient_divide_factors(
        shard_group,
        None,
        key.reduce_dtype,
        pg.device.type,
        pg.gradient_divide_factor,
        pg.force_sum_reduction_for_comms,
    )
    offset = 0
    for fp in pg.fsdp_params:
        param = fp.sharded_param
        if param.requires_grad:
            shard = torch.as_strided(
                accumulator,
                size=fp.sharded_size,
                stride=fp.contiguous_sharded_stride,
                storage_offset=offset,
            )
            if post_divide is not None and post_divide != 1:
                shard = shard / post_divide
            grad = shard.to(dtype=fp.orig_dtype, copy=True)  # the accumulator is reused
            if param.grad is None:
                param.grad = fp.to_sharded_dtensor(grad)
            else:
                param.grad._local_tensor += grad
        offset += fp.padded_sharded_param_size.numel()


def attach(model: torch.nn.Module, *, eager_publish: bool = True) -> Handle:
    """Serves every FSDP2 module of `model` on demand through the "odc" backend.

    Every rank must call it at the same point, after ``fully_shard``. From then on the ranks
    synchronize only in :func:`minibatch_barrier`, which must be called once per minibatch on
    every rank (before ``optimizer.step()``); between two barriers ranks may run different
    numbers of microbatches (zero included).

    With ``eager_publish`` (the default) the first forward of `model` in each minibatch first
    publishes this rank's shard of every module (after the optimizer step, before any layer
    runs), so that peers never wait for this rank to reach a module. With False each shard is
    published at this rank's own first all-gather of its module.
    """
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("torch_odc.attach: the model has no FSDP2 module; call fully_shard first")
    entries, groups, devices = [], set(), set()
    for name, module in modules:
        state = module._get_fsdp_state()
        pg = state._fsdp_param_group
        if pg is None:  # a module that owns no parameters of its own never communicates
            continue
        problem = _describe_unsupported(pg)
        if problem:
            raise NotImplementedError(f"torch_odc.attach: module '{name or '<root>'}': {problem}")
        orig = pg.fsdp_params[0].sharded_param.dtype
        mp = pg.mp_policy
        gather_dtype = mp.param_dtype or orig
        reduce_dtype = mp.reduce_dtype or gather_dtype
        for dtype in (gather_dtype, reduce_dtype):
            if dtype not in _DTYPE_NAMES:
                raise NotImplementedError(f"torch_odc.attach: module '{name}': dtype {dtype}")
        groups.add(pg.mesh_info.shard_process_group)
        devices.add(pg.device)
        numel = sum(fp.padded_sharded_param_size.numel() for fp in pg.fsdp_params)
        entries.append(
            _Key(name or "<root>", module, pg, gather_dtype, reduce_dtype, numel,
                 pg._all_gather_comm, pg._reduce_scatter_comm)
        )
    if len(groups) != 1 or len(devices) != 1:
        raise NotImplementedError(
            "torch_odc.attach: every FSDP2 module must shard over the same process group and device"
        )
    group, device = groups.pop(), devices.pop()
    backend = odc_backend(group)
    handle = Handle(model, backend, entries, device, eager_publish)
    reason = _collective_fallback_reason(group, device)
    if reason:
        warnings.warn(
            f"torch_odc.attach: {reason}; this model keeps collective semantics and "
            "minibatch_barrier() is a no-op for it.",
            stacklevel=2,
        )
        handle._attached = False
        return handle
    backend._connect_engine(
        [(k.name, k.numel, _DTYPE_NAMES[k.gather_dtype], k.numel, _DTYPE_NAMES[k.reduce_dtype])
         for k in entries],
        device.index if device.type == "cuda" else -1,
    )
    for index, key in enumerate(entries):
        key.module.set_custom_all_gather(_KeyedAllGather(handle, index))
        key.module.set_custom_reduce_scatter(_KeyedReduceScatter(index))
    # Before FSDP2's own root pre-forward (which may start the root's all-gather).
    handle._hook = model.register_forward_pre_hook(handle._pre_forward, prepend=True)
    handle._step_hook = register_optimizer_step_pre_hook(handle._check_step)
    _handles.append(handle)
    return handle


def _collective_fallback_reason(group, device: torch.device) -> str | None:
    """Why on-demand mode cannot run for this group and device, or None when it can."""
    import socket

    if device.type == "cuda" and not _C._has_cuda_transport():
        return "this build has no CUDA transport (built without an nvcc matching torch's CUDA)"
    if device.type not in ("cpu", "cuda"):
        return f"no on-demand transport for {device.type} tensors"
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        return (f"the group spans {len(set(hosts))} hosts; multi-node on-demand communication "
                "is not supported yet")
    return None


def minibatch_barrier() -> None:
    """The one synchronization point per minibatch of every attached model.

    When it returns, every parameter's ``.grad`` holds the gradient reduced over all ranks and
    all their microbatches since the previous barrier, as FSDP2 with gradient accumulation
    computes it. Call it on every rank, before ``optimizer.step()``.
    """
    with torch.profiler.record_function("odc::minibatch_barrier"):
        for handle in _handles:
            handle.barrier()


def stats() -> list[dict]:
    """Per-rank counters of every attached model: for the minibatch in progress ("current"),
    the last completed one ("last") and all so far ("total")."""
    return [handle.stats() for handle in _handles]
