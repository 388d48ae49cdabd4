"""SmoothQuant (Xiao et al., 2023) from stored statistics: per-channel smoothing scales of dense
layers, and the migration strength of each, chosen without running any data again.

A dense layer ``Y = X·W`` (``X`` ``[M, K]``, ``W`` ``[K, N]`` constant) computes the same with
``X' = X·diag(1/s)`` and ``W' = diag(s)·W`` for any positive ``s``. An activation channel ``j``
with outliers (``max|X_j|`` far above the others) stretches the per-tensor 8-bit grid of ``X``;
dividing it by ``s_j`` and multiplying row ``j`` of ``W`` by ``s_j`` moves the difficulty into the
weights, which are quantized per output channel. The scales::

    s_j = max|X_j|^a / max|W_j|^(1-a)

(``max|W_j|`` over row ``j`` of every layer reading ``X``: q/k/v projections reading one
LayerNorm share one ``s``). ``a`` is chosen per input from a grid (:data:`ALPHAS`), or "no
smoothing", by the smallest *estimated* output error, from the profile alone:

* ``max|X_j|`` from the input's per-channel ranges (every profile records them for the inputs of
  dense layers, along the axis they sum over), and ``E[X_j²] ≈ ρ·max|X_j|²`` with one ``ρ`` per
  tensor, fitted so that the channels' second moments add up to the tensor's stored one
  (``moments.sum_sq``);
* the activation step ``Δx`` of the smoothed tensor's per-tensor range (its channels' ``[lo_j,
  hi_j] / s_j``): asymmetric uint8 on x86, ``(max(hi') - min(lo')) / 255`` with 0 inside the
  range; symmetric int8 on aarch64, ``max|X'| / 127`` (:data:`X86`, :data:`AARCH64`);
* the weight step of output channel ``n``, symmetric per channel: ``Δw_n = max_j |W'_jn| / 127``.

* clipping on new data: a channel's range was seen on ``n`` values per channel (the profile's
  count over the channels); a new value passes that channel's extreme with probability
  ``1/(n+1)`` per side (order statistics), and the tail beyond is taken exponential with scale
  ``b_j = |extreme_j| / ln(n)`` (an extreme of ``n`` values lies about ``ln n`` scales out).
  A value is clipped only past the smoothed tensor's range, ``g_j`` beyond its channel's own
  extreme (``g_j = 0`` for the channels that set the range): probability
  ``exp(-g_j/b_j)/(n+1)``, mean squared excess ``2·b_j²`` (:func:`clipping`). Smoothing with a
  large ``a`` brings every channel to the range's edge; this term is what stops it there.

Rounding errors are uniform and independent (variance ``Δ²/12``), so the expected squared error
of output ``n`` is::

    E_n = Δx²/12 · Σ_j W'_jn²  +  Δw_n²/12 · Σ_j E[X'_j²]  +  Σ_j c_j · W_jn²

(the activation rounding propagated through ``W'``, the weight rounding times the activations'
per-channel magnitude, and the expected squared clipping ``c_j`` of channel ``j``, in ``X``'s
units, through ``W``; products of errors are of second order). :func:`estimate_error` is the
mean of ``E_n`` over the output channels of every layer reading the input: an expected mean
squared error per output value, comparable with a simulation of the quantized layer on held-out
data (char_gpt: within some 25 % of it, on the safe side: ``benchmarks/smoothquant_error.py``).
An input is smoothed only where the best ``a`` beats no smoothing. The estimate is invariant to
a common factor of ``s``.

The smoothed tensor's range follows from the same statistics (:func:`smoothed_range`): each
channel's ``[lo_j, hi_j] / s_j``, so its qparams need no data either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rangeprof.profiler.profiling.statistics import TensorStats

ALPHAS = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 11))


@dataclass(frozen=True)
class Grid:
    """The integer grids a target quantizes a dense layer on: the activation's per-tensor
    scheme (``asym``: uint8 with a zero point; ``sym``: int8) and the largest weight level
    (symmetric, per output channel)."""

    activation_scheme: str
    weight_max: int = 127

    def activation_step(self, lo: float, hi: float) -> float:
        """The step of a per-tensor grid over ``[lo, hi]`` (max calibration)."""
        if self.activation_scheme == "asym":
            return (max(hi, 0.0) - min(lo, 0.0)) / 255.0
        return max(abs(lo), abs(hi)) / 127.0


X86 = Grid("asym")  # uint8 activations with a zero point, int8 weights
AARCH64 = Grid("sym")  # int8 activations and weights


@dataclass(frozen=True)
class DenseInput:
    """What the profile says of a tensor that dense layers read: each channel's range along the
    axis they sum over, and the tensor's mean square."""

    lo: np.ndarray  # float64 [K]; NaN: a channel without finite values
    hi: np.ndarray
    mean_square: float
    samples: int  # values per channel the ranges were observed on

    @classmethod
    def from_entry(cls, entry: dict) -> DenseInput | None:
        """The statistics of a profile entry, if it has per-channel ranges along its last axis
        (None otherwise: a profile older than schema 1.3, or a tensor no dense layer reads)."""
        channels = entry.get("per_channel")
        shape = entry.get("shape") or []
        if not channels or not shape or channels["axis"] != len(shape) - 1:
            return None
        stats = TensorStats.from_json(entry)
        mean_square = stats.std**2 + stats.mean**2 if stats.finite_count else 0.0
        lo, hi = (np.array(channels[k], dtype=np.float64) for k in ("min", "max"))
        return cls(lo, hi, mean_square, max(stats.count // len(lo), 1))

    def to_json(self) -> dict:
        """What a QPARAMS document keeps of it (``dense_inputs``), so that a build from the
        document alone smooths as a build from the profile does."""

        def values(a: np.ndarray) -> list[float | None]:
            return [None if np.isnan(v) else float(v) for v in a]

        return {
            "min": values(self.lo),
            "max": values(self.hi),
            "mean_square": self.mean_square,
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, doc: dict) -> DenseInput:
        lo, hi = (np.array(doc[k], dtype=np.float64) for k in ("min", "max"))  # None: NaN
        return cls(lo, hi, float(doc["mean_square"]), int(doc["samples"]))

    @property
    def absmax(self) -> np.ndarray:
        """``max|X_j|`` per channel (0 for a channel without finite values)."""
        return np.nan_to_num(np.maximum(np.abs(self.lo), np.abs(self.hi)), nan=0.0)

    def channel_mean_squares(self) -> np.ndarray:
        """``E[X_j²] ≈ ρ·max|X_j|²``, ``ρ`` such that they add up to the tensor's."""
        peaks = self.absmax**2
        total = peaks.sum()
        return peaks * (self.mean_square * len(peaks) / total) if total > 0 else peaks


def smoothing_scales(absmax_x: np.ndarray, absmax_w: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^a / max|W_j|^(1-a)``; 1 where either maximum is 0 (nothing to move)."""
    live = (absmax_x > 0) & (absmax_w > 0)
    x, w = np.where(live, absmax_x, 1.0), np.where(live, absmax_w, 1.0)
    return np.where(live, x**alpha / w ** (1.0 - alpha), 1.0)


def smoothed_range(x: DenseInput, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each channel's range of the smoothed tensor ``X / s`` (``s > 0``)."""
    return x.lo / s, x.hi / s


def per_tensor_range(lo: np.ndarray, hi: np.ndarray) -> tuple[float, float]:
    """The range of a tensor from its channels' (NaN: a channel without finite values)."""
    if np.all(np.isnan(lo)):
        return 0.0, 0.0
    return float(np.nanmin(lo)), float(np.nanmax(hi))


def clipping(x: DenseInput, s: np.ndarray, grid: Grid) -> np.ndarray:
    """Each channel's expected squared clipping error per value (in ``X``'s units) on new data,
    the smoothed tensor quantized on ``grid`` over its calibrated range (the module doc)."""
    lo, hi = per_tensor_range(*smoothed_range(x, s))
    if grid.activation_scheme == "asym":
        top, bottom = max(hi, 0.0), min(lo, 0.0)
    else:
        top = max(abs(lo), abs(hi))
        bottom = -top
    log_n = np.log(max(x.samples, 2))
    total = np.zeros(len(s))
    # Per side: how far beyond the channel's extreme a value may go before it is clipped, and
    # the tail's scale b (the extreme of n values lies some ln(n) scales out).
    for gap, extent in ((top * s - x.hi, x.hi), (x.lo - bottom * s, -x.lo)):
        b = np.nan_to_num(np.maximum(extent, 0.0), nan=0.0) / log_n
        live = b > 0
        b = np.where(live, b, 1.0)
        gap = np.nan_to_num(np.maximum(gap, 0.0), nan=np.inf)
        total += np.where(live, np.exp(-gap / b) * 2.0 * b**2, 0.0)
    return total / (x.samples + 1)


def estimate_error(x: DenseInput, weight: np.ndarray, s: np.ndarray, grid: Grid) -> float:
    """The expected squared error of one output value of ``X·W`` quantized on ``grid`` after
    smoothing by ``s`` (mean over the output channels; the model of the module doc). ``weight``
    is ``[K, N]``: every layer reading ``X``, side by side."""
    weight = weight.astype(np.float64)
    w = weight * s[:, None]
    step_x = grid.activation_step(*per_tensor_range(*smoothed_range(x, s)))
    step_w = np.abs(w).max(axis=0) / grid.weight_max
    activations = step_x**2 / 12.0 * (w**2).sum(axis=0)
    weights = step_w**2 / 12.0 * (x.channel_mean_squares() / s**2).sum()
    clipped = clipping(x, s, grid) @ weight**2
    return float(np.mean(activations + weights + clipped))


@dataclass(frozen=True)
class Choice:
    """The smoothing chosen for one tensor that dense layers read: ``alpha`` None for none."""

    alpha: float | None
    scales: np.ndarray  # s per channel (ones without smoothing)
    error: float  # the estimated error of the choice (:func:`estimate_error`)
    unsmoothed: float  # and without smoothing
    errors: dict[float, float] = field(repr=False)  # every alpha's estimate
    range: tuple[float, float]  # the per-tensor range of the (smoothed) tensor

    @property
    def smoothed(self) -> bool:
        return self.alpha is not None


def choose(
    x: DenseInput, weights: Sequence[np.ndarray], grid: Grid, alphas: Sequence[float] = ALPHAS
) -> Choice:
    """The smoothing of the smallest estimated error for a tensor read by dense layers of
    ``weights`` (each ``[K, N_r]``); one ``alpha`` in ``alphas`` for a global strength."""
    weight = np.concatenate([np.asarray(w, dtype=np.float64) for w in weights], axis=1)
    ones = np.ones(weight.shape[0])
    unsmoothed = estimate_error(x, weight, ones, grid)
    absmax_w = np.abs(weight).max(axis=1)
    errors, scales = {}, {}
    for alpha in alphas:
        scales[alpha] = smoothing_scales(x.absmax, absmax_w, alpha)
        errors[alpha] = estimate_error(x, weight, scales[alpha], grid)
    best = min(errors, key=errors.__getitem__, default=None)
    if best is None or not errors[best] < unsmoothed:
        return Choice(None, ones, unsmoothed, unsmoothed, errors, per_tensor_range(x.lo, x.hi))
    chosen = per_tensor_range(*smoothed_range(x, scales[best]))
    return Choice(best, scales[best], errors[best], unsmoothed, errors, chosen)


@dataclass
class SmoothingPlan:
    """The choice for each tensor dense layers read, by profileID, and why some have none."""

    choices: dict[str, Choice] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def scales(self) -> dict[str, np.ndarray]:
        """The scales of the smoothed tensors (what :class:`~rangeprof.profiler.ir.passes.
        smooth_quant.SmoothQuant` takes)."""
        return {k: c.scales for k, c in self.choices.items() if c.smoothed}

    @property
    def ranges(self) -> dict[str, tuple[float, float]]:
        """The per-tensor range of every smoothed tensor, for its qparams."""
        return {k: c.range for k, c in self.choices.items() if c.smoothed}


def dense_input_stats(profile: dict) -> dict[str, DenseInput]:
    """The :class:`DenseInput` of every activation of a profile document with per-channel
    ranges along its last axis (what dense layers sum over), by profileID."""
    found = {}
    for entry in profile["tensors"]:
        x = None if entry.get("static") else DenseInput.from_entry(entry)
        if x is not None:
            found[entry["profile_id"]] = x
    return found


def plan_smoothing(
    stats: Mapping[str, DenseInput],
    dense_inputs: Mapping[str, Sequence[np.ndarray]],
    grid: Grid,
    alphas: Sequence[float] = ALPHAS,
) -> SmoothingPlan:
    """A :class:`SmoothingPlan` from stored statistics (:func:`dense_input_stats`):
    ``dense_inputs`` maps the profileID of each tensor dense layers read to their weights
    (``[K, N]`` each: ``smooth_quant.dense_inputs`` finds them in the IR)."""
    plan = SmoothingPlan()
    for profile_id, weights in dense_inputs.items():
        x = stats.get(profile_id)
        if x is None:
            plan.skipped[profile_id] = "no per-channel ranges along its last axis in the statistics"
        elif any(np.shape(w)[0] != len(x.lo) for w in weights):
            plan.skipped[profile_id] = f"{len(x.lo)} channels, not its weights' rows"
        else:
            plan.choices[profile_id] = choose(x, weights, grid, alphas)
    return plan
