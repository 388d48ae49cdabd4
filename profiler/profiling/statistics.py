"""Per-tensor statistics as typed records with an exact, associative, commutative merge.

Profiling data in shards and merging the shards' records in any order gives records identical
to a single pass, bit for bit. That needs care in two places:

* **Sums** (for mean and std) are kept as exact integers in units of 2**-1074, the granularity
  of float64, so adding partial sums is exact. Each run (one executor call on one batch)
  contributes its float64 sum, computed by numpy from that batch alone; shards that split the
  data on batch boundaries therefore produce the same partial sums and the same totals.
* **Histograms** have a fixed bin count and power-of-two bin widths, with bins aligned to
  multiples of the width. The exponent and first bin are a function of the data's min and max
  only (:func:`canonical_exponent`): the smallest exponent at which ``[min, max]`` fits in the
  bins. Coarsening from exponent ``e`` to ``e + k`` maps bin ``i`` to ``i >> k`` exactly, so a
  merge re-bins both sides to the canonical exponent of their union without any loss: the result
  is the histogram one pass over all the data would have built.

Only finite values enter min, max, moments and histograms; NaN and inf are counted.
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

DEFAULT_BINS = 2048
# Bin widths never go below 2**-160 (under float32's smallest subnormal), and bin indices stay
# below 2**52 so that float64 computes them exactly.
MIN_EXPONENT = -160
INDEX_BITS = 52
_SUM_SHIFT = 1074  # exact sums are integers in units of 2**-1074


def exact_units(value: float) -> int:
    """A finite float64 as an integer in units of 2**-1074 (exact)."""
    num, den = float(value).as_integer_ratio()
    return num << (_SUM_SHIFT + 1 - den.bit_length())  # den is a power of two


_MAX_UNITS = exact_units(np.finfo(np.float64).max)


def saturated_units(value: float) -> int:
    """:func:`exact_units` of a sum the statistics kernel computed in float64: a float64 tensor
    whose sum or sum of squares left float64's range (values past 1e154) saturates at ±max
    (its min, max and histogram stay exact; only its mean and std are then meaningless)."""
    if math.isfinite(value):
        return exact_units(value)
    return 0 if math.isnan(value) else int(math.copysign(1, value)) * _MAX_UNITS


def units_of(values: np.ndarray) -> list[int]:
    """:func:`saturated_units` of every value of a float64 array, vectorised where that is
    exact: a normal float64 is ``M · 2**(e - 53)`` with ``M`` a 53-bit integer (``frexp``), so
    its units are ``M << (e + 1021)``; per-channel sums are converted run after run."""
    values = np.asarray(values, dtype=np.float64)
    fraction, exponent = np.frexp(values)
    shift = exponent.astype(np.int64) + (_SUM_SHIFT - 53)
    if not (np.isfinite(values).all() and (shift >= 0).all()):  # subnormal, saturated
        return [saturated_units(v) for v in values.tolist()]
    mantissa = np.ldexp(fraction, 53).astype(np.int64)
    return list(map(operator.lshift, mantissa.tolist(), shift.tolist()))


def _exact_sum(values: np.ndarray, square: bool = False) -> int:
    """The exact sum (of squares) of finite float64 values in units of 2**-1074, whatever their
    magnitude (rounded down below the unit)."""
    total = Fraction(0)
    for value in values.tolist():
        total += Fraction(value) ** 2 if square else Fraction(value)
    return math.floor(total * (1 << _SUM_SHIFT))


def canonical_exponent(vmin: float, vmax: float, bins: int) -> int:
    """Smallest exponent ``e`` with ``[vmin, vmax]`` spanning at most ``bins`` bins of width
    ``2**e`` (and bin indices below 2**52). Monotone in the data range, hence merge-consistent."""
    exponent = MIN_EXPONENT
    magnitude = max(abs(vmin), abs(vmax))
    if magnitude > 0:
        exponent = max(exponent, math.frexp(magnitude)[1] - INDEX_BITS)
    span = vmax - vmin
    if span > 0:
        exponent = max(exponent, math.frexp(span / bins)[1] - 1)
    while math.floor(math.ldexp(vmax, -exponent)) - math.floor(math.ldexp(vmin, -exponent)) >= bins:
        exponent += 1
    return exponent


@dataclass(frozen=True, eq=False)
class Histogram:
    """Counts of finite values in bins ``[(offset+k)*w, (offset+k+1)*w)`` with ``w = 2**exponent``.

    ``counts`` starts at the bin holding the minimum and ends at the bin holding the maximum;
    ``bins`` is the capacity that fixes the exponent.
    """

    bins: int
    exponent: int
    offset: int
    counts: np.ndarray  # int64, never mutated

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Histogram):
            return NotImplemented
        return (self.bins, self.exponent, self.offset) == (
            other.bins,
            other.exponent,
            other.offset,
        ) and np.array_equal(self.counts, other.counts)

    __hash__ = None  # mutable-array field: not hashable

    @property
    def width(self) -> float:
        return math.ldexp(1.0, self.exponent)

    @property
    def lo(self) -> float:
        return math.ldexp(float(self.offset), self.exponent)

    @property
    def hi(self) -> float:
        return math.ldexp(float(self.offset + len(self.counts)), self.exponent)

    def edges(self) -> np.ndarray:
        """Bin edges (``len(counts) + 1`` values)."""
        idx = np.arange(self.offset, self.offset + len(self.counts) + 1, dtype=np.float64)
        return np.ldexp(idx, self.exponent)

    @classmethod
    def of(cls, finite: np.ndarray, vmin: float, vmax: float, bins: int) -> Histogram:
        """Histogram of an array of finite values whose min and max are given."""
        exponent = canonical_exponent(vmin, vmax, bins)
        offset = math.floor(math.ldexp(vmin, -exponent))
        # A product with a power of two rounds like ldexp (exact but below float64's normal
        # range), and numpy vectorises it: ldexp is a function call per value.
        scaled = np.asarray(finite, dtype=np.float64).ravel() * math.ldexp(1.0, -exponent)
        index = np.floor(scaled, out=scaled).astype(np.int64) - offset
        length = math.floor(math.ldexp(vmax, -exponent)) - offset + 1
        return cls(bins, exponent, offset, np.bincount(index, minlength=length))

    def add_into(self, total: np.ndarray, exponent: int, offset: int) -> None:
        """Adds these counts to ``total``, bins of ``2**exponent`` (coarser or equal) from
        ``offset``."""
        shift = exponent - self.exponent
        if shift == 0:  # the common case in a long run: the range has settled
            start = self.offset - offset
            total[start : start + len(self.counts)] += self.counts
            return
        index = ((np.arange(len(self.counts), dtype=np.int64) + self.offset) >> shift) - offset
        # Counts stay below 2**53, so float64 weights add them exactly.
        total += np.bincount(index, weights=self.counts, minlength=len(total)).astype(np.int64)

    def merge(self, other: Histogram, vmin: float, vmax: float) -> Histogram:
        """The histogram of both sides' data, whose overall min and max are given."""
        if self.bins != other.bins:
            raise ValueError(f"cannot merge histograms of {self.bins} and {other.bins} bins")
        exponent = canonical_exponent(vmin, vmax, self.bins)
        offset = math.floor(math.ldexp(vmin, -exponent))
        total = np.zeros(math.floor(math.ldexp(vmax, -exponent)) - offset + 1, dtype=np.int64)
        self.add_into(total, exponent, offset)
        other.add_into(total, exponent, offset)
        return Histogram(self.bins, exponent, offset, total)

    def to_json(self) -> dict:
        return {
            "bins": self.bins,
            "exponent": self.exponent,
            "offset": self.offset,
            "lo": self.lo,
            "hi": self.hi,
            "counts": self.counts.tolist(),
        }

    @classmethod
    def from_json(cls, doc: dict) -> Histogram:
        counts = np.asarray(doc["counts"], dtype=np.int64)
        return cls(doc["bins"], doc["exponent"], doc["offset"], counts)


@dataclass(frozen=True, eq=False)
class ChannelRange:
    """Per-channel min and max of finite values along ``axis``; NaN marks a channel without
    finite values (None in JSON and in :attr:`min` / :attr:`max`).

    With channel statistics (``rangeprof profile --channel-stats``) also each channel's exact
    sum and count of finite values, for its mean: sums in units of 2**-1074 as
    :attr:`TensorStats.sum`, so merges are exact in any order. Bias correction from stored
    statistics (:mod:`rangeprof.byoc.bias_correction`) reads the means of region inputs.
    """

    axis: int
    lo: np.ndarray  # float64, never mutated
    hi: np.ndarray
    sums: tuple[int, ...] | None = None  # exact, units of 2**-1074; None: not recorded
    counts: tuple[int, ...] | None = None  # finite values per channel

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChannelRange):
            return NotImplemented
        return (
            self.axis == other.axis
            and np.array_equal(self.lo, other.lo, equal_nan=True)
            and np.array_equal(self.hi, other.hi, equal_nan=True)
            and (self.sums, self.counts) == (other.sums, other.counts)
        )

    __hash__ = None  # mutable-array fields: not hashable

    @property
    def min(self) -> tuple[float | None, ...]:
        return _floats_or_none(self.lo)

    @property
    def max(self) -> tuple[float | None, ...]:
        return _floats_or_none(self.hi)

    @property
    def mean(self) -> tuple[float | None, ...] | None:
        """Each channel's mean of finite values (None: none), or None without sums."""
        if self.sums is None:
            return None
        return tuple(
            float(Fraction(s, n << _SUM_SHIFT)) if n else None
            for s, n in zip(self.sums, self.counts, strict=True)
        )

    def merge(self, other: ChannelRange) -> ChannelRange:
        if self.axis != other.axis or len(self.lo) != len(other.lo):
            raise ValueError("cannot merge per-channel ranges of different layouts")
        sums = counts = None
        if self.sums is not None and other.sums is not None:  # else the means are unknown
            sums = tuple(map(operator.add, self.sums, other.sums))
            counts = tuple(map(operator.add, self.counts, other.counts))
        # fmin / fmax skip NaN: a channel without finite values on one side takes the other's.
        lo, hi = np.fmin(self.lo, other.lo), np.fmax(self.hi, other.hi)
        return ChannelRange(self.axis, lo, hi, sums, counts)

    def to_json(self) -> dict:
        doc = {"axis": self.axis, "min": list(self.min), "max": list(self.max)}
        if self.sums is not None:
            # One shared exponent: the units' trailing zero bits common to every channel are
            # dropped (a sum of float32 activations is then some twenty hex digits, not 270).
            shift = min(((s & -s).bit_length() - 1 for s in self.sums if s), default=0)
            doc["mean"] = list(self.mean)
            doc["count"] = list(self.counts)
            doc["sum"] = {
                "values": [hex(s >> shift) for s in self.sums],
                "unit_exponent": shift - _SUM_SHIFT,
            }
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> ChannelRange:
        # float64 arrays read None as NaN
        lo, hi = (np.array(doc[k], dtype=np.float64) for k in ("min", "max"))
        sums = counts = None
        if "sum" in doc:  # profiles of schema 1.0, or made without channel statistics, lack it
            shift = doc["sum"]["unit_exponent"] + _SUM_SHIFT
            sums = tuple(int(v, 16) << shift for v in doc["sum"]["values"])
            counts = tuple(doc["count"])
        return cls(doc["axis"], lo, hi, sums, counts)


def _floats_or_none(values: np.ndarray) -> tuple[float | None, ...]:
    return tuple(None if math.isnan(v) else v for v in values.tolist())


def _fmin(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _fmax(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass(frozen=True)
class TensorStats:
    """Everything recorded about one tensor; :meth:`merge` is exact (see the module doc)."""

    count: int = 0
    nan_count: int = 0
    inf_count: int = 0
    min: float | None = None
    max: float | None = None
    sum: int = 0  # exact, units of 2**-1074
    sum_sq: int = 0
    histogram: Histogram | None = None
    per_channel: ChannelRange | None = field(default=None)

    @property
    def finite_count(self) -> int:
        return self.count - self.nan_count - self.inf_count

    @property
    def mean(self) -> float | None:
        n = self.finite_count
        return float(Fraction(self.sum, n << _SUM_SHIFT)) if n else None

    @property
    def std(self) -> float | None:
        n = self.finite_count
        if not n:
            return None
        mean = Fraction(self.sum, n << _SUM_SHIFT)
        var = max(Fraction(self.sum_sq, n << _SUM_SHIFT) - mean * mean, Fraction(0))
        if var.numerator.bit_length() - var.denominator.bit_length() < 1000:
            return math.sqrt(float(var))
        return math.sqrt(float(var / (1 << 1024))) * 2.0**512  # float64 values past 1e154

    @classmethod
    def observe(
        cls,
        values: np.ndarray,
        bins: int | None = DEFAULT_BINS,
        channel_axis: int | None = None,
        channel_sums: bool = False,
    ) -> TensorStats:
        """Statistics of one array (one run's value of a tensor); per-channel ranges along
        ``channel_axis``, with each channel's sum and count where ``channel_sums``."""
        flat = values.reshape(-1)
        wide = flat.astype(np.float64)
        with np.errstate(invalid="ignore"):  # inf - inf: the non-finite path below handles it
            total = wide.sum()
        nan_count = inf_count = 0
        finite = flat
        if not math.isfinite(total):
            nan_mask = np.isnan(flat)
            inf_mask = np.isinf(flat)
            nan_count, inf_count = int(nan_mask.sum()), int(inf_mask.sum())
            finite = flat[~(nan_mask | inf_mask)]
            wide = finite.astype(np.float64)
            total = wide.sum()
        if finite.size == 0:
            return cls(count=flat.size, nan_count=nan_count, inf_count=inf_count)
        vmin, vmax = float(finite.min()), float(finite.max())
        # numpy's pairwise sum, not BLAS: deterministic, and no BLAS threads fighting TVM's pool.
        with np.errstate(over="ignore"):
            sum_sq = np.square(wide).sum()
        # Sums of float64 values past 1e154 leave float64's range: exact in integers instead.
        total_units = exact_units(total) if math.isfinite(total) else _exact_sum(wide)
        sum_sq_units = exact_units(sum_sq) if math.isfinite(sum_sq) else _exact_sum(wide, True)
        histogram = Histogram.of(wide, vmin, vmax, bins) if bins else None  # finite, widened
        per_channel = None
        if channel_axis is not None:
            nonfinite = nan_count + inf_count > 0
            per_channel = _channel_range(values, channel_axis, nonfinite, channel_sums)
        return cls(
            count=flat.size,
            nan_count=nan_count,
            inf_count=inf_count,
            min=vmin,
            max=vmax,
            sum=total_units,
            sum_sq=sum_sq_units,
            histogram=histogram,
            per_channel=per_channel,
        )

    def merge(self, other: TensorStats) -> TensorStats:
        vmin, vmax = _fmin(self.min, other.min), _fmax(self.max, other.max)
        if self.histogram is None or other.histogram is None:
            histogram = self.histogram or other.histogram
        else:
            histogram = self.histogram.merge(other.histogram, vmin, vmax)
        if self.per_channel is None or other.per_channel is None:
            per_channel = self.per_channel or other.per_channel
        else:
            per_channel = self.per_channel.merge(other.per_channel)
        return TensorStats(
            count=self.count + other.count,
            nan_count=self.nan_count + other.nan_count,
            inf_count=self.inf_count + other.inf_count,
            min=vmin,
            max=vmax,
            sum=self.sum + other.sum,
            sum_sq=self.sum_sq + other.sum_sq,
            histogram=histogram,
            per_channel=per_channel,
        )

    def to_json(self) -> dict:
        return {
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "std": self.std,
            "count": self.count,
            "nan_count": self.nan_count,
            "inf_count": self.inf_count,
            "moments": {"sum": hex(self.sum), "sum_sq": hex(self.sum_sq), "unit_exponent": -1074},
            "histogram": self.histogram.to_json() if self.histogram else None,
            "per_channel": self.per_channel.to_json() if self.per_channel else None,
        }

    @classmethod
    def from_json(cls, doc: dict) -> TensorStats:
        moments = doc["moments"]
        return cls(
            count=doc["count"],
            nan_count=doc["nan_count"],
            inf_count=doc["inf_count"],
            min=doc["min"],
            max=doc["max"],
            sum=int(moments["sum"], 16),
            sum_sq=int(moments["sum_sq"], 16),
            histogram=Histogram.from_json(doc["histogram"]) if doc.get("histogram") else None,
            per_channel=(
                ChannelRange.from_json(doc["per_channel"]) if doc.get("per_channel") else None
            ),
        )


def _channel_range(values: np.ndarray, axis: int, has_nonfinite: bool, sums: bool) -> ChannelRange:
    axes = tuple(i for i in range(values.ndim) if i != axis)
    finite = values
    if has_nonfinite:
        masked = np.where(np.isfinite(values), values, np.nan)
        with warnings.catch_warnings():  # a channel without finite values is left NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            lo, hi = np.nanmin(masked, axis=axes), np.nanmax(masked, axis=axes)
        finite = np.where(np.isfinite(values), values, 0)
    else:
        lo, hi = values.min(axis=axes), values.max(axis=axes)
    totals = counts = None
    if sums:
        # numpy's reduction over the other axes: a fixed order for a shape, as the kernel's.
        with np.errstate(over="ignore"):
            wide = finite.astype(np.float64).sum(axis=axes)
        totals = tuple(units_of(wide))
        count = np.isfinite(values).sum(axis=axes) if has_nonfinite else None
        size = values.size // max(values.shape[axis], 1)
        counts = tuple(count.tolist()) if count is not None else (size,) * values.shape[axis]
    return ChannelRange(axis, lo.astype(np.float64), hi.astype(np.float64), totals, counts)
