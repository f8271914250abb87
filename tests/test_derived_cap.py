"""The derived microbatch cap's fit (torch_odc.integrations.hf._steps.fit_bytes_per_token): the
marginal peak bytes per token from a step's microbatches, as every rank computes it from the
shared points. The measurement itself runs in the GPU cases of test_integrations_hf.py."""

import math

import pytest

pytest.importorskip("transformers")

from torch_odc.integrations.hf._steps import fit_bytes_per_token


def points(a, b, fwd, sizes):
    """Microbatches whose peak over their start is a + b * tokens, forward kept fwd * tokens."""
    return [(t, fwd * t, a + b * t) for t in sizes]


def test_the_slope_of_a_linear_peak_is_recovered_not_the_average():
    a, b = 3e9, 220e3  # fixed part (gathered parameters, buffers) and per-token part
    got, info = fit_bytes_per_token(points(a, b, 110e3, [2000, 3500, 5000, 6200, 7000]))
    assert got == pytest.approx(b, rel=1e-9)
    assert info["slope_bytes_per_token"] == pytest.approx(b, rel=1e-9)
    # Peak / tokens of the largest microbatch counts the fixed part too: far above b.
    assert info["peak_bytes_per_token"] == pytest.approx(a / 7000 + b)
    assert info["forward_bytes_per_token"] == pytest.approx(110e3)
    assert info["points"] == 5


def test_the_fit_is_kept_between_the_forward_and_the_largest_peak_per_token():
    # A slope below what the forward keeps (noise): the forward's figure.
    got, _ = fit_bytes_per_token(points(1e9, 50e3, 80e3, [2000, 4000, 8000]))
    assert got == pytest.approx(80e3)
    # A negative fixed part (slope above peak / tokens): the largest microbatch's peak per token.
    pts = points(-1e9, 300e3, 100e3, [4000, 6000, 8000])
    got, info = fit_bytes_per_token(pts)
    assert got == pytest.approx(info["peak_bytes_per_token"]) and got < 300e3


def test_too_few_or_too_alike_microbatches_fall_back_to_the_forward():
    got, info = fit_bytes_per_token(points(3e9, 220e3, 110e3, [6000, 7000]))
    assert got == pytest.approx(110e3) and info["slope_bytes_per_token"] is None
    got, info = fit_bytes_per_token(points(3e9, 220e3, 110e3, [6000, 6500, 7000, 7100]))
    assert got == pytest.approx(110e3) and info["slope_bytes_per_token"] is None
    assert fit_bytes_per_token([]) is None
    assert fit_bytes_per_token([(0, 0.0, 0.0)]) is None


def test_every_rank_derives_the_same_figure_whatever_the_order_of_the_points():
    pts = points(2e9, 180e3, 90e3, [1500, 2600, 4100, 5200, 6100, 6900])
    ref = fit_bytes_per_token(pts)[0]
    assert all(fit_bytes_per_token(p)[0] == ref
               for p in (pts[::-1], pts[3:] + pts[:3], sorted(pts, key=lambda p: -p[2])))
    assert math.isfinite(ref)


def test_the_microbatch_furthest_above_the_line_sets_the_margin_kept_free():
    pts = points(3e9, 220e3, 110e3, [2000, 3500, 5000, 7000])
    assert fit_bytes_per_token(pts)[1]["margin_bytes"] == pytest.approx(0, abs=1e-3)
    pts[2] = (5000, 110e3 * 5000, 3e9 + 220e3 * 5000 + 80e6)  # 80 MB above the others' line
    b, info = fit_bytes_per_token(pts)
    a = sum(p[2] - b * p[0] for p in pts) / len(pts)  # the fitted line's intercept
    residual = max(p[2] - (a + b * p[0]) for p in pts)
    assert info["margin_bytes"] == pytest.approx(residual)
    assert 40e6 < info["margin_bytes"] < 80e6  # the fit absorbs part of the outlier
