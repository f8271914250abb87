"""torch_odc.attach(): serves every FSDP2 module of a model on demand through the odc backend.

attach() installs, through FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
hooks, comm objects that FSDP2 calls as it would call ``all_gather_into_tensor`` /
``reduce_scatter_tensor``; each serves the call from the engine (csrc/engine) instead of a
collective, by one call into the odc backend keyed by the module's index
(``OdcBackend._keyed_all_gather`` / ``_keyed_reduce_scatter``, or ``KeyCalls.push_all`` for the
common push). Every c10d collective on the group, FSDP2's own included, stays a collective.

Where the rest lives: _keys.py (one module's state over a minibatch), _comms.py (the comm
objects), _handle.py (Handle, the barrier, stats, detach), _placeholder.py (``.grad`` before the
barrier), _clock.py (host-time accounting).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook

from torch_odc import _C, _fsdp2
from torch_odc._backend import odc_backend
from torch_odc._comms import _KeyedAllGather, _KeyedReduceScatter
from torch_odc._handle import Handle, _attached, _handles
from torch_odc._keys import _DTYPE_NAMES, _Key


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

    Where one-sided access cannot run (a group of one rank, ranks on several hosts without an
    HSDP mesh, no transport for the device) attach warns and leaves the model on FSDP2's own
    collectives: the handle's ``on_demand`` is False, ``collective_reason`` says why, its barrier
    does nothing, and the ranks must run equal numbers of microbatches as under FSDP2.
    """
    try:
        found = _fsdp2.units(model)
    except _fsdp2.Unsupported as e:
        raise NotImplementedError(f"torch_odc.attach: {e}") from None
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("torch_odc.attach: the model has no FSDP2 module; call fully_shard first")
    groups, devices = set(), set()  # (shard group, replicate group or None) per unit
    for unit in found:
        problem = _fsdp2.unsupported_reason(unit)
        if problem:
            raise NotImplementedError(f"torch_odc.attach: module '{unit.name}': {problem}")
        gather = _fsdp2.gather_dtype(unit, unit.params[0])
        if gather not in _DTYPE_NAMES:
            raise NotImplementedError(
                f"torch_odc.attach: module '{unit.name}': parameters in {gather}"
            )
        groups.add((_fsdp2.shard_group(unit), _fsdp2.replicate_group(unit)))
        devices.add(_fsdp2.device(unit))
    if len(groups) != 1 or len(devices) != 1:
        raise NotImplementedError(
            "torch_odc.attach: every FSDP2 module must shard over the same process group and device"
        )
    (group, replicate), device = groups.pop(), devices.pop()
    backend = odc_backend(group)
    world = dist.get_world_size(group)
    entries = [_Key(unit, world) for unit in found]
    handle = Handle(model, backend, entries, device, eager_publish, replicate)
    handle._group = group
    reason = _collective_fallback_reason(group, device, replicate)
    if reason:
        warnings.warn(
            f"torch_odc.attach: {reason}; this model keeps collective semantics and "
            "minibatch_barrier() is a no-op for it.",
            stacklevel=2,
        )
        handle._attached = False
        handle.collective_reason = reason
        return handle
    backend._connect_engine(
        [k.spec() for k in entries], device.index if device.type == "cuda" else -1
    )
    for index, key in enumerate(entries):
        key._where = handle._where
        key.calls = _C.KeyCalls(backend, index, len(key.unit.params))
        key.set_accumulator(backend._accumulator(index))
        key.hook_sharded_grads()
        if replicate is not None:  # FSDP2's per-microbatch all-reduce across replicas: off
            key.unit.module.set_requires_all_reduce(False, recurse=False)
        key.unit.module.set_custom_all_gather(_KeyedAllGather(handle, index))
        key.unit.module.set_custom_reduce_scatter(_KeyedReduceScatter(handle, index))
        # After FSDP2's own pre-forward (registered with prepend=True), which creates the
        # unsharded parameters at the unit's first all-gather. A unit of several modules runs
        # FSDP2's pre-forward at whichever of them runs first: each gets the hook.
        for module in key.unit.modules:
            handle._hooks.append(
                module.register_forward_pre_hook(lambda *_, k=key: k.before_forward())
            )
    handle._accumulator_generation = backend._accumulator_generation  # what the keys view
    # The sharded parameters move into the shard caches now (before the optimizer's state is
    # made, before the first minibatch): FSDP2's lazy init may still re-pad some (those move in
    # at their first publish).
    handle._place_shards()
    # Before FSDP2's own root pre-forward (which may start the root's all-gather).
    handle._hooks.append(model.register_forward_pre_hook(handle._pre_forward, prepend=True))
    handle._step_hook = register_optimizer_step_pre_hook(handle._check_step)
    _attached()  # drops models attached through a process group destroyed since
    _handles.append(handle)
    return handle


def pre_forward_without_call(handle: Handle, module: torch.nn.Module) -> None:
    """ODC's pre-forward of the unit that ``module`` is alone in, for a caller that unshards the
    unit (FSDP2's public ``unshard()``) and reads its parameters without calling ``module``: a
    loss that multiplies by an LM head's weight directly, as TRL's ``fused_lm_head`` does. It
    runs what the unit's forward would run under ODC (see ``_Key.before_forward``; once per
    minibatch it notes the unsharded parameters whose gradients the unit's reduce-scatter
    pushes). A unit of several modules is left alone: another of its modules runs a forward.
    A no-op for a handle left on FSDP2's collectives."""
    if not handle.on_demand:
        return
    for key in handle._keys:
        if len(key.unit.modules) == 1 and key.unit.modules[0] is module:
            key.before_forward()


def host_id() -> str:
    """This process's host, as attach compares it: ``ODC_HOST_ID`` if set (tests present ranks
    of one machine as several hosts with it), else the host name."""
    import socket

    return os.environ.get("ODC_HOST_ID") or socket.gethostname()


def _collective_fallback_reason(group, device: torch.device, replicate=None) -> str | None:
    """Why on-demand mode cannot run for this shard group and device, or None when it can.
    Collective over the group; every rank of it gets the same answer."""
    if device.type == "cuda" and not _C._has_cuda_transport():
        return "this build has no CUDA transport (built without an nvcc matching torch's CUDA)"
    if device.type not in ("cpu", "cuda"):
        return f"no on-demand transport for {device.type} tensors"
    if dist.get_world_size(group) == 1:
        if replicate is not None:
            return (
                "HSDP shard groups of one rank: FSDP2's own path runs (a reduce-scatter of "
                "one and an all-reduce across replicas per microbatch)"
            )
        return "a group of one rank has nothing to communicate (FSDP2 calls no collective)"
    if device.type == "cuda":
        # Collective: peer access and native atomics for every GPU pair, a kernel image here.
        problem = odc_backend(group)._cuda_transport_problem(device.index)
        if problem:
            return f"the CUDA IPC transport cannot run here: {problem}"
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_id(), group=group)
    if len(set(hosts)) > 1:
        n, per = len(set(hosts)), len(hosts) // len(set(hosts))
        if replicate is not None:
            return (
                f"its shard groups span {n} hosts; one-sided access needs each shard group "
                "on one host: make the mesh's shard dimension the GPUs of one host"
            )
        return (
            f"the group spans {n} hosts; one-sided access needs one host. Use hybrid "
            "sharding, on-demand inside each host and one all-reduce per minibatch across "
            f"them: mesh = init_device_mesh(device, ({n}, {per}), mesh_dim_names="
            '("replicate", "shard")); fully_shard(module, mesh=mesh)'
        )
    return None
