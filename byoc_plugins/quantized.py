"""A model ready to quantize for one plugin: tracked, partitioned, its regions planned.

:func:`quantize_model` is what ``rangeprof build`` and ``rangeprof evaluate`` start from: the
tagged model through the canonical stages of :mod:`rangeprof.profiler.ir.stages` (weights
already absorb batch norms and channel scales, lineage carried by every pass; equalized when the
qparams' profile was), partitioned by the plugin's patterns, each region given its qparams by
profileID. :meth:`QuantizedModel.lower` then gives
the module for any choice of region modes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import tvm

from rangeprof.profiler.calibrate.methods import calibrate
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.importer import ImportedModel, import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.ir.passes.equalize import NAME as EQUALIZATION
from rangeprof.profiler.ir.stages import canonicalized, partition

from .lowering import FP32, INT16, W4, default_mode, lower
from .patterns import MATMUL
from .plugin import Plugin
from .policy import WEIGHT_BITS, layer_weight_bits, quantize_weights
from .regions import Region, plan_regions
from .smoothing import Smoothing, dense_stats, smooth
from .weight_only import WeightOnly

Moments = dict[str, tuple[float, float]]  # (mean, std) of activations by profileID


@dataclass
class QuantizedModel:
    imported: ImportedModel
    plugin: Plugin
    partitioned: tvm.IRModule
    regions: list[Region]
    qparams: dict  # the QPARAMS document used
    bias_correction: dict | None = None  # how the biases were corrected (.bias_correction)
    smoothing: Smoothing | None = None  # the dense inputs SmoothQuant (or AWQ) scaled
    weight_only: WeightOnly | None = None  # dense layers' weights in 4 bits
    # Weights the policy gives bits per layer take its narrowest (7), for a budget to widen
    narrowest: bool = False

    def lower(self, modes: dict[str, str] | None = None, expose: bool = False):
        """The lowered module and the profileIDs of its exposed outputs (:func:`lower`)."""
        plugin = self.plugin
        w4a8 = self.weight_only is not None and self.weight_only.activations == "int8"
        return lower(
            self.partitioned, self.regions, plugin.policy, modes, expose, plugin.external,
            plugin.dense_w4a8 if w4a8 else plugin.dense_w4,
        )  # fmt: skip

    def replanned(
        self, qparams: dict, fp32_fallback: bool = False, exclude: tuple[str, ...] = ()
    ) -> QuantizedModel:
        """The same partitioned model with every region planned from ``qparams`` (another
        calibration of the same model needs no new import or partition); regions holding a
        layer ``exclude`` matches stay FP32."""
        sha = self.imported.loaded.sha256
        if qparams["model"]["sha256"] != sha:
            raise RangeprofError(
                f"the qparams are for model {qparams['model']['name']!r} "
                f"(sha256 {qparams['model']['sha256'][:12]}…), not this file ({sha[:12]}…)"
            )
        layers, moments = self.imported.layers, document_moments(qparams)
        if self.smoothing is not None:
            qparams = self.smoothing.qparams(qparams)
            layers = self.smoothing.layers(layers)
        by_id = {entry["profile_id"]: entry for entry in qparams["qparams"]}
        float_outputs = not self.plugin.policy.integer_outputs
        regions = plan_regions(
            self.partitioned, layers, by_id, fp32_fallback, float_outputs, exclude
        )
        stats = dense_stats(qparams) if self.weight_only is not None else {}
        regions = [self._with_weight_bits(r, stats, moments) for r in regions]
        return replace(self, regions=regions, qparams=qparams, bias_correction=None)

    def _with_weight_bits(self, region: Region, stats: dict, moments: Moments) -> Region:
        """``region`` with its weights' bits where the policy chooses them per layer
        (:func:`~.policy.layer_weight_bits`, from ``moments``: the document's of its input, or
        of the tensor a smoothed input scales; with
        ``narrowest``, 7 for every layer, which an accuracy budget widens where it must). Only
        dense convs and matmuls run faster on 7-bit weights (a dot product over input
        channels); depthwise and grouped convs keep 8. With ``weight_only``, every dense
        layer's weights are also given in 4 bits (``stats``: the document's dense inputs), its
        default mode, and 8: it runs on int8 only where a plan widens it for accuracy, which
        7-bit weights would partly give back."""
        fr = region.float_region
        if fr.weight is None or region.fallback:
            return region
        if self.weight_only is not None and fr.kind == MATMUL:
            return replace(region, int4=self._int4(region, stats), weight_bits=8)
        if self.plugin.policy.weight_bits is not None:
            return region
        if fr.attrs.get("groups", 1) != 1:
            return replace(region, weight_bits=8)
        if self.narrowest:
            return replace(region, weight_bits=min(WEIGHT_BITS))
        x, scales = input_statistics(region, moments, self.smoothing)
        bits = layer_weight_bits(
            fr.weight, fr.channel_axis, self.plugin.policy, region.input, region.output, x,
            fr.bias, scales,
        )  # fmt: skip
        return replace(region, weight_bits=bits)

    def _int4(self, region: Region, stats: dict):
        """The region's weights in 4 bits, clipped by its input's stored statistics (its
        source's, divided by the scales, where the input was scaled)."""
        x, scales = input_statistics(region, stats, self.smoothing)
        return self.weight_only.quantize(region.float_region.weight, x, scales)

    def weight_bits(self, region: Region, mode: str) -> int | None:
        """The bits of ``region``'s weights in ``mode`` (None: FP32, or no constant weights);
        int16 activations (the most sensitive layers) take 8 where the policy chooses."""
        if region.float_region.weight is None or mode == FP32:
            return None
        if mode == W4:
            return 4
        bits = 8 if mode == INT16 else region.weight_bits
        return self.plugin.policy.for_layer(bits).weight_bits

    def manifest(self, modes: dict[str, str] | None = None) -> dict:
        """The manifest's model, target, policy and regions, the regions in ``modes`` (by name;
        default int8, FP32 for those without qparams)."""
        modes = {r.name: default_mode(r) for r in self.regions} | (modes or {})
        loaded = self.imported.loaded
        return {
            "model": {"name": loaded.name, "sha256": loaded.sha256},
            "target": self.plugin.name,
            **({"target_options": self.plugin.options} if self.plugin.options else {}),
            "policy": self.plugin.policy.to_json(),
            "calibration": self.qparams.get("options"),
            **({"bias_correction": self.bias_correction} if self.bias_correction else {}),
            **({"smoothing": self.smoothing.to_json()} if self.smoothing else {}),
            **({"weight_only": self.weight_only.to_json()} if self.weight_only else {}),
            "regions": [self._region_json(r, modes[r.name]) for r in self.regions],
        }

    def _region_json(self, region: Region, mode: str) -> dict:
        doc = region.to_json()
        fr = region.float_region
        if fr.weight is None:
            return doc
        bits = self.weight_bits(region, mode)
        if bits == 4:
            w = region.int4  # each column's largest group step stands for its scales
            scale = np.abs(w.scales).max(axis=0).tolist()
            doc["weight"] = {"dtype": "int4", "axis": 1, "scale": scale, "bits": 4}
            doc["weight"]["group_size"] = w.group_size
            return doc
        x_scale = region.input.scale if region.input is not None else None
        policy = self.plugin.policy.for_layer(bits)
        _, scales = quantize_weights(fr.weight, fr.channel_axis, policy, fr.bias, x_scale)
        doc["weight"] = {"dtype": "int8", "axis": fr.channel_axis, "scale": scales.tolist()}
        if bits is not None:
            doc["weight"]["bits"] = bits
        return doc


def input_statistics(
    region: Region, statistics: dict, smoothing: Smoothing | None
) -> tuple[object | None, np.ndarray | None]:
    """``statistics``' entry (moments, dense-input statistics) for ``region``'s input, and
    ``None``; for a smoothed input, whose own profileID's (a folded LayerNorm's) are of its
    values before smoothing or absent (an inserted multiply's), the entry of the tensor it
    smooths and the scales it is divided by."""
    pid = region.input.profile_id
    source = smoothing.source(pid) if smoothing is not None else None
    return (statistics.get(source[0]), source[1]) if source else (statistics.get(pid), None)


def document_moments(qparams: dict) -> Moments:
    """The ``(mean, std)`` of the activations a QPARAMS document carries from its profile
    (none in an imported one)."""
    return {pid: (m["mean"], m["std"]) for pid, m in qparams.get("moments", {}).items()}


def qparams_from_profile(profile: dict, plugin: Plugin, method: str, percentile: float) -> dict:
    """The QPARAMS document a plugin's policy derives from a profile with ``method``: its
    activations' scheme and dtype, and its weights' (symmetric int8) qparams."""
    policy = plugin.policy
    return calibrate(
        profile,
        policy.calibration(method, percentile),
        weights=policy.weight_calibration(),
        target=plugin.name,
    )


def quantize_model(
    path: str | Path,
    qparams: dict,
    plugin: Plugin,
    input_shapes: dict | None = None,
    fp32_fallback: bool = False,
    exclude: tuple[str, ...] = (),
    smooth_quant: bool | None = None,
    smooth_alpha: float | None = None,
    weight_only: WeightOnly | None = None,
    narrowest: bool = False,
) -> QuantizedModel:
    """Track ``path``, partition it for ``plugin`` and plan every region from ``qparams``,
    whose activations' moments let a policy that chooses weight bits per layer narrow them
    (without: 8 bits). Dense layers' inputs are smoothed
    (:func:`~.smoothing.smooth`: ``smooth_quant`` None as the target's policy says, with
    ``smooth_alpha`` or each input's best strength) from the document's statistics;
    ``weight_only``: dense layers' weights in 4 bits, their inputs scaled as AWQ instead;
    ``narrowest``: the narrowest weight bits where the policy chooses per layer (the start of
    an accuracy budget's search: the fastest exact kernels, widened where the budget needs).

    A QDQ model is built as the FP32 model beneath its pairs (the plugin quantizes it itself;
    ``rangeprof import-qparams`` gives its pairs' scales as ``qparams``)."""
    imported = import_onnx(load_model(path, input_shapes, dequantize=True))
    equalize = EQUALIZATION in qparams["model"].get("transforms", [])
    if weight_only is not None and plugin.dense_w4 is None:
        raise RangeprofError(f"--weight-bits 4: target {plugin.name} has no 4-bit dense kernel")
    canonical, smoothing = smooth(
        canonicalized(imported.mod, equalize), qparams, plugin.policy, smooth_quant,
        smooth_alpha, weight_only,
    )  # fmt: skip
    partitioned = partition(canonical, plugin.patterns())
    unplanned = QuantizedModel(
        imported, plugin, partitioned, [], qparams, smoothing=smoothing,
        weight_only=weight_only, narrowest=narrowest,
    )  # fmt: skip
    return unplanned.replanned(qparams, fp32_fallback, exclude)
