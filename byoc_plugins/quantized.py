"""A model ready to quantize for one plugin: tracked, partitioned, its regions planned.

:func:`quantize_model` is what ``rangeprof build`` and ``rangeprof evaluate`` start from: the
tagged model through the canonical stages of :mod:`rangeprof.profiler.ir.stages` (weights
already absorb batch norms and channel scales, lineage carried by every pass; equalized when the
qparams' profile was), partitioned by the plugin's patterns, each region given its qparams by
profileID. :meth:`QuantizedModel.lower` then gives
the module for any choice of region modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tvm

from rangeprof.profiler.calibrate.methods import calibrate
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.importer import ImportedModel, import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.ir.passes.equalize import NAME as EQUALIZATION
from rangeprof.profiler.ir.stages import canonicalized, partition

from .lowering import lower
from .plugin import Plugin
from .policy import quantize_weights
from .regions import Region, plan_regions


@dataclass
class QuantizedModel:
    imported: ImportedModel
    plugin: Plugin
    partitioned: tvm.IRModule
    regions: list[Region]
    qparams: dict  # the QPARAMS document used
    bias_correction: dict | None = None  # how the biases were corrected (.bias_correction)

    def lower(self, modes: dict[str, str] | None = None, expose: bool = False):
        """The lowered module and the profileIDs of its exposed outputs (:func:`lower`)."""
        return lower(
            self.partitioned, self.regions, self.plugin.policy, modes, expose, self.plugin.external
        )

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
        by_id = {entry["profile_id"]: entry for entry in qparams["qparams"]}
        float_outputs = not self.plugin.policy.integer_outputs
        regions = plan_regions(
            self.partitioned, self.imported.layers, by_id, fp32_fallback, float_outputs, exclude
        )
        return QuantizedModel(self.imported, self.plugin, self.partitioned, regions, qparams)

    def manifest(self) -> dict:
        loaded = self.imported.loaded
        return {
            "model": {"name": loaded.name, "sha256": loaded.sha256},
            "target": self.plugin.name,
            **({"target_options": self.plugin.options} if self.plugin.options else {}),
            "policy": self.plugin.policy.to_json(),
            "calibration": self.qparams.get("options"),
            **({"bias_correction": self.bias_correction} if self.bias_correction else {}),
            "regions": [self._region_json(r) for r in self.regions],
        }

    def _region_json(self, region: Region) -> dict:
        doc = region.to_json()
        fr = region.float_region
        if fr.weight is None:
            return doc
        x_scale = region.input.scale if region.input is not None else None
        _, scales = quantize_weights(
            fr.weight, fr.channel_axis, self.plugin.policy, fr.bias, x_scale
        )
        doc["weight"] = {"dtype": "int8", "axis": fr.channel_axis, "scale": scales.tolist()}
        return doc


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
) -> QuantizedModel:
    """Track ``path``, partition it for ``plugin`` and plan every region from ``qparams``.

    A QDQ model is built as the FP32 model beneath its pairs (the plugin quantizes it itself;
    ``rangeprof import-qparams`` gives its pairs' scales as ``qparams``)."""
    imported = import_onnx(load_model(path, input_shapes, dequantize=True))
    equalize = EQUALIZATION in qparams["model"].get("transforms", [])
    partitioned = partition(canonicalized(imported.mod, equalize), plugin.patterns())
    unplanned = QuantizedModel(imported, plugin, partitioned, [], qparams)
    return unplanned.replanned(qparams, fp32_fallback, exclude)
