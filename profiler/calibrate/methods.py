"""Quantization parameters from stored statistics, without touching the data again.

Every tensor entry of a profile document gets a scale ``s`` and zero point ``z`` for
``q = round(x / s) + z`` (:class:`QParams`); :func:`calibrate` builds the QPARAMS document
(``profiler/schemas/qparams.schema.json``).

**Clip range.** A method picks a clip range ``[lo, hi]`` from the tensor's statistics:

* ``max``: the exact min and max.
* ``percentile``: symmetric scheme: the ``p``-th percentile of ``|x|``; asymmetric: the
  ``(100 - p) / 2`` and ``100 - (100 - p) / 2`` percentiles of ``x``. Read off the histogram
  with linear interpolation inside a bin.
* ``entropy``: TensorRT's KL-divergence search (:func:`_kl_window`) on the grid the scheme
  builds. Symmetric: on the ``|x|`` histogram, whose ``h + 1`` levels (128 for 8 bits) cover
  ``[0, α]``. Asymmetric: on the signed histogram, widened to hold 0, over windows ``[-t, t]``
  cut to ``[min, max]`` (ONNX Runtime's windows), each quantized to all ``qmax - qmin + 1``
  levels (256 for 8 bits) of the grid it becomes. Searched as the symmetric scheme instead (128
  levels on ``[0, α]`` where a ReLU output's asymmetric grid has 256, so wide ranges looked twice
  as coarse as they are), ppocr_cls's first ReLU outputs, with spiky histograms, were clipped to
  5–18 % of their max: x86 INT8 top-1 80.5 % against 95.75 % FP32, output SQNR 6.4 dB (now
  95.75 %, 21.7 dB). The bin holding 0 gets the mean count of its neighbours: the spike of a
  ReLU output's zeros would otherwise dominate the divergence (digits_cnn INT8 output SQNR 12 →
  38 dB). Windows cover at least 1/16 of the data's extent, as TensorRT's search starts at 128
  of its 2048 bins: searched from 0, data away from 0 (SE-block gates in ``[0.04, 0.94]``)
  collapsed onto their smallest ``|x|``, where a window holds one occupied bin and ``P = Q``.
  Window edges are the histogram's bin edges.
* ``mse``: the range minimising the expected squared quantization error
  (:func:`_mse_threshold`, :func:`_mse_range`).
* ``best`` (not a range method of its own: the choices are :data:`CHOICES`): per tensor, the
  range of max, percentile, entropy and mse whose grid, as built for the scheme and dtype asked
  (zero point and power-of-two rounding included), has the least estimated mean squared error
  (:func:`_expected_error`: ``mse``'s model, saturation past the range and ``s^2 / 12`` inside);
  ties go to the first of them. The record's ``method`` is the winner, its ``note`` every
  method's estimate. The estimate is per tensor, not end to end: on ppocr_cls best takes mse on
  most tensors and percentile on seven hard-swish tensors, where its estimate is 1–6 % lower;
  end to end, mse's ranges there give 1.8 dB more output SQNR (27.9 against 26.1 dB).

Percentile, entropy, mse and best need a histogram; ``max`` alone works without one. Where the
data span fewer histogram bins than entropy's levels (for 8 bits 128, asymmetric 256; int16
32768 or 65536) the tensor falls back to ``max`` and its ``note`` says so.

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

from rangeprof.profiler.calibrate.smoothing import dense_input_stats
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.statistics import Histogram, TensorStats, canonical_exponent

SCHEMA_VERSION = "1.5"
# The clip-range methods; a user may also ask for "best", the one of them that fits each tensor.
METHODS = ("max", "percentile", "entropy", "mse")
CHOICES = (*METHODS, "best")
# The method of qparams read from a QDQ model's own pairs (``rangeprof import-qparams``).
IMPORTED = "qdq"
SCHEMES = ("sym", "asym")
GRANULARITIES = ("per-tensor", "per-channel")
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
# TensorRT's entropy calibration runs on 2048 |x| bins for 128 levels.
_KL_BINS_PER_LEVEL = 16
# TensorRT's search starts at 128 of its 2048 bins: windows cover at least 1/16 of the data.
_KL_MIN_COVER = 16
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
        _check_choice("calibration method", self.method, CHOICES)
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


def calibrate(
    profile: dict,
    options: CalibrationOptions,
    *,
    weights: CalibrationOptions | None = None,
    target: str | None = None,
) -> dict:
    """The QPARAMS document of a profile document: one record per tensor entry. ``weights``,
    when given, are the options of weights and other static tensors (a target's own); the
    document records the ``target`` whose policy chose the options."""

    def options_of(entry: dict) -> CalibrationOptions:
        return weights if is_static(entry) and weights is not None else options

    recorded = options.to_json()
    if target is not None:
        recorded["target"] = target
    if weights is not None:
        recorded["weights"] = {k: v for k, v in weights.to_json().items() if k != "percentile"}
    dense = {k: x.to_json() for k, x in dense_input_stats(profile).items()}
    return {
        "schema_version": SCHEMA_VERSION,
        "model": dict(profile["model"]),
        "options": recorded,
        "qparams": [
            qparams_for(entry, options_of(entry)).to_json() for entry in profile["tensors"]
        ],
        # What a build needs to choose SmoothQuant's scales and weight bits from the document
        # alone, as it would from the profile.
        **({"dense_inputs": dense} if dense else {}),
        **({"moments": moments} if (moments := activation_moments(profile)) else {}),
    }


def activation_moments(profile: dict) -> dict[str, dict[str, float]]:
    """The mean and standard deviation of every activation of a profile document that has
    finite ones, by profileID: the input statistics a policy that chooses weight bits per layer
    reads (:func:`rangeprof.byoc.policy.layer_weight_bits`)."""
    return {
        entry["profile_id"]: {"mean": entry["mean"], "std": entry["std"]}
        for entry in profile["tensors"]
        if not is_static(entry)
        and entry.get("mean") is not None
        and entry.get("std") is not None
        and math.isfinite(entry["mean"])
        and math.isfinite(entry["std"])
    }


def is_static(entry: dict) -> bool:
    """Whether a profile entry is a weight or a weight transform (a Gemm's transposed weight):
    a tensor calibrated on the weights' grid."""
    return entry["kind"] == "weight" or bool(entry.get("static"))


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
    weight = is_static(entry)
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
    return range_qparams(common, method, lo, hi, options, note)


def range_qparams(
    common: dict, method: str, lo: float, hi: float, options: CalibrationOptions, note=None
) -> QParams:
    """The per-tensor qparams of the range ``[lo, hi]`` (widened to hold 0) on ``options``'
    grid; ``common`` names the tensor (profile_id, source_tensor, kind, dtype)."""
    grid = _grid(*_with_zero(lo, hi), options.int_type, options)
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
    if method == "best":
        return _best_range(stats, hist, options)
    return _method_range(method, stats, hist, options)


def _method_range(
    method: str, stats: TensorStats, hist: Histogram, options: CalibrationOptions
) -> tuple[str, float, float, str | None]:
    """(method applied, lo, hi, note) of one of :data:`METHODS` on a tensor with a histogram."""
    sym = options.scheme == "sym"
    amax = max(-stats.min, stats.max)
    if method == "max":
        return method, stats.min, stats.max, None
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
        return _entropy_range(stats, hist, options)
    if sym:
        counts, width = _folded(hist, amax)
        alpha = _mse_threshold(counts, width, amax, options.int_type.half)
        return method, -alpha, alpha, None
    lo, hi = _mse_range(hist, stats.min, stats.max, options.int_type)
    return method, lo, hi, None


def _best_range(
    stats: TensorStats, hist: Histogram, options: CalibrationOptions
) -> tuple[str, float, float, str]:
    """The range of :data:`METHODS` whose grid has the least :func:`_expected_error`; ties go to
    the first in that order (the simpler method)."""
    candidates = {}
    for name in METHODS:
        method, lo, hi, _ = _method_range(name, stats, hist, options)
        if method not in candidates:  # entropy falls back to max on a coarse histogram
            grid = _grid(*_with_zero(lo, hi), options.int_type, options)
            candidates[method] = (_expected_error(hist, grid), lo, hi)
    method = min(candidates, key=lambda name: candidates[name][0])
    errors = ", ".join(f"{name} {error:.3g}" for name, (error, _, _) in candidates.items())
    _, lo, hi = candidates[method]
    return method, lo, hi, f"best of {errors} (estimated mean squared error)"


def _expected_error(hist: Histogram, grid: _Grid) -> float:
    """The mean squared error of quantizing the histogram's values on ``grid``, by
    :func:`_mse_threshold`'s model: a bin whose centre lies past the grid's range saturates, error
    ``(c - edge)^2``; the rest round, ``s^2 / 12``."""
    centres = hist.edges()[:-1] + hist.width / 2
    past = np.maximum(centres - grid.hi, 0.0) + np.maximum(grid.lo - centres, 0.0)
    error = np.where(past > 0, past**2, grid.scale**2 / 12)
    counts = hist.counts.astype(np.float64)
    return float(counts @ error / counts.sum())


def _entropy_range(
    stats: TensorStats, hist: Histogram, options: CalibrationOptions
) -> tuple[str, float, float, str | None]:
    """(method applied, lo, hi, note) of the entropy method (see the module doc)."""
    t = options.int_type
    amax = max(-stats.min, stats.max)
    sym = options.scheme == "sym"
    if sym:
        # The symmetric grid treats both signs alike: its levels are the h + 1 magnitudes
        # 0, s, ..., h s of |x|.
        counts, width = _folded(hist, amax)
        zero, levels = 0, t.half + 1
    else:
        # The asymmetric grid spends all its levels on [lo, hi], whatever the signs there.
        counts, zero, width = _signed(hist, stats.min, stats.max)
        levels = t.qmax - t.qmin + 1
    occupied = np.flatnonzero(counts)
    span = int(occupied[-1] + 1 - occupied[0])
    if span < levels:
        note = (
            f"histogram resolves {span} bins over the data, fewer than the {levels} levels "
            "entropy needs: used max"
        )
        return "max", stats.min, stats.max, note
    a, b = _kl_window(counts, zero, levels)
    if sym:
        alpha = min(b * width, amax)
        return "entropy", -alpha, alpha, None
    return "entropy", max(stats.min, (a - zero) * width), min(stats.max, (b - zero) * width), None


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
    # Never 0 (a fraction that underflows): the search then lands on a bin holding mass.
    target = max(fraction * cumulative[-1], np.finfo(np.float64).tiny)
    k = min(int(np.searchsorted(cumulative, target)), len(counts) - 1)
    inside = (target - (cumulative[k] - counts[k])) / counts[k]
    return float(first_edge + (k + inside) * width)


def _signed(hist: Histogram, vmin: float, vmax: float) -> tuple[np.ndarray, int, float]:
    """The histogram widened to hold 0, as (counts, index of the bin ``[0, w)``, bin width),
    exact: coarsened (``j >> k``) to fit ``hist.bins`` bins over ``[min(vmin, 0), max(vmax, 0)]``
    (data far from 0 would otherwise need any number of empty bins)."""
    lo, hi = min(vmin, 0.0), max(vmax, 0.0)
    exponent = max(hist.exponent, canonical_exponent(lo, hi, hist.bins))
    first = math.floor(math.ldexp(lo, -exponent))
    counts = np.zeros(math.floor(math.ldexp(hi, -exponent)) - first + 1, dtype=np.int64)
    hist.add_into(counts, exponent, first)
    return counts, -first, math.ldexp(1.0, exponent)


def _kl_window(counts: Sequence[int], zero: int, levels: int) -> tuple[int, int]:
    """TensorRT's entropy calibration on windows about 0: the window ``[a, b)``, in bins of
    ``counts`` (bin ``zero`` is ``[0, w)``), minimising ``KL(P || Q)``.

    The bin holding 0 gets the mean count of its neighbours within the data (see the module doc).
    The candidates are the windows ``[zero - k, zero + k)`` cut to the histogram, covering at
    least 1/16 of the data's extent (TensorRT starts its search at 128 of its 2048 bins; on data
    that do not reach 0 a narrower window could hold one occupied bin, where ``P`` and ``Q``
    coincide). The histogram is split evenly to at least ``16 * levels`` bins (2048 for 128
    levels, the resolution TensorRT's own histogram has), and windows of fewer than ``levels`` of
    those are skipped. For each window ``P`` is its bins with the mass below added to the first
    and the mass above to the last; ``Q`` merges the window's bins (without that outer mass) into
    ``levels`` equal groups and spreads each group's mass evenly over its non-empty bins. An end
    bin that is empty in ``Q`` but receives outer mass in ``P`` gets ``_KL_EPS``; windows without
    mass are skipped.

    All candidates are evaluated at once from prefix sums: with ``S_l``, ``C_l`` the mass and
    non-empty bin count of group ``l``, ``L``, ``U`` the mass below and above the window and
    ``N`` the total, ``N KL = sum P log P - sum_l S_l log(S_l / C_l) - L log Q_first
    - U log Q_last + N log(sum Q / N)``.
    """
    f = np.asarray(counts, dtype=np.float64)
    occupied = np.flatnonzero(f)
    first, last = int(occupied[0]), int(occupied[-1])
    if first <= zero <= last:
        f[zero] = np.mean([f[j] for j in (zero - 1, zero + 1) if first <= j <= last])
    k = np.arange(1, max(zero, len(f) - zero) + 1)
    a, b = np.maximum(zero - k, 0), np.minimum(zero + k, len(f))
    covered = np.minimum(b, last + 1) - np.maximum(a, first)
    split = 1
    while len(f) * split < _KL_BINS_PER_LEVEL * levels:
        split *= 2
    keep = ((b - a) * split >= levels) & (covered * _KL_MIN_COVER >= last + 1 - first)
    a, b = a[keep], b[keep]
    f = np.repeat(f / split, split)
    start, stop, total = a * split, b * split, f.sum()

    cum = np.concatenate([[0.0], np.cumsum(f)])
    cum_nonzero = np.concatenate([[0], np.cumsum(f > 0)])
    cum_plogp = np.concatenate([[0.0], np.cumsum(_xlogx(f))])
    groups = np.arange(levels + 1)
    # start + ceil(l * width / levels) for each group edge l
    bounds = start[:, None] - ((-groups[None, :] * (stop - start)[:, None]) // levels)
    mass = np.diff(cum[bounds], axis=1)
    nonzero = np.maximum(np.diff(cum_nonzero[bounds], axis=1), 1)
    mass_logq = np.sum(mass * np.log(np.where(mass > 0, mass, 1.0) / nonzero), axis=1)

    below, above, inside = cum[start], total - cum[stop], cum[stop] - cum[start]
    f_first, f_last = f[start], f[stop - 1]
    q_first = np.where(f_first > 0, mass[:, 0] / nonzero[:, 0], _KL_EPS)
    q_last = np.where(f_last > 0, mass[:, -1] / nonzero[:, -1], _KL_EPS)
    q_total = (
        inside
        + np.where((f_first == 0) & (below > 0), _KL_EPS, 0.0)
        + np.where((f_last == 0) & (above > 0), _KL_EPS, 0.0)
    )
    plogp = (
        cum_plogp[stop]
        - cum_plogp[start]
        + _xlogx(f_first + below)
        - _xlogx(f_first)
        + _xlogx(f_last + above)
        - _xlogx(f_last)
    )
    kl = (plogp - mass_logq - below * np.log(q_first) - above * np.log(q_last)) / total
    kl += np.log(q_total / total)
    kl[inside == 0] = np.inf
    best = np.argmin(kl)
    return int(a[best]), int(b[best])


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
