"""Size generated samples to a target length in the model's own tokens.

Generators are functions `build(units) -> Sample` where `units` counts haystack pieces (sentences,
noise repeats, words). RULER grows `units` in fixed increments until the prompt plus the tokens to
generate no longer fit; here the first sample of a (task, length) is sized by an exponential then
binary search, and later samples start from that size and step down until they fit.
"""

from __future__ import annotations

from typing import Callable

from kvtrim.eval.sample import Sample
from kvtrim.methods.base import KvtrimError

Builder = Callable[[int], Sample]
Counter = Callable[[Sample], int]


def largest_fitting(build: Builder, count: Counter, budget: int, start: int = 8) -> int:
    """The largest `units` whose sample has at most `budget` prompt tokens (assumes monotone growth).

    Secant steps on the (nearly linear) tokens-per-unit curve, then unit steps to the exact edge:
    a handful of tokenizations instead of a bisection's twenty."""
    cache: dict[int, int] = {}

    def tokens(u: int) -> int:
        if u not in cache:
            cache[u] = count(build(u))
        return cache[u]

    if tokens(1) > budget:
        raise KvtrimError(f"the target length is too short: the smallest sample needs more than {budget} prompt tokens")
    a, b = 1, max(2, start)
    for _ in range(8):
        if tokens(b) == tokens(a):
            b = b * 2
            continue
        slope = (tokens(b) - tokens(a)) / (b - a)
        guess = max(1, min(1 << 24, round(b + (budget - tokens(b)) / slope)))
        if abs(guess - b) <= 2:
            break
        a, b = b, guess
    u = b
    while tokens(u) > budget and u > 1:
        u -= 1
    while tokens(u + 1) <= budget:
        u += 1
        if u > 1 << 24:
            raise KvtrimError("could not size the sample: its length does not grow with the haystack")
    return u


def fit_sample(build: Builder, count: Counter, budget: int, units: int) -> Sample:
    """The sample with the most units that fits `budget` prompt tokens, searched around `units`.

    Steps by ~0.5% of `units` (a sample differs from the calibration one only by its needles, keys or
    random words, so one or two steps are the rule): down until it fits, else up while it still fits."""
    step = max(1, units // 200)
    sample = build(units)
    n = count(sample)
    if n <= budget:
        for _ in range(50):
            bigger = build(units + step)
            m = count(bigger)
            if m > budget:
                break
            sample, n, units = bigger, m, units + step
    while n > budget and units > 1:
        units = max(1, units - step)
        sample = build(units)
        n = count(sample)
    sample.meta["prompt_tokens"] = n
    sample.meta["units"] = units
    return sample


def sized_samples(make: Callable[[int, int], Sample], count: Counter, budget: int, n: int) -> list[Sample]:
    """`n` samples `make(index, units)`, each with as many units as fit `budget` prompt tokens."""
    units = largest_fitting(lambda u: make(0, u), count, budget)
    return [fit_sample(lambda u, i=i: make(i, u), count, budget, units) for i in range(n)]
