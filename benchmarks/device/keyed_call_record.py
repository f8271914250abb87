"""Writes a keyed-call side-by-side record (JSON) from the keyed_call_micro.txt files of one or
more calls of benchmarks/device/keyed_call_side_by_side.sh:

    python benchmarks/device/keyed_call_record.py --out FILE.json --what ... --command ... \\
        --reading ... --gpu-tests ... call1/keyed_call_micro.txt call2/keyed_call_micro.txt
"""

from __future__ import annotations

import argparse
import json
import re


def rounds_of(paths: list[str]) -> list[dict]:
    rounds, cur = [], None
    for call, path in enumerate(paths, 1):
        with open(path) as f:
            lines = f.read().splitlines()
        for line in lines:
            m = re.match(r"== round (\d+) (before|after) \((\w+)\)", line)
            if m:
                cur = {
                    "call": call,
                    "round": int(m.group(1)),
                    "tree": m.group(2),
                    "commit": m.group(3),
                    "us_per_call": {},
                    "cpp_us_per_call": {},
                }
                rounds.append(cur)
                continue
            m = re.match(r"\s*(.+?)\s{2,}([\d.]+) us per call \(C\+\+ clock ([\d.]+) us\)", line)
            if m and cur:
                cur["us_per_call"][m.group(1)] = float(m.group(2))
                cur["cpp_us_per_call"][m.group(1)] = float(m.group(3))
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    for name in ("what", "command", "machine", "torch", "date", "reading", "gpu-tests"):
        ap.add_argument(f"--{name}", required=True)
    args = ap.parse_args()
    rounds = rounds_of(args.files)
    best = {}
    for tree in ("before", "after"):
        rs = [r for r in rounds if r["tree"] == tree]
        best[tree] = {k: min(r["us_per_call"][k] for r in rs) for k in rs[0]["us_per_call"]}
    out = {
        "what": args.what,
        "command": args.command,
        "machine": args.machine,
        "torch": args.torch,
        "date": args.date,
        "rounds": rounds,
        "best_of_rounds_us_per_call": best,
        "reading": args.reading,
        "gpu_tests_after": args.gpu_tests,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
