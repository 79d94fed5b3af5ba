"""Percentiles as the inference-perf load generator reports them.

The lifecycle JSON files give, per latency, ``mean``, ``min``, ``max`` and the percentiles
``p0.1 p1 p5 p10 p25 median p75 p90 p95 p99 p99.9``, each ``np.percentile(values, p)``
(numpy's default, linear interpolation between the two nearest ranks). Here the median is
called ``p50``, so that every percentile has one spelling: ``stat_key(p)``.

:func:`counted_percentiles` gives the same figures for a sample held as values with counts
(the client's pooled inter-token gaps: one event gap per token, millions of times),
without expanding it.
"""

from __future__ import annotations

import numpy as np

PERCENTILES = (0.1, 1.0, 5.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.9)


def stat_key(p: float) -> str:
    """``p90``, ``p99.9``: the name of percentile P (``p50`` is the files' ``median``)."""
    return f"p{p:g}"


PERCENTILE_KEYS = tuple(stat_key(p) for p in PERCENTILES)


def percentiles(values: np.ndarray) -> dict[str, float]:
    """Every percentile of ``PERCENTILES`` of VALUES, by key; empty for no values."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return {}
    return dict(zip(PERCENTILE_KEYS, np.percentile(v, PERCENTILES).tolist(), strict=True))


def counted_percentiles(values: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    """:func:`percentiles` of the sample that holds ``values[i]`` ``counts[i]`` times (counts >= 0)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.asarray(counts, dtype=np.int64)
    keep = c > 0
    v, c = v[keep], c[keep]
    if not len(v):
        return {}
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(c[order])
    n = int(cum[-1])
    h = (n - 1) * np.asarray(PERCENTILES) / 100.0  # numpy's "linear" method: rank h between floor and floor + 1
    lo = np.floor(h).astype(np.int64)
    frac = h - lo
    at = lambda rank: v[np.searchsorted(cum, rank, side="right")]  # noqa: E731  (value of the rank-th element)
    a, b = at(lo), at(np.minimum(lo + 1, n - 1))
    return dict(zip(PERCENTILE_KEYS, (a + frac * (b - a)).tolist(), strict=True))
