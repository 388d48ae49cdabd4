"""How far apart two runs' value distributions of a tensor are.

The Jensen-Shannon distance (base 2, so within [0, 1]) of the two histograms after re-binning
both to the coarser of their bin widths. Bins are aligned to multiples of a power-of-two width
(:class:`~rangeprof.profiler.profiling.statistics.Histogram`), so re-binning is exact; it works
on the occupied bins only, so two ranges far apart cost no memory."""

from __future__ import annotations

import math

import numpy as np

from rangeprof.profiler.profiling.statistics import Histogram


def histogram_distance(first: Histogram, second: Histogram) -> float | None:
    """The Jensen-Shannon distance of two histograms on their common bin grid; None when one of
    them is empty."""
    exponent = max(first.exponent, second.exponent)
    keys, weights = [], []
    for hist in (first, second):
        index = np.arange(hist.offset, hist.offset + len(hist.counts), dtype=np.int64)
        keys.append(index >> (exponent - hist.exponent))
        weights.append(hist.counts.astype(np.float64))
    bins, where = np.unique(np.concatenate(keys), return_inverse=True)
    split = len(keys[0])
    p = np.bincount(where[:split], weights=weights[0], minlength=len(bins))
    q = np.bincount(where[split:], weights=weights[1], minlength=len(bins))
    if p.sum() == 0 or q.sum() == 0:
        return None
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2
    divergence = (_kl(p, m) + _kl(q, m)) / 2
    return math.sqrt(min(max(divergence, 0.0), 1.0))


def _kl(p: np.ndarray, m: np.ndarray) -> float:
    used = p > 0
    return float(np.sum(p[used] * np.log2(p[used] / m[used])))
