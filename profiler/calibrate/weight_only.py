"""4-bit weight-only quantization of dense layers, group-wise along the axis they sum over, with
its clipping and AWQ-style activation-aware scaling chosen from stored statistics alone.

A dense layer ``Y = X·W`` (``W`` ``[K, N]`` constant) keeps ``X`` in float and stores ``W`` in
4 bits: the ``K`` rows are cut into groups of ``group_size`` (32, 64 or 128; the last one
shorter), and every group of every output column ``n`` has its own scale (ONNX Runtime's
``MatMulNBits`` and opset-21 blocked ``DequantizeLinear`` layouts, :mod:`rangeprof.profiler.
export.int4_onnx`). A weight is ``(q - z)·scale`` with ``q`` in ``0..15``:

* **asymmetric**: ``scale = (hi - lo) / 15``, ``z = round(-lo / scale)`` over the group's range
  ``[lo, hi]`` widened to hold 0 (so ``z`` lies in ``0..15`` and 0 is exact);
* **symmetric**: ``z = 8`` (levels ``-8..7``) and ``scale = -e / 8`` with ``e`` the group's value
  of largest magnitude, sign kept (ONNX Runtime's MLAS rule; the scale may be negative). The
  extreme lands exactly on level ``-8``, and the step is 7/8 of ``max|w| / 7``'s; only values of
  the other sign within one step of the extreme are clipped, by less than a step. On char_gpt's
  weights (groups of 32 to 128) its squared error is 21-23 % below that of ``max|w| / 7`` on
  levels ``-7..7`` and 13-18 % below ``2·max|w| / 15`` (the RTN of ONNX Runtime's Python
  quantizer, ``RTNWeightOnlyQuantConfig``).

Both are the grids of ONNX Runtime's ``MatMulNBitsQuantizer`` (its default, MLAS's blockwise
quantizer), code for code up to float rounding: round-to-nearest here is that baseline.

**Clipping** (:func:`search_clip`): each group's range may shrink by a ratio ``r`` in ``(0, 1]``
(:data:`RATIOS`); values beyond it saturate. ``r`` is chosen per group and column by the smallest
error of the layer's output. With ``X``'s channels uncorrelated, a weight error ``δ_jn`` adds
``Σ_j E[X_j²]·δ_jn²`` to the expected squared error of output ``n``, so the error of a choice is
that sum with ``E[X_j²]`` from the profile (:meth:`~rangeprof.profiler.calibrate.smoothing.
DenseInput.channel_mean_squares`: each channel's ``max|X_j|²`` scaled to the tensor's stored mean
square). A group's ``r`` changes only its own terms, so the per-group minimum over the grid is
the exact minimum of the sum over the grid; ``r = 1`` is round-to-nearest, never beaten.

**Activation-aware scaling** (:func:`choose_awq`, AWQ: Lin et al., 2024): ``X·W = (X/s)·(s·W)``
for per-channel ``s > 0``; quantizing ``diag(s)·W`` instead gives the channels of large ``E[X_j²]``
finer steps relative to their weights. With ``s_j = max|X_j|^a`` the expected squared error of
output ``n`` is ``Σ_j E[X_j²] / s_j² · (deq(q(s_j·W_jn)) - s_j·W_jn)²`` — computed exactly from
the real weights and the stored statistics, no data run. ``a`` is chosen from a grid
(:data:`ALPHAS`), or no scaling, by the smallest error, each candidate with its own clipping
search; q/k/v projections reading one tensor share one ``s`` (the rewrite of :mod:`rangeprof.
profiler.ir.passes.smooth_quant` folds it). A common factor of ``s`` changes nothing (the grids
scale with it), so ``s`` is normalised to a geometric mean of 1 over the live channels.

:func:`estimate_w4_error` is the resulting expected squared error of one output value (mean over
the output columns of every layer reading ``X``), in the units of :func:`~rangeprof.profiler.
calibrate.smoothing.estimate_error`, for the precision search to set against 8 bits and FP32.
It holds the weights' error alone: ``X`` stays float (W4A16 / FP32).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rangeprof.profiler.calibrate.smoothing import DenseInput
from rangeprof.profiler.errors import RangeprofError

GROUP_SIZES = (32, 64, 128)
RATIOS = tuple(round(1.0 - 0.025 * i, 3) for i in range(21))  # 1.0 down to 0.5
ALPHAS = tuple(round(0.1 * i, 1) for i in range(1, 11))  # 0.1 .. 1.0; 0 is "no scaling"
_LEVELS = 15  # the largest 4-bit code
_MID = 8  # the symmetric zero point


@dataclass(frozen=True)
class Int4Weights:
    """A ``[K, N]`` weight in 4 bits, groups of ``group_size`` rows along ``K``: ``q`` the codes
    ``0..15`` (uint8, one per weight), ``scales`` ``[G, N]`` float32 (``G = ceil(K /
    group_size)``), ``zero_points`` ``[G, N]`` uint8, or None when symmetric (8)."""

    q: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    group_size: int
    symmetric: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def groups(self) -> int:
        return self.scales.shape[0]

    def zeros(self) -> np.ndarray:
        """The zero point of every group ``[G, N]`` (8 throughout when symmetric)."""
        if self.zero_points is None:
            return np.full(self.scales.shape, _MID, dtype=np.uint8)
        return self.zero_points

    def dequantize(self) -> np.ndarray:
        """The float32 ``[K, N]`` weight the codes stand for."""
        rows = np.arange(self.q.shape[0]) // self.group_size
        levels = self.q.astype(np.float32) - self.zeros()[rows].astype(np.float32)
        return levels * self.scales[rows]

    @property
    def nbytes(self) -> int:
        """Bytes stored: two codes a byte, float32 scales, two zero points a byte."""
        k, n = self.q.shape
        zeros = 0 if self.zero_points is None else (self.zero_points.size + 1) // 2
        return (k * n + 1) // 2 + self.scales.nbytes + zeros


def _grouped(w: np.ndarray, group_size: int) -> np.ndarray:
    """``w`` ``[K, N]`` as float64 ``[G, group_size, N]``, the last group padded with zeros (a
    zero widens no range: the asymmetric one holds 0 anyway)."""
    if w.ndim != 2:
        raise RangeprofError(f"a 4-bit weight must be 2-D [K, N], not of shape {w.shape}")
    if group_size < 2 or group_size & (group_size - 1):
        raise RangeprofError(f"group size {group_size} is not a power of two of at least 2")
    k, n = w.shape
    groups = -(-k // group_size)
    padded = np.zeros((groups * group_size, n))
    padded[:k] = w
    return padded.reshape(groups, group_size, n)


def _ranges(wg: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """What each group's grid spans ``[G, 1, N]``: symmetric, its value of largest magnitude
    (twice); asymmetric, its range widened to hold 0."""
    if symmetric:
        extreme = np.take_along_axis(wg, np.abs(wg).argmax(axis=1)[:, None], axis=1)
        return extreme, extreme
    lo = np.minimum(wg.min(axis=1, keepdims=True), 0.0)
    return lo, np.maximum(wg.max(axis=1, keepdims=True), 0.0)


def _parameters(
    ranges: tuple[np.ndarray, np.ndarray], symmetric: bool, clip: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Scale (float32) and zero point of every group ``[G, 1, N]``, ranges shrunk by ``clip``."""
    lo, hi = ranges[0] * clip, ranges[1] * clip
    if symmetric:
        scale = (-lo / _MID).astype(np.float32)
        zero = np.full(scale.shape, float(_MID))
    else:
        scale = ((hi - lo) / _LEVELS).astype(np.float32)
        safe = np.where(scale == 0, 1.0, scale)
        zero = np.clip(np.round(-lo / safe), 0, _LEVELS)
    # A group of zeros: any scale gives exact zeros; 1 keeps the division finite.
    return np.where(scale == 0, np.float32(1.0), scale), zero


def _codes(wg: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    return np.clip(np.round(wg / scale) + zero, 0, _LEVELS)


def _clip_array(clip: float | np.ndarray | None, groups: int, n: int) -> np.ndarray:
    ratios = np.broadcast_to(
        np.asarray(1.0 if clip is None else clip, dtype=np.float64), (groups, n)
    )
    if not np.all((ratios > 0) & (ratios <= 1)):
        raise RangeprofError("a clip ratio lies outside (0, 1]")
    return ratios[:, None, :]


def quantize_groups(
    w: np.ndarray, group_size: int, symmetric: bool, clip: float | np.ndarray | None = None
) -> Int4Weights:
    """Round-to-nearest 4-bit codes of ``w`` ``[K, N]`` (the module doc's grids); ``clip`` a
    ratio in ``(0, 1]`` shrinking each group's range, one for all or one per group ``[G, N]``."""
    wg = _grouped(np.asarray(w, dtype=np.float64), group_size)
    clip = _clip_array(clip, wg.shape[0], wg.shape[2])
    scale, zero = _parameters(_ranges(wg, symmetric), symmetric, clip)
    q = _codes(wg, scale, zero).reshape(-1, wg.shape[2])[: w.shape[0]]
    zeros = None if symmetric else zero[:, 0].astype(np.uint8)
    return Int4Weights(q.astype(np.uint8), scale[:, 0], zeros, group_size, symmetric)


def _channel_weight(channel_weight: np.ndarray | None, k: int) -> np.ndarray:
    if channel_weight is None:
        return np.ones(k)
    weight = np.asarray(channel_weight, dtype=np.float64)
    if weight.shape != (k,):
        raise RangeprofError(f"{weight.shape[0]} channel weights for a weight of {k} rows")
    return weight


def search_clip(
    w: np.ndarray,
    group_size: int,
    symmetric: bool,
    channel_weight: np.ndarray | None = None,
    ratios: Sequence[float] = RATIOS,
) -> Int4Weights:
    """The codes of ``w`` ``[K, N]`` with each group's clip ratio (of ``ratios``; 1 is always
    tried) minimising ``Σ_j channel_weight_j·(deq - w)²`` over the group (``channel_weight``:
    ``E[X_j²]`` per input channel; None for plain squared error)."""
    w = np.asarray(w, dtype=np.float64)
    wg = _grouped(w, group_size)
    c = _grouped(_channel_weight(channel_weight, w.shape[0])[:, None], group_size)
    best_error = np.full((wg.shape[0], wg.shape[2]), np.inf)
    best = np.ones_like(best_error)
    ranges = _ranges(wg, symmetric)
    for ratio in sorted({1.0, *map(float, ratios)}, reverse=True):
        scale, zero = _parameters(ranges, symmetric, np.float64(ratio))
        error = (c * ((_codes(wg, scale, zero) - zero) * scale - wg) ** 2).sum(axis=1)
        better = error < best_error
        best_error = np.where(better, error, best_error)
        best = np.where(better, ratio, best)
    return quantize_groups(w, group_size, symmetric, best)


def weighted_error(
    w: np.ndarray, quantized: Int4Weights, channel_weight: np.ndarray | None = None
) -> float:
    """``Σ_j channel_weight_j·(deq_jn - w_jn)²`` averaged over the columns ``n``: the expected
    squared error of one output of ``X·W`` with uncorrelated channels of ``E[X_j²] =
    channel_weight_j`` (None: 1 each)."""
    w = np.asarray(w, dtype=np.float64)
    c = _channel_weight(channel_weight, w.shape[0])
    return float(np.mean(c @ (quantized.dequantize() - w) ** 2))


def awq_scales(absmax: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^a``, normalised to a geometric mean of 1 over the live channels; a
    channel without values (max 0) takes the smallest live scale, so that its weights widen no
    group's range more than they must."""
    absmax = np.nan_to_num(np.asarray(absmax, dtype=np.float64), nan=0.0)
    live = absmax > 0
    if not live.any():
        return np.ones(len(absmax))
    s = np.where(live, absmax, 1.0) ** alpha
    s = s / np.exp(np.mean(np.log(s[live])))
    return np.where(live, s, s[live].min())


@dataclass(frozen=True)
class AwqChoice:
    """The 4-bit quantization chosen for the dense layers reading one tensor: ``alpha`` None
    without scaling (``scales`` ones); ``weights`` each layer's codes of ``diag(s)·W_r``, clip
    ratios searched; errors as :func:`estimate_w4_error`."""

    alpha: float | None
    scales: np.ndarray  # s per input channel: the layers read X / s
    weights: tuple[Int4Weights, ...]
    error: float  # the estimated error of the choice
    unscaled: float  # and without scaling (clipping searched too)
    errors: dict[float, float] = field(repr=False)  # every alpha's estimate

    @property
    def scaled(self) -> bool:
        return self.alpha is not None


def _check_rows(x: DenseInput, weights: Sequence[np.ndarray]) -> list[np.ndarray]:
    arrays = [np.asarray(w, dtype=np.float64) for w in weights]
    for w in arrays:
        if w.ndim != 2 or w.shape[0] != len(x.lo):
            raise RangeprofError(
                f"a weight of shape {w.shape} for a tensor of {len(x.lo)} channels"
            )
    return arrays


def _scaled_error(
    mean_squares: np.ndarray,
    weights: Sequence[np.ndarray],
    s: np.ndarray,
    quantized: Sequence[Int4Weights],
) -> float:
    """The mean over every output column of ``Σ_j E[X_j²]/s_j²·(deq - s_j·W_jn)²``."""
    total = sum(
        weighted_error(w * s[:, None], q, mean_squares / s**2) * w.shape[1]
        for w, q in zip(weights, quantized, strict=True)
    )
    return float(total / sum(w.shape[1] for w in weights))


def _candidate(
    mean_squares: np.ndarray,
    weights: Sequence[np.ndarray],
    s: np.ndarray,
    group_size: int,
    symmetric: bool,
    ratios: Sequence[float],
) -> tuple[tuple[Int4Weights, ...], float]:
    quantized = tuple(
        search_clip(w * s[:, None], group_size, symmetric, mean_squares / s**2, ratios)
        for w in weights
    )
    return quantized, _scaled_error(mean_squares, weights, s, quantized)


def choose_awq(
    x: DenseInput,
    weights: Sequence[np.ndarray],
    group_size: int,
    symmetric: bool,
    alphas: Sequence[float] = ALPHAS,
    ratios: Sequence[float] = RATIOS,
) -> AwqChoice:
    """The scaling (an ``alpha`` of ``alphas``, or none) and clipping of the smallest estimated
    output error for the dense layers of ``weights`` (each ``[K, N_r]``) reading ``x``."""
    arrays = _check_rows(x, weights)
    mean_squares = x.channel_mean_squares()
    ones = np.ones(len(x.lo))
    plain, unscaled = _candidate(mean_squares, arrays, ones, group_size, symmetric, ratios)
    errors, chosen = {}, {}
    for alpha in alphas:
        s = awq_scales(x.absmax, alpha)
        chosen[alpha] = (s, *_candidate(mean_squares, arrays, s, group_size, symmetric, ratios))
        errors[alpha] = chosen[alpha][2]
    best = min(errors, key=errors.__getitem__, default=None)
    if best is None or not errors[best] < unscaled:
        return AwqChoice(None, ones, plain, unscaled, unscaled, errors)
    s, quantized, error = chosen[best]
    return AwqChoice(best, s, quantized, error, unscaled, errors)


def estimate_w4_error(x: DenseInput, weights: Sequence[np.ndarray], choice: AwqChoice) -> float:
    """The expected squared error of one output value (mean over the output columns of every
    layer of ``weights`` reading ``x``) with the weights in 4 bits as ``choice`` says and ``x``
    in float (the module doc's model)."""
    return _scaled_error(
        x.channel_mean_squares(), _check_rows(x, weights), choice.scales, choice.weights
    )
