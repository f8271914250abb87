"""Tests of torch_odc.balance: planner rules (property-based), errors, quality, the sampler."""

import itertools
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_odc import balance

MODES = ("mini", "micro")


def _costs_of(lengths, cost, **cost_args):
    if cost == "tokens":
        return [float(x) for x in lengths]
    if cost == "flops":
        return [balance.flops_cost(x, **cost_args) for x in lengths]
    return [float(cost(x)) for x in lengths]


def check_plan(p, lengths, world_size, cap, mode, costs):
    """Asserts every rule a plan must obey."""
    n = len(lengths)
    assert p.mode == mode
    assert len(p.microbatches) == world_size
    seen = sorted(i for rank in p.microbatches for mb in rank for i in mb)
    assert seen == list(range(n)), "every index exactly once"

    oversized = {i for i, x in enumerate(lengths) if x > cap}
    assert set(p.oversized) == oversized
    for rank in p.microbatches:
        for mb in rank:
            if len(mb) > 1:
                assert sum(lengths[i] for i in mb) <= cap
                assert not oversized.intersection(mb), "an over-long sequence is alone"

    per_rank = [sum(len(mb) for mb in rank) for rank in p.microbatches]
    if n >= world_size:
        assert min(per_rank) >= 1, "every rank gets a sequence"

    mb_cost = [[sum(costs[i] for i in mb) for mb in rank] for rank in p.microbatches]
    rank_costs = [sum(r) for r in mb_cost]
    assert p.rank_costs == pytest.approx(rank_costs, rel=1e-9, abs=1e-9)
    assert p.lower_bound == pytest.approx(max(sum(costs) / world_size, max(costs)), rel=1e-12)
    if mode == "mini":
        assert p.makespan == pytest.approx(max(rank_costs), rel=1e-9)
        assert all(mb for rank in p.microbatches for mb in rank), "no empty microbatch"
        for r in mb_cost:  # costliest microbatch first
            assert all(a >= b * (1 - 1e-12) for a, b in itertools.pairwise(r))
    else:
        m = len(p.microbatches[0])
        assert all(len(rank) == m for rank in p.microbatches), "same count on every rank"
        if n >= m * world_size:
            assert all(mb for rank in p.microbatches for mb in rank), "no empty microbatch"
        step_max = [max(r[j] for r in mb_cost) for j in range(m)]
        assert p.makespan == pytest.approx(sum(step_max), rel=1e-9)
        assert all(a >= b * (1 - 1e-12) for a, b in itertools.pairwise(step_max))
    assert p.makespan >= p.lower_bound * (1 - 1e-9)
    for rank in p.microbatches:  # longest sequence first inside a microbatch
        for mb in rank:
            assert all(lengths[a] >= lengths[b] for a, b in itertools.pairwise(mb))


def plan_quietly(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", balance.OversizedSequenceWarning)
        return balance.plan(*args, **kwargs)


def sawtooth_cost(length):
    """A cost that does not grow with length and can be zero."""
    return (length % 97) * 3.0


cost_specs = st.sampled_from(["tokens", "flops", "callable"])


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=80),
    world_size=st.integers(1, 12),
    cap=st.integers(1, 12000),
    mode=st.sampled_from(MODES),
    cost=cost_specs,
)
def test_plan_obeys_the_rules(lengths, world_size, cap, mode, cost):
    if cost == "callable":
        cost = sawtooth_cost
    p = plan_quietly(lengths, world_size, cap, mode=mode, cost=cost)
    check_plan(p, lengths, world_size, cap, mode, _costs_of(lengths, cost))
    assert plan_quietly(lengths, world_size, cap, mode=mode, cost=cost) == p, "deterministic"


@settings(deadline=None, max_examples=40)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=30),
    world_size=st.integers(1, 40),
    mode=st.sampled_from(MODES),
)
def test_tight_caps_and_few_sequences(lengths, world_size, mode):
    # Caps near the sequence lengths force many microbatches and over-long sequences.
    cap = max(1, max(lengths) // 2)
    p = plan_quietly(lengths, world_size, cap, mode=mode)
    check_plan(p, lengths, world_size, cap, mode, _costs_of(lengths, "tokens"))


def test_oversized_sequence_warns_and_sits_alone():
    with pytest.warns(balance.OversizedSequenceWarning, match="1 sequence"):
        p = balance.plan([10, 200, 30], 2, 100)
    assert p.oversized == (1,)
    assert [1] in p.microbatches[0] + p.microbatches[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        balance.plan([10, 20, 30], 2, 100)


def test_a_cap_of_one_token_means_one_sequence_per_microbatch_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = balance.plan([5, 300, 40, 7000, 2], 2, 1, mode="mini", cost="flops")
        balance.BalancedBatchSampler([5, 300, 40, 7000], 2, 0, 4, 1)
    assert sorted(len(mb) for r in p.microbatches for mb in r) == [1] * 5


def test_fewer_sequences_than_ranks():
    mini = balance.plan([5, 3], 4, 10, mode="mini")
    assert sorted(len(r) for r in mini.microbatches) == [0, 0, 1, 1]
    micro = balance.plan([5, 3], 4, 10, mode="micro")
    assert all(len(r) == 1 for r in micro.microbatches)
    assert sorted(len(r[0]) for r in micro.microbatches) == [0, 0, 1, 1]
    assert micro.makespan == 5.0 and micro.ratio == 1.0


def test_micro_balances_each_microbatch_index():
    p = balance.plan([100] * 8, 2, 200, mode="micro")
    assert [len(r) for r in p.microbatches] == [2, 2]
    assert p.makespan == p.lower_bound == 400.0


def test_flops_cost_model():
    # 6 * (N * L + layers * hidden * L^2) for training, 2 * (...) forward only.
    assert balance.flops_cost(1000, num_params=1e9, num_layers=10, hidden_size=100) == 6 * (
        1e12 + 10 * 100 * 1e6
    )
    assert balance.flops_cost(10, num_params=1.0, num_layers=1, hidden_size=1, training=False) == (
        2 * (10 + 100)
    )
    lengths = [1000, 4000, 16000]
    p = balance.plan(lengths, 1, 10**6, cost="flops", num_params=1e9, num_layers=4, hidden_size=64)
    expected = sum(
        balance.flops_cost(x, num_params=1e9, num_layers=4, hidden_size=64) for x in lengths
    )
    assert p.rank_costs[0] == pytest.approx(expected)


def test_inputs_accept_numpy_and_tensors():
    import torch

    ref = balance.plan([7, 3, 9, 1, 4], 2, 10)
    assert balance.plan(np.array([7, 3, 9, 1, 4]), 2, 10) == ref
    assert balance.plan(np.array([7, 3, 9, 1, 4], dtype=np.int32), 2, 10) == ref
    assert balance.plan(torch.tensor([7, 3, 9, 1, 4]), 2, 10) == ref
    assert balance.plan((7, 3, 9, 1, 4), np.int64(2), 10) == ref


BASE_ARGS = {"lengths": [4, 5, 6], "world_size": 2, "max_tokens_per_microbatch": 10}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": []}, "empty"),
        ({"lengths": [3, 0, 2]}, "positive"),
        ({"lengths": [3, -1]}, "positive"),
        ({"lengths": np.array([5, 0])}, "positive"),
        ({"world_size": 0}, "world_size"),
        ({"world_size": -2}, "world_size"),
        ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch"),
        ({"mode": "collective"}, "mode"),
        ({"cost": "bytes"}, "cost"),
        ({"cost": lambda x: -1.0}, "non-negative"),
        ({"cost": lambda x: float("nan")}, "finite"),
        ({"cost": lambda x: float("inf")}, "finite"),
        ({"cost": "flops", "num_layers": 0}, "num_layers"),
    ],
)
def test_bad_values_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        balance.plan(**{**BASE_ARGS, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": [3, 2.5]}, "integers"),
        ({"lengths": [3, True]}, "integers"),
        ({"lengths": np.array([1.0, 2.0])}, "integers"),
        ({"lengths": 5}, "sequence"),
        ({"world_size": 2.0}, "world_size"),
        ({"cost": lambda x: "big"}, "real number"),
    ],
)
def test_bad_types_raise_type_error(kwargs, match):
    with pytest.raises(TypeError, match=match):
        balance.plan(**{**BASE_ARGS, **kwargs})


def test_multidimensional_lengths_raise_value_error():
    with pytest.raises(ValueError, match="one-dimensional"):
        balance.plan(np.array([[1, 2]]), 1, 10)


def test_unknown_cost_args_raise_type_error():
    with pytest.raises(TypeError, match="unknown cost_args"):
        balance.plan([1, 2], 1, 10, cost="flops", num_heads=8)
    with pytest.raises(TypeError, match="flops"):
        balance.plan([1, 2], 1, 10, cost="tokens", num_params=1e9)


# ---- quality and speed -----------------------------------------------------------------------


def long_context_lengths(rng, n):
    """Lognormal truncated to [8K, 64K], mean ~16.4K (as in benchmarks/bench_balance.py)."""
    out = np.empty(0, dtype=np.int64)
    while out.size < n:
        draw = rng.lognormal(np.log(11000.0), 0.6, size=2 * n)
        out = np.concatenate([out, draw[(draw >= 8192) & (draw <= 65536)].astype(np.int64)])
    return out[:n]


def rl_lengths(rng, n):
    """Prompt up to 2K plus a long-tailed response up to 20K."""
    prompt = rng.integers(128, 2049, size=n)
    response = np.minimum(rng.lognormal(np.log(4000.0), 1.0, size=n), 20480).astype(np.int64)
    return prompt + np.maximum(response, 1)


@pytest.mark.parametrize("dist", [long_context_lengths, rl_lengths])
@pytest.mark.parametrize("cost", ["tokens", "flops"])
def test_lb_mini_is_within_two_percent_of_the_lower_bound(dist, cost):
    rng = np.random.default_rng(2024)
    ratios = []
    for world_size in (4, 8, 32, 64):
        for per_rank in (4, 16):
            for _ in range(3):
                lengths = dist(rng, world_size * per_rank)
                p = balance.plan(lengths, world_size, 65536, mode="mini", cost=cost)
                ratios.append(p.ratio)
    assert np.mean(ratios) < 1.02, ratios
    assert max(ratios) < 1.10, ratios


def test_lb_micro_is_not_better_than_lb_mini_on_average():
    rng = np.random.default_rng(7)
    mini, micro = [], []
    for _ in range(5):
        lengths = long_context_lengths(rng, 8 * 16)
        mini.append(balance.plan(lengths, 8, 65536, mode="mini", cost="flops").ratio)
        micro.append(balance.plan(lengths, 8, 65536, mode="micro", cost="flops").ratio)
    assert np.mean(mini) <= np.mean(micro)


@pytest.mark.parametrize("mode", MODES)
def test_ten_thousand_sequences_on_64_ranks_plan_well(mode):
    # Quality only: planning time is a benchmark (benchmarks/bench_balance.py), not a unit test.
    lengths = long_context_lengths(np.random.default_rng(0), 10_000)
    p = balance.plan(lengths, 64, 65536, mode=mode, cost="flops")
    assert p.ratio < 1.05
    assert sorted(i for mbs in p.microbatches for mb in mbs for i in mb) == list(range(10_000))


# ---- sampler ---------------------------------------------------------------------------------


def make_samplers(lengths, world_size, spm, **kwargs):
    """One sampler per rank, built independently as each rank's process would."""
    return [
        balance.BalancedBatchSampler(lengths, world_size, r, spm, 4096, **kwargs)
        for r in range(world_size)
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_ranks_cover_each_minibatch_exactly(mode, drop_last):
    rng = np.random.default_rng(3)
    lengths = rng.integers(100, 3000, size=100).tolist()
    world_size, spm = 4, 24
    samplers = make_samplers(lengths, world_size, spm, mode=mode, drop_last=drop_last, seed=5)
    expected = samplers[0].minibatches()
    assert len(expected) == len(samplers[0]) == (4 if drop_last else 5)
    per_rank = [list(s) for s in samplers]
    assert all(len(steps) == len(expected) for steps in per_rank)
    for step, minibatch in enumerate(expected):
        got = sorted(i for r in range(world_size) for mb in per_rank[r][step] for i in mb)
        assert got == sorted(minibatch)
        for r in range(world_size):
            for mb in per_rank[r][step]:
                if len(mb) > 1:
                    assert sum(lengths[i] for i in mb) <= 4096
        if mode == "micro":
            assert len({len(per_rank[r][step]) for r in range(world_size)}) == 1
    seen = sorted(i for minibatch in expected for i in minibatch)
    if drop_last:
        assert len(seen) == len(set(seen)) == 96
    else:
        assert seen == list(range(100))


def test_sampler_is_identical_across_instances_and_follows_the_epoch():
    lengths = list(range(50, 2050, 20))
    a = balance.BalancedBatchSampler(lengths, 2, 1, 16, 2048, seed=11)
    b = balance.BalancedBatchSampler(lengths, 2, 1, 16, 2048, seed=11)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    b.set_epoch(1)
    assert list(a) == list(b)
    c = balance.BalancedBatchSampler(lengths, 2, 1, 16, 2048, seed=12)
    assert list(c) != first
    assert a.last_plan is not None and a.last_plan.world_size == 2


def test_sampler_shuffle_does_not_depend_on_hash_seed():
    code = (
        "from torch_odc import balance; "
        "s = balance.BalancedBatchSampler(list(range(1, 200)), 4, 2, 32, 1000, seed=3); "
        "s.set_epoch(2); print(list(s))"
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(out.stdout)
    assert len(outputs) == 1


def test_sampler_validates_its_arguments():
    with pytest.raises(ValueError, match="rank"):
        balance.BalancedBatchSampler([1, 2, 3], 2, 2, 2, 10)
    with pytest.raises(TypeError, match="seed"):
        balance.BalancedBatchSampler([1, 2, 3], 2, 0, 2, 10, seed="a")
    with pytest.raises(ValueError, match="sequences_per_minibatch"):
        balance.BalancedBatchSampler([1, 2, 3], 2, 0, 0, 10)
    with pytest.raises(ValueError, match="positive"):
        balance.BalancedBatchSampler([1, 0, 3], 2, 0, 2, 10)
    with pytest.warns(balance.OversizedSequenceWarning):
        balance.BalancedBatchSampler([1, 20, 3], 2, 0, 2, 10)


def test_time_cost_fit_recovers_floor_and_rates():
    """TimeCost.fit on exact timings returns the model that made them; on timings of one rate
    it falls back to one rate; packed sequences pay their token share of the floor."""
    want = balance.TimeCost(0.17, 7.1e14, 2.5e14, 1.03e9, 19, 2048)
    lengths = [509, 1021, 2039, 3067, 4093, 6143, 8191, 12281, 16381, 24571, 32749, 49139]
    got = balance.TimeCost.fit(
        [(n, want(n)) for n in lengths], num_params=1.03e9, num_layers=19, hidden_size=2048
    )
    assert got.floor_s == pytest.approx(0.17, rel=1e-6)
    assert got.dense_flops_per_s == pytest.approx(7.1e14, rel=1e-6)
    assert got.attention_flops_per_s == pytest.approx(2.5e14, rel=1e-6)
    one = balance.TimeCost.fit(
        [(n, 1e-9 * n) for n in (10, 20)], num_params=1.0, num_layers=1, hidden_size=1
    )
    assert one.dense_flops_per_s == one.attention_flops_per_s
    assert one(15) == pytest.approx(
        balance.flops_cost(15, num_params=1.0, num_layers=1, hidden_size=1) / one.dense_flops_per_s
        + one.floor_s
    )
    packed = balance.TimeCost(0.2, 1e14, 1e14, 1e9, 1, 1, max_tokens_per_microbatch=1000)
    assert packed(250) - balance.TimeCost(0.0, 1e14, 1e14, 1e9, 1, 1)(250) == pytest.approx(0.05)


def test_time_cost_floor_changes_the_plan():
    """One sequence per microbatch: a FLOPs-only cost gives the rank with the shorter long
    sequence every short one; with the per-microbatch floor that rank is the straggler, and
    the plan made with the floor is much shorter (both judged by the floored model)."""
    lengths = [12000, 6000] + [750] * 8
    flops = balance.TimeCost(0.0, 1e14, 1e14, 1e9, 16, 2048)
    floored = balance.TimeCost(0.2, 1e14, 1e14, 1e9, 16, 2048)
    by_flops = balance.plan(lengths, 2, 1, mode="mini", cost=flops)
    by_time = balance.plan(lengths, 2, 1, mode="mini", cost=floored)

    def makespan(p):
        return max(sum(floored(lengths[i]) for mb in r for i in mb) for r in p.microbatches)

    assert sorted(len(r) for r in by_flops.microbatches) == [1, 9]
    assert makespan(by_time) < 0.8 * makespan(by_flops), (makespan(by_time), makespan(by_flops))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"floor_s": -1.0}, ValueError),
        ({"dense_flops_per_s": 0.0}, ValueError),
        ({"num_layers": float("inf")}, ValueError),
        ({"hidden_size": "1"}, TypeError),
    ],
)
def test_time_cost_validates(kwargs, error):
    args = {
        "floor_s": 0.1,
        "dense_flops_per_s": 1e14,
        "attention_flops_per_s": 1e14,
        "num_params": 1e9,
        "num_layers": 1,
        "hidden_size": 1,
        **kwargs,
    }
    with pytest.raises(error):
        balance.TimeCost(**args)
    with pytest.raises(ValueError):
        balance.TimeCost.fit([(0, 1.0)], num_params=1, num_layers=1, hidden_size=1)


def test_plan_takes_per_item_costs():
    """costs= plans items by the given costs (a pair costs the sum of its sequences' costs),
    the cap still on the lengths: the same plan as the cost model that gives those costs."""
    lengths = [300, 20, 40, 500, 60, 80, 90, 10]
    pairs = [(n // 2, n - n // 2) for n in lengths]
    seq = balance.sequence_costs([x for p in pairs for x in p], "flops", num_params=1e6)
    costs = [seq[2 * i] + seq[2 * i + 1] for i in range(len(pairs))]
    got = balance.plan(lengths, 3, 600, costs=costs)
    assert sorted(i for r in got.microbatches for mb in r for i in mb) == list(range(8))
    assert sum(got.rank_costs) == pytest.approx(sum(costs))
    assert max(got.rank_costs) == pytest.approx(got.makespan)
    # A cost model giving each length exactly these costs plans the same.
    table = dict(zip(lengths, costs, strict=True))
    ref = balance.plan(lengths, 3, 600, cost=lambda n: table[n])
    assert got.microbatches == ref.microbatches
    with pytest.raises(ValueError, match="costs for"):
        balance.plan(lengths, 3, 600, costs=costs[:-1])
    with pytest.raises(ValueError, match="finite"):
        balance.plan(lengths, 3, 600, costs=[float("nan")] * 8)
    with pytest.raises(TypeError, match="either costs"):
        balance.plan(lengths, 3, 600, cost="flops", costs=costs)
