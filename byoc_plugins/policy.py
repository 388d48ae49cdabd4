"""A target's quantization policy, and the integer arithmetic every target shares.

The formulas (``q = round(x / s) + z``, ``x = s · (q − z)``):

* **Weights** are quantized at build time from the constants the target actually multiplies —
  after batch norms and channel scales folded into them, so not the initial weights the profile
  saw: symmetric, ``s_c = max|W_c| / 127`` per output channel (or one scale per tensor),
  ``z = 0``, values in ``[-127, 127]``; a channel of zeros gets ``s_c = 1``. With
  ``weight_bits=7``, ``s_c = max|W_c| / 63`` and values in ``[-63, 63]`` (still int8): on x86
  without VNNI the kernels then use ``vpmaddubsw``, exact only for such weights and 1.2–1.6×
  faster than ``vpmaddwd`` (onnxruntime's ``reduce_range``, for the same CPUs). A policy
  without ``weight_bits`` (x86 on such CPUs) chooses per layer (:func:`layer_weight_bits`):
  7 where the error they add stays within the output's rounding, else 8.
* **Activations** take the QPARAMS document's scale and zero point for the region's input and
  output profileIDs (``uint8`` or ``int8``; the document's scheme decides ``z``).
* **Zero point**: an activation zero point ``z_x`` is corrected in int32 accumulator units
  (``s_x · s_c``): ``Σ (x_q − z_x) w = Σ x_q w − z_x Σ w``, so the kernels multiply raw ``x_q``
  (padding pads with ``z_x``, which keeps the correction exact at the borders).
* **Bias**: int32 in the same units where the requantization is fixed point; unrounded in a
  float epilogue, ``β_c = b_c / (s_x · s_c)`` added to ``float32(acc)`` — rounding a batch norm's
  shift folded into the bias would move its whole channel by up to ``m_c / 2`` steps.
* **Requantization** by ``m_c = s_x · s_c / s_y``, one of two ways the policy names, then
  ``+ z_y`` and clamped to the output type (and to ``z_y`` from below after a ReLU):

  - ``fixed_point``, as integer-only hardware does (npu): ``m_c = M_c · 2^-S_c`` with ``M_c``
    an int32 in ``[2^30, 2^31)``, ``y = (acc · M_c + 2^(S_c − 1)) >> S_c`` in int64 (round half
    up);
  - ``float``, as CPUs do it fastest (x86, aarch64; XNNPACK's and onnxruntime's choice):
    ``y = round_half_even((float32(acc) + β_c) · float32(m_c))``, IEEE single operations that
    every CPU rounds alike. AVX2 has no 64-bit multiply or shift: the fixed-point epilogue cost
    MobileNetV2's INT8 build 7 % of its time. A region whose accumulator could leave the int32
    range once scaled (``Σ|w_c| · max|x_q − z_x| + |β_c|`` times ``m_c`` ≥ 2^30) keeps fixed point.

  Targets with the same policy compute exactly the same integers (x86 and aarch64 agree bit
  for bit, as x86 with the npu's policy and the npu do).
* ``power_of_two``: every scale is a power of two, so ``M_c = 2^30`` and requantization is a
  shift (shift-only hardware).
* **int16 activations** (``wide_activations``), for the layers an accuracy budget would
  otherwise keep in FP32: the input's 8-bit range on a symmetric int16 grid (``z = 0``) with
  the int8 weights, the accumulator still int32. Its levels are capped so that it cannot
  overflow: ``max_c Σ|w_c| · q_max ≤ 2^30`` (:func:`wide_input`), the bias being within 2^30
  units already — a 3×3×64 conv of typical weights keeps all 32767 levels, 256 times the 8-bit
  resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from rangeprof.profiler.calibrate.methods import CalibrationOptions
from rangeprof.profiler.errors import RangeprofError

WEIGHT_BITS = (7, 8)
FIXED_POINT, FLOAT = "fixed_point", "float"
REQUANTIZE = (FIXED_POINT, FLOAT)
# Scaled accumulators stay this far inside int32, float32 rounding of the scale included.
_FLOAT_LIMIT = 2.0**30
_INT32 = np.iinfo(np.int32)
_RANGES = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-32768, 32767)}
EIGHT_BITS = ("uint8", "int8")


@dataclass(frozen=True)
class QuantPolicy:
    """What a target's integer kernels take."""

    activation_scheme: str = "asym"  # the scheme a profile is calibrated with for this target
    activation_dtype: str = "uint8"
    weight_granularity: str = "per-channel"  # or "per-tensor"
    power_of_two: bool = False
    # Requantize every region output to 8 bits, also where FP32 operators consume it
    # (integer-only hardware). Otherwise such outputs leave as ``s_x · s_c · acc`` in FP32.
    integer_outputs: bool = False
    # 8: weights in [-127, 127]; 7: in [-63, 63]; None: chosen per layer (:meth:`for_layer`)
    weight_bits: int | None = 8
    requantize: str = FIXED_POINT  # or FLOAT (see the module doc)
    # The activation type of layers too sensitive for 8 bits ("int16"), or None: FP32 then.
    wide_activations: str | None = None
    # SmoothQuant dense layers' inputs where the stored statistics say the error drops.
    smooth_quant: bool = True

    def __post_init__(self):
        if self.weight_bits not in (*WEIGHT_BITS, None):
            raise RangeprofError(f"weight bits must be 7 or 8, not {self.weight_bits}")
        if self.requantize not in REQUANTIZE:
            raise RangeprofError(f"requantize must be one of {REQUANTIZE}, not {self.requantize!r}")
        if self.wide_activations not in (None, "int16"):
            raise RangeprofError(f"wide activations must be int16, not {self.wide_activations!r}")

    @property
    def weight_max(self) -> int:
        """The largest quantized weight magnitude (8 bits' where chosen per layer: a layer's
        own is its :meth:`for_layer` policy's)."""
        return 2 ** ((self.weight_bits or 8) - 1) - 1

    def for_layer(self, bits: int | None) -> QuantPolicy:
        """The policy a layer's weights are quantized with: where this one chooses per layer,
        with the layer's ``bits`` (8 when None); else this one."""
        return self if self.weight_bits is not None else replace(self, weight_bits=bits or 8)

    def calibration(
        self,
        method: str = "max",
        percentile: float = 99.99,
        *,
        scheme: str | None = None,
        dtype: str | None = None,
        granularity: str | None = None,
        power_of_two: bool | None = None,
    ) -> CalibrationOptions:
        """Calibration options that give this target's activation qparams from a profile; an
        option given overrides the policy's."""
        return CalibrationOptions(
            method=method,
            percentile=percentile,
            scheme=self.activation_scheme if scheme is None else scheme,
            dtype=self.activation_dtype if dtype is None else dtype,
            granularity=self.weight_granularity if granularity is None else granularity,
            power_of_two=self.power_of_two if power_of_two is None else power_of_two,
        )

    def weight_calibration(self, granularity: str | None = None) -> CalibrationOptions:
        """How this target quantizes weights (symmetric int8, ``max``), for the qparams a
        document shows of them: the build quantizes the constants it multiplies itself."""
        return CalibrationOptions(
            method="max",
            scheme="sym",
            dtype="int8",
            granularity=self.weight_granularity if granularity is None else granularity,
            power_of_two=self.power_of_two,
        )

    def to_json(self) -> dict:
        return {
            "activations": f"{self.activation_scheme} {self.activation_dtype}",
            "weights": f"sym int8 {self.weight_granularity}" + _bits_note(self.weight_bits),
            "bias": "int32",
            "requantize": (
                "float32 scale, round half to even"
                if self.requantize == FLOAT
                else "int32 multiplier + shift"
            )
            + (" (power-of-two scales)" if self.power_of_two else ""),
            **(
                {"sensitive_layers": f"sym {self.wide_activations} activations"}
                if self.wide_activations
                else {}
            ),
        }


def _bits_note(bits: int | None) -> str:
    if bits is None:
        return ", 7-bit ±63 where a layer's error budget allows it, else 8-bit"
    return "" if bits == 8 else f", {bits}-bit ±{2 ** (bits - 1) - 1}"


# Each target's policy, importable without TVM: the service calibrates with them, and each
# plugin (``rangeprof.byoc.<target>``) takes its own from here.
POLICIES = {
    "x86": QuantPolicy(requantize=FLOAT, wide_activations="int16"),
    "aarch64": QuantPolicy(requantize=FLOAT),
    "npu": QuantPolicy(integer_outputs=True, wide_activations="int16", smooth_quant=False),
}
TARGETS = tuple(POLICIES)


@dataclass(frozen=True)
class ActivationQ:
    """Per-tensor qparams of an activation at a region boundary."""

    profile_id: str
    scale: float
    zero_point: int
    dtype: str

    @property
    def qmin(self) -> int:
        return _RANGES[self.dtype][0]

    @property
    def qmax(self) -> int:
        return _RANGES[self.dtype][1]

    @classmethod
    def from_entry(cls, entry: dict) -> ActivationQ:
        """From a QPARAMS document entry; only per-tensor 8-bit entries fit 8-bit kernels."""
        pid = entry["profile_id"]
        if entry["dtype"] not in EIGHT_BITS:
            raise RangeprofError(
                f"qparams of {pid!r} are {entry['dtype']}; 8-bit kernels need int8 or uint8"
            )
        if entry["axis"] is not None:
            raise RangeprofError(f"qparams of activation {pid!r} are per-channel; need per-tensor")
        return cls(pid, float(entry["scale"]), int(entry["zero_point"]), entry["dtype"])

    def symmetric(self, dtype: str = "int8") -> ActivationQ:
        """The same real range ``[s·(qmin − z), s·(qmax − z)]`` on a symmetric ``dtype`` grid
        (``z = 0``, ``s = max(|lo|, |hi|) / qmax``): what a signed kernel operand takes."""
        lo = self.scale * (self.qmin - self.zero_point)
        hi = self.scale * (self.qmax - self.zero_point)
        return ActivationQ(self.profile_id, max(-lo, hi) / _RANGES[dtype][1], 0, dtype)

    def to_json(self) -> dict:
        return {
            "profile_id": self.profile_id,
            "scale": self.scale,
            "zero_point": self.zero_point,
            "dtype": self.dtype,
        }


def _power_of_two_up(scale: np.ndarray) -> np.ndarray:
    return np.exp2(np.ceil(np.log2(scale)))


_BIAS_UNITS = 2.0**30  # of int32's 2^31: room for the input zero point's correction


def quantize_weights(
    w: np.ndarray,
    axis: int,
    policy: QuantPolicy,
    bias: np.ndarray | None = None,
    input_scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(w_q int8, scales float64 per output channel)`` for a float weight whose output
    channels lie along ``axis`` (per-tensor policies repeat one scale).

    With the ``bias`` and the input's scale, a channel's scale is at least what keeps its bias
    within ±2^30 accumulator units (``|b_c| / (s_x · 2^30)``): a channel of near-zero weights
    under a real bias (PP-OCR's detector has them) would otherwise overflow its int32 bias, and
    its products are near zero at either scale."""
    moved = np.moveaxis(w.astype(np.float64), axis, 0).reshape(w.shape[axis], -1)
    amax = np.abs(moved).max(axis=1)
    if policy.weight_granularity == "per-tensor":
        amax = np.full_like(amax, amax.max())
    scales = np.where(amax > 0, amax / policy.weight_max, 1.0)
    if bias is not None and input_scale is not None:
        floor = np.abs(bias.astype(np.float64).reshape(-1)) / (input_scale * _BIAS_UNITS)
        scales = np.maximum(
            scales, floor.max() if policy.weight_granularity == "per-tensor" else floor
        )
    if policy.power_of_two:
        scales = _power_of_two_up(scales)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.round(w / scales.reshape(shape)), -policy.weight_max, policy.weight_max)
    return q.astype(np.int8), scales


def layer_weight_bits(
    w: np.ndarray,
    axis: int,
    policy: QuantPolicy,
    x: ActivationQ,
    y: ActivationQ | None,
    moments: tuple[float, float] | None,
    bias: np.ndarray | None = None,
    input_scales: np.ndarray | None = None,
) -> int:
    """A layer's weight bits where the policy chooses per layer: 7 where the noise 7-bit
    weights add to its output (over 8-bit ones, mean over channels) is within the rounding noise
    of the output's 8-bit grid, ``s_y² / 12``; else 8, also without an output grid or without
    ``moments``, the ``(mean, std)`` of its input in the profile.

    A channel's weight error ``δ_c = ŵ_c − w_c`` adds ``Σ_i δ_ci · x_i`` to its output, of
    mean square ``σ² · Σ δ_ci² + μ² · (Σ δ_ci)²`` for inputs of mean ``μ`` and standard
    deviation ``σ`` uncorrelated about their mean. The layer SQNR lost from 8 to 7 bits that
    this predicts was within 1.5 dB of the measured loss on the layers of ResNet-18 and a
    digits CNN whose outputs are requantized (those leaving in FP32 lose no rounding).

    A smoothed input (SmoothQuant: ``x'_i = x_i / s_i``, the weights' rows multiplied by
    ``s_i``) has no moments of its own in the profile (a folded LayerNorm's are of its values
    before smoothing): ``moments`` are then its source's and ``input_scales``
    the ``s_i``, the error on ``x'_i`` being ``δ_ci / s_i`` on ``x_i``."""
    if y is None or moments is None:
        return 8
    mean, std = moments
    channels = w.shape[axis]
    rows = np.moveaxis(w.astype(np.float64), axis, 0).reshape(channels, -1)

    def noise(bits: int) -> np.ndarray:
        wq, scales = quantize_weights(w, axis, replace(policy, weight_bits=bits), bias, x.scale)
        error = np.moveaxis(wq.astype(np.float64), axis, 0).reshape(channels, -1)
        error = error * scales[:, None] - rows
        if input_scales is not None:  # in the source's units: rows by input channel
            error = (
                error.reshape(channels, len(input_scales), -1) / input_scales[:, None]
            ).reshape(channels, -1)
        return std**2 * np.square(error).sum(axis=1) + mean**2 * np.square(error.sum(axis=1))

    added = float(np.mean(noise(7) - noise(8)))
    return 7 if added <= y.scale**2 / 12 else 8


def wide_input(
    x: ActivationQ, w: np.ndarray, axis: int, policy: QuantPolicy
) -> tuple[ActivationQ, int]:
    """``x``'s range on the policy's wide (int16) symmetric grid and the levels ``q_max`` it
    may use (inputs are clamped to ``±q_max``): at most those that keep ``max_c Σ|w_c| · q_max``
    within 2^30 (weights quantized as the policy does, without the bias floor of
    :func:`quantize_weights`, which can only shrink them)."""
    wq, _ = quantize_weights(w, axis, policy)
    channels = wq.shape[axis]
    sums = np.abs(np.moveaxis(wq.astype(np.int64), axis, 0).reshape(channels, -1)).sum(axis=1)
    wide = x.symmetric(policy.wide_activations)
    levels = min(wide.qmax, int(_BIAS_UNITS // max(int(sums.max()), 1)))
    return replace(wide, scale=wide.scale * wide.qmax / levels), levels


def fixed_point(multiplier: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(M int64, S int64)`` with ``multiplier ≈ M · 2^-S``, ``M`` in ``[2^30, 2^31)``."""
    mantissa, exponent = np.frexp(np.asarray(multiplier, dtype=np.float64))
    m = np.round(mantissa * 2.0**31).astype(np.int64)
    carry = m == 2**31
    m = np.where(carry, 2**30, m)
    shift = 31 - (exponent.astype(np.int64) + carry)
    if np.any(shift < 1):
        raise RangeprofError(f"requantization multiplier {float(np.max(multiplier))} is too large")
    # Tiny multipliers (a scale near zero): keep the shift within int64 arithmetic.
    too_far = shift > 62
    tiny = np.round(np.where(too_far, multiplier, 0.0) * 2.0**62).astype(np.int64)
    m = np.where(too_far, tiny, m)
    return m, np.minimum(shift, 62).astype(np.int64)


def requantize_reference(acc: np.ndarray, m: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """The fixed-point requantization in numpy (int64), before adding the zero point."""
    acc = acc.astype(np.int64)
    return (acc * m + (np.int64(1) << (shift - 1))) >> shift


def float_requantize_reference(
    acc: np.ndarray, multiplier: np.ndarray, offset: np.ndarray | None = None
) -> np.ndarray:
    """The float requantization in numpy, before adding the zero point: ``(acc + β) · m`` in
    float32 (``offset`` is ``β``)."""
    scaled = acc.astype(np.float32)
    if offset is not None:
        scaled = scaled + np.asarray(offset).astype(np.float32)
    scaled = scaled * np.asarray(multiplier).astype(np.float32)
    return np.rint(scaled).astype(np.int64)


def float_requantize_fits(
    w_q: np.ndarray, offset: np.ndarray, axis: int, x: ActivationQ, multiplier: np.ndarray
) -> bool:
    """Whether every scaled accumulator ``(acc_c + β_c) · m_c`` stays well inside int32 (so its
    float rounding converts back exactly): ``|acc_c| ≤ Σ|w_c| · max|x_q − z_x|``, and
    ``offset`` is ``β`` (:func:`float_bias`)."""
    channels = w_q.shape[axis]
    weights = np.moveaxis(np.abs(w_q.astype(np.float64)), axis, 0).reshape(channels, -1)
    largest = max(x.zero_point - x.qmin, x.qmax - x.zero_point)
    bound = weights.sum(axis=1) * largest + np.abs(offset.reshape(channels))
    return bool(np.all(bound * multiplier < _FLOAT_LIMIT))


def float_bias(
    bias: np.ndarray | None, channels: int, x: ActivationQ, w_scales: np.ndarray
) -> np.ndarray:
    """A float epilogue's bias ``β_c = b_c / (s_x · s_c)``, in accumulator units, unrounded."""
    b = np.zeros(channels) if bias is None else bias.astype(np.float64).reshape(channels)
    return b / (x.scale * w_scales)


def int32_bias(
    bias: np.ndarray | None, w_q: np.ndarray, axis: int, x: ActivationQ, w_scales: np.ndarray
) -> np.ndarray:
    """Bias in accumulator units with the input zero point folded in (see the module doc)."""
    channels = w_q.shape[axis]
    b = np.zeros(channels) if bias is None else bias.astype(np.float64).reshape(channels)
    q = np.round(b / (x.scale * w_scales))
    sums = np.moveaxis(w_q.astype(np.int64), axis, 0).reshape(channels, -1).sum(axis=1)
    q = q - x.zero_point * sums
    if np.any(q < _INT32.min) or np.any(q > _INT32.max):
        worst = float(np.max(np.abs(b)))
        raise RangeprofError(f"bias {worst:g} does not fit int32 at input scale {x.scale:g}")
    return q.astype(np.int32)


def output_clamp(out: ActivationQ, clamp: tuple[float, float] | None) -> tuple[int, int]:
    """Integer bounds of the output: the type's range, narrowed by a ReLU / Clip epilogue's
    ``(lo, hi)`` rounded onto the grid."""
    lo, hi = out.qmin, out.qmax
    if clamp is not None:
        lo = max(lo, out.zero_point + math.floor(clamp[0] / out.scale + 0.5))
        if math.isfinite(clamp[1]):
            hi = min(hi, out.zero_point + math.floor(clamp[1] / out.scale + 0.5))
    return lo, hi
