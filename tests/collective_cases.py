"""Collective calls run identically on an "odc" group and on a reference group (gloo or nccl).

Each case takes (group, rank, world_size, device) and returns the tensors it produced, moved to
the CPU. ``compare_all`` runs every case on both groups and reports any difference in result or
in outcome (an operation the inner backend rejects must be rejected by odc the same way).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def _data(rank, shape, device, dtype=torch.float32, salt=0):
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen).to(dtype)
    else:
        t = torch.randint(0, 1 << 20, shape, generator=gen, dtype=torch.int64).to(dtype)
    return t.to(device)


def _cpu(*tensors):
    return [t.detach().cpu().clone() for t in tensors]


def allreduce(op, dtype=torch.float32, async_op=False):
    def case(g, rank, world, device):
        t = _data(rank, (37, 5), device, dtype)
        if dtype.is_floating_point and op == dist.ReduceOp.PRODUCT:
            t = t.abs() + 0.5
        work = dist.all_reduce(t, op=op, group=g, async_op=async_op)
        if async_op:
            work.wait()
        return _cpu(t)

    return case


def allreduce_premul_sum(g, rank, world, device):
    t = _data(rank, (64,), device)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25), group=g)
    return _cpu(t)


def allreduce_coalesced(g, rank, world, device):
    ts = [_data(rank, (7,), device, salt=1), _data(rank, (3, 3), device, salt=2)]
    dist.all_reduce_coalesced(ts, group=g)
    return _cpu(*ts)


def broadcast(src_of):
    def case(g, rank, world, device):
        t = _data(rank, (129,), device)
        dist.broadcast(t, group_src=src_of(world), group=g)
        return _cpu(t)

    return case


def reduce(g, rank, world, device):
    t = _data(rank, (33,), device)
    dist.reduce(t, group_dst=world - 1, group=g)
    return _cpu(t) if rank == world - 1 else []


def all_gather_list(g, rank, world, device):
    outs = [torch.empty(6, 2, device=device) for _ in range(world)]
    dist.all_gather(outs, _data(rank, (6, 2), device), group=g)
    return _cpu(*outs)


def all_gather_into_tensor(async_op):
    def case(g, rank, world, device):
        out = torch.full((world * 50,), float("nan"), device=device, dtype=torch.bfloat16)
        work = dist.all_gather_into_tensor(
            out, _data(rank, (50,), device, torch.bfloat16), group=g, async_op=async_op
        )
        if async_op:
            work.wait()
        return _cpu(out)

    return case


def all_gather_into_tensor_coalesced(g, rank, world, device):
    ins = [_data(rank, (8,), device, salt=3), _data(rank, (5, 2), device, salt=4)]
    outs = [torch.empty(world * 8, device=device), torch.empty(world * 5, 2, device=device)]
    g.allgather_into_tensor_coalesced(outs, ins).wait()
    return _cpu(*outs)


def reduce_scatter_list(op):
    def case(g, rank, world, device):
        ins = [_data(rank, (9,), device, salt=s) for s in range(world)]
        out = torch.empty(9, device=device)
        dist.reduce_scatter(out, ins, op=op, group=g)
        return _cpu(out)

    return case


def reduce_scatter_tensor(op, dtype=torch.float32):
    def case(g, rank, world, device):
        out = torch.empty(11, device=device, dtype=dtype)
        dist.reduce_scatter_tensor(out, _data(rank, (world * 11,), device, dtype), op=op, group=g)
        return _cpu(out)

    return case


def reduce_scatter_tensor_coalesced(g, rank, world, device):
    ins = [_data(rank, (world * 4,), device, salt=5), _data(rank, (world * 3,), device, salt=6)]
    outs = [torch.empty(4, device=device), torch.empty(3, device=device)]
    g.reduce_scatter_tensor_coalesced(outs, ins, dist.ReduceScatterOptions()).wait()
    return _cpu(*outs)


def all_to_all_single_even(g, rank, world, device):
    out = torch.empty(world * 3, device=device)
    dist.all_to_all_single(out, _data(rank, (world * 3,), device), group=g)
    return _cpu(out)


def all_to_all_single_uneven(g, rank, world, device):
    # rank r sends (r + j + 1) elements to rank j.
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [j + rank + 1 for j in range(world)]
    out = torch.empty(sum(out_splits), device=device)
    inp = _data(rank, (sum(in_splits),), device)
    dist.all_to_all_single(out, inp, out_splits, in_splits, group=g)
    return _cpu(out)


def all_to_all_list(g, rank, world, device):
    ins = [_data(rank, (j + 2,), device, salt=j) for j in range(world)]
    outs = [torch.empty(rank + 2, device=device) for _ in range(world)]
    dist.all_to_all(outs, ins, group=g)
    return _cpu(*outs)


def gather(g, rank, world, device):
    outs = [torch.empty(4, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(_data(rank, (4,), device), outs, group_dst=0, group=g)
    return _cpu(*outs) if rank == 0 else []


def scatter(g, rank, world, device):
    ins = [_data(0, (5,), device, salt=j) for j in range(world)] if rank == 0 else None
    out = torch.empty(5, device=device)
    dist.scatter(out, ins, group_src=0, group=g)
    return _cpu(out)


def send_recv_ring(g, rank, world, device):
    send = _data(rank, (17,), device)
    recv = torch.empty(17, device=device)
    ops = [
        dist.P2POp(dist.isend, send, group_peer=(rank + 1) % world, group=g),
        dist.P2POp(dist.irecv, recv, group_peer=(rank - 1) % world, group=g),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return _cpu(recv)


def send_recv_blocking(g, rank, world, device):
    # Pairs (0,1), (2,3): the even rank sends first, the odd one receives first.
    t = _data(rank, (3,), device)
    peer = rank ^ 1
    if peer >= world:
        return []
    if rank % 2 == 0:
        dist.send(t, group_dst=peer, group=g)
        dist.recv(t, group_src=peer, group=g)
    else:
        other = torch.empty_like(t)
        dist.recv(other, group_src=peer, group=g)
        dist.send(t, group_dst=peer, group=g)
        t = other
    return _cpu(t)


def barrier(g, rank, world, device):
    dist.barrier(group=g)
    return []


def objects(g, rank, world, device):
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "payload": list(range(rank + 1))}, group=g)
    obj = [f"from-{rank}"]
    dist.broadcast_object_list(obj, group_src=world - 1, group=g)
    return [torch.tensor([len(str(gathered)), len(obj[0])])]


def cases(device):
    R = dist.ReduceOp
    table = {
        "allreduce_sum": allreduce(R.SUM),
        "allreduce_sum_async": allreduce(R.SUM, async_op=True),
        "allreduce_max": allreduce(R.MAX),
        "allreduce_min": allreduce(R.MIN),
        "allreduce_product": allreduce(R.PRODUCT),
        "allreduce_avg": allreduce(R.AVG),
        "allreduce_sum_bf16": allreduce(R.SUM, torch.bfloat16),
        "allreduce_sum_int64": allreduce(R.SUM, torch.int64),
        "allreduce_premul_sum": allreduce_premul_sum,
        "allreduce_coalesced": allreduce_coalesced,
        "broadcast_from_0": broadcast(lambda w: 0),
        "broadcast_from_last": broadcast(lambda w: w - 1),
        "reduce": reduce,
        "all_gather_list": all_gather_list,
        "all_gather_into_tensor": all_gather_into_tensor(False),
        "all_gather_into_tensor_async": all_gather_into_tensor(True),
        "all_gather_into_tensor_coalesced": all_gather_into_tensor_coalesced,
        "reduce_scatter_list_sum": reduce_scatter_list(R.SUM),
        "reduce_scatter_tensor_sum": reduce_scatter_tensor(R.SUM),
        "reduce_scatter_tensor_avg": reduce_scatter_tensor(R.AVG),
        "reduce_scatter_tensor_sum_bf16": reduce_scatter_tensor(R.SUM, torch.bfloat16),
        "reduce_scatter_tensor_coalesced": reduce_scatter_tensor_coalesced,
        "all_to_all_single_even": all_to_all_single_even,
        "all_to_all_single_uneven": all_to_all_single_uneven,
        "all_to_all_list": all_to_all_list,
        "gather": gather,
        "scatter": scatter,
        "send_recv_ring": send_recv_ring,
        "send_recv_blocking": send_recv_blocking,
        "barrier": barrier,
        "objects": objects,
    }
    if device.type == "cpu":
        table["monitored_barrier"] = _monitored_barrier
    return table


def _monitored_barrier(g, rank, world, device):
    # dist.monitored_barrier() insists on backend == "gloo" by name; the c10d method is what
    # odc forwards, so call it on the group directly.
    g.monitored_barrier(datetime.timedelta(seconds=30), True)
    return []


def _outcome(case, group, rank, world, device):
    try:
        return ("ok", case(group, rank, world, device))
    except Exception as exc:  # noqa: BLE001 - the outcome itself is compared
        return ("error", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


def compare_all(rank, world, device_kind, ref_backend):
    """Runs every case on the default (odc) group and on a ref_backend group of the same ranks.

    Returns {case name: (None if identical else a description of the difference, outcome kind
    on odc: "ok" or "error")}.
    """
    device = (
        torch.device(device_kind, torch.cuda.current_device())
        if device_kind == "cuda"
        else (torch.device("cpu"))
    )
    odc = dist.group.WORLD
    ref = dist.new_group(backend=ref_backend)
    report = {}
    for name, case in cases(device).items():
        got = _outcome(case, odc, rank, world, device)
        want = _outcome(case, ref, rank, world, device)
        report[name] = (_difference(got, want), got[0])
    if device_kind == "cuda":
        torch.cuda.synchronize()
    return report


def _difference(got, want):
    if got[0] != want[0]:
        return f"odc outcome {got} but reference outcome {want}"
    if got[0] == "error":
        return None if got[1] == want[1] else f"odc raised {got[1:]} but reference {want[1:]}"
    if len(got[1]) != len(want[1]):
        return f"odc returned {len(got[1])} tensors, reference {len(want[1])}"
    for i, (a, b) in enumerate(zip(got[1], want[1])):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"tensor {i}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            return f"tensor {i} differs: max abs diff {(a.double() - b.double()).abs().max()}"
    return None


def assert_case(world, per_rank, name, rejected):
    """Every rank's outcome of case `name` matched the reference, and succeeded unless the
    reference backend rejects the operation (then odc must reject it too)."""
    for rank, rep in enumerate(per_rank):
        diff, kind = rep[name]
        assert diff is None, f"world {world} rank {rank} {name}: {diff}"
        expected = "error" if name in rejected else "ok"
        assert kind == expected, f"world {world} rank {rank} {name}: odc outcome {kind}"
