"""benchmarks/sim_multinode.py, the multi-node projection: properties its model must keep on a
tiny configuration (CPU, a few seconds)."""

import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import sim_multinode as sim
from workloads import long_context, rl_like

RESULTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "e2e")
COST = sim.time_cost(
    {"floor_s": 0.5, "dense_flops_per_s": 4.4e14, "attention_flops_per_s": 2.8e14}, "7b", 1
)
MODEL = sim.model_of("7b")
SCHEMES = ("fsdp2_every", "fsdp2_once", "odc", "odc_overlap", "odc_full")


def machine(nodes=2, gpus=4, link=50.0, nvlink=300.0, barrier=0.01, latency=10e-6):
    return sim.Machine(
        nodes=nodes,
        gpus_per_node=gpus,
        link_gbs=link,
        nvlink_gbs=nvlink,
        barrier_s=barrier,
        link_latency_s=latency,
    )


def draw(workload, n, seed):
    return workload(np.random.default_rng(seed), n)


def test_equal_lengths_and_free_network_tie():
    """Equal lengths give every rank the same work under both plans; with an infinitely fast
    network and no barrier cost nothing else separates the schemes."""
    m = machine(nodes=2, gpus=4, link=math.inf, nvlink=math.inf, barrier=0.0, latency=0.0)
    lengths = np.full(3 * 8, 16384)
    r = sim.minibatch("7b", m, lengths, COST, COST(2))
    for scheme in SCHEMES:
        assert r[scheme] == pytest.approx(r["fsdp2_every"], rel=1e-9), (scheme, r)
    assert r["fsdp2_every"] == pytest.approx(3 * COST(16384), rel=1e-9)


def test_free_network_reduces_to_the_planner():
    """With communication free, FSDP2 (every microbatch index waits for its slowest rank) is the
    LB-Micro plan's makespan and ODC (each rank alone) the LB-Mini plan's."""
    m = machine(nodes=2, gpus=4, link=math.inf, nvlink=math.inf, barrier=0.0, latency=0.0)
    for seed in range(3):
        r = sim.minibatch("7b", m, draw(long_context, 4 * 8, seed), COST, COST(2))
        assert r["fsdp2_every"] == pytest.approx(r["planner_micro"], rel=1e-9)
        assert r["odc"] == pytest.approx(r["planner_mini"], rel=1e-9)


@pytest.mark.parametrize("workload", [long_context, rl_like])
def test_a_slower_link_never_makes_a_scheme_faster(workload):
    lengths = draw(workload, 4 * 8, 11)
    last = None
    for link in (math.inf, 400.0, 50.0, 25.0, 5.0):
        r = sim.minibatch("7b", machine(link=link), lengths, COST, COST(2))
        if last is not None:
            for scheme in SCHEMES:
                assert r[scheme] >= last[scheme] * (1 - 1e-12), (scheme, link, r, last)
        last = r
    assert last["odc"] > last["planner_mini"]  # 5 GB/s: the all-reduce shows


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_bounds_and_orderings(nodes):
    """No scheme beats the planner's lower bound; FSDP2 meeting every microbatch across nodes is
    never faster than meeting once; the overlapped all-reduce never loses to the exposed one;
    one node has no all-reduce, so its ODC time does not depend on the link."""
    for seed in range(3):
        lengths = draw(rl_like, 3 * nodes * 4, seed)
        r = sim.minibatch("7b", machine(nodes=nodes), lengths, COST, COST(2))
        for scheme in SCHEMES:
            assert r[scheme] >= r["lower_bound"] * (1 - 1e-12), (scheme, r)
        assert r["odc"] >= r["planner_mini"]
        assert r["fsdp2_every"] >= r["fsdp2_once"] * (1 - 1e-12)
        assert r["odc_overlap"] <= r["odc"] * (1 + 1e-12)
        if nodes == 1:
            slow = sim.minibatch("7b", machine(nodes=1, link=1.0), lengths, COST, COST(2))
            assert slow["odc"] == r["odc"] and slow["fsdp2_every"] == r["fsdp2_every"]


def test_all_reduce_cost_is_the_ring_formula():
    m = machine(nodes=4, gpus=8, link=50.0, latency=0.0)
    t = sim.comm_times(MODEL, m)
    assert t["ar_all"] == pytest.approx(2 * 3 / 4 * 4 * MODEL.n_params / 50e9)
    assert t["ar"] * MODEL.layers == pytest.approx(t["ar_all"])
    assert sim.comm_times(MODEL, machine(nodes=1))["ar_all"] == 0.0


def test_uneven_counts_are_refused_for_fsdp2():
    with pytest.raises(ValueError, match="same number"):
        sim.fsdp2_step([[1.0, 1.0], [1.0]], MODEL, machine(nodes=1, gpus=2))


def test_validation_against_the_committed_7b_run():
    """At the size of the committed 7B run (2 GPUs, one node) on the minibatches it measured,
    the modeled speed-up of ODC over FSDP2 is within 0.05 of the measured one."""
    rows = sim.validate(os.path.join(RESULTS, "e2e_7b_2gpu-4spr_h100x2_2026-11-25.json"), 270.0)
    assert {r["workload"] for r in rows} == {"long-context", "rl"}
    for r in rows:
        assert abs(r["modeled_speedup"] - r["measured_speedup"]) < 0.05, r


def test_main_writes_the_projection(tmp_path):
    out = tmp_path / "proj"
    sim.main(
        [
            "--nodes",
            "1,2",
            "--gpus-per-node",
            "2",
            "--link-gbs",
            "25,50",
            "--seqs-per-rank",
            "2",
            "--draws",
            "2",
            "--workloads",
            "long-context,rl",
            "--results",
            RESULTS,
            "--out",
            str(out),
            "--no-plot",
        ]
    )
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["assumptions"] and data["calibrations"]["7b"]["calibration_check"]["microbatches"]
    assert len(data["rows"]) == 2 * (1 + 2)  # workloads x (one node + two links)
    for row in data["rows"]:
        assert row["odc_speedup_vs_fsdp2_every"] > 0 and row["planner_bound"] >= 1 - 1e-9
    assert data["validation_one_node"]
