"""benchmarks/probes/grpo_plan_floor.py (planner arithmetic, no GPU): the floor-priced packing agrees
with the adapter's where the floor dominates and trades microbatches for padding where it does
not, and the search never reports a plan costlier than the adapter's."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))

import grpo_plan_floor as gpf


def test_floor_priced_packing_trades_microbatches_for_padding():
    # Four rows of a 1900-token prompt and twelve of 500, completions of 20 tokens.
    rows = [(1900, 20)] * 4 + [(500, 20)] * 12
    members = list(range(len(rows)))
    fewest = gpf.pack_fewest(rows, members, 40000)
    assert len(fewest) == 1  # one microbatch fits: 16 rows x 1920 (a multiple of 128)
    assert sum(gpf.padded(rows, mb) for mb in fewest) == 16 * 1920
    # With a floor of 1 token the long rows go apart: 4 x 1920 + 12 x 640 padded tokens.
    free = gpf.pack_cheapest(rows, members, 40000, 1)
    assert sorted(len(mb) for mb in free) == [4, 12]
    assert sum(gpf.padded(rows, mb) for mb in free) == 4 * 1920 + 12 * 640
    # A floor above the padding saved keeps one microbatch.
    assert len(gpf.pack_cheapest(rows, members, 40000, 20000)) == 1
    # Every row in exactly one microbatch.
    for mbs in (fewest, free):
        assert sorted(i for mb in mbs for i in mb) == members


def test_search_reports_no_plan_costlier_than_the_adapters(tmp_path):
    out = tmp_path / "floor.json"
    gpf.main(["--gpus", "2", "--caps", "8639,16927", "--floors", "0,6000", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == [1, 2]
    for step in result["steps"]:
        assert sum(r["microbatches"] for r in step["adapter"]) >= 2
        for floor in step["floors"].values():
            assert floor["best_found"] <= floor["adapter"]
    # Padded tokens alone (no floor): splitting more finds a cheaper slowest rank.
    assert result["totals"]["0"]["best_found"] < result["totals"]["0"]["adapter"]
