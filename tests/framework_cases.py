"""The c10d calls that training frameworks make, with their arguments, run on "odc" and on the
backend the frameworks would otherwise use (gloo for CPU tensors, nccl for CUDA tensors).

Every entry of ``TABLE`` names its source (framework, version, file, function) and makes the call
the way that source does: the default group where the source passes none, the same keyword
arguments, dtypes and shapes, the same kind of group (DeviceMesh dimension, new_group,
new_subgroups_by_enumeration). ``run_table`` runs the whole table in one process group per
backend: first on "odc" (the group run_ranks created), then, in the same processes, on a fresh
default group of the reference backend; each entry's outcome is compared with
``collective_cases._difference`` (same tensors bit for bit, or the same exception type).

Read for this table: accelerate 1.15.0, transformers 5.23.0, trl 1.16.0 (installed wheels),
torchtitan 0.3.0 and verl 0.9.1 (PyPI wheels). Calls the sources make only on a group created
with an explicit backend="gloo" (transformers' continuous batching cpu_comm_group, torchtitan's
async-checkpoint group) are listed with that group: the odc default group only creates it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from collective_cases import _difference, _outcome


@dataclass(frozen=True)
class Entry:
    name: str
    source: str  # framework version, file, function
    fn: Callable  # (rank, world, device) -> list of tensors


def _data(rank, shape, device, dtype=torch.float32, salt=0):
    gen = torch.Generator().manual_seed(7919 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype).to(device)
    return torch.randint(0, 1000, shape, generator=gen, dtype=torch.int64).to(dtype).to(device)


def _cpu(*tensors):
    return [t.detach().cpu().clone() for t in tensors]


def _obj(x):
    """An object collective's result as a tensor (its repr's bytes), so _difference compares it."""
    return torch.tensor(list(repr(x).encode()), dtype=torch.uint8)


def _local_device_index(device):
    return device.index if device.type == "cuda" else int(os.environ.get("LOCAL_RANK", "0"))


# ---- setup -----------------------------------------------------------------------------------


def accelerate_wait_for_everyone(rank, world, device):
    # PartialState.wait_for_everyone passes device_ids on every distributed type, MULTI_CPU too.
    dist.barrier(device_ids=[_local_device_index(device)])
    return []


def transformers_barrier(rank, world, device):
    device_type = torch._C._get_accelerator().type
    if device_type != "cpu":
        torch.distributed.barrier(device_ids=[torch.accelerator.current_device_index()])
    else:
        torch.distributed.barrier()
    return []


def barrier_async(rank, world, device):
    work = dist.barrier(async_op=True)
    work.wait()
    return [torch.tensor([work.is_completed()])]


def torchtitan_set_pg_timeouts(rank, world, device):
    dist.barrier(device_ids=[_local_device_index(device)])
    if device.type == "cuda":
        torch.cuda.synchronize()
    # torch only applies the timeout to Gloo/NCCL backend objects (a warning otherwise); the
    # call must not fail, and the group must keep working.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=90), None)
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    return _cpu(t)


def accelerate_synchronize_rng_state(rank, world, device):
    torch.manual_seed(rank)
    rng_state = torch.get_rng_state()
    if device.type == "cuda":  # CUDA_DISTRIBUTED_TYPES branch
        rng_state = rng_state.to(device)
        torch.distributed.broadcast(rng_state, 0)
        rng_state = rng_state.cpu()
    else:  # MULTI_CPU branch
        torch.distributed.broadcast(rng_state, 0)
    return [rng_state]


def torchtitan_set_determinism(rank, world, device):
    torch.manual_seed(100 + rank)
    seed_tensor = torch.get_rng_state()[:8].to(device)
    torch.distributed.broadcast(seed_tensor, src=0)
    return [seed_tensor.to("cpu").view(torch.uint64).to(torch.int64)]


def accelerate_dataloader_dispatch(rank, world, device):
    batch_info = (
        [{"input_ids": (torch.Size([4, 7]), torch.int64)}, False] if rank == 0 else [None, False]
    )
    torch.distributed.broadcast_object_list(batch_info, src=0)
    return [_obj(batch_info)]


def transformers_replicated_params(rank, world, device):
    param = _data(rank, (6, 5), device)
    grad = _data(rank, (6, 5), device, salt=1)
    with torch.no_grad():
        dist.broadcast(param.data, src=0)
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    return _cpu(param, grad)


def accelerate_fsdp2_load_full_state_dict(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh(device.type, (world,))
    if rank == 0:
        full_param = _data(0, (2 * world + 1, 3), device).detach().to(mesh.device_type)
        dist.broadcast(full_param, src=0, group=dist.group.WORLD)
    else:
        full_param = torch.empty((2 * world + 1, 3), device=mesh.device_type, dtype=torch.float32)
        dist.broadcast(full_param, src=0, group=dist.group.WORLD)
    sharded = distribute_tensor(full_param, mesh, [Shard(0)])
    return _cpu(sharded.to_local())


# ---- training steps and metrics ------------------------------------------------------------------


def _accelerate_gather_one(tensor, world, device):
    # utils/operations.py _gpu_gather._gpu_gather_one: the path depends on the backend's name.
    if tensor.ndim == 0:
        tensor = tensor.clone()[None]
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if dist.get_backend() != "gloo":
        output_tensors = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=device)
        torch.distributed.all_gather_into_tensor(output_tensors, tensor)
        return output_tensors.view(-1, *tensor.size()[1:])
    output_tensors = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(output_tensors, tensor)
    return torch.cat(output_tensors, dim=0)


def accelerate_gather(rank, world, device):
    return _cpu(
        _accelerate_gather_one(torch.tensor(rank + 3, device=device), world, device),  # 0-dim count
        _accelerate_gather_one(_data(rank, (3, 4), device, torch.bfloat16), world, device),
        _accelerate_gather_one(_data(rank, (2, 3, 2), device).transpose(0, 2), world, device),
    )


def accelerate_pad_across_processes(rank, world, device):
    tensor = torch.zeros(2, 3 + rank, device=device)
    size = torch.tensor(tensor.shape, device=tensor.device)[None]
    return _cpu(_accelerate_gather_one(size, world, device).cpu())


def all_gather_into_tensor_flat_output(rank, world, device):
    # The call accelerate makes on any backend not named "gloo", made on every backend: NCCL
    # takes it (world_size x input.numel() elements), Gloo refuses the shapes; odc takes it.
    tensor = _data(rank, (3, 4), device)
    output_tensors = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=device)
    torch.distributed.all_gather_into_tensor(output_tensors, tensor)
    return _cpu(output_tensors)


def accelerate_reduce(rank, world, device):
    out = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
        cloned_tensor = _data(rank, (2, 3), device).clone()
        torch.distributed.all_reduce(cloned_tensor, op)
        out.append(cloned_tensor)
    return _cpu(*out)


def accelerate_gather_object(rank, world, device):
    output_objects = [None for _ in range(world)]
    torch.distributed.all_gather_object(output_objects, [f"prompt {rank}", {"len": rank}])
    return [_obj([x for y in output_objects for x in y])]


def transformers_distributed_concat(rank, world, device):
    tensor = torch.atleast_1d(_data(rank, (3,), device)).contiguous()
    output_tensors = [tensor.clone() for _ in range(world)]
    dist.all_gather(output_tensors, tensor)
    # distributed_broadcast_scalars: a float64 tensor of Python scalars
    tensorized_scalar = torch.tensor([0.5 * rank, 1.0 + rank], device=device)
    scalars = [tensorized_scalar.clone() for _ in range(world)]
    dist.all_gather(scalars, tensorized_scalar)
    return _cpu(torch.cat(output_tensors, dim=0), torch.cat(scalars, dim=0))


def torchtitan_dist_reduce(rank, world, device):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
    out = []
    for op in (c10d.ReduceOp.MAX.name, c10d.ReduceOp.SUM.name, c10d.ReduceOp.AVG.name):
        x = _data(rank, (), device)
        x = funcol.all_reduce(x, reduceOp=op, group=mesh)
        out.append(funcol.wait_tensor(x))
    return _cpu(*out)


def torchtitan_parallel_dims(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh

    tp = 2 if world % 2 == 0 and world > 2 else 1
    pp, cp, batch = 1, 1, world // tp
    world_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))
    names, degrees = ("pp", "batch", "cp", "tp"), (pp, batch, cp, tp)
    backend_override = {n: "fake" for n, d in zip(names, degrees) if d == 1}
    dataloading_mesh = world_mesh._unflatten(0, degrees, names, backend_override=backend_override)
    loss_mesh = dataloading_mesh["batch", "cp"]._flatten("loss_mesh")
    out = []
    # optimizer.py: all_reduce(tokens_per_expert, group=loss_mesh.get_group(), op=SUM)
    t = _data(rank, (2, 3), device)
    torch.distributed.all_reduce(t, group=loss_mesh.get_group(), op=torch.distributed.ReduceOp.SUM)
    out.append(t)
    if tp > 1:
        t = _data(rank, (4,), device, salt=1)
        torch.distributed.all_reduce(t, group=dataloading_mesh["tp"].get_group())
        out.append(t)
    # utils.py clip_grad_norm_ with pp: all_reduce(total_norm, op=MAX/SUM, group=pp_mesh.get_group())
    # (a degree-1 "fake" group here, as torchtitan builds it)
    total_norm = torch.tensor(float(rank + 1), device=device)
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=dataloading_mesh["batch"].get_group())
    out.append(total_norm)
    return _cpu(*out) + [torch.tensor(dist.get_process_group_ranks(loss_mesh.get_group()))]


def verl_device_mesh(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh

    fsdp_size = 2
    device_mesh = init_device_mesh(
        device.type, mesh_shape=(world // fsdp_size, fsdp_size), mesh_dim_names=["ddp", "fsdp"]
    )
    dp_group = device_mesh.get_group("fsdp")
    dp_size = dist.get_world_size(dp_group)
    out = []
    # trainer/sft_trainer.py: batch seqlens gathered with keyword arguments
    batch_seqlens = torch.tensor([5 + rank, 9 - rank], device=device)
    output_tensor = torch.empty(
        (batch_seqlens.shape[0] * dp_size,), dtype=batch_seqlens.dtype, device=device
    )
    torch.distributed.all_gather_into_tensor(
        output_tensor=output_tensor, input_tensor=batch_seqlens, group=dp_group
    )
    out.append(output_tensor)
    # trainer/sft_trainer.py: validation loss averaged over the dp group
    val_loss = _data(rank, (), device)
    torch.distributed.all_reduce(val_loss, op=torch.distributed.ReduceOp.AVG, group=dp_group)
    out.append(val_loss)
    # utils/seqlen_balancing.py: micro-batch counts and limits over the dp group
    num_micro_batches = torch.tensor([rank + 2], device=device)
    dist.all_reduce(num_micro_batches, op=dist.ReduceOp.MAX, group=dp_group)
    within_limit = torch.tensor([rank % 2], device=device)
    dist.all_reduce(within_limit, op=dist.ReduceOp.MIN, group=dp_group)
    out += [num_micro_batches, within_limit]
    # workers/rollout/sglang_rollout: gather_object to the sub-mesh's first (global) rank
    mesh = device_mesh["fsdp"]
    gathered = [None for _ in range(dp_size)] if mesh.get_local_rank() == 0 else None
    dist.gather_object(
        obj=[("w", rank)],
        object_gather_list=gathered,
        dst=mesh.mesh.tolist()[0],
        group=mesh.get_group(),
    )
    out.append(_obj(gathered))
    ddp_t = _data(rank, (3,), device, salt=2)
    dist.all_reduce(ddp_t, group=device_mesh.get_group("ddp"))
    out.append(ddp_t)
    return _cpu(*out)


def verl_ulysses_all_to_all(rank, world, device):
    # utils/ulysses.py all_to_all_tensor (async_op=True): a list all_to_all
    group = dist.group.WORLD
    local_input = _data(rank, (2, 2 * world), device)
    input_list = [t.contiguous() for t in torch.tensor_split(local_input, world, 1)]
    output_list = [torch.empty_like(input_list[0]) for _ in range(world)]
    comm = dist.all_to_all(output_list, input_list, group=group, async_op=True)
    comm.wait()
    return _cpu(torch.cat(output_list, dim=0).contiguous())


def verl_ulysses_all_gather(rank, world, device):
    # utils/ulysses.py all_gather_tensor (async_op=True)
    group = dist.group.WORLD
    local_tensor = _data(rank, (2, 3), device, salt=1)
    output = torch.empty([2 * world, 3], dtype=local_tensor.dtype, device=device)
    dist.all_gather_into_tensor(output, local_tensor, group=group, async_op=True).wait()
    return _cpu(output)


def verl_dict_tensors(rank, world, device):
    group = dist.group.WORLD
    # utils/torch_functional.py allgather_dict_tensors / broadcast_dict_tensor / allgather_dict_into_dict
    val = _data(rank, (2, 3), device)
    output = [torch.empty_like(val) for _ in range(world)]
    torch.distributed.all_gather(output, val, group=group, async_op=False)
    b = _data(rank, (4,), device, torch.int64)
    torch.distributed.broadcast(b, src=0, group=group, async_op=False)
    all_metrics_lst = [None for _ in range(world)]
    torch.distributed.all_gather_object(all_metrics_lst, {"loss": 0.5 * rank}, group=group)
    # protocol.py all_gather_data_proto: non-tensor batch of numpy arrays
    all_non_tensor_batch = [None for _ in range(world)]
    torch.distributed.all_gather_object(
        all_non_tensor_batch, {"uid": np.array([f"u{rank}", "x"], dtype=object)}, group=group
    )
    merged = np.concatenate([d["uid"] for d in all_non_tensor_batch]).tolist()
    return _cpu(torch.cat(output), b) + [_obj(all_metrics_lst), _obj(merged)]


def verl_sparse_gather(rank, world, device):
    group, dst = dist.group.WORLD, 0
    counts = torch.tensor([rank + 1], device=device)
    counts_all = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(counts_all, counts.to(device), group=group)
    idx_pad = _data(rank, (4,), device, torch.int64)
    val_pad = _data(rank, (4,), device, torch.bfloat16)
    idx_list = [torch.empty_like(idx_pad) for _ in range(world)] if rank == dst else None
    val_list = [torch.empty_like(val_pad) for _ in range(world)] if rank == dst else None
    dist.gather(idx_pad, idx_list, dst=dst, group=group)
    dist.gather(val_pad, val_list, dst=dst, group=group)
    out = counts_all + (idx_list + val_list if rank == dst else [])
    return _cpu(*out)


def trl_tp_subgroups(rank, world, device):
    tensor_parallel_size = 2
    tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
        [
            list(range(i * tensor_parallel_size, (i + 1) * tensor_parallel_size))
            for i in range(world // tensor_parallel_size)
        ]
    )
    prompts = [f"prompt-{rank}-{i}" for i in range(rank + 1)]
    gathered_prompts = [None for _ in range(tensor_parallel_size)]
    torch.distributed.all_gather_object(gathered_prompts, prompts, group=tp_group)
    return [_obj(gathered_prompts)]


def transformers_pipeline_p2p(rank, world, device):
    # distributed/pipeline_parallel.py: one isend/irecv with the adjacent stage in the pp group
    pp_group = dist.new_group(list(range(world)))
    tensor = _data(rank, (3, 2), device)
    if rank % 2 == 0:
        op = dist.P2POp(
            dist.isend, tensor, dist.get_global_rank(pp_group, rank + 1), group=pp_group
        )
    else:
        tensor = torch.empty(3, 2, device=device)
        op = dist.P2POp(
            dist.irecv, tensor, dist.get_global_rank(pp_group, rank - 1), group=pp_group
        )
    for req in dist.batch_isend_irecv([op]):
        req.wait()
    return _cpu(tensor)


def torchtitan_flex_shard_all_to_all(rank, world, device):
    # distributed/flex_shard/_optimizer_reshard_runtime.py: uneven splits, sliced buffers
    input_split_sizes = [(rank + j) % 3 + 1 for j in range(world)]
    output_split_sizes = [(j + rank) % 3 + 1 for j in range(world)]
    input = _data(rank, (sum(input_split_sizes) + 5,), device)
    output = torch.full((sum(output_split_sizes) + 4,), -1.0, device=device)
    torch.distributed.all_to_all_single(
        output[: sum(output_split_sizes)],
        input[: sum(input_split_sizes)],
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=dist.group.WORLD,
    )
    return _cpu(output)


def dtensor_redistribute(rank, world, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh(device.type, (world,))
    local = _data(rank, (2, 2 * world), device)
    out = []
    s0 = DTensor.from_local(local, mesh, [Shard(0)])
    out.append(s0.full_tensor())  # all_gather_into_tensor
    out.append(s0.redistribute(mesh, [Shard(1)]).to_local())  # all_to_all
    p = DTensor.from_local(local, mesh, [Partial()])
    out.append(p.redistribute(mesh, [Replicate()]).to_local())  # all_reduce
    out.append(p.redistribute(mesh, [Shard(0)]).to_local())  # reduce_scatter_tensor
    return _cpu(*out)


def accelerate_ddp(rank, world, device, comm_hook=None):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = model.to(device)
    kwargs = (
        {"device_ids": [device.index], "output_device": device.index}
        if (device.type == "cuda")
        else {}
    )
    model = DistributedDataParallel(model, **kwargs)
    if comm_hook is not None:
        model.register_comm_hook(state=None, hook=comm_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for step in range(2):
        x = _data(rank, (4, 6), device, salt=step)
        model(x).square().mean().backward()
        grads += [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return _cpu(*grads, *model.parameters())


def accelerate_ddp_fp16_hook(rank, world, device):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return accelerate_ddp(rank, world, device, comm_hook=default_hooks.fp16_compress_hook)


def async_work_future(rank, world, device):
    # DDP comm hooks (default_hooks._allreduce_fut): all_reduce(async_op=True).get_future()
    t = _data(rank, (5,), device)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    return _cpu(fut.wait())


def torchtitan_dcp(rank, world, device):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (world,))
    state_dict = {
        "model": {
            "w": DTensor.from_local(_data(rank, (3, 4), device), mesh, [Shard(0)]),
            "b": _data(0, (5,), device, torch.bfloat16),
        },
        "train_state": {"step": 7},
    }
    checkpoint_id = os.path.join(_RUN["tmp"], f"dcp-{dist.get_backend()}", "step-7")
    dcp.save(state_dict, checkpoint_id=checkpoint_id)
    loaded = {
        "model": {
            "w": DTensor.from_local(torch.zeros(3, 4, device=device), mesh, [Shard(0)]),
            "b": torch.zeros(5, device=device, dtype=torch.bfloat16),
        },
        "train_state": {"step": 0},
    }
    dcp.load(loaded, checkpoint_id=checkpoint_id)
    return _cpu(loaded["model"]["w"].to_local(), loaded["model"]["b"]) + [
        torch.tensor([loaded["train_state"]["step"]])
    ]


def transformers_cpu_comm_group(rank, world, device):
    # generation/continuous_batching/distributed.py + continuous_api.py: a gloo group made from
    # the default group, then monitored_barrier on it
    tp_ranks = list(range(world))
    cpu_comm_group = dist.new_group(
        ranks=tp_ranks,
        backend="gloo",
        timeout=datetime.timedelta(seconds=60),
        use_local_synchronization=len(tp_ranks) < world,
    )
    dist.monitored_barrier(
        group=cpu_comm_group, timeout=datetime.timedelta(seconds=60), wait_all_ranks=True
    )
    acc = torch.tensor([rank])
    dist.all_reduce(acc, op=dist.ReduceOp.MAX, async_op=False, group=cpu_comm_group)
    return [acc]


def monitored_barrier_default_group(rank, world, device):
    # torch refuses by backend name for anything but gloo: nccl and odc raise the same error.
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    return []


A, T, TRL, TT, V = (
    "accelerate 1.15.0",
    "transformers 5.23.0",
    "trl 1.16.0",
    "torchtitan 0.3.0",
    "verl 0.9.1",
)
TABLE = [
    Entry(
        "accelerate_wait_for_everyone",
        f"{A} state.py PartialState.wait_for_everyone",
        accelerate_wait_for_everyone,
    ),
    Entry("transformers_barrier", f"{T} distributed/utils.py barrier", transformers_barrier),
    Entry("barrier_async", f"{V} / {TT}: dist.barrier(async_op=True).wait()", barrier_async),
    Entry(
        "torchtitan_set_pg_timeouts",
        f"{TT} distributed/utils.py set_pg_timeouts",
        torchtitan_set_pg_timeouts,
    ),
    Entry(
        "accelerate_synchronize_rng_state",
        f"{A} utils/random.py synchronize_rng_state",
        accelerate_synchronize_rng_state,
    ),
    Entry(
        "torchtitan_set_determinism",
        f"{TT} distributed/utils.py set_determinism",
        torchtitan_set_determinism,
    ),
    Entry(
        "accelerate_dataloader_dispatch",
        f"{A} data_loader.py DataLoaderDispatcher._fetch_batches (broadcast_object_list)",
        accelerate_dataloader_dispatch,
    ),
    Entry(
        "transformers_replicated_params",
        f"{T} trainer.py (params FSDP does not wrap: broadcast, grad all_reduce AVG)",
        transformers_replicated_params,
    ),
    Entry(
        "accelerate_fsdp2_load_full_state_dict",
        f"{A} utils/fsdp_utils.py fsdp2_load_full_state_dict (broadcast, distribute_tensor)",
        accelerate_fsdp2_load_full_state_dict,
    ),
    Entry(
        "accelerate_gather",
        f"{A} utils/operations.py _gpu_gather (gather_for_metrics; "
        f"{TRL} sft_trainer.py compute_loss metrics)",
        accelerate_gather,
    ),
    Entry(
        "accelerate_pad_across_processes",
        f"{A} utils/operations.py pad_across_processes",
        accelerate_pad_across_processes,
    ),
    Entry(
        "all_gather_into_tensor_flat_output",
        f"{A} utils/operations.py _gpu_gather (its non-gloo call, on every backend)",
        all_gather_into_tensor_flat_output,
    ),
    Entry("accelerate_reduce", f"{A} utils/operations.py reduce", accelerate_reduce),
    Entry(
        "accelerate_gather_object",
        f"{A} utils/operations.py _gpu_gather_object",
        accelerate_gather_object,
    ),
    Entry(
        "transformers_distributed_concat",
        f"{T} trainer_pt_utils.py distributed_concat, distributed_broadcast_scalars",
        transformers_distributed_concat,
    ),
    Entry(
        "torchtitan_dist_reduce",
        f"{TT} distributed/utils.py _dist_reduce (dist_max/sum/mean)",
        torchtitan_dist_reduce,
    ),
    Entry(
        "torchtitan_parallel_dims",
        f"{TT} distributed/parallel_dims.py build_mesh "
        "(_unflatten, fake dims, _flatten), components/optimizer/optimizer.py, "
        "distributed/utils.py clip_grad_norm_",
        torchtitan_parallel_dims,
    ),
    Entry(
        "verl_device_mesh",
        f"{V} workers/engine/fsdp/utils.py create_device_mesh, "
        "trainer/sft_trainer.py, utils/seqlen_balancing.py, sglang_rollout.py",
        verl_device_mesh,
    ),
    Entry(
        "verl_ulysses_all_to_all",
        f"{V} utils/ulysses.py all_to_all_tensor",
        verl_ulysses_all_to_all,
    ),
    Entry(
        "verl_ulysses_all_gather",
        f"{V} utils/ulysses.py all_gather_tensor",
        verl_ulysses_all_gather,
    ),
    Entry(
        "verl_dict_tensors",
        f"{V} utils/torch_functional.py, protocol.py all_gather_data_proto",
        verl_dict_tensors,
    ),
    Entry(
        "verl_sparse_gather",
        f"{V} checkpoint_engine/delta_sync/sparse_gather.py",
        verl_sparse_gather,
    ),
    Entry(
        "trl_tp_subgroups",
        f"{TRL} generation/vllm_generation.py (new_subgroups_by_enumeration, all_gather_object)",
        trl_tp_subgroups,
    ),
    Entry(
        "transformers_pipeline_p2p",
        f"{T} distributed/pipeline_parallel.py (batch_isend_irecv)",
        transformers_pipeline_p2p,
    ),
    Entry(
        "torchtitan_flex_shard_all_to_all",
        f"{TT} distributed/flex_shard/_optimizer_reshard_runtime.py (all_to_all_single)",
        torchtitan_flex_shard_all_to_all,
    ),
    Entry(
        "dtensor_redistribute",
        f"{TT} loss/TP and {T} distributed/tensor_parallel.py: DTensor full_tensor / redistribute",
        dtensor_redistribute,
    ),
    Entry(
        "accelerate_ddp",
        f"{A} accelerator.py prepare_model (MULTI_CPU: DistributedDataParallel)",
        accelerate_ddp,
    ),
    Entry(
        "accelerate_ddp_fp16_hook",
        f"{A} utils/dataclasses.py DistributedDataParallelKwargs.register_comm_hook (FP16)",
        accelerate_ddp_fp16_hook,
    ),
    Entry(
        "async_work_future",
        "torch ddp_comm_hooks default_hooks (used by accelerate's hooks)",
        async_work_future,
    ),
    Entry(
        "torchtitan_dcp",
        f"{TT} components/checkpointer/dcp.py (dcp.save, dcp.load)",
        torchtitan_dcp,
    ),
    Entry(
        "transformers_cpu_comm_group",
        f"{T} generation/continuous_batching/distributed.py, "
        "continuous_api.py (gloo group, monitored_barrier)",
        transformers_cpu_comm_group,
    ),
    Entry(
        "monitored_barrier_default_group",
        "torch dist.monitored_barrier on the default group (no framework above calls it there)",
        monitored_barrier_default_group,
    ),
]
# dist.monitored_barrier checks the backend's name: "gloo" only. On "odc" and on "nccl" it raises
# the same ValueError.
# all_gather_into_tensor with a flat output for an N-d input: NCCL's rule (numel) on odc, which
# accelerate relies on for every backend not named "gloo"; gloo itself refuses the shapes.
# Two outcomes changed between the torch lines CI runs (odc matches gloo on both):
# - torch 2.11 refuses dist.monitored_barrier on any backend not named "gloo"; torch 2.15 asks
#   for a group with a CPU backend, so on "odc" it runs as on gloo (nccl still raises);
# - gloo on torch 2.11 has no list all_to_all on CPU; on torch 2.15 it has one.
# The lines between (2.12-2.14) were not run: for these entries either outcome is accepted there,
# as long as odc's result equals gloo's (or, for monitored_barrier, odc raises by torch's name
# check).
TORCH_LINE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
VERSION_DEPENDENT = {"monitored_barrier_default_group", "verl_ulysses_all_to_all"}
CHECKED_LINES = {(2, 11), (2, 15)}
NAME_CHECKED_MONITORED_BARRIER = TORCH_LINE <= (2, 11)
# Entry name -> odc's outcome where it differs from gloo's on purpose.
EXPECTED_GLOO_DIFFERENCES = {"all_gather_into_tensor_flat_output": "ok"}
if NAME_CHECKED_MONITORED_BARRIER:
    EXPECTED_GLOO_DIFFERENCES["monitored_barrier_default_group"] = "error"
# Entries whose reference outcome is an error: odc must raise the same exception type.
GLOO_REJECTS = {"verl_ulysses_all_to_all"} if TORCH_LINE <= (2, 11) else set()
NCCL_REJECTS = {"monitored_barrier_default_group"}


_RUN = {}  # the run's shared temporary directory (checkpoints, the reference group's store)


def _run_all(rank, world, device):
    results = {}
    for entry in TABLE:
        results[entry.name] = _outcome(
            lambda g, r, w, d, fn=entry.fn: fn(r, w, d), None, rank, world, device
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
    return results


def run_table(rank, world, device_kind, ref_backend, tmp):
    """On the odc default group run_ranks made, then on a fresh ref_backend default group in the
    same processes; returns {entry name: (difference or None, odc outcome kind)}."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_kind == "cuda"
        else (torch.device("cpu"))
    )
    _RUN["tmp"] = tmp
    odc = _run_all(rank, world, device)
    timeout = datetime.timedelta(seconds=60)
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(tmp, "ref-store"), world)
    dist.init_process_group(ref_backend, store=store, rank=rank, world_size=world, timeout=timeout)
    ref = _run_all(rank, world, device)
    return {name: (_difference(odc[name], ref[name]), odc[name][0]) for name in odc}
