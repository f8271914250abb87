"""The counts of a test run from pytest's JUnit XML files (one per phase of
`benchmarks/device/device_run.sh tests`): one summary line, the skip reasons, the failed tests, the
slowest tests.

    python benchmarks/device/suite_summary.py --wall 312 --phase serial=a.xml:0 --phase parallel=b.xml:1
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import xml.etree.ElementTree as ET


def read(path: str) -> list[dict]:
    """One dict per test case: name, outcome (passed/failed/error/skipped), seconds, message."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):
            continue  # what pytest writes for a run stopped by SIGINT: no test
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = child.get("message") or ""
                if outcome != "skipped":
                    break  # a failure beside a teardown error counts once, as failed
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append(
            {
                "name": name,
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    return cases


def unexpected_skip(reason: str, gpus: int) -> bool:
    """A skip the machine should not need: a package that did not import, or fewer GPUs asked
    for than it has ("needs a GPU", "needs 2 CUDA GPUs", "needs at least 2 ...")."""
    if "could not import" in reason or "No module named" in reason:
        return True
    if "no CUDA transport" in reason:
        return gpus > 0
    m = re.search(r"needs (?:at least )?(a|an|one|\d+) (?:CUDA )?GPU", reason)
    if m is None:
        return False
    need = 1 if m.group(1) in ("a", "an", "one") else int(m.group(1))
    return need <= gpus


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wall", type=float, required=True, help="wall seconds of the stage")
    parser.add_argument(
        "--phase",
        action="append",
        default=[],
        help="NAME=JUNIT_XML:EXIT_CODE:SECONDS (exit code and seconds optional)",
    )
    parser.add_argument("--slowest", type=int, default=12)
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs of the machine: a skip asking for as many or fewer (or for a "
        "package that did not import) makes the run not green",
    )
    args = parser.parse_args(argv)
    cases, notes = [], []
    for spec in args.phase:
        name, _, rest = spec.partition("=")
        path, _, tail = rest.partition(":")
        code, _, secs = tail.partition(":")
        where = f"{name} ({secs} s)" if secs else name
        if code in ("124", "137", "130"):
            notes.append(f"{where} stopped at its time limit (exit {code})")
        elif code not in ("", "0", "1", "5"):
            notes.append(f"{where} exited {code}")
        if not os.path.exists(path):
            notes.append(f"{where}: no report ({path} missing)")
            continue
        got = read(path)
        for c in got:
            c["phase"] = name
        cases += got
        counts = collections.Counter(c["outcome"] for c in got)
        notes.append(
            f"{where}: {len(got)} tests, {counts['passed']} passed, "
            f"{counts['failed']} failed, {counts['skipped']} skipped, "
            f"{counts['error']} errors"
        )
    counts = collections.Counter(c["outcome"] for c in cases)
    reasons = collections.Counter(c["message"] for c in cases if c["outcome"] == "skipped")
    unexpected = {r for r in reasons if args.gpus is not None and unexpected_skip(r, args.gpus)}
    if unexpected:
        notes.append(
            f"{sum(reasons[r] for r in unexpected)} skipped that this machine "
            f"({args.gpus} GPUs) should run (marked !)"
        )
    ok = (
        counts["failed"] == 0
        and counts["error"] == 0
        and not unexpected
        and not any("time limit" in n or "exited" in n or "no report" in n for n in notes)
    )
    print(
        f"GPU SUITE {'GREEN' if ok else 'NOT GREEN'}: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped, {counts['error']} errors "
        f"in {args.wall:.0f} s wall"
    )
    for n in notes:
        print(f"  {n}")
    if reasons:
        print("skip reasons:")
        for reason, n in reasons.most_common():
            print(f"  {'!' if reason in unexpected else ' '}{n:4d} x {reason}")
    bad = [c for c in cases if c["outcome"] in ("failed", "error")]
    if bad:
        print("failed / errors:")
        for c in bad:
            print(
                f"  {c['outcome']}: {c['name']} ({c['phase']}, {c['seconds']:.0f} s): "
                f"{' '.join(c['message'].split())[:300]}"
            )
    slow = sorted((c for c in cases if c["outcome"] != "skipped"), key=lambda c: -c["seconds"])
    if slow:
        print(f"slowest {min(args.slowest, len(slow))} (seconds in the test, its phase):")
        for c in slow[: args.slowest]:
            print(f"  {c['seconds']:6.1f}  {c['name']} ({c['phase']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
