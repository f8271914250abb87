"""The step core (torch_odc.step) alone, no trainer: two real ranks of an "odc" process group hold
uneven numbers of rows of a toy step; they gather the rows' lengths, plan the step with LB-Mini,
move the rows, pack and weight their microbatches, run a toy model's backward and reduce their
metrics. Compared with a single process that has every row (no step core): the rows each rank
ran are exactly the step's rows, each once, bit for bit; the averaged gradient is the
full-batch token-mean gradient; the reduced metrics are the full batch's."""

from __future__ import annotations

import math

import pytest
import torch
from multiproc import run_ranks

from torch_odc import step as core

COUNTS = [7, 2]  # uneven: rank 0 holds most of the step's rows
WIDTH = 16  # rows arrive right-padded to this width
VOCAB, DIM = 31, 6
CAP = 16  # tokens per microbatch (padded, in the packing)


def _lengths(rank: int) -> list[int]:
    # 3 to 14 tokens; rank 1's first row is the step's longest
    return [((5 * rank + 3 * i) % 9) + 3 + 6 * ((rank, i) == (1, 0)) for i in range(COUNTS[rank])]


def _rows(rank: int) -> dict:
    """Rank's rows: right-padded token ids whose values identify (rank, row, position), their
    lengths and a float64 payload."""
    lengths = _lengths(rank)
    n = len(lengths)
    g = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(1, VOCAB, (n, WIDTH), generator=g)
    mask = torch.arange(WIDTH)[None, :] < torch.tensor(lengths)[:, None]
    return {
        "ids": ids * mask,
        "mask": mask,
        "length": torch.tensor(lengths),
        "tag": torch.tensor([rank * 100.0 + i for i in range(n)], dtype=torch.float64),
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, VOCAB)).double()


def _token_losses(model, ids, mask):
    """Next-token cross entropy per position (rows, width - 1), zero where the target is a pad."""
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.size(0), -1)
    return loss * mask[:, 1:]


def _rank_step(rank, world):
    import torch.distributed as dist

    rows = _rows(rank)
    lengths = rows["length"].tolist()
    # 1. every rank's rows: their lengths and this rank's loss tokens (the step's normalizer)
    step = core.gather_rows(lengths, extra={"loss_tokens": int(rows["mask"][:, 1:].sum())})
    assert step.counts == COUNTS and len(step.lengths) == sum(COUNTS)
    loss_tokens = sum(e["loss_tokens"] for e in step.extras)
    # 2. the plan: LB-Mini over the step's rows, checked
    plan = core.plan_step(step.lengths, world, core.LBMini(CAP), costs=step.costs())
    # 3. the rows move to the ranks the plan names, kept in place where it allows
    moved = step.exchange(rows, plan, keep_in_place=True)
    mine = moved.rows
    # 4. this rank's rows repacked under a padded-token cap: each microbatch rows x its longest
    own = mine["length"].tolist()
    packed = core.pack_padded(
        range(len(own)), lambda i: core.row_shape((own[i],)), lambda d: d[0], CAP
    )
    model = _model()
    micro_tokens, micro_longest = [], []
    for positions in packed:
        longest = max(own[i] for i in positions)
        idx = torch.tensor(positions, dtype=torch.long)
        mb = core.Microbatch(
            {"ids": mine["ids"][idx, :longest], "mask": mine["mask"][idx, :longest]},
            rows=positions,
            shape=(len(positions), longest),
            token_weight=world / loss_tokens,  # FSDP2's average over ranks divides world out
        )
        assert mb.padded_tokens == core.padded_tokens([(own[i],) for i in positions])
        assert mb.padded_tokens <= CAP or len(positions) == 1
        loss = _token_losses(model, mb["ids"], mb["mask"]).sum() * mb.token_weight
        loss.backward()
        micro_tokens.append(float(mb["mask"][:, 1:].sum()))
        micro_longest.append(float(longest))
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for gr in grads:  # what FSDP2 / ODC do with the ranks' gradients: their average
        dist.all_reduce(gr)
        gr /= world
    # 5. metrics over uneven counts, once per step
    (tokens,) = core.all_reduce_sums([sum(micro_tokens)])
    (shortest,) = core.all_reduce_min([min(own, default=math.inf)])
    metrics = core.reduce_metrics(
        {"tokens": ("sum", micro_tokens), "longest": ("max", micro_longest)}
    )
    return {
        "plan": plan,
        "used": moved.plan,
        "tags": mine["tag"].tolist(),
        "ids": mine["ids"],
        "microbatches": len(packed),
        "grads": [g.clone() for g in grads],
        "tokens": tokens,
        "shortest": shortest,
        "metrics": metrics,
        "moved": (moved.moved, moved.received),
    }


def test_a_toy_step_on_two_ranks_equals_one_process():
    world = len(COUNTS)
    out = run_ranks(world, _rank_step)
    every = [_rows(r) for r in range(world)]
    ids = torch.cat([r["ids"] for r in every])
    mask = torch.cat([r["mask"] for r in every])
    tags = torch.cat([r["tag"] for r in every]).tolist()
    lengths = [n for r in range(world) for n in _lengths(r)]

    # Every rank planned the same step, and the plan is LB-Mini's of the step's lengths.
    from torch_odc import balance

    reference = balance.plan(lengths, world, CAP, mode="mini").microbatches
    assert out[0]["plan"] == out[1]["plan"] == [[list(m) for m in p] for p in reference]
    # The rows each rank ran: the plan's (after keeping in place), bit for bit, each row once.
    used = out[0]["used"]
    assert out[1]["used"] == used
    for r in range(world):
        order = [i for m in used[r] for i in m]
        assert out[r]["tags"] == [tags[i] for i in order]
        assert torch.equal(out[r]["ids"], ids[order])
    assert sorted(t for o in out for t in o["tags"]) == sorted(tags)
    # Uneven counts: the ranks ran different numbers of microbatches (rank 0 held 7 rows).
    assert out[0]["microbatches"] != out[1]["microbatches"]
    assert out[0]["moved"][0] == out[1]["moved"][0] > 0

    # The gradient: the full batch's token-mean loss in one process, no step core.
    model = _model()
    per_token = _token_losses(model, ids, mask)
    (per_token.sum() / mask[:, 1:].sum()).backward()
    for r in range(world):
        for got, want in zip(out[r]["grads"], model.parameters(), strict=True):
            torch.testing.assert_close(got, want.grad, rtol=1e-12, atol=1e-14)

    # Metrics: the full batch's, on every rank.
    for r in range(world):
        assert out[r]["tokens"] == float(mask[:, 1:].sum())
        assert out[r]["shortest"] == min(lengths)
        m = out[r]["metrics"]
        assert m["tokens"] == ("sum", float(mask[:, 1:].sum()), sum(o["microbatches"] for o in out))
        assert m["longest"][:2] == ("max", float(max(lengths)))


def test_check_plan_refuses_a_plan_that_drops_or_repeats_a_row():
    assert core.check_plan([[[0, 2]], [[1]]], 3, 2) == [[[0, 2]], [[1]]]
    with pytest.raises(ValueError, match="once each"):
        core.check_plan([[[0, 1]], [[1]]], 3, 2)
    with pytest.raises(ValueError, match="empty microbatch"):
        core.check_plan([[[0, 1, 2]], [[]]], 3, 2)
    with pytest.raises(ValueError, match="outside"):
        core.check_plan([[[0, 1, 3]], []], 3, 2)
    with pytest.raises(ValueError, match="world of 2"):
        core.check_plan([[[0, 1, 2]]], 3, 2)


def test_plan_step_over_the_cap():
    lengths = [30, 5, 5]
    with pytest.warns(UserWarning, match="longer than"):
        plan = core.plan_step(lengths, 2, core.LBMini(20))
    assert [30] in [[lengths[i] for i in m] for p in plan for m in p]
    with pytest.raises(ValueError, match="30 tokens is longer than the cap of 20"):
        core.plan_step(lengths, 2, core.LBMini(20), oversized="raise")


def test_row_costs_of_pairs_and_images():
    # A pair costs the sum of its sequences' costs; an image as a sequence of its patches.
    flops = {"num_params": 1e6, "num_layers": 2, "hidden_size": 8}
    one = lambda n: (6e6 + 6 * 2 * 8 * n) * n  # flops_cost, training
    got = core.row_costs([(3, 4), (5,)], "flops", flops, images=[(), (2,)])
    assert got == [pytest.approx(one(3) + one(4)), pytest.approx(one(5) + one(2))]
    assert core.row_costs([(3,), (5,)]) is None
