"""The derived microbatch cap's fit (torch_odc.step.fit_bytes_per_token): the
marginal peak bytes per token from a step's microbatches, as every rank computes it from the
shared points, and the packing of a rank's rows under the cap (pack_padded). The measurement
itself runs in the GPU cases of test_integrations_hf.py."""

import itertools
import math
import random

import pytest

from torch_odc.step import (
    fit_bytes_per_token,
    left_padded_widths,
    pack_padded,
    padded_tokens,
    round_up,
    row_shape,
)


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
    assert all(
        fit_bytes_per_token(p)[0] == ref
        for p in (pts[::-1], pts[3:] + pts[:3], sorted(pts, key=lambda p: -p[2]))
    )
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


def _cuttings(order, size, cap):
    """Every cutting of ``order`` into consecutive runs that keeps each run of several rows
    within the cap, as (microbatches, padded tokens): the reference pack_padded must reach."""
    n = len(order)
    for mask in range(1 << max(n - 1, 0)):
        cuts = [0, *(k + 1 for k in range(n - 1) if mask >> k & 1), n]
        runs = [order[a:b] for a, b in itertools.pairwise(cuts) if b > a]
        if all(len(r) == 1 or size(r) <= cap for r in runs):
            yield len(runs), sum(size(r) for r in runs)


def _counted(kind: int, rows):
    """How a trainer counts a microbatch of ``rows``, straight (``size``) and as pack_padded
    is told (``shape``, ``width``): padded_tokens for language-modeling rows (kind 0), preference
    pairs (1) and padding-free rows (2); GRPO's rollouts (3: longest prompt, left-padded to a
    multiple of 64, plus longest completion, per row)."""
    if kind == 3:

        def size(mb):
            return len(mb) * sum(
                left_padded_widths(
                    max(rows[i][0] for i in mb), max(rows[i][1] for i in mb), 64, True
                )
            )

        return size, lambda i: (1, rows[i]), lambda d: sum(left_padded_widths(*d, 64, True))
    free = kind == 2
    return (
        (lambda mb: padded_tokens([rows[i] for i in mb], free, 8)),
        (lambda i: row_shape(rows[i], free)),
        (lambda d: round_up(d[0], 8) if d else 1),
    )


def test_packing_takes_the_fewest_microbatches_then_the_fewest_padded_tokens():
    # A GRPO step's rank: 4 rollouts of one long prompt, 12 of short ones. Filling each
    # microbatch up to the cap pads 3 short rows to the long length (7 x 1800 + 9 x 600).
    lengths = [600] * 6 + [1800] * 4 + [600] * 6
    got = pack_padded(range(16), lambda i: (1, (lengths[i],)), lambda d: d[0], 14400)
    assert [sorted(mb) for mb in got] == [[6, 7, 8, 9], [*range(6), *range(10, 16)]]

    # Against every cutting of the sorted rows, on random lengths and caps (a row above the cap
    # runs alone), the microbatches counted as each trainer counts them.
    rng = random.Random(7)
    for case in range(400):
        n, cap, kind = rng.randint(1, 9), rng.randint(50, 6000), case % 4
        lengths = [rng.choice([rng.randint(1, 100), rng.randint(1, 3000)]) for _ in range(2 * n)]
        rows = (
            [(lengths[i], 1 + lengths[n + i] % 40) for i in range(n)]
            if kind == 3
            else [tuple(lengths[i::n][: 1 + (kind == 1)]) for i in range(n)]
        )
        size, shape, width = _counted(kind, rows)
        got = pack_padded(range(n), shape, width, cap)
        assert sorted(i for mb in got for i in mb) == list(range(n))
        assert all(len(mb) == 1 or size(mb) <= cap for mb in got), (case, got)
        order = sorted(range(n), key=lambda i: (-size([i]), i))
        assert (len(got), sum(size(mb) for mb in got)) == min(_cuttings(order, size, cap)), case
