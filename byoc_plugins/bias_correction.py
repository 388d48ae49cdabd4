"""Empirical bias correction: the per-channel mean shift INT8 puts on each region's output,
measured on calibration data and folded into the region's int32 bias.

Rounding is unbiased on average, but quantized weights are not: ``Σ (W_q − W) x`` has a mean
per output channel that depends on the data (Nagel et al., "Data-Free Quantization", 2019;
AIMET's empirical bias correction). It is measured, not derived from stored statistics, because
no statistic of the FP32 profile holds the INT8 outputs: the calibration data runs once more
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

from .evaluate import Progress, model_data, program
from .lowering import FP32, SHADOW
from .patterns import CONV2D
from .quantized import QuantizedModel

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
    quantized = [r for r in qm.regions if r.fallback is None]
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
