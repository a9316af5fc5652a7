"""95 % intervals for the cells of an evaluation table, and the rule that marks a difference.

* `wilson(k, n)`: the Wilson score interval of a rate of `k` successes in `n` trials (exact-match cells:
  every sample scored 0 or 1). It stays inside [0, 1] and is not degenerate at 0/n or n/n, unlike the
  normal ("Wald") interval.
* `bootstrap_mean(groups)`: the percentile bootstrap of a mean score (cells whose samples score
  fractions, e.g. string_match_all over several references, F1, ROUGE-L; and the average over tasks),
  given only from `MIN_BOOTSTRAP` samples per group on (`average_interval`).
  `groups` are resampled separately (a stratified bootstrap: each task keeps its sample count), and the
  statistic is the mean of the groups' means, which is how a table averages over tasks. Seeded: the same
  rows give the same interval.
* `differs(a, b)`: the marking rule of the report: two cells differ when their 95 % intervals do not
  overlap. It is conservative (for two intervals of equal width it corresponds to a test at about the
  0.6 % level, not 5 %), ignores that the cells share their samples (a paired test would find more),
  and makes no correction for the many cells compared: an unmarked difference is not evidence that two
  methods are equal.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval `(low, high)` of the rate `k / n` (in [0, 1]); `n` >= 1."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"wilson needs 0 <= k <= n and n >= 1, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_mean(groups: Sequence[Sequence[float]], resamples: int = BOOTSTRAP_RESAMPLES,
                   seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the groups' means (one group: a plain mean).

    Each resample draws every group's values with replacement (same size as the group); the interval
    is the (1 - level) / 2 and (1 + level) / 2 quantiles (linear interpolation) of the resampled
    statistics."""
    groups = [list(map(float, g)) for g in groups]
    if not groups or any(not g for g in groups):
        raise ValueError("bootstrap_mean needs non-empty groups")
    gen = torch.Generator().manual_seed(seed)
    stat = torch.zeros(resamples, dtype=torch.float64)
    for g in groups:
        values = torch.tensor(g, dtype=torch.float64)
        picks = torch.randint(len(g), (resamples, len(g)), generator=gen)  # (resamples, n)
        stat += values[picks].mean(dim=1)
    stat /= len(groups)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(stat, q).tolist()
    return low, high


#: the fewest samples per group a bootstrap interval is given for: below that the percentile bootstrap is
#: far too narrow (one sample per group resamples to a single point)
MIN_BOOTSTRAP = 10


def is_binary(values: Sequence[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def cell_interval(values: Sequence[float]) -> tuple[float, float, str] | None:
    """`(low, high, kind)` of one cell's per-sample scores (in [0, 1]): Wilson when every score is 0 or
    1, else the bootstrap of the mean; None when a bootstrap would rest on fewer than `MIN_BOOTSTRAP`."""
    return average_interval([values])


def average_interval(groups: Sequence[Sequence[float]]) -> tuple[float, float, str] | None:
    """`(low, high, kind)` of the mean of the groups' means (the average over tasks; one group: a cell).

    Every score 0 or 1 and the groups of equal size: the mean of means is the pooled rate k / N, and
    Wilson's interval of k / N is used (it treats the N samples as one draw, which is conservative for a
    stratified sample). Otherwise the stratified bootstrap, given only when every group has at least
    `MIN_BOOTSTRAP` samples (else None: no honest interval)."""
    if all(is_binary(g) for g in groups) and len({len(g) for g in groups}) == 1:
        low, high = wilson(int(sum(map(sum, groups))), sum(map(len, groups)))
        return low, high, "wilson"
    if min(len(g) for g in groups) < MIN_BOOTSTRAP:
        return None
    low, high = bootstrap_mean(groups)
    return low, high, "bootstrap"


def differs(a: tuple[float, float], b: tuple[float, float]) -> int:
    """+1 when interval `a` lies entirely above `b`, -1 entirely below, 0 when they overlap."""
    if a[0] > b[1]:
        return 1
    if a[1] < b[0]:
        return -1
    return 0


def wilson_half_width(n: int, rate: float = 0.5) -> float:
    """Half the width of the Wilson interval at `rate` (the widest at 0.5): what `n` samples can resolve."""
    z = Z95
    return z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
