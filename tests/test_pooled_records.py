"""The committed trainer records are what bench_trl.py writes (issue 63): every pooled record
and every trainers.json row with a ``pooled`` block is what ``bench_trl.py pool`` makes of its
committed inputs, run with the arguments the record's own ``command`` holds (its notes among
them); and no record, row or block under benchmarks/results/trainers/ has a top-level key
outside the keys bench_trl.py's writers write (``RECORD_KEYS`` and the others, which those
writers check what they write against). CPU, stdlib and bench_trl's own functions."""

from __future__ import annotations

import glob
import json
import math
import os
import shlex
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_trl

TRAINERS = os.path.join(ROOT, "benchmarks", "results", "trainers")
SUMMARY = os.path.join(TRAINERS, "trainers.json")


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _records() -> dict:
    return {
        os.path.basename(p): _load(p)
        for p in sorted(glob.glob(os.path.join(TRAINERS, "*.json")))
        if os.path.basename(p) != "trainers.json"
    }


def _pooled_names() -> list:
    return sorted(name for name, rec in _records().items() if "pooled_from" in rec)


def _differences(committed, produced, path: str = "") -> list:
    """Where two JSON values differ: numbers at 1e-12 relative, everything else exactly."""
    if isinstance(committed, dict) and isinstance(produced, dict):
        out = [f"{path}/{k}: only committed" for k in committed.keys() - produced.keys()]
        out += [f"{path}/{k}: only produced" for k in produced.keys() - committed.keys()]
        for k in committed.keys() & produced.keys():
            out += _differences(committed[k], produced[k], f"{path}/{k}")
        return out
    if isinstance(committed, list) and isinstance(produced, list):
        if len(committed) != len(produced):
            return [f"{path}: {len(committed)} items committed, {len(produced)} produced"]
        return [
            d
            for i, (a, b) in enumerate(zip(committed, produced, strict=True))
            for d in _differences(a, b, f"{path}[{i}]")
        ]
    numbers = (int, float)
    if (
        isinstance(committed, numbers)
        and isinstance(produced, numbers)
        and not isinstance(committed, bool)
        and not isinstance(produced, bool)
    ):
        if committed == produced or math.isclose(committed, produced, rel_tol=1e-12):
            return []
        return [f"{path}: committed {committed!r}, produced {produced!r}"]
    return (
        [] if committed == produced else [f"{path}: committed {committed!r}, produced {produced!r}"]
    )


def _row_of(rows: list, result: str) -> dict:
    hit = [r for r in rows if r.get("result") == result]
    assert len(hit) == 1, f"trainers.json: {len(hit)} rows with result {result}"
    return hit[0]


def test_every_pooled_row_has_its_pooled_record():
    """A row's ``pooled`` block comes with the pooled record pool wrote beside it (the record's
    command is what the test below reruns), and each pooled record makes a row."""
    rows = _load(SUMMARY)["rows"]
    pooled_rows = sorted(r["result"] for r in rows if "pooled" in r)
    assert pooled_rows == _pooled_names()


@pytest.mark.parametrize("name", _pooled_names())
def test_pooled_record_is_what_pool_makes_of_its_inputs(name, tmp_path, monkeypatch):
    committed = _load(os.path.join(TRAINERS, name))
    words = shlex.split(committed["command"])
    assert words[1:3] == ["benchmarks/bench_trl.py", "pool"], committed["command"]
    argv = words[3:]
    # Rerun the record's own command, its output placed in tmp_path (trainers.json a copy).
    summary = tmp_path / "trainers.json"
    shutil.copy(SUMMARY, summary)
    for flag, value in (("--out", str(tmp_path)), ("--summary", str(summary))):
        assert flag in argv, f"{name}: its command has no {flag}"
        argv[argv.index(flag) + 1] = value
    stem = argv[argv.index("--stem") + 1] if "--stem" in argv else None
    assert stem and f"{stem}.json" == name, f"{name}: its command writes {stem}.json"
    inputs = argv[: next(i for i, a in enumerate(argv) if a.startswith("--"))]
    for p in inputs:
        assert os.path.exists(os.path.join(ROOT, p)), f"{name}: input {p} is not committed"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", words[1:])  # the command pool records
    bench_trl.pool_main(argv)
    produced = _load(tmp_path / name)
    assert produced.pop("command") == shlex.join([sys.executable, *words[1:]])
    committed.pop("command")
    assert not _differences(committed, produced), _differences(committed, produced)

    # The row pool wrote (and, where the committed row has one, decompose's block from the
    # inputs that block names) against the committed row.
    row = _row_of(_load(SUMMARY)["rows"], name)
    if "decomposition" in row:
        d = row["decomposition"]
        bench_trl.decompose_main(
            [
                os.path.join(TRAINERS, d["one_rank"]),
                os.path.join(TRAINERS, d["multi_rank"]),
                "--summary",
                str(summary),
                "--kind",
                row["kind"],
            ]
        )
    got = _row_of(_load(summary)["rows"], name)
    assert not _differences(row, got), _differences(row, got)
    assert not _differences(produced["pooled"], got["pooled"])


def test_no_committed_trainer_file_has_a_key_bench_trl_does_not_write():
    bad = []
    for name, rec in _records().items():
        if "pooled_from" in rec:
            bad += bench_trl.unknown_keys(rec, bench_trl.POOLED_RECORD_KEYS, name)
            bad += bench_trl.unknown_keys(rec["pooled"], bench_trl.POOLED_BLOCK_KEYS, name)
        else:
            bad += bench_trl.unknown_keys(rec, bench_trl.RECORD_KEYS, name)
    for row in _load(SUMMARY)["rows"]:
        what = f"trainers.json row {row.get('result')}"
        bad += bench_trl.unknown_keys(row, bench_trl.ROW_KEYS, what)
        for key, allowed in (
            ("pooled", bench_trl.POOLED_BLOCK_KEYS),
            ("decomposition", bench_trl.DECOMPOSITION_KEYS),
        ):
            if key in row:
                bad += bench_trl.unknown_keys(row[key], allowed, f"{what}.{key}")
    assert not bad, bad


def test_the_writers_refuse_a_key_outside_their_sets():
    """The check above means something: the key sets are what the writers hold themselves to."""
    with pytest.raises(AssertionError, match="hand_added"):
        bench_trl._checked({"mode": "sft", "hand_added": 1}, bench_trl.RECORD_KEYS, "record")
