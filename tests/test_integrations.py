"""balance.plan_for_rank, the one-call helper that framework recipes (docs/integrations/) use:
this rank's microbatches and the global token count, the same on every rank with no
communication; and, on real ranks under ODC, that scaling each microbatch's summed loss by
RankPlan.loss_scale trains exactly like one process on the token mean of the whole minibatch,
with FSDP2's default division, with torchtitan's set_gradient_divide_factor(1.0) and with the
gradient reduction deferred to each rank's last microbatch."""

import warnings

import pytest
import torch
from multiproc import run_ranks
from odc_training import make_model, reference, samples, sharded_model

from torch_odc import balance

LR = 0.1


def test_every_rank_gets_its_share_of_one_global_plan():
    lengths = [900, 30, 410, 77, 1200, 64, 64, 300, 5, 18]
    world, cap = 3, 2048
    shares = [balance.plan_for_rank(lengths, world, r, cap) for r in range(world)]
    want = balance.plan(lengths, world, cap, mode="mini")
    for r, share in enumerate(shares):
        assert share.rank == r
        assert share.microbatches == want.microbatches[r]
        assert share.plan == want  # the same global plan on every rank
        assert share.num_tokens == sum(lengths)
        assert share.indices == [i for mb in want.microbatches[r] for i in mb]
    assert sorted(i for s in shares for i in s.indices) == list(range(len(lengths)))


def test_micro_mode_gives_every_rank_the_same_number_of_microbatches():
    lengths = [700, 20, 20, 20, 650, 30, 40, 500, 11, 90, 300, 300]
    shares = [balance.plan_for_rank(lengths, 4, r, 800, mode="micro") for r in range(4)]
    assert len({len(s.microbatches) for s in shares}) == 1


def test_loss_tokens_set_the_global_count_and_ranks_may_be_empty():
    lengths, loss_tokens = [50, 20], [49, 0]  # the second sequence is all prompt
    shares = [balance.plan_for_rank(lengths, 4, r, 64, loss_tokens=loss_tokens) for r in range(4)]
    assert [s.num_tokens for s in shares] == [49] * 4
    assert sum(1 for s in shares if not s.microbatches) == 2  # fewer sequences than ranks
    assert shares[0].loss_scale() == pytest.approx(4 / 49)
    assert shares[0].loss_scale(1.0) == pytest.approx(1 / 49)
    none = balance.plan_for_rank([5], 1, 0, 8, loss_tokens=[0])
    assert none.num_tokens == 0 and none.loss_scale() == 0.0


def test_lengths_from_tensors_and_numpy_give_the_same_share():
    np = pytest.importorskip("numpy")
    lengths = [33, 8, 91, 40, 12, 70]
    want = balance.plan_for_rank(lengths, 2, 1, 100, loss_tokens=[n - 1 for n in lengths])
    for lens in (torch.tensor(lengths), np.array(lengths)):
        got = balance.plan_for_rank(lens, 2, 1, 100, loss_tokens=lens - 1)
        assert got == want


def test_cost_arguments_reach_the_planner():
    lengths = [4000, 100, 100, 100, 100, 100, 100, 100]
    by_flops = balance.plan_for_rank(
        lengths, 2, 0, 8192, cost="flops", num_params=1e6, num_layers=8, hidden_size=256
    )
    assert by_flops.plan == balance.plan(
        lengths, 2, 8192, cost="flops", num_params=1e6, num_layers=8, hidden_size=256
    )


def test_oversized_sequences_warn_at_the_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        balance.plan_for_rank([10, 500], 2, 0, 100)
    assert [w.category for w in caught] == [balance.OversizedSequenceWarning]
    assert caught[0].filename == __file__


@pytest.mark.parametrize(
    "args,kwargs,error",
    [
        (([5, 6], 2, 2, 8), {}, ValueError),  # rank out of range
        (([5, 6], 2, -1, 8), {}, ValueError),
        (([5, 6], 2, True, 8), {}, TypeError),
        (([5, 6], 2, 0.5, 8), {}, TypeError),
        (([5, 6], 2, 0, 8), {"loss_tokens": [1]}, ValueError),  # wrong count
        (([5, 6], 2, 0, 8), {"loss_tokens": [1, -1]}, ValueError),
        (([5, 6], 2, 0, 8), {"loss_tokens": [1, 2.0]}, TypeError),
        (([], 2, 0, 8), {}, ValueError),
        (([5, 6], 0, 0, 8), {}, ValueError),
        (([5, 6], 2, 0, 8), {"mode": "minibatch"}, ValueError),
    ],
)
def test_bad_arguments_are_refused(args, kwargs, error):
    with pytest.raises(error):
        balance.plan_for_rank(*args, **kwargs)


def test_loss_scale_refuses_a_non_positive_factor():
    share = balance.plan_for_rank([5, 6], 2, 0, 8)
    with pytest.raises(ValueError):
        share.loss_scale(0.0)


# Three minibatches of 5, 2 and 7 sequences over 3 ranks: with 2 sequences one rank has none.
SEQUENCES = [5, 2, 7]
CAP = 40  # tokens per microbatch: several sequences share a microbatch, counts differ per rank


def _train_with_plan_for_rank(rank, world, divide_factor, defer_sync):
    import torch.distributed as dist
    from odc_training import loss_of
    from torch.distributed.fsdp import FSDPModule

    import torch_odc

    model = sharded_model(world)
    if divide_factor is not None:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(divide_factor)
    handle = torch_odc.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)  # as `reference`
    counts = []
    for mb, n in enumerate(SEQUENCES):
        seqs = samples(mb, n)  # the same minibatch on every rank (shared seed)
        lengths = [s.shape[1] - 1 for s in seqs]  # inputs; each predicts one target
        share = balance.plan_for_rank(lengths, world, rank, CAP)
        scale = share.loss_scale(divide_factor)
        counts.append(len(share.microbatches))
        for j, micro in enumerate(share.microbatches):
            # verl's and HF Trainer's default: no gradient reduction before the last microbatch
            model.set_requires_gradient_sync(not defer_sync or j == len(share.microbatches) - 1)
            (sum(loss_of(model, seqs[i]) for i in micro) * scale).backward()
        torch_odc.minibatch_barrier()
        opt.step()
        opt.zero_grad()
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    handle.detach()
    dist.barrier()
    return full, counts


@pytest.mark.parametrize(
    "divide_factor,defer_sync",
    [(None, False), (1.0, False), (None, True)],
    ids=["fsdp2-avg", "divide-factor-1", "sync-at-last-microbatch"],
)
def test_plan_for_rank_and_loss_scale_train_like_one_process(divide_factor, defer_sync):
    """torchtitan sets the divide factor to 1.0; verl and HF Trainer skip the gradient
    reduction (set_requires_gradient_sync(False)) on all but each rank's last microbatch."""
    results = run_ranks(3, _train_with_plan_for_rank, divide_factor, defer_sync)
    counts = [c for _, c in results]
    assert any(c[1] == 0 for c in counts), counts  # a rank without microbatches
    assert len({tuple(c) for c in counts}) > 1, counts  # ranks ran different numbers
    assert max(max(c) for c in counts) >= 2, counts  # some rank accumulated (deferred sync)
    want = reference([[n] for n in SEQUENCES], False, LR)
    init = make_model(False).state_dict()
    for rank, (params, _) in enumerate(results):
        for name, ref in want.items():
            torch.testing.assert_close(
                params[name],
                ref,
                rtol=0,
                atol=1e-5,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
    assert max((want[k] - init[k]).abs().max().item() for k in want) > 1e-3
