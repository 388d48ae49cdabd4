"""Drift between two profiling runs, per profileID, as the API answers it: how the range moved
and how far apart the value distributions are
(:func:`~rangeprof.profiler.profiling.drift.histogram_distance`)."""

from __future__ import annotations

from rangeprof.profiler.profiling.drift import histogram_distance
from rangeprof.profiler.profiling.statistics import Histogram

from .schemas import Range, TensorDrift


def _distance(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None:
        return None
    return histogram_distance(Histogram.from_json(a), Histogram.from_json(b))


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
        histogram_distance=_distance(a["histogram"], b["histogram"]),
    )
