"""The results tables of README.md and docs/benchmarks.md, written from benchmarks/results/.

    python benchmarks/docs_tables.py           # rewrite the tables between their markers
    python benchmarks/docs_tables.py --check   # exit 1 when a table or the index disagrees

Every figure comes from a result record (JSON or a test-suite summary); benchmarks/results/
index.json says which record makes which row (its table, the baseline's name, the machine, the
commit, the command to rerun it on a GPU host) and describes every committed file. A field the
record holds (date, command, machine kind, commit) is taken from it unless the row names it:
a record's commit is the device copy's git HEAD, which can be older than the tree that ran.
The one-rank decomposition rows are found by name (trainers/*_1gpu-decomposition-a_*.json).
Tables sit between ``<!-- tables:NAME begin -->`` and ``<!-- tables:NAME end -->``.
Standard library only, so the check runs anywhere (tests/test_docs_tables.py).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
INDEX = os.path.join(RESULTS, "index.json")
DOC = "docs/benchmarks.md"
DOC_LINK = "docs/benchmarks.md"  # from README.md
RESULTS_LINK = "../benchmarks/results"  # from docs/
GIB = 2**30
DATE_IN_NAME = re.compile(r"_(\d{4}-\d{2}-\d{2})\.[a-z]+$")
DECOMPOSITION = "trainers/*_1gpu-decomposition-a_*.json"


def load(rel: str):
    with open(os.path.join(RESULTS, rel)) as f:
        return json.load(f)


def date_of(rel: str, record=None) -> str:
    env = (record or {}).get("environment") if isinstance(record, dict) else None
    for d in ((env or {}).get("date"), (record or {}).get("date") if record else None):
        if isinstance(d, str) and d:
            return d[:10]
    m = DATE_IN_NAME.search(rel)
    return m.group(1) if m else "?"


def user_command(cmd: str) -> str:
    """A record's command as a user types it: `python` for the interpreter's path, without the
    options that only place the output or annotate the record."""
    drop = {"--out", "--summary", "--kind", "--commit-note", "--device-command", "--note"}
    words, out, skip = shlex.split(cmd), [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in drop:
            skip = True
            continue
        out.append(w)
    if out and out[0].endswith(("python", "python3")):
        out[0] = "python"
    return shlex.join(out)


def x(v: float, digits: int = 2) -> str:
    return f"**{v:.{digits}f}x**"


def gib(v) -> str:
    return "" if v is None else f"{v:.2f}"


def code(s: str) -> str:
    return "`" + s.replace("|", "\\|") + "`"


def file_link(rel: str) -> str:
    return f"[{os.path.basename(rel)}]({RESULTS_LINK}/{rel})"


# ---- rows, by kind -------------------------------------------------------------------------


def e2e_row(row: dict) -> dict:
    rec = load(row["file"])
    w = rec["workloads"][row["workload"]]
    runs = w["configs"]

    def mean(name):
        v = [c["tokens_per_s_per_gpu"] for k, c in runs.items() if k.split("#")[0] == name]
        return sum(v) / len(v), len(v)

    odc, n_odc = mean(row.get("odc", "odc-mini"))
    base, n_base = mean(row.get("base", "nccl-micro"))
    mem = (w.get("memory_vs_reference") or {}).get(row.get("odc", "odc-mini")) or {}
    bound = w["predicted_speedup_mini_over_micro"]
    runs_note = f" (means of {n_odc} and {n_base} runs)" if max(n_odc, n_base) > 1 else ""
    return {
        "speedup": odc / base,
        "result": f"{odc:.0f} vs {base:.0f} tok/s/GPU{runs_note}: {x(odc / base, 3)}, "
        f"bound {bound:.3f}",
        "odc_peak": mem.get("odc_peak_plus_region_bytes", 0) / GIB or None,
        "base_peak": mem.get("reference_peak_bytes", 0) / GIB or None,
        "date": date_of(row["file"], rec),
    }


def transport_row(row: dict) -> dict:
    rec = load(row["file"])
    by = {r["size_bytes"] // 2**20: r for r in rec["ratios"]}
    sizes = [64, 256, 1024]

    def three(k):
        return " / ".join(f"{by[s][k]:.2f}" for s in sizes)

    gather = [by[s]["gather"] for s in sizes]
    return {
        "speedup": min(gather),
        "result": f"gather {three('gather')}; fp32 push {three('push')}; "
        f"bf16 push {three('push_bf16')}",
        "gather": f"{min(gather):.2f}-{max(gather):.2f}x",
        "push": "{:.2f}-{:.2f}x".format(
            min(by[s]["push"] for s in sizes), max(by[s]["push"] for s in sizes)
        ),
        "date": date_of(row["file"], rec),
    }


def step_row(row: dict) -> dict:
    rec = load(row["file"])
    odc, base = rec["configs"]["odc"], rec["configs"].get("nccl")
    if base:
        share = odc["host_odc_unprofiled_share_max"]
        t_o, t_b = odc["minibatch_s_median"], base["minibatch_s_median"]
        result = (
            f"minibatch {t_o:.3f} vs {t_b:.3f} s ({x(t_b / t_o)}); ODC's host work "
            f"outside its waits {100 * share:.2f} % of it"
        )
        speedup = t_b / t_o
    else:
        result = (
            f"minibatch {odc['minibatch_s_median']:.3f} s; ODC's kernels "
            f"{100 * odc['odc_share_max']:.1f} % of GPU time"
        )
        speedup = None
    return {"speedup": speedup, "result": result, "date": date_of(row["file"], rec)}


def release_row(row: dict) -> dict:
    rec = load(row["file"])
    ph = rec["modes"]["odc"]["phases"]

    def used(p):
        return (ph[p]["driver_total_bytes"] - ph[p]["driver_free_bytes"]) / GIB

    return {
        "result": f"in use: trained {used('trained'):.2f} GiB, released "
        f"{used('released'):.2f} GiB (CUDA contexts {used('start'):.2f}), restored "
        f"{used('restored'):.2f} GiB; parameters after the switch within "
        f"{rec['max_param_diff_odc_switch_vs_no_switch']:.2e} of a run without it "
        f"(two runs without it: {rec['max_param_diff_noise_no_switch_twice']:.2e})",
        "odc_peak": used("trained"),
        "date": date_of(row["file"], rec),
        "command": rec.get("command"),
    }


def suite_row(row: dict) -> dict:
    with open(os.path.join(RESULTS, row["file"])) as f:
        text = f.read()
    if row["file"].endswith(".txt"):
        m = re.search(r"GPU SUITE (GREEN|NOT GREEN): (.*?) in (\d+) s wall", text)
        result = f"**{m.group(1)}**: {m.group(2)}, {m.group(3)} s"
    else:
        errors = sum(int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", text))
        hazards = sum(int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", text))
        result = f"{errors} errors, {hazards} hazards"
    return {"result": result, "date": date_of(row["file"])}


def trainer_record(result_name: str, was: dict) -> str:
    """The committed path of a trainers.json row's `result` (its name when written)."""
    rel = was.get(result_name) or f"trainers/{result_name}"
    if not os.path.exists(os.path.join(RESULTS, rel)):
        raise SystemExit(f"trainers.json names {result_name}, which is not committed")
    return rel


def trainer_row(row: dict, summary: list, was: dict) -> dict:
    match = [
        r
        for r in summary
        if r["trainer"] == row["trainer"]
        and r["gpus"] == row["gpus"]
        and r.get("model", "1b") == row.get("model", "1b")
    ]
    if len(match) != 1:
        raise SystemExit(f"trainers.json: {len(match)} rows for {row['id']}")
    r = match[0]
    rel = trainer_record(r["result"], was)
    rec = load(rel)
    speedup = r.get("speedup_vs_defaults", r["speedup"])
    result = (
        f"{r['odc_tokens_per_s_per_gpu']:.0f} vs {r['base_tokens_per_s_per_gpu']:.0f} "
        f"tok/s/GPU: {x(speedup)}"
    )
    if r["trainer"] == "grpo":
        result = f"update {result}; whole step {x(r['step_speedup'])}"
    if r.get("repeats") or r.get("pooled"):
        result += " (rounds pooled)"
    result += f", bound {r['bound']:.3f}"
    if r.get("bound_with_fixed_cost"):
        result += f" ({r['bound_with_fixed_cost']:.3f} with the fixed part of a step)"
    return {
        "speedup": speedup,
        "step_speedup": r.get("step_speedup") if r["trainer"] == "grpo" else None,
        "result": result,
        "odc_peak": r["odc_peak_gib"],
        "base_peak": r["base_peak_gib"],
        "file": rel,
        "machine": r.get("kind") or rec.get("kind"),
        "commit": r.get("commit") or rec.get("commit"),
        "date": date_of(rel, rec),
        "command": user_command(rec["command"]),
    }


def decomposition_rows() -> list:
    rows = []
    for path in sorted(glob.glob(os.path.join(RESULTS, DECOMPOSITION))):
        rel = os.path.relpath(path, RESULTS)
        rec = load(rel)
        s = rec["summary"]
        odc = s["odc"]
        vs = {
            b: odc["tokens_per_s_per_gpu"] / s[b]["tokens_per_s_per_gpu"] for b in s if b != "odc"
        }
        peak = {b: s[b]["peak_memory_gib"][0] for b in s}
        result = "; ".join(
            f"{odc['tokens_per_s_per_gpu']:.0f} vs {s[b]['tokens_per_s_per_gpu']:.0f} "
            f"tok/s against `{b}`: {x(v)}"
            for b, v in vs.items()
        )
        update = None
        if rec["mode"] == "grpo":  # the update phase (what ODC changes) beside the whole step
            key = "update_tokens_per_s_per_gpu"
            update = {b: odc[key] / s[b][key] for b in s if b != "odc"}
            result = (
                "update "
                + "; ".join(
                    f"{odc[key]:.0f} vs {s[b][key]:.0f} tok/s against `{b}`: {x(v)}"
                    for b, v in update.items()
                )
                + "; whole step "
                + ", ".join(f"{x(v)} against `{b}`" for b, v in vs.items())
            )
        rows.append(
            {
                "id": f"decomposition-{rec['mode']}",
                "label": f"{rec['mode'].upper()}, the plan on one rank",
                "trainer": rec["mode"],
                "speedup": vs.get("plain"),
                "vs": vs,
                "update_vs": update,
                "result": result,
                "odc_peak": peak["odc"],
                "base_peak": peak.get("plain"),
                "peaks": peak,
                "file": rel,
                "machine": rec.get("kind"),
                "commit": rec.get("commit"),
                "date": date_of(rel, rec),
                "command": user_command(rec["command"]),
                "baseline": "`plain` (TRL's defaults) and `plain-tuned` "
                "(`pad_to_multiple_of` equal to ODC's)",
            }
        )
    return rows


# ---- assembling -----------------------------------------------------------------------------


def resolve(index: dict) -> dict:
    """Every row of every table, its figures from the records, the manifest's fields over them."""
    summary = load("trainers/trainers.json")["rows"]
    was = {v["was"]: k for k, v in index["files"].items() if v.get("was")}
    kinds = {
        "e2e": e2e_row,
        "transport": transport_row,
        "step": step_row,
        "release": release_row,
        "suite": suite_row,
    }
    tables = {}
    for name, rows in index["tables"].items():
        out = []
        for row in rows:
            if row["kind"] == "trainer":
                got = trainer_row(row, summary, was)
            else:
                got = kinds[row["kind"]](row)
                got["file"] = row["file"]
            out.append({**got, **{k: v for k, v in row.items() if k != "kind"}})
        tables[name] = out
    tables["decomposition"] = decomposition_rows()
    tables["split"] = split_rows(summary, was)
    return tables


def anchor(row: dict) -> str:
    return f'<a id="{row["id"]}"></a>'


def provenance(row: dict) -> list:
    return [
        row.get("machine") or "?",
        row.get("date") or "?",
        code(row["commit"]) if row.get("commit") else "not recorded",
        code(row["command"]) if row.get("command") else "?",
        file_link(row["file"]),
    ]


def md_table(head: list, rows: list) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


PROV = ["machine", "date", "commit", "command", "file"]


def split_rows(summary: list, was: dict) -> list:
    """The multi-rank trainer rows whose speed-up `bench_trl.py decompose` split (its
    ``decomposition`` field in trainers.json): (a) the plan on one rank, (b) what balancing
    across ranks adds to it, (c) the measured speed-up, and c / (a x b), the single sync and
    the transport; each against the baseline both records have."""
    rows = []
    for r in summary:
        d = r.get("decomposition")
        if not d:
            continue
        for base, e in d["by_baseline"].items():
            if "measured" not in e:
                continue
            rows.append(
                {
                    "label": f"{r['trainer'].upper()} {r.get('model', '1b')}, {r['gpus']} GPUs",
                    "baseline": f"`{base}`",
                    "a": x(e["plan_one_rank"]),
                    "b": x(d["balance_bound"]) if d.get("balance_bound") else "?",
                    "c": x(e["measured"]),
                    "remainder": x(e["remainder"]) if e.get("remainder") else "?",
                    "files": f"{file_link('trainers/' + d['one_rank'])}, "
                    f"{file_link(trainer_record(d['multi_rank'], was))}",
                }
            )
    return rows


def doc_tables(t: dict) -> dict:
    out = {}
    for name in ("e2e-2gpu", "e2e-4gpu", "step", "transport", "memory", "suite"):
        out[name] = md_table(
            ["row", "baseline", "result", *PROV],
            [[anchor(r) + r["label"], r["baseline"], r["result"], *provenance(r)] for r in t[name]],
        )
    out["trainers"] = md_table(
        ["row", "GPUs", "baseline", "result", "peak GiB, ODC / baseline", *PROV],
        [
            [
                anchor(r) + r["label"],
                r["gpus"],
                r["baseline"],
                r["result"],
                f"{gib(r['odc_peak'])} / {gib(r['base_peak'])}",
                *provenance(r),
            ]
            for r in t["trainers"]
        ],
    )
    out["split"] = md_table(
        [
            "row",
            "baseline",
            "(a) plan, one rank",
            "(b) balance",
            "(c) measured",
            "c / (a x b)",
            "records",
        ],
        [
            [r["label"], r["baseline"], r["a"], r["b"], r["c"], r["remainder"], r["files"]]
            for r in t["split"]
        ]
        or [["(no decomposed row yet)", "", "", "", "", "", ""]],
    )
    out["decomposition"] = md_table(
        ["row", "baselines", "result", "peak GiB", *PROV],
        [
            [
                anchor(r) + r["label"],
                r["baseline"],
                r["result"],
                ", ".join(f"`{b}` {gib(v)}" for b, v in r["peaks"].items()),
                *provenance(r),
            ]
            for r in t["decomposition"]
        ]
        or [["(no one-rank record yet)", "", "", "", "", "", "", "", ""]],
    )
    return out


def readme_tables(t: dict) -> str:
    """One table per topology: each row's headline, its baseline, memory, machine, a link."""
    by_topology = {"1 GPU": [], "2 GPUs": [], "4 GPUs": []}
    for name in ("decomposition", "e2e-2gpu", "e2e-4gpu", "trainers"):
        for r in t[name]:
            if name != "decomposition" and not r.get("readme"):
                continue
            top = "1 GPU" if name == "decomposition" else f"{r.get('gpus', 2)} GPUs"
            if name == "decomposition":
                figure = ", ".join(f"{v:.2f}x `{b}`" for b, v in r["vs"].items())
                if r.get("update_vs"):
                    update = ", ".join(f"{v:.2f}x `{b}`" for b, v in r["update_vs"].items())
                    figure = f"update {update}; whole step {figure}"
                base = "`plain`, `plain-tuned`"
            else:
                figure = f"{r['speedup']:.2f}x"
                if r.get("step_speedup"):
                    figure = f"update {figure}, whole step {r['step_speedup']:.2f}x"
                base = r["baseline"]
            mem = ""
            if r.get("odc_peak") and r.get("base_peak"):
                mem = f"{gib(r['odc_peak'])} vs {gib(r['base_peak'])}"
            by_topology[top].append(
                [
                    r.get("short", r["label"]),
                    f"[{figure}]({DOC_LINK}#{r['id']})",
                    base,
                    mem,
                    r.get("machine") or "?",
                ]
            )
    parts = []
    for top, rows in by_topology.items():
        parts.append(
            f"**{top}**\n\n"
            + md_table(
                ["workload or trainer", "speed-up", "against", "peak GiB, ODC vs it", "machine"],
                rows,
            )
        )
    return "\n\n".join(parts)


def files_listing(index: dict) -> str:
    lines = []
    files = with_decompositions(index)
    for folder in sorted({os.path.dirname(k) for k in files}):
        lines.append(f"\n### {folder}/\n")
        for rel, meta in sorted(files.items()):
            if os.path.dirname(rel) == folder:
                lines.append(f"- [{os.path.basename(rel)}]({rel}): {meta['what']}")
    return "\n".join(lines).strip()


def committed_files() -> set:
    found = set()
    for dirpath, _, names in os.walk(RESULTS):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), RESULTS)
            if rel not in ("index.json", "README.md"):
                found.add(rel)
    return found


def with_decompositions(index: dict) -> dict:
    """The index's files plus the one-rank decomposition records (found by name) and their
    plots and logs, so that a new one needs no index entry."""
    files = dict(index["files"])
    pattern = re.compile(r"trainers/.*_1gpu-decomposition-a_.*\.(json|png|log)$")
    for rel in committed_files():
        if rel not in files and pattern.match(rel):
            kind = {"json": "record", "png": "plot", "log": "log"}[rel.rsplit(".", 1)[1]]
            files[rel] = {"what": f"a trainer's plan on one rank (bench_trl --nproc 1): {kind}"}
    return files


def index_problems(index: dict) -> list:
    listed, present = set(with_decompositions(index)), committed_files()
    return [f"benchmarks/results/{f} is not in index.json" for f in sorted(present - listed)] + [
        f"index.json lists benchmarks/results/{f}, which is missing"
        for f in sorted(listed - present)
    ]


def replace_between(text: str, name: str, body: str, where: str) -> str:
    begin, end = f"<!-- tables:{name} begin -->", f"<!-- tables:{name} end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise SystemExit(f"{where}: needs exactly one {begin} and one {end}")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(index: dict) -> dict:
    """{path relative to the repository: its text with every table written}."""
    t = resolve(index)
    pages = {}
    for path, tables in (
        (DOC, doc_tables(t)),
        ("README.md", {"readme": readme_tables(t)}),
        ("benchmarks/results/README.md", {"files": files_listing(index)}),
    ):
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for name, body in tables.items():
            text = replace_between(text, name, body, path)
        pages[path] = text
    return pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, write nothing")
    args = ap.parse_args(argv)
    with open(INDEX) as f:
        index = json.load(f)
    problems = index_problems(index)
    for path, text in render(index).items():
        with open(os.path.join(ROOT, path)) as f:
            current = f.read()
        if current != text:
            if args.check:
                problems.append(f"{path}: tables differ from the results (run {__file__})")
            else:
                with open(os.path.join(ROOT, path), "w") as f:
                    f.write(text)
                print(f"wrote {path}")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
