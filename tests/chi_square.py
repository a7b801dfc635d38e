"""Pearson's two-sample chi-square test, for tests that compare two samplers' outputs.

No statistics library is a dependency of the suite, so the chi-square distribution's tail comes from the
series of the regularised lower incomplete gamma function (exact to double rounding for the sizes the
tests use: a few dozen degrees of freedom, statistics of a few hundred).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with `df` degrees of freedom."""
    if x <= 0:
        return 1.0
    a, half = df / 2, x / 2
    term = total = 1.0 / a
    n = 1
    while term > total * 1e-17:
        term *= half / (a + n)
        total += term
        n += 1
    lower = math.exp(-half + a * math.log(half) - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def two_sample(first: Counter[Hashable], second: Counter[Hashable], min_count: int = 20) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) that two equal-sized samples come from one distribution.

    Outcomes seen fewer than `min_count` times in both samples together are pooled into one bucket, so
    every bucket's expected count is large enough for the chi-square approximation.
    """
    if sum(first.values()) != sum(second.values()):
        raise ValueError("the samples must be the same size")
    common = [o for o in first.keys() | second.keys() if first[o] + second[o] >= min_count]
    buckets = [(first[o], second[o]) for o in common]
    rest = (sum(first.values()) - sum(a for a, _ in buckets), sum(second.values()) - sum(b for _, b in buckets))
    if sum(rest):
        buckets.append(rest)
    statistic = sum((a - b) ** 2 / (a + b) for a, b in buckets)
    df = len(buckets) - 1
    return statistic, df, chi2_sf(statistic, df)
