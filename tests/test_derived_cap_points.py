"""Which measured microbatches the derived cap (torch_odc.step.AutoCap) fits its line to: one
that leaves memory allocated behind it (a one-time allocation such as the gradients FSDP2
creates at the first backward on one rank) is left out, since every later microbatch starts
with that memory; counted, its peak would set the margin held free (the cap then falls to a
token). The GPU measurement itself runs in the GPU cases of test_integrations_hf.py."""

import pytest

from torch_odc.step import AutoCap, fit_bytes_per_token

A, B, FWD = 3e9, 220e3, 110e3  # a microbatch's peak over its start: A + B * tokens
SIZES = [2000, 3500, 5000, 7000, 9000]


def measured(kept_first: float) -> list:
    """The points AutoCap keeps of microbatches of SIZES, the first leaving kept_first bytes."""
    pts = []
    for k, t in enumerate(SIZES):
        growth = A + B * t + (kept_first if k == 0 else 0.0)  # its peak counts what it keeps
        pts.append(AutoCap.point(t, FWD * t, growth, kept_first if k == 0 else 1e6))
    return [p for p in pts if p is not None]


def test_a_microbatch_that_keeps_memory_is_no_point_and_sets_no_margin():
    grads = 2.85e9  # one rank's gradients, created by the first backward
    kept = measured(grads)
    assert len(kept) == len(SIZES) - 1
    b, info = fit_bytes_per_token(kept)
    assert b == pytest.approx(B, rel=1e-9)
    assert info["margin_bytes"] == pytest.approx(0, abs=1e-3)
    # Counted, the same microbatch would hold gigabytes free: what the rule is for.
    counted = [(t, FWD * t, A + B * t + (grads if k == 0 else 0.0)) for k, t in enumerate(SIZES)]
    assert fit_bytes_per_token(counted)[1]["margin_bytes"] > 1e9


def test_microbatches_that_keep_little_stay_points():
    assert len(measured(0.0)) == len(SIZES)
    small = AutoCap.KEPT_FRACTION * (A + B * SIZES[0]) * 0.99
    assert len(measured(small)) == len(SIZES)
    assert AutoCap.point(100, 0.0, 1e9, 0.0) == (100, 0.0, 1e9)
    assert AutoCap.point(0, 0.0, 1e9, 0.0) is None
    assert AutoCap.point(100, 0.0, 0.0, 0.0) is None
