"""benchmarks/bench_trl.py on 2 CPU ranks (its numbers on CPU say nothing about GPUs): verl's
actor update runs both variants through verl's own environment and reports what the trainers
table needs (skipped like the verl tests without verl's environment: a failure in CI, whose
bootstrap builds it); SFTTrainer's run streams each variant's output into the log and leaves a
complete record and a trainers row; trace_phases.py reads a profiled step's Chrome trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from verl_env import ROOT, verl_python


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "remove-padding"])
def test_the_verl_benchmark_reports_a_trainers_row(tmp_path, rmpad):
    """verl's fsdp2 engine against the odc engine; with ``rmpad`` their tuned pair,
    ``plain-rmpad`` / ``odc-rmpad`` (verl's use_remove_padding, which reaches the engine)."""
    python = verl_python()
    sfx = "-rmpad" if rmpad else ""
    variants = ["--variants", f"odc{sfx},plain{sfx}"] if rmpad else []
    summary = tmp_path / "trainers.json"
    env = {**os.environ, "ODC_VERL_PYTHON": python, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_trl.py"),
            "verl",
            "--cpu",
            "--nproc",
            "2",
            "--out",
            str(tmp_path),
            "--summary",
            str(summary),
            "--kind",
            "cpu",
            *variants,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(summary.read_text())["rows"]
    assert row["trainer"] == "verl" and row["gpus"] == 2
    for key in ("odc_tokens_per_s_per_gpu", "base_tokens_per_s_per_gpu", "speedup", "bound"):
        assert row[key] > 0, (key, row)
    record = json.loads((tmp_path / "bench_trl_verl_2cpu.json").read_text())
    assert record["versions"]["verl"] == "0.9.1"
    odc, plain = record["runs"][f"odc{sfx}"], record["runs"][f"plain{sfx}"]
    assert (row["odc_variant"], row["baseline"]) == (f"odc{sfx}", f"plain{sfx}")
    assert odc["meta"]["strategy"] == "odc" and odc["meta"]["balance"] == "mini"
    assert plain["meta"]["strategy"] == "fsdp2"
    for run in (odc, plain):
        assert run["meta"]["use_remove_padding"] is rmpad
    for o, p in zip(odc["steps"], plain["steps"], strict=True):
        # the same rollouts, and every token run exactly once under either engine
        assert o["tokens"] == p["tokens"] == sum(o["padded_per_rank"]) == sum(p["padded_per_rank"])
        assert o["plain_padded_per_rank"] == p["plain_padded_per_rank"]
        # verl runs equal microbatch counts; ODC's may differ by rank
        assert len(set(p["microbatches"])) == 1
    # the two engines train the same model on the same data: the same losses, step by step
    for o, p in zip(odc["steps"], plain["steps"], strict=True):
        assert abs(o["loss"] - p["loss"]) <= 1e-4 * max(1.0, abs(p["loss"])), (o, p)
    assert (tmp_path / "bench_trl_verl_2cpu.png").exists()


def test_the_sft_benchmark_streams_its_log_and_reports_a_trainers_row(tmp_path):
    """Two rounds (--repeats 2: odc, plain, then plain, odc): every run is kept, and the row's
    rates pool both rounds' measured steps."""
    pytest.importorskip("trl")
    summary = tmp_path / "trainers.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_trl.py"),
            "sft",
            "--cpu",
            "--nproc",
            "2",
            "--repeats",
            "2",
            "--variants",
            "odc,plain",
            "--out",
            str(tmp_path),
            "--summary",
            str(summary),
            "--kind",
            "cpu",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(summary.read_text())["rows"]
    assert row["trainer"] == "sft" and row["speedup"] > 0 and row["bound"] > 0, row
    record = json.loads((tmp_path / "bench_trl_sft_2cpu.json").read_text())
    assert "partial" not in record
    assert set(record["runs"]) == {"odc", "plain", "odc@2", "plain@2"}
    assert [r["order"] for r in record["rounds"]] == [["odc", "plain"], ["plain", "odc"]]
    steps = len(record["runs"]["odc"]["steps"])
    warmup = record["warmup_steps"]

    # The pooled rate, recomputed from the runs: tokens over seconds of both rounds' steps.
    def pooled(variant):
        measured = [
            s for name in (variant, f"{variant}@2") for s in record["runs"][name]["steps"][warmup:]
        ]
        assert record["summary"][variant]["steps"] == len(measured) == 2 * (steps - warmup)
        return sum(s["tokens"] for s in measured) / sum(s["seconds"] for s in measured) / 2

    assert row["speedup"] == pytest.approx(pooled("odc") / pooled("plain"))
    assert row["repeats"] == 2 and row["speedup_of_each_round"] == [
        r["speedup"] for r in record["rounds"]
    ]
    # Every run's step lines, as the examples printed them, are in the log.
    log = (tmp_path / "bench_trl_sft_2cpu.log").read_text().splitlines()
    assert sum(line.startswith("step ") for line in log) == 4 * steps, log[-20:]
    # What each step spent besides its work (docs/examples/_step_probe.py): compile seconds
    # (none on CPU ranks: TRL's Triton kernels run on GPUs only), and for ODC every rank's
    # host seconds with one figure per microbatch the rank ran.
    for run in record["runs"].values():
        assert all(s["jit_seconds"] == 0.0 for s in run["steps"])
    for variant in ("odc", "plain"):
        assert record["summary"][variant]["steady_tokens_per_s_per_gpu"] == pytest.approx(
            record["summary"][variant]["tokens_per_s_per_gpu"]
        )
    for s in record["runs"]["odc"]["steps"] + record["runs"]["odc@2"]["steps"]:
        assert [len(h["microbatches"]) for h in s["host_seconds"]] == s["microbatches"], s


def test_the_fixed_cost_bound_recovers_a_known_line():
    """Steps timed exactly as 0.15 s + 0.03 s per 1k padded tokens of the slowest rank: the fit
    gives that line back, and the bound with the fixed part counted is the line's ratio (below
    the padded-token ratio, which ignores the fixed part)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_trl import fixed_cost_bound

    def secs(tokens):
        return 0.15 + 3e-5 * tokens

    odc_pad = [[9000, 8800], [12000, 12100], [6000, 5900], [15000, 14000]]
    plain_pad = [[4000, 17000], [9000, 20000], [12000, 3000], [30000, 1000]]
    odc = [
        {
            "step": i,
            "padded_per_rank": o,
            "plain_padded_per_rank": p,
            "seconds": 2.0 + secs(max(o)),
            "rollout_seconds": 2.0,
        }
        for i, (o, p) in enumerate(zip(odc_pad, plain_pad))
    ]
    plain = [
        {"step": i, "seconds": 1.0 + secs(max(p)), "rollout_seconds": 1.0}
        for i, p in enumerate(plain_pad)
    ]
    fit = fixed_cost_bound(odc, plain)
    assert fit["fixed_seconds"] == pytest.approx(0.15)
    assert fit["seconds_per_1k_padded_tokens"] == pytest.approx(0.03)
    assert fit["r2"] == pytest.approx(1.0) and fit["points"] == 8
    plain_s = sum(secs(max(p)) for p in plain_pad)
    odc_s = sum(secs(max(o)) for o in odc_pad)
    assert fit["bound"] == pytest.approx(plain_s / odc_s)
    tokens = sum(max(p) for p in plain_pad) / sum(max(o) for o in odc_pad)
    assert fit["bound"] < tokens
    assert fixed_cost_bound(odc[:2], plain) is None  # too few steps to fit
    # Times that do not follow the padded tokens (a host-bound step): no line, no bound.
    for step, noise in zip(odc, [0.9, -0.4, 0.7, -0.8], strict=True):
        step["seconds"] += noise
    assert fixed_cost_bound(odc, plain) is None


def test_pool_makes_one_row_of_separate_records(tmp_path):
    """``bench_trl.py pool``: two records of the same GRPO setup (one round each, separate
    calls) give one row whose rates pool both records' measured steps (warm-up left out), with
    each record's own speed-up, the larger peaks and the model size in the row's key (a 1B row
    beside it stays); records of different model sizes are refused."""

    def step(i, tokens, seconds, rollout):
        return {
            "step": i,
            "tokens": tokens,
            "seconds": seconds,
            "rollout_seconds": rollout,
            "rollouts": 16,
            "padded_per_rank": [tokens, tokens - 100],
            "plain_padded_per_rank": [tokens + 4000, 100],
        }

    def record(path, odc_steps, plain_steps, size="3b", peaks=(10.0, 11.0)):
        runs = {}
        for name, steps in (("odc", odc_steps), ("plain", plain_steps)):
            runs[name] = {
                "meta": {
                    "world": 2,
                    "size": size,
                    "peak_memory_gib": list(peaks) if name == "odc" else [12.0],
                },
                "steps": [step(i, *s) for i, s in enumerate(steps, 1)],
            }
        rate = {
            n: {
                "update_tokens_per_s_per_gpu": sum(s[0] for s in st[1:])
                / sum(s[1] - s[2] for s in st[1:])
                / 2
            }
            for n, st in (("odc", odc_steps), ("plain", plain_steps))
        }
        path.write_text(
            json.dumps(
                {
                    "mode": "grpo",
                    "nproc": 2,
                    "warmup_steps": 1,
                    "hardware": "test",
                    "kind": "k",
                    "versions": {},
                    "commit": "abcdef0123",
                    "summary": rate,
                    "runs": runs,
                }
            )
        )
        return (
            rate["odc"]["update_tokens_per_s_per_gpu"]
            / rate["plain"]["update_tokens_per_s_per_gpu"]
        )

    a = [(9000, 9.0, 8.0), (8000, 3.0, 2.0), (12000, 3.5, 2.2), (6000, 2.6, 2.0)]
    b = [(9000, 9.5, 8.0), (8000, 3.1, 2.0), (12000, 3.4, 2.2), (6000, 2.7, 2.0)]
    pa = [(9000, 9.0, 8.0), (8000, 3.4, 2.0), (12000, 4.2, 2.2), (6000, 3.1, 2.0)]
    pb = [(9000, 9.0, 8.0), (8000, 3.3, 2.0), (12000, 4.0, 2.2), (6000, 3.2, 2.0)]
    first = record(tmp_path / "a.json", a, pa)
    second = record(tmp_path / "b.json", b, pb, peaks=(10.5, 10.0))
    summary = tmp_path / "trainers.json"
    summary.write_text(
        json.dumps(
            {
                "rows": [
                    {
                        "trainer": "grpo",
                        "gpus": 2,
                        "kind": "k",
                        "speedup": 1.0,
                        "result": "old.json",
                    }
                ]
            }
        )
    )
    bench = os.path.join(ROOT, "benchmarks", "bench_trl.py")

    def pool(*records, notes=()):
        return subprocess.run(
            [
                sys.executable,
                bench,
                "pool",
                *map(str, records),
                "--out",
                str(tmp_path / "out"),
                "--summary",
                str(summary),
                *notes,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    notes = {
        "--note": "two calls, one round each",
        "--commit-note": "tree abcdef0, day 1",
        "--device-command": "OUT=$OUT bash benchmarks/device/device_trainers.sh grpo ''",
    }
    proc = pool(
        tmp_path / "a.json", tmp_path / "b.json", notes=[x for kv in notes.items() for x in kv]
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(summary.read_text())["rows"]
    assert [r.get("model", "1b") for r in rows] == ["1b", "3b"]
    row = rows[1]

    def rate(*runs):  # the measured steps (after the one warm-up step) of the runs, pooled
        steps = [s for run in runs for s in run[1:]]
        return sum(s[0] for s in steps) / sum(s[1] - s[2] for s in steps) / 2

    assert row["speedup"] == pytest.approx(rate(a, b) / rate(pa, pb))
    assert row["speedup_of_each_round"] == pytest.approx([first, second])
    assert row["repeats"] == 2 and row["commit"] == "abcdef0" and row["kind"] == "k"
    assert row["odc_peak_gib"] == 11.0 and row["base_peak_gib"] == 12.0
    pooled = json.loads((tmp_path / "out" / row["result"]).read_text())
    assert pooled["pooled_from"] == ["a.json", "b.json"]
    assert pooled["summary"]["odc"]["steps"] == 6
    # The notes and commands come from the arguments, the pooled block from the records.
    assert pooled["note"] == notes["--note"] and pooled["commit_note"] == notes["--commit-note"]
    assert pooled["device_command"] == notes["--device-command"]
    block = row["pooled"]
    assert block == pooled["pooled"] and "note" not in row
    assert block["runs"] == ["a.json", "b.json"] and block["note"] == notes["--note"]
    assert block["steps_per_variant"] == {"odc": 6, "plain": 6}
    assert block["speedup_of_each_run"] == pytest.approx([first, second])
    update = [s[1] - s[2] for run in (a, b) for s in run[1:]]
    assert block["seconds_per_step"]["odc"]["mean"] == pytest.approx(sum(update) / 6)
    record(tmp_path / "c.json", b, pb, size="1b")
    proc = pool(tmp_path / "a.json", tmp_path / "c.json")
    assert proc.returncode != 0 and "model sizes" in proc.stderr, proc.stderr[-2000:]


def test_trace_phases_attributes_device_work_to_the_range_that_launched_it(tmp_path):
    """A hand-made Chrome trace: two microbatch ranges (one nested in a range of the same
    name), a kernel launched in each and one launched outside both; trace_phases counts the
    nested range once, gives each range the device time of what it launched (wherever the
    kernel ran), and ``--within`` / ``after:`` keep only what runs inside the windows."""
    import gzip

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from trace_phases import phases

    def x(name, cat, ts, dur, **args):
        return {
            "ph": "X",
            "name": name,
            "cat": cat,
            "ts": ts,
            "dur": dur,
            "pid": 1,
            "tid": 1,
            "args": args,
        }

    events = [
        x("trl::generate_and_score", "user_annotation", 0, 100),
        x("odc::grpo_microbatches", "user_annotation", 200, 100),
        x("odc::grpo_microbatches", "user_annotation", 220, 30),  # nested: counted once
        x("cudaLaunchKernel", "cuda_runtime", 230, 5, correlation=1),
        x("gemm", "kernel", 400, 70, correlation=1),  # runs after its range ended
        x("odc::grpo_microbatches", "user_annotation", 500, 50),
        x("cudaLaunchKernel", "cuda_runtime", 510, 5, correlation=2),
        x("gemm", "kernel", 520, 20, correlation=2),
        x("cudaLaunchKernel", "cuda_runtime", 50, 5, correlation=3),  # in generation
        x("decode", "kernel", 60, 10, correlation=3),
        {"ph": "i", "name": "marker", "ts": 5},  # not a complete event: ignored
    ]
    path = tmp_path / "step1_rank0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)

    whole = phases(str(path))
    mb = whole["ranges"]["odc::grpo_microbatches"]
    assert mb == {"calls": 2, "host_ms": 0.15, "device_ms": 0.09}, mb
    assert whole["ranges"]["trl::generate_and_score"]["device_ms"] == 0.01
    assert whole["span_ms"] == 0.55 and whole["device_busy_ms"] == 0.1
    assert whole["instances"]["odc::grpo_microbatches"] == [
        {"host_ms": 0.1, "device_ms": 0.07},
        {"host_ms": 0.03, "device_ms": 0.07},
        {"host_ms": 0.05, "device_ms": 0.02},
    ]

    inside = phases(str(path), within="odc::grpo_microbatches")
    assert inside["span_ms"] == 0.15 and inside["device_busy_ms"] == 0.09
    assert "trl::generate_and_score" not in inside["ranges"]
    update = phases(str(path), within="after:trl::generate_and_score")
    assert update["span_ms"] == 0.45 and update["device_busy_ms"] == 0.09


def _bench(tmp_path, *argv, timeout=600):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_trl.py"),
            argv[0],
            "--out",
            str(tmp_path),
            "--kind",
            "cpu",
            *argv[1:],
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_sft_baselines_reach_the_trainer(tmp_path):
    """plain-tuned (SFTConfig.pad_to_multiple_of, here 16), and the padding-free pair
    (padding_free=True for TRL and for ODC) in one call: each variant's record names what it
    sets and what reached the trainer; the model saw plain-tuned's microbatches at multiples
    of 16 with an attention mask, and the padding-free ones as one row with position_ids and
    no attention mask (SDPA then gets transformers' block-diagonal mask from them); the row
    compares the faster ODC variant with the faster baseline and keeps every baseline."""
    pytest.importorskip("trl")
    summary = tmp_path / "trainers.json"
    _bench(
        tmp_path,
        "sft",
        "--cpu",
        "--nproc",
        "2",
        "--pad-multiple",
        "16",
        "--variants",
        "plain-tuned,odc-padfree,plain-padfree",
        "--summary",
        str(summary),
    )
    record = json.loads((tmp_path / "bench_trl_sft_2cpu.json").read_text())
    configs = record["variant_configs"]
    assert record["pad_multiple"] == 16
    tuned = configs["plain-tuned"]
    assert tuned["args"] == ["--no-odc", "--trl-pad-to-multiple-of", "16"]
    assert tuned["reached"]["pad_to_multiple_of"] == 16
    assert tuned["reached"]["collator_pad_to_multiple_of"] == 16
    for variant in ("odc-padfree", "plain-padfree"):
        reached = configs[variant]["reached"]
        assert reached["padding_free"] and reached["collator_padding_free"], reached
    assert configs["odc-padfree"]["reached"]["odc_pad_to_multiple_of"] == 1
    assert record["attention"]["implementation"] == "sdpa" and record["attention"]["same"]
    for step in record["runs"]["plain-tuned"]["steps"]:
        seen = step["batches"]
        widths = [w for rank in seen["widths_per_rank"] for w in rank]
        assert widths and all(w % 16 == 0 for w in widths), seen
        assert seen["attention_mask"] and not seen["position_ids"]
    for variant in ("odc-padfree", "plain-padfree"):
        for step in record["runs"][variant]["steps"]:
            seen = step["batches"]
            assert seen["position_ids"] and not seen["attention_mask"], seen
            assert all(r == 1 for rank in seen["rows_per_rank"] for r in rank), seen
    # The same rows, padded or not: the same tokens per step in every variant.
    tokens = {v: [s["tokens"] for s in run["steps"]] for v, run in record["runs"].items()}
    assert len({tuple(t) for t in tokens.values()}) == 1, tokens
    (row,) = json.loads(summary.read_text())["rows"]
    key = "tokens_per_s_per_gpu"
    rates = {v: record["summary"][v][key] for v in record["summary"]}
    assert row["odc_variant"] == "odc-padfree"
    assert row["baseline"] == max(("plain-tuned", "plain-padfree"), key=rates.get)
    assert row["speedup"] == pytest.approx(rates["odc-padfree"] / rates[row["baseline"]])
    assert set(row["baselines"]) == {"plain-tuned", "plain-padfree"}
    assert row["baselines"]["plain-tuned"]["args"] == tuned["args"]
    assert row["attention"] == "sdpa"


def test_one_rank_plans_the_data_of_two(tmp_path):
    """--nproc 1 --same-data-as 2: odc, plain and plain-tuned with one rank, each step the
    rows of a 2-rank step (accumulation doubled); ODC still plans its microbatches (its
    record has the one-rank bound), and the row carries (a) of the decomposition."""
    pytest.importorskip("trl")
    summary = tmp_path / "trainers.json"
    _bench(
        tmp_path,
        "sft",
        "--cpu",
        "--nproc",
        "1",
        "--same-data-as",
        "2",
        "--pad-multiple",
        "16",
        "--summary",
        str(summary),
        "--",
        "--steps",
        "3",
    )
    record = json.loads((tmp_path / "bench_trl_sft_1cpu.json").read_text())
    assert record["nproc"] == 1 and record["data_ranks"] == 2
    assert set(record["runs"]) == {"odc", "plain", "plain-tuned"}
    for run in record["runs"].values():
        assert run["meta"]["world"] == 1 and run["meta"]["args"]["accumulation"] == 4
        assert all(s["sequences"] == 2 * 4 for s in run["steps"])
    odc = record["runs"]["odc"]["steps"]
    assert all(len(s["microbatches"]) == 1 and len(s["plain_padded_per_rank"]) == 1 for s in odc)
    (row,) = json.loads(summary.read_text())["rows"]
    assert row["gpus"] == 1 and row["data_ranks"] == 2
    key = "tokens_per_s_per_gpu"
    plan = row["decomposition"]["plan_one_rank"]
    assert set(plan) == {"plain", "plain-tuned"}
    assert plan["plain"] == pytest.approx(
        record["summary"]["odc"][key] / record["summary"]["plain"][key]
    )
    assert row["decomposition"]["bound_one_rank"] == record["summary"]["odc"]["bound"] > 0


def test_decompose_splits_the_measured_speedup():
    """decompose: (a) from the one-rank record, (b) the multi-rank bound and the part of it
    that balance adds, (c) the measured multi-rank speed-up, and the remainders."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_trl import decompose

    key = "tokens_per_s_per_gpu"

    def record(rates, bound, tokens=(100, 200)):
        return {
            "summary": {
                v: {key: r, **({"bound": bound} if v == "odc" else {})} for v, r in rates.items()
            },
            "runs": {v: {"steps": [{"tokens": t} for t in tokens]} for v in rates},
        }

    one = record({"odc": 1.2, "plain": 1.0, "plain-tuned": 1.1}, 1.1)
    multi = record({"odc": 3.0, "plain": 2.0}, 1.5)
    out = decompose(one, multi, key)
    assert out["bound_one_rank"] == 1.1 and out["bound"] == 1.5
    assert out["balance_bound"] == pytest.approx(1.5 / 1.1)
    plain = out["by_baseline"]["plain"]
    assert plain["plan_one_rank"] == pytest.approx(1.2) and plain["measured"] == 1.5
    assert plain["remainder"] == pytest.approx(1.5 / (1.2 * 1.5 / 1.1))
    assert plain["remainder_whole_bound"] == pytest.approx(1.5 / (1.2 * 1.5))
    assert out["by_baseline"]["plain-tuned"] == {"plan_one_rank": pytest.approx(1.2 / 1.1)}
    with pytest.raises(SystemExit, match="different tokens"):
        decompose(one, record({"odc": 3.0, "plain": 2.0}, 1.5, tokens=(100, 300)), key)

    # GRPO's completions are sampled: the same rollouts, tokens within 2 %, pass; more, or
    # other rollouts, do not; the other trainers' tokens must be equal.
    def grpo(tokens, rollouts=(8, 8)):
        r = record({"odc": 3.0, "plain": 2.0}, 1.5, tokens=tokens)
        r["mode"] = "grpo"
        for v in r["runs"].values():
            for s, n in zip(v["steps"], rollouts, strict=True):
                s["rollouts"] = n
        return r

    one_grpo = grpo((100, 200))
    one_grpo["summary"] = one["summary"]
    assert decompose(one_grpo, grpo((101, 197)), key)["steps_compared"] == 2
    with pytest.raises(SystemExit, match="different tokens"):
        decompose(one_grpo, grpo((100, 210)), key)
    with pytest.raises(SystemExit, match="different rollouts"):
        decompose(one_grpo, grpo((100, 200), rollouts=(8, 16)), key)
    with pytest.raises(SystemExit, match="different tokens"):
        decompose(one, record({"odc": 3.0, "plain": 2.0}, 1.5, tokens=(101, 200)), key)
