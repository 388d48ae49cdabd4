"""A numpy simulation of a dense layer quantized after SmoothQuant smoothing: the reference that
``rangeprof.profiler.calibrate.smoothing``'s error estimate is checked against (by
``tests/test_smoothquant.py`` and ``benchmarks/smoothquant_error.py``)."""

from __future__ import annotations

import numpy as np

from rangeprof.profiler.calibrate.smoothing import DenseInput, Grid


def quantized(x: np.ndarray, lo: float, hi: float, grid: Grid) -> np.ndarray:
    """``x`` on the per-tensor grid of ``[lo, hi]``, as the integer kernels see it."""
    if grid.activation_scheme == "asym":
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        step = (hi - lo) / 255
        zero = np.round(-lo / step)
        return (np.clip(np.round(x / step) + zero, 0, 255) - zero) * step
    step = max(abs(lo), abs(hi)) / 127
    return np.clip(np.round(x / step), -128, 127) * step


def simulated(x: np.ndarray, w: np.ndarray, s: np.ndarray, stats: DenseInput, grid: Grid) -> float:
    """The mean squared output error of ``x @ w`` quantized after smoothing by ``s``: the
    smoothed activations on the range the statistics give, the weights per output channel."""
    ws = w * s[:, None]
    step = np.abs(ws).max(axis=0) / grid.weight_max
    step[step == 0] = 1.0
    wq = np.round(ws / step) * step
    lo, hi = np.nanmin(stats.lo / s), np.nanmax(stats.hi / s)
    return float(np.mean((quantized(x / s, lo, hi, grid) @ wq - x @ w) ** 2))
