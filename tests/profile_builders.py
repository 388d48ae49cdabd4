"""Profile documents built from arrays, for calibration and export tests."""

from __future__ import annotations

import numpy as np

from rangeprof.profiler.profiling.statistics import TensorStats


def entry(
    values,
    *,
    kind: str = "activation",
    bins: int | None = 2048,
    channel_axis: int | None = None,
    name: str = "t",
    source_tensor: str | None = "t_out",
) -> dict:
    array = np.asarray(values, dtype=np.float32)
    stats = TensorStats.observe(array, bins, channel_axis)
    return {
        "profile_id": name,
        "source_node": name,
        "source_tensor": source_tensor,
        "kind": kind,
        "shape": list(array.shape),
        "dtype": "float32",
        "static": kind == "weight",
        **stats.to_json(),
    }


def profile(*entries: dict) -> dict:
    return {
        "schema_version": "1.0",
        "model": {"name": "m", "sha256": "0" * 64, "inputs": {"x": [1, 4]}},
        "run": {},
        "tensors": list(entries),
    }
