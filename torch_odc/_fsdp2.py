"""Every FSDP2 internal that torch-odc reads, in one place.

The rest of the package uses only this module and FSDP2's public API (``fully_shard``,
``FSDPModule`` and its ``set_*`` / ``unshard`` / ``reshard`` methods). Porting to a new torch
release means reading this file against that release's ``torch/distributed/fsdp/_fully_shard``.
Accessors prefer feature detection (``getattr`` with the older spelling as the fallback) over
version comparisons. Supported and tested: torch 2.11 through 2.15.

What is read, and how it differs between 2.11 and 2.15:

* a module's state: ``FSDPModule._get_fsdp_state()`` (both);
* a module's param group: ``FSDPState._fsdp_param_group`` (2.11) vs the list
  ``FSDPState._fsdp_param_groups`` (2.15; several groups only with per-parameter meshes from
  ``shard_placement_fn``, which we refuse). ``fully_shard([a, b])`` gives every module of the
  list the same state, hence the same group: a unit is a group, found once per module;
* per parameter (``FSDPParam``): ``sharded_param``, ``padded_sharded_param_size``,
  ``sharded_size``, ``contiguous_sharded_stride``, ``to_sharded_dtensor``, ``orig_dtype``,
  ``param_dtype``, ``fsdp_placement``, ``offload_to_cpu``, ``_unsharded_param``: the same in both;
  the sharded gradient's dtype is ``sharded_grad_dtype`` in 2.15 (a per-parameter policy) and
  ``orig_dtype`` in 2.11;
* mixed precision: 2.11 keeps the policy on the group (``FSDPParamGroup.mp_policy``) and clamps
  ``FSDPParam.reduce_dtype`` to None when it equals the parameter dtype; 2.15 keeps a resolved
  policy per parameter (``FSDPParam.mp_policy``, the group attribute is gone) and may pick the
  reduce dtype per backward. ``FSDPParam.param_dtype``/``orig_dtype`` exist only after FSDP2's
  lazy init (the first forward), after attach. We read the policy's ``param_dtype`` (the
  all-gather dtype) and take the reduce dtype from each reduce-scatter's input, so neither
  difference matters;
* the order of parameters in the reduce-scatter input: ``fsdp_params`` order (2.11) vs
  ``FSDPParamGroup._reduce_scatter_param_indices`` (2.15: grouped by gradient dtype);
* divide factors: ``FSDPParamGroup.gradient_divide_factor`` and
  ``force_sum_reduction_for_comms`` fed to ``_fsdp_collectives._get_gradient_divide_factors``
  (same signature in both; 2.15 spells PREMUL_SUM as ``ReduceOp.PREMUL_SUM(f)``, 2.11 as
  ``_make_nccl_premul_sum(f)``, both reach the backend as a PreMulSumSupplement);
* ``FSDPParamGroup.reduce_scatter_unused_params`` (2.15 only; False when absent);
* mesh: ``mesh_info`` (``HSDPMeshInfo``: replicate x shard; a ``DDPMeshInfo`` that is not one:
  replication only), ``mesh_info.shard_process_group``, ``replicate_process_group``,
  ``post_forward_mesh_info`` (``reshard_after_forward=int``);
* HSDP: with ``set_requires_all_reduce(False)`` (public) FSDP2 keeps each backward's
  reduce-scatter output in ``FSDPParamGroup._partial_reduce_output`` (zeros under ODC), dropped
  before every forward (2.11 cannot add outputs of different parameter subsets into it) and at
  the barrier;
* the comm objects in place before attach: ``_all_gather_comm`` / ``_reduce_scatter_comm``, and
  the comm base classes ``_fsdp_api.AllGather`` / ``ReduceScatter``;
* a parameter's module and name in it: ``FSDPParam._module_info.module`` / ``.param_name`` (for
  messages only);
* the sharded gradient: FSDP2's post-reduce (both versions) sets ``sharded_param.grad`` to a
  view of the reduce-scatter output when it is None, adds into it otherwise, then calls the
  sharded parameter's post-accumulate-grad hooks (public ``register_post_accumulate_grad_hook``;
  skipped under compiled autograd in 2.11). It reads ``.grad`` only after the reduce-scatter
  comm returned, and not at all under HSDP while ``FSDPParamGroup.all_reduce_grads`` is False
  (both versions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.fsdp import FSDPModule

# The comm interfaces of set_custom_all_gather / set_custom_reduce_scatter (public methods whose
# base classes live in a private module in both 2.11 and 2.15).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: F401


@dataclass
class Unit:
    """One FSDP unit (an ``FSDPParamGroup``: the parameters of one ``fully_shard`` call, which
    may span several modules, e.g. ``fully_shard([model.norm, model.output])``): one key of the
    engine. ``name`` joins the modules' names with "+"."""

    name: str
    modules: list  # FSDPModule, in named_modules order; all share one FSDP state and group
    group: object  # FSDPParamGroup
    params: list  # FSDPParam, in the group's order
    param_names: list = field(default_factory=list)  # qualified names, for messages
    default_order: tuple = ()  # reduce_scatter_order where FSDP2 keeps none (2.11)

    @property
    def module(self) -> FSDPModule:
        """The module to call the unit's per-group FSDP2 methods on (``set_custom_*``,
        ``set_requires_all_reduce(recurse=False)``, ``unshard``/``reshard``): FSDP2 keeps one
        state for every module of a ``fully_shard`` call, so any of them acts on the group."""
        return self.modules[0]


class Unsupported(NotImplementedError):
    pass


def _param_group(module: FSDPModule):
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.11
        return state._fsdp_param_group
    if len(groups) > 1:
        raise Unsupported(
            "several parameter groups in one module (per-parameter meshes from "
            "shard_placement_fn) are not supported"
        )
    return groups[0] if groups else None


def units(model: torch.nn.Module) -> list[Unit]:
    """Every FSDP unit of `model` that owns parameters, one per ``FSDPParamGroup`` however many
    modules its ``fully_shard`` call spans, in `named_modules` order of their first module (the
    same on every rank for the same model). Raises `Unsupported` naming the module."""
    out: dict[int, Unit] = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        name = name or "<root>"
        try:
            group = _param_group(module)
        except Unsupported as e:
            raise Unsupported(f"module '{name}': {e}") from None
        if group is None:  # a unit that owns no parameters never communicates
            continue
        unit = out.get(id(group))
        if unit is None:
            out[id(group)] = Unit(name, [module], group, list(group.fsdp_params))
        else:  # another module of the same fully_shard call
            unit.modules.append(module)
            unit.name = f"{unit.name}+{name}"
    names = {id(m): n for n, m in model.named_modules()}
    for unit in out.values():
        for index, fp in enumerate(unit.params):
            info = getattr(fp, "_module_info", None)
            owner = names.get(id(getattr(info, "module", None)))
            attr = getattr(info, "param_name", None)
            unit.param_names.append(
                f"{owner}.{attr}" if owner is not None and attr else f"{unit.name}[{index}]"
            )
    return list(out.values())


def unsupported_reason(unit: Unit) -> str | None:
    """What in this unit's FSDP2 configuration on-demand mode cannot serve exactly, or None."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    group = unit.group
    if isinstance(group.mesh_info, DDPMeshInfo) and not isinstance(group.mesh_info, FSDPMeshInfo):
        return "replication without sharding (a DDP mesh) is not supported; use an HSDP mesh"
    post = group.post_forward_mesh_info
    if post is not None and post is not group.mesh_info:
        return (
            "reshard_after_forward=<int> (resharding to a smaller group after forward) is not "
            "supported; use True or False"
        )
    for fp in unit.params:
        if getattr(fp, "offload_to_cpu", False):
            return "CPU offload (CPUOffloadPolicy) is not supported"
        if fp.fsdp_placement.dim != 0:
            return f"sharding on dim {fp.fsdp_placement.dim} (shard_placement_fn) is not supported"
        if hasattr(fp.sharded_param._local_tensor, "fsdp_pre_all_gather"):
            return "tensor subclasses with fsdp_pre_all_gather extensions are not supported"
        if getattr(fp.sharded_param, "_post_accumulate_grad_hooks", None):
            return (
                "post-accumulate-grad hooks on sharded parameters (optimizer in backward) are "
                "not supported: gradients arrive at minibatch_barrier(), not in backward"
            )
    if len({gather_dtype(unit, fp) for fp in unit.params}) > 1:
        return "parameters all-gathered in different dtypes (param_dtype_override_fn)"
    return None


def shard_group(unit: Unit):
    return unit.group.mesh_info.shard_process_group


def replicate_group(unit: Unit):
    """The HSDP replicate group (one rank per replica), or None for a 1-D FSDP mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    info = unit.group.mesh_info
    return info.replicate_process_group if isinstance(info, HSDPMeshInfo) else None


def drop_partial_reduce_output(unit: Unit) -> None:
    """Frees what FSDP2 kept of this minibatch's reduce-scatter outputs (zeros under ODC) while
    its HSDP all-reduce is off."""
    if getattr(unit.group, "_partial_reduce_output", None) is not None:
        unit.group._partial_reduce_output = None


def end_unfinished_forward(unit: Unit) -> None:
    """Ends a forward that FSDP2 left unfinished for this unit, as its root post-backward
    callback would. A ``fully_shard`` call over several modules runs its group post-forward only
    once every module ran (``_register_group_forward_hooks``); when one never runs (an LM head
    whose weight a fused loss reads directly: TRL's ``fused_lm_head``), torch 2.11 leaves the
    group in FORWARD and the module set pending until a backward's final callback clears them
    (2.15 completes such forwards at the root's post-forward). A rank that ran only forwards
    (generation, an evaluation) then no microbatch never gets there: reshard() would keep a
    reshard_after_forward=False unit unsharded and its next forward would skip the pre-forward."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = unit.module._get_fsdp_state()
    state._modules_to_run_forward.clear()
    if state._training_state == TrainingState.FORWARD:
        state._training_state = TrainingState.IDLE
    if unit.group._training_state == TrainingState.FORWARD:
        unit.group._training_state = TrainingState.IDLE


def device(unit: Unit) -> torch.device:
    return unit.group.device


def gather_dtype(unit: Unit, fp) -> torch.dtype:
    """The dtype FSDP2 all-gathers this parameter in (the mixed-precision param dtype). Known
    before FSDP2's lazy init (the first forward), which is when attach runs."""
    if "param_dtype" in fp.__dict__:  # set by FSDP2's lazy init
        return fp.param_dtype or fp.orig_dtype
    policy = getattr(fp, "mp_policy", None) or unit.group.mp_policy  # 2.15: per parameter
    dtype = fp.sharded_param.dtype
    wanted = policy.param_dtype
    return wanted if wanted is not None and dtype.is_floating_point else dtype


def grad_dtype(fp) -> torch.dtype:
    """The dtype of the sharded gradient FSDP2 leaves in ``.grad`` (also before lazy init)."""
    return (
        getattr(fp, "sharded_grad_dtype", None)
        or getattr(fp, "orig_dtype", None)
        or fp.sharded_param.dtype
    )


def trainable(fp) -> bool:
    return fp.sharded_param.requires_grad


def padded_shard_numel(fp) -> int:
    """Elements of this rank's (dim-0 padded) shard: its span in the flat all-gather input and
    in each rank's chunk of the reduce-scatter input."""
    return fp.padded_sharded_param_size.numel()


def shard_view(fp, flat: torch.Tensor, offset: int) -> torch.Tensor:
    """This parameter's sharded gradient, a view of `flat` starting at element `offset`."""
    return torch.as_strided(
        flat,
        size=fp.sharded_size,
        stride=fp.contiguous_sharded_stride,
        storage_offset=flat.storage_offset() + offset,
    )


def sharded_grad(fp) -> torch.Tensor | None:
    """The local tensor of the parameter's sharded ``.grad``, or None. Read without running an
    op (``to_local()`` runs one), so that it works on ODC's placeholder gradient too."""
    grad = fp.sharded_param.grad
    return None if grad is None else local_tensor(grad)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (attribute read, no op); any other tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def grad_meta(fp) -> tuple[torch.Size, tuple, torch.dtype, torch.device]:
    """Size, stride, dtype and device of the local tensor FSDP2 puts in the sharded ``.grad``.
    The dtype is the parameter's ``grad_dtype`` (what the ``.grad`` setter accepts; FSDP2 2.15
    casts to it) where torch has it."""
    dtype = getattr(fp.sharded_param, "grad_dtype", None) or grad_dtype(fp)
    return fp.sharded_size, tuple(fp.contiguous_sharded_stride), dtype, fp.sharded_param.device


def sets_grad_after_reduce_scatter(unit: Unit) -> bool:
    """Whether FSDP2's post-backward sets or adds to ``.grad`` after this unit's reduce-scatter.
    It does not under HSDP with its all-reduce off (``set_requires_all_reduce(False)``, which
    ``set_requires_gradient_sync(True)`` turns back on): it then keeps the output apart."""
    return replicate_group(unit) is None or bool(getattr(unit.group, "all_reduce_grads", True))


def set_grad(fp, grad: torch.Tensor | None) -> None:
    """Sets the sharded ``.grad`` to `grad` (this rank's shard, in the gradient dtype), or None."""
    fp.sharded_param.grad = None if grad is None else fp.to_sharded_dtensor(grad)


def sharded_dtensor(fp, local: torch.Tensor):
    """`local` (this rank's shard of the parameter, e.g. a gradient) as the DTensor FSDP2 puts in
    the sharded ``.grad`` (``FSDPParam.to_sharded_dtensor``: same in 2.11 and 2.15)."""
    return fp.to_sharded_dtensor(local)


def lazy_init(unit: Unit) -> None:
    """FSDP2's lazy init of the unit's param group (``FSDPParamGroup.lazy_init``, which the public
    ``FSDPModule.unshard()`` runs first; idempotent, same in 2.11 and 2.15): re-pads sharded
    parameters replaced since ``fully_shard`` and sets the mixed-precision dtypes."""
    unit.group.lazy_init()


def all_gather_input(unit: Unit) -> tuple[torch.dtype, list[torch.Tensor]]:
    """What FSDP2's all-gather of this unit sends from this rank, without running it: the dtype
    (the mixed-precision param dtype, else the parameters' own) and, per parameter in the
    group's order, the tensor whose bytes (cast to that dtype) are its part: the padded flat
    shard ``FSDPParam._sharded_param_data`` (2.11 and 2.15: ``_get_param_all_gather_inputs``
    and ``FSDPParam.all_gather_inputs`` in the sharded state, without extensions or CPU
    offload, which attach refuses). Laid back to back they are the all-gather input. Call after
    `lazy_init`."""
    data = [fp._sharded_param_data for fp in unit.params]
    first = unit.params[0]
    dtype = (first.__dict__.get("param_dtype") or data[0].dtype) if data else torch.float32
    return dtype, data


def shard_dtype(unit: Unit) -> torch.dtype | None:
    """The dtype of the padded flat shards FSDP2 keeps for the unit's parameters (the sharded
    parameters' own dtype, what `all_gather_input` casts from) if they all share one, else
    None."""
    dtypes = {fp._sharded_param_data.dtype for fp in unit.params}
    return dtypes.pop() if len(dtypes) == 1 else None


def divide_settings(unit: Unit) -> tuple:
    """The param group's settings that `push_scale` depends on besides the reduce dtype."""
    group = unit.group
    return group.gradient_divide_factor, group.force_sum_reduction_for_comms


def sharded_param(fp) -> torch.nn.Parameter:
    """The parameter the optimizer sees (a DTensor); FSDP2 calls its post-accumulate-grad hooks
    after it sets or accumulates its ``.grad`` in each reduce-scatter's post-reduce."""
    return fp.sharded_param


def sharded_grads(fps) -> list:
    """The ``.grad`` of `sharded_param` of each FSDPParam in `fps` (one call for a whole unit)."""
    return [fp.sharded_param.grad for fp in fps]


def sharded_params(fps) -> list:
    """`sharded_param` of each FSDPParam in `fps`."""
    return [fp.sharded_param for fp in fps]


def clear_sharded_grads(fps) -> None:
    """Sets the ``.grad`` of `sharded_param` of each FSDPParam in `fps` to None."""
    for fp in fps:
        fp.sharded_param.grad = None


def add_grad(fp, grad: torch.Tensor) -> None:
    """Sets or adds to the sharded ``.grad`` exactly as FSDP2's post-backward does."""
    param = fp.sharded_param
    if param.grad is None:
        param.grad = fp.to_sharded_dtensor(grad)
    else:
        param.grad._local_tensor += grad


def unsharded_param(fp):
    """The unsharded parameter autograd accumulates into, or None before the first all-gather.
    FSDP2 creates it once and reuses it (its storage is freed and reallocated)."""
    return fp.__dict__.get("_unsharded_param")


def unsharded_params(unit: Unit) -> list:
    """`unsharded_param` of every parameter of the unit, in its order."""
    return [fp.__dict__.get("_unsharded_param") for fp in unit.params]


def reduce_scatter_order(unit: Unit):
    """Indices into `unit.params` in the order FSDP2 lays out the reduce-scatter input (a
    sequence owned by FSDP2 or the unit: the same object while the order stays the same; do not
    modify it)."""
    order = getattr(unit.group, "_reduce_scatter_param_indices", None)
    if order:
        return order
    if len(unit.default_order) != len(unit.params):
        unit.default_order = tuple(range(len(unit.params)))
    return unit.default_order


def reduces_unused_params(unit: Unit) -> bool:
    """Whether FSDP2 reduce-scatters zeros for trainable parameters without a gradient."""
    return bool(getattr(unit.group, "reduce_scatter_unused_params", False))


def push_scale(unit: Unit, reduce_dtype: torch.dtype) -> float:
    """What FSDP2 applies to a reduce-scatter's result besides the reduce op's own factor, as one
    factor for the push: its post-division (a divide factor, fp16 reduction or force-sum) and,
    under HSDP, the replicate all-reduce's averaging (AVG over the replicas). ODC all-reduces
    across replicas with SUM, so every rank scales its own pushes consistently."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    group, replicate = unit.group, replicate_group(unit)
    _, post, _, all_reduce_op = _get_gradient_divide_factors(
        shard_group(unit),
        replicate,
        reduce_dtype,
        device(unit).type,
        group.gradient_divide_factor,
        group.force_sum_reduction_for_comms,
    )
    scale = 1.0 / float(post) if post is not None else 1.0
    if replicate is not None and all_reduce_op == torch.distributed.ReduceOp.AVG:
        scale /= replicate.size()
    return scale


def comms(unit: Unit):
    """The all-gather and reduce-scatter comm objects installed on this unit now."""
    return unit.group._all_gather_comm, unit.group._reduce_scatter_comm
