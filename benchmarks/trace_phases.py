"""Where a profiled training step's time went, by named range, from the Chrome traces the
examples write with ``--profile-steps N --profile-trace DIR`` (one per rank and step).

    python benchmarks/trace_phases.py DIR/step7_rank0.json.gz [...] [--json OUT.json]

For every range name (``record_function`` ranges: ODC's ``odc::*`` phases, FSDP2's
``FSDP::*``, the optimizer's ``Optimizer.step#...``, the examples' own), a trace's table gives
how often it ran, its host milliseconds (a range nested in one of the same name counted once),
and the device milliseconds of the kernels, copies and memsets launched inside it (by the CUDA
runtime call's correlation id). Besides, per trace: the span from the first to the last event,
the time the device was busy (the union of kernel intervals) and, for each instance of the
ranges named with ``--each`` (default ``odc::grpo_microbatches``), its host and device
milliseconds one by one. The profiler slows the host: host milliseconds are relative, not rates.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RANGE_CATS = ("user_annotation", "python_function", "cpu_op")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _outermost(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals ``spans`` cover, sorted and disjoint: a span inside another (a recursive
    range) counts once, and overlapping spans merge."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a < out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
            continue
        out.append((a, b))
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    """The time covered by ``spans`` (overlaps counted once)."""
    return sum(b - a for a, b in _outermost(spans))


def _clip(
    spans: list[tuple[float, float]], windows: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The parts of ``spans`` inside ``windows`` (sorted, disjoint)."""
    out = []
    for a, b in spans:
        for wa, wb in windows:
            if wa < b and a < wb:
                out.append((max(a, wa), min(b, wb)))
    return out


def phases(
    path: str, each: tuple[str, ...] = ("odc::grpo_microbatches",), within: str | None = None
) -> dict:
    """One trace's table (see the module's docstring); ``within``: only the parts of ranges
    and device work inside that range's instances."""
    events = _load(path)
    launch_ts = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    device = [
        (launch_ts.get(e.get("args", {}).get("correlation")), e["ts"], e["dur"])
        for e in events
        if e.get("cat") in DEVICE_CATS
    ]
    by_name: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in RANGE_CATS:
            by_name[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    windows = None
    if within is not None:
        if within.startswith("after:"):  # from the end of the range's last instance on
            ends = [b for _, b in by_name.get(within[len("after:") :], [])]
            last = max(e["ts"] + e["dur"] for e in events)
            windows = [(max(ends), last)] if ends else []
        else:
            windows = _outermost(by_name.get(within, []))
        by_name = {
            name: clipped for name, spans in by_name.items() if (clipped := _clip(spans, windows))
        }
        device = [
            d for d in device if d[0] is not None and any(wa <= d[0] <= wb for wa, wb in windows)
        ]
    launched = sorted((ts, dur) for ts, _, dur in device if ts is not None)
    starts = [ts for ts, _ in launched]
    prefix = [0.0]
    for _, dur in launched:
        prefix.append(prefix[-1] + dur)

    def device_ms(a: float, b: float) -> float:
        return (
            prefix[bisect.bisect_right(starts, b)] - prefix[bisect.bisect_left(starts, a)]
        ) / 1e3

    table = {}
    for name, spans in by_name.items():
        spans = _outermost(spans)
        table[name] = {
            "calls": len(spans),
            "host_ms": round(sum(b - a for a, b in spans) / 1e3, 3),
            "device_ms": round(sum(device_ms(a, b) for a, b in spans), 3),
        }
    instances = {
        name: [
            {"host_ms": round((b - a) / 1e3, 3), "device_ms": round(device_ms(a, b), 3)}
            for a, b in sorted(by_name[name])
        ]
        for name in each
        if name in by_name
    }
    if windows:
        span = sum(b - a for a, b in windows)
    else:
        span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    return {
        "trace": os.path.basename(path),
        "within": within,
        "span_ms": round(span / 1e3, 3),
        "device_busy_ms": round(_union([(ts, ts + dur) for _, ts, dur in device]) / 1e3, 3),
        "ranges": dict(sorted(table.items(), key=lambda kv: -kv[1]["host_ms"])),
        "instances": instances,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument(
        "--each",
        default="odc::grpo_microbatches",
        help="comma-separated range names listed instance by instance",
    )
    ap.add_argument("--top", type=int, default=25, help="ranges printed per trace")
    ap.add_argument(
        "--within",
        default=None,
        help="only what runs inside this range's instances (its host time, and "
        "the device work launched there), e.g. odc::grpo_microbatches; "
        "after:NAME: from the end of NAME's last instance to the trace's end",
    )
    ap.add_argument("--json", default=None, help="write every trace's table there")
    args = ap.parse_args()
    each = tuple(n for n in args.each.split(",") if n)
    out = [phases(path, each, args.within) for path in args.traces]
    for t in out:
        where = f" (within {t['within']})" if t["within"] else ""
        print(
            f"{t['trace']}{where}: span {t['span_ms']:.1f} ms, "
            f"device busy {t['device_busy_ms']:.1f} ms"
        )
        print(f"  {'range':<60} {'calls':>6} {'host ms':>10} {'device ms':>10}")
        for name, r in list(t["ranges"].items())[: args.top]:
            print(
                f"  {name[:60]:<60} {r['calls']:>6} {r['host_ms']:>10.1f} {r['device_ms']:>10.1f}"
            )
        for name, rows in t["instances"].items():
            print(
                f"  {name}: "
                + ", ".join(f"{r['host_ms']:.1f}/{r['device_ms']:.1f}" for r in rows)
                + " (host/device ms)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
