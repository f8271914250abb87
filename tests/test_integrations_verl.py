"""torch_odc.integrations.verl against the real verl 0.9.1 on 2 (and 4) CPU ranks.

verl pins transformers < 5.11 and breaks with the TRL of the main environment, so it lives in
its own virtual environment, ``.venv/verl-<torch line>``, which ``.ci/bootstrap test`` builds on
top of the torch line's environment (same torch files, so the torch_odc extension built for
that line loads there). The ranks run under that environment's python (tests/verl_cases.py, one
launch for every scenario); this file reads what they saw and compares each ODC run with verl's
own FSDP2 engine (equal microbatch counts) on the same data:

* the actor (verl's ``ppo_loss``, PPO clip + entropy + KL loss) through
  ``TrainingWorker.train_mini_batch``: uneven microbatch counts per rank, then equal ones;
* the actor with LB-Mini across the ranks (``odc_balance="mini"``): sequences moved, different
  numbers of sequences per rank;
* the critic (``value_loss``, ``FSDPEngineWithValueHead`` under ODC);
* ``TrainingWorker.train_batch`` with a rank that holds a single short sequence;
* configurations that cannot work under ODC are refused with a message;
* a tiny Qwen2-VL and Qwen2.5-VL (tests/verl_vlm.py) with rows with images, a video and none:
  microbatches without images run no vision forward under ODC (verl's engine runs a dummy one
  on zeros, with a test fix for transformers 5: ``verl_vlm.install_dummy_fix``), LB-Mini moves
  rows with their images and costs their patches, unserved multi-modal fields are refused;
* on 4 ranks (one more launch): verl's 2-D ``("ddp", "fsdp")`` mesh (``fsdp_size=2``, HSDP over
  odc) and Ulysses sequence parallelism (dp 2 x sp 2, one SP group running more microbatches
  than the other; with LB-Mini; inside the 2-D mesh), against verl's own engine with the same
  settings and against verl's sp=1 run; SP peers that plan differently are refused. verl's
  Ulysses path runs on CPU ranks through test shims (``verl_cases.install_cpu_ulysses``).

Parameters after every run equal verl's within 1e-6 (SGD, fp32); every logged value that does
not depend on how a rank cuts its rows into microbatches (loss, grad_norm, pg_loss, entropy and
KL losses, vf_loss, lr) equals verl's; with equal counts every logged value does.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from verl_env import ROOT, run_under_verl

# Logged values that are the same however each rank cuts its rows into microbatches (verl
# normalizes them by the whole mini-batch); the MEAN ones (pg_clipfrac, ppo_kl, vf_clipfrac,
# vpred_mean: means of per-microbatch means) depend on the cut, in verl itself too.
INVARIANT = (
    "loss",
    "grad_norm",
    "lr",
    "actor/pg_loss",
    "actor/entropy_loss",
    "kl_loss",
    "critic/vf_loss",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    found = run_under_verl(
        "verl_cases.py", tmp_path_factory.mktemp("verl") / "runs.json", timeout=1800
    )
    timings = {**found["ranks"][0]["timings"], **found["four_ranks"][0]["timings"]}
    print(
        f"verl runs: {found['wall_s']:.1f} s "
        f"{ {k: round(v, 1) for k, v in found['launch_wall_s'].items()} }, "
        f"{found['versions']}, per run { {k: round(v, 1) for k, v in timings.items()} }"
    )
    return found


def _close(a: float, b: float, rel: float = 2e-6, abs_: float = 1e-7) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def _compare(found, name: str, reference: str, all_metrics_calls=()) -> list[list[int]]:
    """Parameters and logged values of run `name` against `reference`; returns the microbatch
    counts of each step per rank."""
    for rank in found["ranks"]:
        ref, odc = rank[reference], rank[name]
        worst = max(
            abs(x - y)
            for key in ref["params"]
            for x, y in zip(ref["params"][key], odc["params"][key])
        )
        assert worst < 1e-6, f"{name}: parameters differ from verl's by {worst}"
        for call, (a, b) in enumerate(zip(ref.get("forward", []), odc.get("forward", []))):
            if a is None:  # an SP rank other than its group's first: verl returns nothing
                assert b is None, (name, call)
                continue
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (
                f"{name}: forward-only pass {call} (old log-probs / values) differs from verl's"
            )
        assert len(ref["metrics"]) == len(odc["metrics"])
        for call, (logged_ref, logged_odc) in enumerate(zip(ref["metrics"], odc["metrics"])):
            if logged_ref is None:  # likewise
                assert logged_odc is None, (name, call)
                continue
            assert set(logged_ref) == set(logged_odc), (name, call)
            keys = (
                set(logged_ref)
                if call in all_metrics_calls
                else {k for k in logged_ref if k in INVARIANT}
            )
            assert keys & set(INVARIANT), (name, call)
            for key in sorted(keys):
                a, b = logged_ref[key], logged_odc[key]
                assert len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b)), (
                    f"{name} call {call} {key}: verl logged {a}, ODC {b}"
                )
    return [[s["microbatches"] for s in rank[name]["steps"]] for rank in found["ranks"]]


def test_actor_ppo_uneven_counts_equal_verl(runs):
    # Call 0: rank 0's long responses need more microbatches than rank 1's short ones; call 1:
    # equal lengths, equal counts, so even the per-microbatch means equal verl's.
    counts = _compare(runs, "actor_odc", "actor_ref", all_metrics_calls=(1,))
    assert counts[0][:2] != counts[1][:2], counts  # uneven in call 0 (2 mini-batches)
    assert counts[0][2:] == counts[1][2:], counts


def test_actor_lb_mini_moves_sequences(runs):
    _compare(runs, "mini_odc", "mini_ref")
    steps = [rank["mini_odc"]["steps"] for rank in runs["ranks"]]
    sequences = [[s["sequences"] for s in rank] for rank in steps]
    assert sequences[0][:2] != sequences[1][:2], sequences  # LB-Mini: not 4 and 4
    assert all(sum(pair) == 8 for pair in zip(*sequences)), sequences
    assert any(s["received"] for rank in steps for s in rank)
    tokens = [[s["tokens"] for s in rank] for rank in steps]
    for step in range(len(tokens[0])):  # the plan balances the tokens: within a long sequence
        assert abs(tokens[0][step] - tokens[1][step]) <= 28, tokens


def test_param_and_optimizer_offload_equal_verl(runs):
    """verl's param_offload and optimizer_offload under ODC: every phase switch of verl's train
    and eval contexts releases ODC's memory and takes it back (on CPU ranks in one call), with
    uneven microbatch counts, equal to verl's own engine with the same offload settings."""
    counts = _compare(runs, "offload_odc", "offload_ref")
    assert counts[0][:2] != counts[1][:2], counts
    for rank in runs["ranks"]:
        assert rank["offload_odc"]["after"] >= 4, rank["offload_odc"]["after"]


def test_critic_uneven_counts_equal_verl(runs):
    counts = _compare(runs, "critic_odc", "critic_ref")
    assert counts[0] != counts[1], counts


def test_rank_with_a_single_short_sequence(runs):
    counts = _compare(runs, "single_odc", "single_ref")
    assert counts[1] == [1, 1], counts
    assert [s["sequences"] for s in runs["ranks"][1]["single_odc"]["steps"]] == [1, 1]


def test_ranks_on_two_hosts_run_verls_own_path(runs):
    # attach cannot serve ranks of two hosts on demand: it warns, and the engine runs verl's
    # equal counts over FSDP2's collectives (every logged value as verl's, no ODC step).
    _compare(runs, "hosts_odc", "actor_ref", all_metrics_calls=(0, 1))
    for rank in runs["ranks"]:
        assert rank["hosts_odc"]["steps"] == []
        assert any("spans 2 hosts" in w for w in rank["hosts_odc"]["warned"]), rank["hosts_odc"]


def test_one_rank_runs_verls_own_path(runs):
    one = {"ranks": [{"ref": runs["one_rank"]["ref"], "odc": runs["one_rank"]["odc"]}]}
    _compare(one, "odc", "ref", all_metrics_calls=(0,))
    assert runs["one_rank"]["odc"]["steps"] == []
    assert any("one rank" in w for w in runs["one_rank"]["odc"]["warned"])


def test_reference_model_is_not_refused(runs):
    # verl's ref.strategy follows actor.strategy: a forward-only "odc" engine is built inactive
    # and runs as verl's FSDP2 engine (verl offloads it with pinned memory: GPUs only).
    for rank in runs["ranks"]:
        assert rank["reference"] == {"class": "ODCFSDPEngineWithLMHead", "active": False}


# -- vision-language rows: a tiny Qwen2-VL / Qwen2.5-VL (tests/verl_vlm.py) -----------------


def _vision_forwards(run) -> tuple[int, int]:
    """(calls of the vision tower, dummy vision forwards) in one run of one rank."""
    return run["before"]["vision"], run["after"]["dummy_end"] - run["before"]["dummy_start"]


@pytest.mark.parametrize("name, reference", [("vlm_odc", "vlm_ref"), ("vlm25_odc", "vlm25_ref")])
def test_vlm_mixed_image_and_text_microbatches_equal_verl(runs, name, reference):
    """Rows with images, a video and none, AdamW: verl's own engine (equal counts, its dummy
    vision forward in every text-only microbatch) and the "odc" engine (its own counts, no
    vision forward without images) reach the same parameters, log-probs and logged values."""
    counts = _compare(runs, name, reference)
    assert counts == [[2, 2, 1, 2], [1, 1, 2, 1]], counts
    for rank in runs["ranks"]:
        odc, ref = rank[name], rank[reference]
        steps = odc["steps"]
        # Text-only microbatches beside ones with images, on the same rank and across ranks.
        assert any(0 < s["vision_microbatches"] < s["microbatches"] for s in steps), steps
        # The second mini-batch of call 0 has no image on any rank: the vision tower's
        # gradients are verl's zeros (AdamW then moves it as on verl's engine); otherwise none.
        assert [s["vision_grads_zeroed"] > 0 for s in steps] == [False, True, False, False]
        vision, dummies = _vision_forwards(odc)
        assert dummies == 0 and vision == odc["after"]["odc"]["with_vision"] > 0, odc["after"]
        assert odc["after"]["odc"]["text_only"] > 0, odc["after"]
        ref_vision, ref_dummies = _vision_forwards(ref)
        assert ref_dummies > 0 and ref_vision > vision, (ref_vision, ref_dummies, vision)


def test_vlm_lb_mini_moves_rows_with_their_images(runs):
    """LB-Mini over rows with images: rows move between ranks with their images (the arrived
    rows' image grids are checked against the plan, and the result equals verl's), and a row
    costs its tokens plus its images' patches (odc_cost="tokens")."""
    from verl_vlm import calls, patches, tokens  # tests/ is on sys.path

    _compare(runs, "vlm_mini_odc", "vlm_ref")
    steps = [rank["vlm_mini_odc"]["steps"] for rank in runs["ranks"]]
    assert any(s["received"] for rank in steps for s in rank), steps
    assert any(s["sequences"] != 2 for rank in steps for s in rank), steps
    for rank in steps:
        for s in rank:
            assert s["cost"] == s["tokens"] + s["patches"], s
    # Every row's patches arrived somewhere: each step's patches over the ranks are the rows'.
    for step, (call, half) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        rows = [r for rank in calls()[call] for r in rank[2 * half : 2 * half + 2]]
        assert sum(rank[step]["patches"] for rank in steps) == sum(map(patches, rows))
        assert sum(rank[step]["tokens"] for rank in steps) == sum(map(tokens, rows))
    for rank in runs["ranks"]:
        assert _vision_forwards(rank["vlm_mini_odc"])[1] == 0


def test_vlm_unserved_field_is_refused_on_every_rank(runs):
    # Rank 1's rows carry 'mm_token_type_ids' (verl pads it per microbatch): both ranks raise
    # before any microbatch, naming the field and the rank whose rows had it.
    for rank, found in enumerate(runs["ranks"]):
        message = found["vlm_odc"]["after"]["refused"]
        assert f"rank {rank}, training step 5 of this engine: not served" in message, message
        assert "'mm_token_type_ids'" in message and "(rows of rank(s) [1])" in message, message


def test_unsupported_settings_are_refused(runs):
    rank = runs["ranks"][0]
    assert "offload_policy" in rank["refused_offload"], rank["refused_offload"]


# -- 4 ranks: verl's 2-D mesh (fsdp_size=2) and Ulysses SP (dp 2 x sp 2) ----------------------


def _four(runs) -> dict:
    return {"ranks": runs["four_ranks"]}


def _params_within(runs, name: str, reference: str, bound: float = 1e-6) -> float:
    worst = max(
        abs(x - y)
        for rank in runs["four_ranks"]
        for key in rank[reference]["params"]
        for x, y in zip(rank[reference]["params"][key], rank[name]["params"][key])
    )
    assert worst < bound, f"{name}: parameters differ from {reference}'s by {worst}"
    return worst


def test_fsdp_size_2_of_4_is_hsdp_over_odc_and_equals_verl(runs):
    # verl's ("ddp", "fsdp") mesh rebuilt over odc on both dimensions (the same ranks), and the
    # run equal to verl's own fsdp_size=2 engine (equal counts) while ranks ran different
    # microbatch counts inside a shard group and across replicas.
    counts = _compare(_four(runs), "hsdp_odc", "hsdp_ref")
    assert counts == [[2, 2, 2, 1], [2, 2, 1, 1], [1, 1, 2, 1], [1, 1, 1, 1]], counts
    for rank, found in enumerate(runs["four_ranks"]):
        ref, odc = found["hsdp_ref"]["mesh"], found["hsdp_odc"]["mesh"]
        assert odc["names"] == ["ddp", "fsdp"] and odc["shape"] == [2, 2], odc
        assert odc["backends"] == ["OdcBackend", "OdcBackend"], odc
        assert (
            odc["groups"]
            == ref["groups"]
            == [[rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1]]
        ), odc


def test_ulysses_sp_groups_run_their_own_counts_and_equal_verl(runs):
    # dp 2 x sp 2: the SP group {0, 1} runs 2 microbatches per mini-batch where {2, 3} runs 1
    # (call 0), then both 1 (call 1, where every logged value equals verl's); the same as
    # verl's own sp=2 engine (equal counts) and as verl's sp=1 run on the same mini-batches.
    counts = _compare(_four(runs), "sp_odc", "sp_ref", all_metrics_calls=(1,))
    assert counts == [[2, 2, 1, 1], [2, 2, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], counts
    _params_within(runs, "sp_odc", "hsdp_ref")  # verl's sp=1 run (4 DP ranks)
    _params_within(runs, "sp_ref", "hsdp_ref")
    for rank, found in enumerate(runs["four_ranks"]):
        mesh = found["sp_odc"]["mesh"]
        # FSDP2 shards over every rank (verl's 1-D mesh, over odc); SP groups are consecutive.
        assert mesh["names"] == ["fsdp"] and mesh["backends"] == ["OdcBackend"], mesh
        assert mesh["groups"] == [[0, 1, 2, 3]] and mesh["sp_mesh"] == [2, 2], mesh
        assert mesh["sp_group"] == [rank - rank % 2, rank - rank % 2 + 1], mesh
        # verl's Ulysses all-to-alls ran (the test's shims on CPU); its sp=1 run has none.
        assert found["sp_odc"]["shim_calls"]["all_to_all"] > 0, found["sp_odc"]["shim_calls"]
        assert found["hsdp_ref"]["shim_calls"]["all_to_all"] == 0


def test_ulysses_sp_peers_that_plan_differently_are_refused(runs):
    # Each SP group's two ranks hold different rows: every rank raises before its first
    # microbatch (no hang), naming itself, the step and its SP group.
    for rank, found in enumerate(runs["four_ranks"]):
        message = found["sp_odc"]["after"]
        group = [rank - rank % 2, rank - rank % 2 + 1]
        assert f"rank {rank}, training step 5 of this engine" in message, message
        assert f"Ulysses SP group {group} planned different microbatches" in message, message


def test_ulysses_sp_with_lb_mini_and_inside_verls_2d_mesh(runs):
    # LB-Mini over the 2 DP ranks (each SP group's ranks move the same rows), and SP with
    # fsdp_size=2 (shard groups = SP groups, replicas across them): both equal verl's sp=2.
    _compare(_four(runs), "sp_mini_odc", "sp_ref")
    moved = [[s["received"] for s in found["sp_mini_odc"]["steps"]] for found in runs["four_ranks"]]
    assert any(any(r) for r in moved), moved
    assert moved[0] == moved[1] and moved[2] == moved[3], moved  # SP peers: the same rows
    counts = _compare(_four(runs), "sp_hsdp_odc", "sp_ref", all_metrics_calls=(1,))
    assert counts == [[2, 2, 1, 1], [2, 2, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], counts
    for found in runs["four_ranks"]:
        mesh = found["sp_hsdp_odc"]["mesh"]
        assert mesh["names"] == ["ddp", "fsdp"], mesh
        assert mesh["backends"] == ["OdcBackend", "OdcBackend"], mesh
        assert mesh["groups"][1] == mesh["sp_group"], mesh


def test_cases_ran_under_verls_environment(runs):
    versions = runs["versions"]
    assert versions["torch"] == torch.__version__, versions  # the torch line's own torch
    assert versions["verl"] == "0.9.1", versions
    if "ODC_VERL_PYTHON" not in os.environ:  # the bootstrap's environment, not one given
        assert versions["transformers"] == "5.9.0", versions
    assert versions["torch_odc"].startswith(ROOT), versions
