"""Drift between two profiling runs, per profileID: how the range moved and how far apart the
value distributions are.

The histogram distance is the Jensen-Shannon distance (base 2, so within [0, 1]) of the two
histograms after re-binning both to the coarser of their bin widths. Bins are aligned to multiples
of a power-of-two width (:mod:`rangeprof.profiler.profiling.statistics`), so re-binning is exact; it
works on the occupied bins only, so two ranges far apart cost no memory."""

from __future__ import annotations

import math

import numpy as np

from rangeprof.profiler.profiling.statistics import Histogram

from .schemas import Range, TensorDrift


def histogram_distance(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None:
        return None
    first, second = Histogram.from_json(a), Histogram.from_json(b)
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


def tensor_drift(profile_id: str, kind: str, a: dict, b: dict) -> TensorDrift:
    """``a`` and ``b`` are the tensor's ``stats`` in each run (see
    :mod:`rangeprof.service.models`)."""

    def shift(key: str) -> float | None:
        return None if a[key] is None or b[key] is None else b[key] - a[key]

    change = None
    if None not in (a["min"], a["max"], b["min"], b["max"]) and a["max"] > a["min"]:
        change = ((b["max"] - b["min"]) - (a["max"] - a["min"])) / (a["max"] - a["min"])
    return TensorDrift(
        profile_id=profile_id,
        kind=kind,
        a=Range(min=a["min"], max=a["max"]),
        b=Range(min=b["min"], max=b["max"]),
        min_shift=shift("min"),
        max_shift=shift("max"),
        range_change=change,
        histogram_distance=histogram_distance(a["histogram"], b["histogram"]),
    )
