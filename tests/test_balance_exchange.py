"""balance.exchange_rows on real process groups: every rank ends with exactly the rows the plan
gives it, in its microbatches' order, bit for bit (compared with indexing the concatenation of
every rank's rows in one process), through both transports; ranks that disagree on the plan or
the rows' layout get an error naming the rank, before anything moves."""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks

from torch_odc import balance

COUNTS = [5, 0, 7]  # a rank without rows


def _rows(rank: int, n: int) -> dict:
    """Rows whose every value identifies (rank, row), in dtypes a float buffer would not carry
    exactly: int64 ids above 2**24, float64, bfloat16, bool, and a 3-D tensor."""
    g = torch.Generator().manual_seed(100 + rank)
    base = rank * 1000 + torch.arange(n, dtype=torch.int64)
    return {
        "ids": (2**40 + base[:, None] * 16 + torch.arange(6)),
        "value": base.double() / 3,
        "half": torch.randn(n, 4, generator=g).bfloat16(),
        "mask": torch.rand(n, 3, generator=g) > 0.5,
        "cube": torch.randn(n, 2, 3, generator=g),
    }


def _plan(world: int):
    lengths = [((7 * i) % 11) + 1 for i in range(sum(COUNTS))]
    return balance.plan(lengths, world, 12, mode="mini")


def _dense(rank, world, keep):
    rows = _rows(rank, COUNTS[rank])
    out = balance.exchange_rows(rows, _plan(world), COUNTS, keep_in_place=keep)
    return out.rows, out.microbatches, out.plan, out.moved, out.received


def _objects(rank, world):
    rows = [("row", rank, i) for i in range(COUNTS[rank])]
    out = balance.exchange_rows(
        rows,
        _plan(world),
        COUNTS,
        take=lambda rs, idx: [rs[i] for i in idx],
        join=lambda pieces: [r for p in pieces for r in p],
    )
    return out.rows, out.microbatches, out.plan


def _expected(plan, rank):
    every = {k: torch.cat([_rows(r, n)[k] for r, n in enumerate(COUNTS)]) for k in _rows(0, 1)}
    order = torch.tensor([p for micro in plan[rank] for p in micro], dtype=torch.long)
    return {k: v[order] for k, v in every.items()}


@pytest.mark.parametrize("keep", [False, True])
def test_every_rank_gets_exactly_its_planned_rows_bit_for_bit(keep):
    results = run_ranks(3, _dense, keep, backend="gloo", timeout=120)
    plans = [r[2] for r in results]
    assert plans[0] == plans[1] == plans[2]
    plan = plans[0]
    if not keep:
        assert plan == _plan(3).microbatches
    else:
        assert sorted(map(str, plan)) == sorted(map(str, _plan(3).microbatches))
    owner = [r for r, n in enumerate(COUNTS) for _ in range(n)]
    moved = sum(owner[p] != d for d in range(3) for m in plan[d] for p in m)
    for rank, (rows, micros, _, got_moved, received) in enumerate(results):
        expected = _expected(plan, rank)
        assert rows.keys() == expected.keys()
        for k in rows:
            assert rows[k].dtype == expected[k].dtype and rows[k].shape == expected[k].shape, k
            assert torch.equal(rows[k], expected[k]), (rank, k)
        assert [len(m) for m in micros] == [len(m) for m in plan[rank]]
        assert [p for m in micros for p in m] == list(range(len(rows["ids"])))
        assert got_moved == moved
        assert received == sum(owner[p] != rank for m in plan[rank] for p in m)
    if keep:
        plain = _plan(3).microbatches
        assert moved <= sum(owner[p] != d for d in range(3) for m in plain[d] for p in m)


def _swap_single_rows(rank, world):
    rows = _rows(rank, 1)
    out = balance.exchange_rows(rows, [[[1]], [[0]]], [1, 1])
    return out.rows


def test_a_single_row_of_several_dtypes_arrives_intact():
    results = run_ranks(2, _swap_single_rows, backend="gloo", timeout=120)
    for rank, rows in enumerate(results):
        expected = _rows(1 - rank, 1)
        for k in expected:
            assert torch.equal(rows[k], expected[k]), (rank, k)


def test_keep_in_place_gives_each_share_to_the_rank_holding_most_of_it():
    plan = [[[5, 6], [7]], [[0, 1, 2]], [[3, 4, 8]]]  # shares as rows 0-2, 3-5, 6-8 are held
    out = balance.keep_in_place(plan, [3, 3, 3])
    assert out == [[[0, 1, 2]], [[3, 4, 8]], [[5, 6], [7]]]


def test_other_containers_travel_pickled_in_plan_order():
    results = run_ranks(3, _objects, backend="gloo", timeout=120)
    plan = results[0][2]
    owner = [r for r, n in enumerate(COUNTS) for _ in range(n)]
    offset = [sum(COUNTS[:r]) for r in range(3)]
    for rank, (rows, micros, _) in enumerate(results):
        expected = [("row", owner[p], p - offset[owner[p]]) for m in plan[rank] for p in m]
        assert rows == expected
        assert sum(len(m) for m in micros) == len(rows)


def _disagree(rank, world, what):
    rows = _rows(rank, COUNTS[rank])
    plan = _plan(world).microbatches
    if what == "plan" and rank == 2:
        plan = [plan[1], plan[0], plan[2]]
    if what == "layout" and rank == 0:
        rows["value"] = rows["value"].float()
    try:
        balance.exchange_rows(rows, plan, COUNTS, where="test")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "what,odd,named", [("plan", 2, "rank 2 planned"), ("layout", 0, "rank 0's rows are laid out")]
)
def test_ranks_that_disagree_are_refused_naming_the_rank(what, odd, named):
    results = run_ranks(3, _disagree, what, backend="gloo", timeout=120)
    for rank, message in enumerate(results):
        assert message is not None and message.startswith(f"test, rank {rank}:"), message
        if rank != odd:  # the odd rank names the first peer that disagrees with it
            assert named in message, (rank, message)


def _lone(rank, world):
    try:
        balance.exchange_rows({"x": torch.zeros(3, 1)}, [[[0, 1]]], [3])
    except ValueError as e:
        return str(e)
    return None


def test_a_plan_that_misses_a_row_is_refused_before_any_collective():
    (message,) = run_ranks(1, _lone, backend="gloo", timeout=60)
    assert "exactly once" in message, message


def _dense_cuda(rank, world):
    rows = {k: v.cuda() for k, v in _rows(rank, COUNTS[rank]).items()}
    out = balance.exchange_rows(rows, _plan(world), COUNTS, keep_in_place=True)
    assert all(v.is_cuda for v in out.rows.values())
    return {k: v.cpu() for k, v in out.rows.items()}, out.plan


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs (one per rank, NCCL)")
def test_gpu_rows_move_over_the_odc_groups_nccl_bit_for_bit():
    results = run_ranks(3, _dense_cuda, backend="odc", cuda=True, timeout=180)
    for rank, (rows, plan) in enumerate(results):
        expected = _expected(plan, rank)
        for k in rows:
            assert torch.equal(rows[k], expected[k]), (rank, k)
