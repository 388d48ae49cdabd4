"""Bias correction: the per-channel mean shift INT8 puts on each region's output, folded into
the region's bias. Two ways to know the shift, one fold (:func:`corrected`), one kind of
record in the manifest or report (``mode``, ``regions`` corrected):

Rounding is unbiased on average, but quantized weights are not: ``Σ (W_q − W) x`` has a mean
per output channel that depends on the data (Nagel et al., "Data-Free Quantization", 2019;
AIMET's empirical bias correction). Only regions with a constant weight (conv2d, matmul) are
corrected; a ``batch_matmul`` of two activations has no weight rounding to correct.

**Stored** (:func:`derive`, ``--bias-correction stored``): no data is run. The expected shift of
the pre-activation is the weights' rounding error against the mean of the input, per output
channel ``c``: ``E[ŷ − y]_c = Σ_{i,kh,kw} (Ŵ − W)[c, i, kh, kw] · E[x_i]`` (over the group's
input channels for a grouped or depthwise conv; ``Σ_k (Ŵ − W)[k, c] · E[x_k]`` for a matmul),
``Ŵ`` the weights as :func:`~.policy.quantize_weights` quantizes them for the region
(:func:`~.lowering.integer_core`'s arguments). ``E[x_i]`` are the per-channel means the profile
holds for the region's input (``rangeprof profile --channel-stats``). First order, as Nagel's
analytic form: a conv's zero padding is ignored (border outputs see fewer inputs, whose mean is
taken as the interior's), and so is the input's own quantization error; the correction goes to
the pre-activation, where the bias is, so a clamp needs no rescaling. A region whose input has
no stored means (a profile without channel statistics, an input whose channel axis is not the
one the region contracts) is left alone and reported.

**Empirical** (:func:`measure`, ``--bias-correction FILE.npz:KEY``): measured, which catches
what the first-order form leaves out, at the cost of running the calibration data once more
through two programs, every region FP32, and every region's INT8 core computed beside it on its
FP32 input (the *isolated* outputs of :mod:`.evaluate`), both exposing every region's output.
Isolated shifts are each layer's own: corrected together, they do not count a shift twice (with
the accumulated outputs, a layer's shift would include what the layers before it pass on, which
their own corrections already remove: digits_cnn's output SQNR fell 6 dB that way, and rises
1-1.5 dB this way).

Per region and output channel ``c``, ``Δ_c = mean(y_fp32) − mean(y_int8)`` over samples and
positions. A region whose output is clamped (a ReLU or Clip epilogue) exposes the clamped value,
whose mean moves by only ``p_c · δ`` when its pre-activation moves by ``δ``, ``p_c`` the share of
outputs strictly inside the clamp: the bias gets ``δ_c = Δ_c / p_c`` (first order), nothing where
``p_c`` is below :data:`MIN_ACTIVE` (a dead channel says nothing about its shift).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rangeprof.profiler.profiling.statistics import ChannelRange

from .evaluate import Progress, model_data, program
from .lowering import FP32, SHADOW
from .patterns import CONV2D
from .policy import QuantPolicy, quantize_weights
from .quantized import QuantizedModel
from .regions import Region

MIN_ACTIVE = 0.01


@dataclass
class _Means:
    fp32: np.ndarray
    int8: np.ndarray
    inside: np.ndarray  # FP32 outputs strictly inside the clamp
    count: int = 0

    @classmethod
    def empty(cls, channels: int) -> _Means:
        return cls(*(np.zeros(channels) for _ in range(3)))


def _channels_last(array: np.ndarray, kind: str) -> np.ndarray:
    """Rows of one output channel's values: NCHW for convs, the last axis for dense layers."""
    moved = np.moveaxis(array, 1, -1) if kind == CONV2D else array
    return moved.reshape(-1, moved.shape[-1]).astype(np.float64)


def measure(
    qm: QuantizedModel,
    data: str,
    samples: int | None = None,
    progress: Progress | None = None,
    compiled: dict | None = None,
) -> dict[str, np.ndarray]:
    """The bias correction ``δ`` per output channel of every quantized region, keyed by the
    region's output profileID (the same whichever plugin partitioned the model), measured on
    ``data`` (a :func:`~rangeprof.profiler.profiling.data.open_data` spec). ``compiled`` is
    :func:`~.evaluate.evaluate`'s program cache: the FP32 program serves both."""
    quantized = _weighted(qm)
    if progress:
        progress("bias correction: compiling", 0, 2)
    compiled = {} if compiled is None else compiled
    reference = program(qm, "fp32", {r.name: FP32 for r in qm.regions}, compiled)
    deployed = program(qm, "shadow", {r.name: SHADOW for r in quantized}, compiled)
    source = model_data(qm, data, samples)
    means: dict[str, _Means] = {}
    done = 0
    for arrays in source.batches():
        inputs = list(arrays.values())
        _, ref_layers = reference.run(inputs)
        _, got_layers = deployed.run(inputs)
        ref_at = dict(zip(reference.ids, ref_layers, strict=True))
        got_at = dict(zip(deployed.ids, got_layers, strict=True))
        for region in quantized:
            kind = region.float_region.kind
            ref = _channels_last(ref_at[region.output_id], kind)
            got = _channels_last(got_at[region.output_id], kind)
            m = means.setdefault(region.output_id, _Means.empty(ref.shape[1]))
            m.fp32 += ref.sum(axis=0)
            m.int8 += got.sum(axis=0)
            lo, hi = region.float_region.clamp or (-np.inf, np.inf)
            m.inside += ((ref > lo) & (ref < hi)).sum(axis=0)
            m.count += ref.shape[0]
        done += len(inputs[0])
        if progress:
            progress("bias correction: measuring", done, source.num_samples)
    corrections = {}
    for output_id, m in means.items():
        active = m.inside / m.count
        shift = (m.fp32 - m.int8) / m.count
        corrections[output_id] = np.where(
            active >= MIN_ACTIVE, shift / np.maximum(active, 1e-12), 0.0
        )
    return corrections


def _weighted(qm: QuantizedModel) -> list[Region]:
    """The INT8 regions with a constant weight: those whose bias corrects weight rounding."""
    return [r for r in qm.regions if r.fallback is None and r.float_region.weight is not None]


def derive(qm: QuantizedModel, profile: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The bias correction ``δ = −E[ŷ − y]`` per output channel of every quantized region with
    a constant weight, from the per-channel means ``profile`` holds for its input (see the
    module doc), keyed by the region's output profileID; and the regions left alone, by name,
    with the reason."""
    entries = {t["profile_id"]: t for t in profile["tensors"]}
    corrections: dict[str, np.ndarray] = {}
    skipped: dict[str, str] = {}
    for region in _weighted(qm):
        # A smoothed input's means are its source tensor's, divided by the smoothing scales.
        pid = region.input.profile_id
        source = qm.smoothing.source(pid) if qm.smoothing is not None else None
        means, why = _input_means(region, entries.get(source[0] if source else pid))
        if means is None:
            skipped[region.name] = why
            continue
        if source is not None:
            means = means / source[1]
        corrections[region.output_id] = -_expected_shift(region, qm.plugin.policy, means)
    return corrections, skipped


def _input_means(region: Region, entry: dict | None) -> tuple[np.ndarray | None, str]:
    """The per-channel means of the region's input along the axis it contracts, or why not."""
    pid = region.input.profile_id
    channels = _record(entry)
    if channels is None or channels.mean is None:
        return None, f"no per-channel means of its input {pid} in the profile"
    fr = region.float_region
    if fr.kind == CONV2D:
        axis, size = 1, fr.weight.shape[1] * fr.attrs["groups"]
    else:  # a matmul contracts the input's last axis with the weight's first
        axis, size = len(entry["shape"]) - 1, fr.weight.shape[0]
    if channels.axis != axis or len(channels.lo) != size:
        return None, f"its input {pid} has means along axis {channels.axis}, not {axis}"
    means = np.array(channels.mean, dtype=np.float64)  # None: a channel without finite values
    if np.isnan(means).any():
        return None, f"a channel of its input {pid} has no finite values"
    return means, ""


def _record(entry: dict | None) -> ChannelRange | None:
    if entry is None or not entry.get("per_channel"):
        return None
    return ChannelRange.from_json(entry["per_channel"])


def _expected_shift(region: Region, policy: QuantPolicy, means: np.ndarray) -> np.ndarray:
    """``E[ŷ − y]`` per output channel: the weights' rounding error against the input means."""
    fr = region.float_region
    policy = policy.for_layer(region.weight_bits)
    wq, scales = quantize_weights(fr.weight, fr.channel_axis, policy, fr.bias, region.input.scale)
    shape = [1] * fr.weight.ndim
    shape[fr.channel_axis] = -1
    error = wq.astype(np.float64) * scales.reshape(shape) - fr.weight.astype(np.float64)
    if fr.kind != CONV2D:
        return means @ error  # [K] · [K, N]
    out_channels, per_group = error.shape[:2]
    groups = fr.attrs["groups"]
    # each output channel sees its group's input channels, at every kernel position
    group = np.arange(out_channels) // (out_channels // groups)
    group_means = means.reshape(groups, per_group)[group]
    return (error.sum(axis=(2, 3)) * group_means).sum(axis=1)


def corrected(
    qm: QuantizedModel, corrections: dict[str, np.ndarray], record: dict
) -> QuantizedModel:
    """``qm`` with each region's float bias moved by its correction (quantized with it);
    ``record`` says in its manifest how the corrections were measured."""
    regions = []
    for region in qm.regions:
        delta = corrections.get(region.output_id) if region.fallback is None else None
        if delta is not None:
            fr = region.float_region
            bias = delta if fr.bias is None else fr.bias.astype(np.float64).reshape(-1) + delta
            dtype = fr.weight.dtype
            region = replace(region, float_region=replace(fr, bias=bias.astype(dtype)))
        regions.append(region)
    return replace(qm, regions=regions, bias_correction=record)
