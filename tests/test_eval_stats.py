"""The intervals of the evaluation tables (`kvtrim.eval.stats`) against textbook values, and the report's
marking rule."""

from __future__ import annotations

import math
import random

import pytest

from kvtrim.eval.report import markdown_tables, summarize
from kvtrim.eval.stats import average_interval, bootstrap_mean, cell_interval, differs, wilson, wilson_half_width


@pytest.mark.parametrize("k, n, low, high", [
    (8, 10, 0.4902, 0.9433),   # Wilson 95 % for 8/10 (Newcombe 1998's worked example style; by hand)
    (0, 10, 0.0, 0.2775),      # 0/n: not degenerate, unlike the Wald interval
    (10, 10, 0.7225, 1.0),
    (1, 1, 0.2065, 1.0),
    (50, 100, 0.4038, 0.5962),
])
def test_wilson_known_values(k, n, low, high):
    lo, hi = wilson(k, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_wilson_by_its_definition():
    # the interval's ends are the rates p0 where |k/n - p0| = z sqrt(p0 (1 - p0) / n): check that equation
    z = 1.959963984540054
    for k, n in [(3, 7), (20, 25), (1, 50)]:
        for p0 in wilson(k, n):
            assert abs(k / n - p0) == pytest.approx(z * math.sqrt(p0 * (1 - p0) / n), abs=1e-12)


def test_bootstrap_two_values_exactly():
    # [0, 1]: the resampled mean is 0 (1/4), 0.5 (1/2) or 1 (1/4), so the 2.5 / 97.5 % quantiles are 0 and 1
    assert bootstrap_mean([[0.0, 1.0]]) == (0.0, 1.0)
    assert bootstrap_mean([[0.3] * 7]) == pytest.approx((0.3, 0.3))


def test_bootstrap_matches_the_normal_interval_for_a_large_sample():
    rng = random.Random(1)
    values = [rng.random() for _ in range(400)]  # uniform: sd = 1/sqrt(12)
    m = sum(values) / len(values)
    half = 1.96 * math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values))
    lo, hi = bootstrap_mean([values])
    assert lo == pytest.approx(m - half, abs=0.006) and hi == pytest.approx(m + half, abs=0.006)
    assert bootstrap_mean([values]) == (lo, hi)  # seeded


def test_stratified_bootstrap_keeps_each_group():
    # one constant group shifts the mean of means by a constant: the interval is the other's, halved and shifted
    other = [0.0, 0.2, 0.9, 0.4, 1.0, 0.1]
    lo, hi = bootstrap_mean([other])
    lo2, hi2 = bootstrap_mean([other, [1.0] * 6])
    assert lo2 == pytest.approx((lo + 1) / 2, abs=1e-9) and hi2 == pytest.approx((hi + 1) / 2, abs=1e-9)


def test_cell_interval_kind_and_half_width():
    assert cell_interval([1.0, 0.0, 1.0])[2] == "wilson"
    assert cell_interval([1.0, 0.5, 1.0]) is None  # a bootstrap of 3 samples: no honest interval
    assert cell_interval([1.0, 0.5, 1.0] * 4)[2] == "bootstrap"
    # the average of equal-sized exact-match groups: Wilson's of the pooled rate; unequal sizes: bootstrap
    assert average_interval([[1.0, 0.0], [1.0, 1.0]]) == (*wilson(3, 4), "wilson")
    assert average_interval([[1.0, 0.0] * 5, [1.0] * 12])[2] == "bootstrap"
    assert average_interval([[1.0], [1.0] * 12]) is None
    # what the report's note quotes: ±18 points at n = 25, ±10 at n = 100 (a 50 % rate)
    assert wilson_half_width(25) == pytest.approx(0.182, abs=0.001)
    assert wilson_half_width(100) == pytest.approx(0.096, abs=0.001)
    assert differs((0.6, 0.9), (0.1, 0.5)) == 1 and differs((0.1, 0.5), (0.6, 0.9)) == -1
    assert differs((0.1, 0.6), (0.5, 0.9)) == 0


def _row(method, ratio, task, score, i):
    return {"method": method, "method_name": method, "compression_ratio": ratio, "length": 1000, "task": task,
            "score": score, "string_match_all": score, "string_match_part": score, "achieved_compression": ratio,
            "final_compression": ratio, "seconds": 1.0, "sample_id": f"{task}/{i}"}


def test_summary_cells_carry_n_interval_and_mark():
    rows = []
    for i in range(20):
        rows += [_row("full", 0.0, "a", 1.0, i), _row("full", 0.0, "b", float(i % 2), i)]
        rows += [_row("x", 0.5, "a", float(i < 4), i), _row("x", 0.5, "b", float(i % 2), i)]
    s = {(r["method"], r["task"]): r for r in summarize(rows)}
    a = s[("x", "a")]
    assert a["n"] == 20 and a["ci"] == "wilson"
    assert (a["ci_low"], a["ci_high"]) == pytest.approx(tuple(100 * v for v in wilson(4, 20)))
    assert a["vs_full"] == -1 and s[("x", "b")]["vs_full"] == 0 and "vs_full" not in s[("full", "a")]
    avg = s[("x", "average")]
    assert avg["ci"] == "wilson" and (avg["ci_low"], avg["ci_high"]) == pytest.approx(
        tuple(100 * v for v in wilson(14, 40)))  # 4 + 10 of 40 samples right
    md = markdown_tables(summarize(rows))
    lo, hi = wilson(4, 20)
    assert f"| 20.0 [{100 * lo:.0f}, {100 * hi:.0f}] ▼ |" in md and "a (n=20)" in md and "avg (n=40)" in md
