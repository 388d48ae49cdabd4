"""Quantization parameters from stored statistics, without touching the data again.

Every tensor entry of a profile document gets a scale ``s`` and zero point ``z`` for
``q = round(x / s) + z`` (:class:`QParams`); :func:`calibrate` builds the QPARAMS document
(``profiler/schemas/qparams.schema.json``).

**Clip range.** A method picks a clip range ``[lo, hi]`` from the tensor's statistics:

* ``max``: the exact min and max.
* ``percentile``: symmetric scheme: the ``p``-th percentile of ``|x|``; asymmetric: the
  ``(100 - p) / 2`` and ``100 - (100 - p) / 2`` percentiles of ``x``. Read off the histogram
  with linear interpolation inside a bin.
* ``entropy``: TensorRT's KL-divergence search on the ``|x|`` histogram (:func:`_kl_threshold`),
  with the zero bin given its neighbour's count (the spike of a ReLU output's zeros would
  otherwise dominate the divergence: digits_cnn INT8 output SQNR 12 → 35 dB). The asymmetric
  scheme takes the symmetric threshold intersected with ``[min, max]``.
* ``mse``: the range minimising the expected squared quantization error
  (:func:`_mse_threshold`, :func:`_mse_range`).

Percentile, entropy and mse need a histogram; ``max`` alone works without one. Where the histogram
is too coarse for entropy (fewer ``|x|`` bins than quantization levels: 128 for 8 bits, 32768 for
int16) the tensor falls back to ``max`` and its ``note`` says so.

**Scale and zero point.** The range is widened to hold 0 (``lo <= 0 <= hi``: integer-only
kernels need 0 exactly representable, e.g. for padding). Then

* symmetric: ``s = max(-lo, hi) / h`` with ``h = 127`` (8 bits) or ``32767`` (int16), values
  clamped to ``z ± h`` — the restricted range, so that ``-x`` quantizes to ``-q``. ``z = 0`` for
  int8 and int16; for **uint8** ``z = 128`` with the same ``s = α/127``: the int8 grid shifted by
  128 (``q_u8 = q_i8 + 128``), covering ``[-α, α]`` exactly. (ONNX Runtime's uint8 symmetric
  choice, ``s = 2α/255``, would leave ``α`` itself out of range.)
* asymmetric: ``s = (hi - lo) / (qmax - qmin)``, ``z = round(qmin - lo / s)`` clamped to
  ``[qmin, qmax]``.
* ``power_of_two``: ``s`` is rounded up to a power of two (shift-only requantization); the
  symmetric zero point stays, the asymmetric one is recomputed and, as the wider grid leaves
  slack, moved where the whole ``[lo, hi]`` stays representable.

``range`` records what the grid then represents: ``[(q_lo - z) s, (q_hi - z) s]``.

**Degenerate tensors** (all zeros, no finite values: a zero-width range, so a scale below
float32's smallest normal number) get ``s = 1.0`` with the symmetric zero point, or ``z = 0``
for the asymmetric scheme — ONNX Runtime's rule: any scale represents 0, and 1.0 keeps
requantization multipliers finite.

**Per-channel** (``granularity="per-channel"``) applies to weights and other static tensors
(weight transforms, such as a Gemm's transposed weight) whose entry has per-channel min/max:
each channel uses ``max`` on its own range (``s_c = max|W_c| / 127`` for int8 symmetric),
whatever the method, since the histogram is per tensor. Everything else stays per-tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from itertools import accumulate
from pathlib import Path

import numpy as np

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.statistics import Histogram, TensorStats, canonical_exponent

SCHEMA_VERSION = "1.1"
METHODS = ("max", "percentile", "entropy", "mse")
SCHEMES = ("sym", "asym")
GRANULARITIES = ("per-tensor", "per-channel")
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
# TensorRT's entropy calibration runs on 2048 |x| bins for 128 levels.
_KL_BINS_PER_LEVEL = 16
# Mass given to an empty reference bin that receives clipped outliers (as the reference
# implementations' smoothing does), so that clipping into empty space costs a finite penalty.
_KL_EPS = 1e-4


@dataclass(frozen=True)
class IntType:
    """An integer target type: its full range, and the symmetric scheme's half-width."""

    qmin: int
    qmax: int

    @property
    def half(self) -> int:
        return (self.qmax - self.qmin) // 2

    @property
    def sym_zero(self) -> int:
        return (self.qmin + self.qmax + 1) // 2


DTYPES = {
    "int8": IntType(-128, 127),
    "uint8": IntType(0, 255),
    "int16": IntType(-32768, 32767),
}


@dataclass(frozen=True)
class CalibrationOptions:
    """How to turn statistics into quantization parameters; validated on construction."""

    method: str = "max"
    percentile: float = 99.99
    scheme: str = "sym"
    dtype: str = "int8"
    granularity: str = "per-tensor"
    power_of_two: bool = False

    def __post_init__(self):
        _check_choice("calibration method", self.method, METHODS)
        _check_choice("quantization scheme", self.scheme, SCHEMES)
        _check_choice("quantized dtype", self.dtype, tuple(DTYPES))
        _check_choice("granularity", self.granularity, GRANULARITIES)
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 100:
            raise RangeprofError(f"percentile must be a number in (0, 100], got {p!r}")
        if not isinstance(self.power_of_two, bool):
            raise RangeprofError(f"power_of_two must be true or false, got {self.power_of_two!r}")

    @property
    def int_type(self) -> IntType:
        return DTYPES[self.dtype]

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "percentile": float(self.percentile),
            "scheme": self.scheme,
            "dtype": self.dtype,
            "granularity": self.granularity,
            "power_of_two": self.power_of_two,
        }


def _check_choice(what: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise RangeprofError(f"unknown {what} {value!r}; expected one of {', '.join(choices)}")


@dataclass(frozen=True)
class QParams:
    """Quantization parameters of one tensor; per-channel ones hold one value per channel."""

    profile_id: str
    source_tensor: str | None
    kind: str
    dtype: str
    method: str  # the method applied (see ``note`` when it differs from the requested one)
    scale: float | tuple[float, ...]
    zero_point: int | tuple[int, ...]
    axis: int | None
    range: tuple[float, float] | tuple[tuple[float, ...], tuple[float, ...]]
    note: str | None = None

    @property
    def threshold(self) -> float:
        """The symmetric clip threshold ``max(|lo|, |hi|)`` of a per-tensor range."""
        lo, hi = self.range
        return max(-lo, hi)

    def to_json(self) -> dict:
        listed = self.axis is not None
        return {
            "profile_id": self.profile_id,
            "source_tensor": self.source_tensor,
            "kind": self.kind,
            "dtype": self.dtype,
            "method": self.method,
            "scale": list(self.scale) if listed else self.scale,
            "zero_point": list(self.zero_point) if listed else self.zero_point,
            "axis": self.axis,
            "range": [list(r) for r in self.range] if listed else list(self.range),
            "note": self.note,
        }


def schema() -> dict:
    text = resources.files("rangeprof.profiler").joinpath("schemas/qparams.schema.json").read_text()
    return json.loads(text)


def read_qparams(path: Path) -> dict:
    """The QPARAMS document at ``path``, checked against its schema."""
    import jsonschema

    try:
        doc = json.loads(Path(path).read_text())
        jsonschema.validate(doc, schema())
    except OSError as err:
        raise RangeprofError(f"{path}: {err.strerror}") from None
    except (ValueError, jsonschema.ValidationError) as err:
        detail = getattr(err, "message", str(err)).splitlines()[0]
        raise RangeprofError(f"{path}: not a QPARAMS document ({detail})") from None
    return doc


def calibrate(profile: dict, options: CalibrationOptions) -> dict:
    """The QPARAMS document of a profile document: one record per tensor entry."""
    return {
        "schema_version": SCHEMA_VERSION,
        "model": dict(profile["model"]),
        "options": options.to_json(),
        "qparams": [qparams_for(entry, options).to_json() for entry in profile["tensors"]],
    }


def qparams_for(entry: dict, options: CalibrationOptions) -> QParams:
    """Quantization parameters of one profile tensor entry."""
    stats = TensorStats.from_json(entry)
    t = options.int_type
    common = {
        "profile_id": entry["profile_id"],
        "source_tensor": entry["source_tensor"],
        "kind": entry["kind"],
        "dtype": options.dtype,
    }
    channels = stats.per_channel
    # Static tensors are weights and weight transforms (e.g. a Gemm's transposed weight).
    weight = entry["kind"] == "weight" or entry.get("static", False)
    if options.granularity == "per-channel" and weight and channels:
        grids = [
            _grid(*_with_zero(lo, hi), t, options)
            for lo, hi in zip(channels.min, channels.max, strict=True)
        ]
        note = None if options.method == "max" else "per-channel: max of each channel's range"
        return QParams(
            **common,
            method="max",
            scale=tuple(g.scale for g in grids),
            zero_point=tuple(g.zero_point for g in grids),
            axis=channels.axis,
            range=(tuple(g.lo for g in grids), tuple(g.hi for g in grids)),
            note=note,
        )
    method, lo, hi, note = _clip_range(stats, options, entry["profile_id"])
    grid = _grid(*_with_zero(lo, hi), t, options)
    if grid.degenerate:
        note = "zero-width range (all zeros or no finite values): scale 1.0"
    return QParams(
        **common,
        method=method,
        scale=grid.scale,
        zero_point=grid.zero_point,
        axis=None,
        range=(grid.lo, grid.hi),
        note=note,
    )


def _with_zero(lo: float | None, hi: float | None) -> tuple[float, float]:
    """The clip range widened to hold 0; no finite values gives ``[0, 0]``."""
    return min(lo or 0.0, 0.0), max(hi or 0.0, 0.0)


@dataclass(frozen=True)
class _Grid:
    scale: float
    zero_point: int
    lo: float
    hi: float
    degenerate: bool


def _grid(lo: float, hi: float, t: IntType, options: CalibrationOptions) -> _Grid:
    """Scale and zero point for a clip range with ``lo <= 0 <= hi`` (see the module doc)."""
    sym = options.scheme == "sym"
    scale = max(-lo, hi) / t.half if sym else (hi - lo) / (t.qmax - t.qmin)
    degenerate = scale < _FLOAT32_TINY
    if degenerate:
        scale = 1.0
    elif options.power_of_two:
        scale = _power_of_two_up(scale)
    if sym:
        zero = t.sym_zero
        q_lo, q_hi = zero - t.half, zero + t.half
    else:
        zero = 0 if degenerate else _zero_point(lo, hi, scale, t)
        q_lo, q_hi = t.qmin, t.qmax
    return _Grid(scale, zero, (q_lo - zero) * scale, (q_hi - zero) * scale, degenerate)


def _power_of_two_up(scale: float) -> float:
    mantissa, exponent = math.frexp(scale)
    return scale if mantissa == 0.5 else math.ldexp(1.0, exponent)


def _zero_point(lo: float, hi: float, scale: float, t: IntType) -> int:
    zero = round(t.qmin - lo / scale)
    # Zero points with (qmin - z) s <= lo and (qmax - z) s >= hi: all of [lo, hi] on the grid.
    # Only a grid with slack (a scale rounded up) has them, bar an exactly integral qmin - lo/s.
    low, high = math.ceil(t.qmin - lo / scale), math.floor(t.qmax - hi / scale)
    if low <= high:
        zero = min(max(zero, low), high)
    return min(max(zero, t.qmin), t.qmax)


def _clip_range(
    stats: TensorStats, options: CalibrationOptions, profile_id: str
) -> tuple[str, float | None, float | None, str | None]:
    """(method applied, lo, hi, note) for a per-tensor clip range."""
    method = options.method
    if method == "max" or stats.min is None or stats.min == stats.max == 0:
        return "max", stats.min, stats.max, None
    hist = stats.histogram
    if hist is None:
        raise RangeprofError(
            f"tensor {profile_id!r} has no histogram (profiled with --bins 0?): "
            f"calibration method {method!r} needs one; only 'max' works without"
        )
    sym = options.scheme == "sym"
    amax = max(-stats.min, stats.max)
    if method == "percentile":
        if sym:
            counts, width = _folded(hist, amax)
            alpha = min(_quantile(counts, 0.0, width, options.percentile / 100), amax)
            return method, -alpha, alpha, None
        tail = (100 - options.percentile) / 200
        lo = _quantile(hist.counts, hist.lo, hist.width, tail) if tail else stats.min
        hi = _quantile(hist.counts, hist.lo, hist.width, 1 - tail)
        return method, max(lo, stats.min), min(hi, stats.max), None
    if method == "entropy":
        levels = options.int_type.half + 1
        counts, width = _folded(hist, amax)
        if len(counts) < levels:
            note = (
                f"histogram resolves {len(counts)} |x| bins, fewer than the {levels} levels "
                "entropy needs: used max"
            )
            return "max", stats.min, stats.max, note
        # The zero bin of a ReLU output holds a large share of the mass; counted as is, spreading
        # it over a group of Q's bins dominates the divergence and drives the threshold far
        # down. Like NVIDIA's pytorch-quantization, give it its neighbour's count.
        counts = [counts[1], *counts[1:]]
        alpha = min(_kl_threshold(counts, width, levels), amax)
        if sym:
            return method, -alpha, alpha, None
        return method, max(stats.min, -alpha), min(stats.max, alpha), None
    if sym:
        counts, width = _folded(hist, amax)
        alpha = _mse_threshold(counts, width, amax, options.int_type.half)
        return method, -alpha, alpha, None
    lo, hi = _mse_range(hist, stats.min, stats.max, options.int_type)
    return method, lo, hi, None


def _folded(hist: Histogram, amax: float) -> tuple[list[int], float]:
    """The histogram of ``|x|`` as (counts from 0, bin width), exact.

    Edges are multiples of the width, so bin ``i < 0`` folds onto bin ``-i - 1``; the result is
    coarsened (exactly, ``j >> k``) to fit ``hist.bins`` bins over ``[0, amax]``.
    """
    exponent = max(hist.exponent, canonical_exponent(0.0, amax, hist.bins))
    counts = [0] * (math.floor(math.ldexp(amax, -exponent)) + 1)
    shift = exponent - hist.exponent
    for i, c in enumerate(hist.counts, start=hist.offset):
        counts[(i if i >= 0 else -i - 1) >> shift] += c
    return counts, math.ldexp(1.0, exponent)


def _quantile(counts: Sequence[int], first_edge: float, width: float, fraction: float) -> float:
    """The value below which ``fraction`` of the mass lies, linear inside a bin."""
    cumulative = np.cumsum(np.asarray(counts, dtype=np.float64))
    target = fraction * cumulative[-1]
    k = min(int(np.searchsorted(cumulative, target)), len(counts) - 1)
    inside = (target - (cumulative[k] - counts[k])) / counts[k]
    return float(first_edge + (k + inside) * width)


def _kl_threshold(counts: Sequence[int], width: float, levels: int) -> float:
    """TensorRT's entropy calibration on a ``|x|`` histogram: the threshold minimising
    ``KL(P || Q)``.

    The histogram is first split evenly to at least ``16 * levels`` bins (2048 for 8 bits, the
    resolution TensorRT's own histogram has; a signed histogram folds into fewer). For each
    candidate ``i`` in ``levels..n`` bins: ``P`` is the first ``i`` bins with all mass beyond
    added to the last one; ``Q`` merges those ``i`` bins (without the outliers) into ``levels``
    equal groups and spreads each group's mass evenly over its non-empty bins. A last bin that is
    empty in ``Q`` but receives outliers in ``P`` gets ``_KL_EPS``; candidates with no mass at all
    below them are skipped. The threshold is the upper edge of bin ``i - 1``.

    All candidates are evaluated at once from prefix sums: with ``S_l``, ``C_l`` the mass and
    non-empty bin count of group ``l``, ``T`` the outlier mass and ``N`` the total,
    ``N KL = sum P log P - sum_l S_l log(S_l / C_l) - T log Q_last + N log(sum Q / N)``.
    """
    split = 1
    while len(counts) * split < _KL_BINS_PER_LEVEL * levels:
        split *= 2
    f = np.repeat(np.asarray(counts, dtype=np.float64) / split, split)
    n, total = len(f), f.sum()
    cum = np.concatenate([[0.0], np.cumsum(f)])
    cum_nonzero = np.concatenate([[0], np.cumsum(f > 0)])
    cum_plogp = np.concatenate([[0.0], np.cumsum(_xlogx(f))])

    i = np.arange(levels, n + 1)
    groups = np.arange(levels + 1)
    bounds = -((-groups[None, :] * i[:, None]) // levels)  # ceil(l * i / levels)
    mass = np.diff(cum[bounds], axis=1)
    nonzero = np.maximum(np.diff(cum_nonzero[bounds], axis=1), 1)
    mass_logq = np.sum(_xlogx(mass) - mass * np.log(nonzero), axis=1)

    outliers = total - cum[i]
    last = f[i - 1]
    last_q = np.where(last > 0, mass[:, -1] / nonzero[:, -1], _KL_EPS)
    q_total = cum[i] + np.where(last > 0, 0.0, _KL_EPS)
    plogp = cum_plogp[i - 1] + _xlogx(last + outliers)
    kl = (plogp - mass_logq - outliers * np.log(last_q)) / total + np.log(q_total / total)
    kl[cum[i] == 0] = np.inf
    return float(i[np.argmin(kl)]) * width / split


def _xlogx(x: np.ndarray) -> np.ndarray:
    return x * np.log(np.where(x > 0, x, 1.0))


def _mse_threshold(counts: list[int], width: float, amax: float, half: int) -> float:
    """The symmetric threshold minimising the expected squared error on a ``|x|`` histogram.

    Candidates are the bin edges ``k * width`` (the top one clamped to the max). Bins whose
    centre lies past the threshold saturate: error ``(c - α)^2``; the rest round on the grid:
    its expectation ``s^2 / 12`` (values are not aligned with the grid; rounding the bin centres
    themselves would alias with the bin grid), ``s = α / half``.
    """
    edges = np.arange(1, len(counts) + 1)
    alpha = np.minimum(edges * width, amax)
    inside = np.cumsum(np.asarray(counts, dtype=np.float64))
    error = (alpha / half) ** 2 / 12 * inside + _clip_error(counts, 0, edges, True) * width**2
    return float(alpha[np.argmin(error)])


def _mse_range(hist: Histogram, vmin: float, vmax: float, t: IntType) -> tuple[float, float]:
    """The asymmetric clip range ``[lo, hi]`` minimising the expected squared error.

    Candidates: every bin edge at or below 0 for ``lo`` times every bin edge at or above 0 for
    ``hi`` (clamped to the data range); the error model is :func:`_mse_threshold`'s with
    ``s = (hi - lo) / (qmax - qmin)``.
    """
    counts, first, n = list(hist.counts), hist.offset, len(hist.counts)
    lo_edges = np.arange(min(0, first), min(0, first + n) + 1)
    hi_edges = np.arange(max(0, first), max(0, first + n) + 1)
    lo = np.clip(lo_edges * hist.width, min(vmin, 0.0), 0.0)
    hi = np.clip(hi_edges * hist.width, 0.0, max(vmax, 0.0))
    cum = np.concatenate([[0.0], np.cumsum(np.asarray(counts, dtype=np.float64))])
    inside = (
        cum[np.clip(hi_edges - first, 0, n)][None, :]
        - cum[np.clip(lo_edges - first, 0, n)][:, None]
    )
    below = _clip_error(counts, first, lo_edges, False) * hist.width**2
    above = _clip_error(counts, first, hi_edges, True) * hist.width**2
    scale = (hi[None, :] - lo[:, None]) / (t.qmax - t.qmin)
    error = scale**2 / 12 * inside + below[:, None] + above[None, :]
    a, b = np.unravel_index(np.argmin(error), error.shape)
    return float(lo[a]), float(hi[b])


def _clip_error(counts: list[int], first: int, edges: np.ndarray, above: bool) -> np.ndarray:
    """For each edge index ``k``: ``sum counts_j (c_j - k)^2`` over the bins ``j`` (numbered from
    ``first``) with centre ``c_j = j + 1/2`` above ``k`` (or below it), in units of width^2.

    With ``t_j = 2j + 1``, ``4 (c_j - k)^2 = t_j^2 - 4k t_j + 4k^2``: prefix sums of ``f``,
    ``f t`` and ``f t^2`` in Python integers stay exact however large counts and indices get.
    """
    counts = [int(c) for c in counts]  # Python ints: the products below outgrow int64
    odd = range(2 * first + 1, 2 * (first + len(counts)) + 1, 2)
    s0 = [0, *accumulate(counts)]
    s1 = [0, *accumulate(f * t for f, t in zip(counts, odd, strict=True))]
    s2 = [0, *accumulate(f * t * t for f, t in zip(counts, odd, strict=True))]
    out = []
    for k in edges.tolist():
        u = min(max(k - first, 0), len(counts))
        if above:
            f0, f1, f2 = s0[-1] - s0[u], s1[-1] - s1[u], s2[-1] - s2[u]
        else:
            f0, f1, f2 = s0[u], s1[u], s2[u]
        out.append((f2 - 4 * k * f1 + 4 * k * k * f0) / 4)
    return np.asarray(out, dtype=np.float64)
