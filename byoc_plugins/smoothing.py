"""SmoothQuant in a build: the scales chosen from the qparams document's stored statistics
(:mod:`rangeprof.profiler.calibrate.smoothing`), folded into the canonical model
(:mod:`rangeprof.profiler.ir.passes.smooth_quant`), and the smoothed tensors' qparams derived
from their smoothed ranges — no data run.

It runs after the canonical stages, just before partitioning: FoldScaleAxis would fold an
inserted ``X · (1/s)`` back into the dense weights it precedes. The error estimate is made on
the target's grid (its activation scheme, its weights' largest level), so a tensor is smoothed
only where that target's INT8 error drops. Where the target chooses weight bits per layer (x86
on AVX2), that grid is its narrowest, 7-bit weights: the bits it prefers, chosen after the
smoothing, for each layer whose error budget allows them (on char_gpt built for AVX2, one more
layer kept the faster 7-bit kernel and bpc fell from 1.3399 to 1.3393; FP32 1.3346). The
smoothed tensors' qparams are ``max`` ranges of their smoothed channels (the estimate's own
model), on the document's activation grid whatever method calibrated the rest: their histograms
were never observed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import tvm

from rangeprof.profiler.calibrate.methods import CalibrationOptions, range_qparams
from rangeprof.profiler.calibrate.smoothing import (
    ALPHAS,
    DenseInput,
    Grid,
    SmoothingPlan,
    plan_smoothing,
)
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.passes.smooth_quant import SMOOTHED, Site, dense_inputs, smooth_quant
from rangeprof.profiler.ir.tagging import LayerRecord

from .policy import WEIGHT_BITS, QuantPolicy
from .weight_only import WeightOnly, plan_awq

SMOOTH_QUANT, AWQ = "smooth_quant", "awq"


def target_grid(policy: QuantPolicy) -> Grid:
    """The grid ``policy``'s kernels quantize a dense layer on: where it chooses weight bits per
    layer, its narrowest."""
    return Grid(policy.activation_scheme, policy.for_layer(min(WEIGHT_BITS)).weight_max)


@dataclass(frozen=True)
class Smoothing:
    """The tensors a build smoothed: the plan (choices, skipped inputs) and where."""

    plan: SmoothingPlan
    sites: dict[str, Site]
    method: str = SMOOTH_QUANT  # or AWQ: the scales chosen by the 4-bit weights' error

    def qparams(self, document: dict) -> dict:
        """``document`` with every smoothed tensor's qparams from its smoothed range (max, on
        the document's activation grid); an inserted multiply's tensor is added."""
        options = document["options"]
        grid = CalibrationOptions(
            method="max",
            scheme=options["scheme"],
            dtype=options["dtype"],
            power_of_two=options["power_of_two"],
        )
        smoothed = {}
        for profile_id, site in self.sites.items():
            lo, hi = self.plan.choices[profile_id].range
            alpha = self.plan.choices[profile_id].alpha
            for tensor_id in site.tensor_ids:
                common = {
                    "profile_id": tensor_id,
                    "source_tensor": None,
                    "kind": "activation",
                    "dtype": options["dtype"],
                }
                note = f"{self.method} (alpha {alpha}): max of the smoothed channels' ranges"
                smoothed[tensor_id] = range_qparams(common, "max", lo, hi, grid, note).to_json()
        kept = [q for q in document["qparams"] if q["profile_id"] not in smoothed]
        for q in document["qparams"]:
            if q["profile_id"] in smoothed:
                smoothed[q["profile_id"]]["source_tensor"] = q["source_tensor"]
        return {**document, "qparams": kept + list(smoothed.values())}

    def source(self, tensor_id: str) -> tuple[str, np.ndarray] | None:
        """For a tensor holding smoothed values, the profileID of the tensor it smooths and the
        scales it is divided by (None: not smoothed)."""
        for profile_id, site in self.sites.items():
            if tensor_id in site.tensor_ids:
                return profile_id, self.plan.choices[profile_id].scales
        return None

    def layers(self, layers: list[LayerRecord]) -> list[LayerRecord]:
        """``layers`` with a record for each inserted multiply, right after its tensor's (the
        build names region boundaries in program order)."""
        inserted = {s.profile_id: s for s in self.sites.values() if not s.folded}
        out = []
        for layer in layers:
            out.append(layer)
            if layer.profile_id in inserted:
                out.append(replace(layer, profile_id=layer.profile_id + SMOOTHED, op="multiply"))
        return out

    def to_json(self) -> dict:
        """What the manifest shows: per smoothed tensor its strength, how it was folded and
        the estimated error against none; and why the other dense inputs were left."""
        choices = self.plan.choices
        unsmoothed = {k: "no strength lowers its estimated error" for k in choices}
        smoothed = {}
        for k, site in self.sites.items():
            del unsmoothed[k]
            smoothed[k] = {
                "alpha": float(choices[k].alpha),
                "folded": "into its LayerNorm" if site.folded else "a multiply inserted",
                "estimated_error_ratio": choices[k].error / choices[k].unsmoothed,
            }
        return {
            "method": self.method,
            "smoothed": smoothed,
            "unsmoothed": unsmoothed | self.plan.skipped,
        }


def dense_stats(document: dict) -> dict[str, DenseInput]:
    """The stored statistics of a QPARAMS document's dense inputs, by profileID."""
    return {k: DenseInput.from_json(v) for k, v in (document.get("dense_inputs") or {}).items()}


def smooth(
    mod: tvm.IRModule,
    document: dict,
    policy: QuantPolicy,
    enabled: bool | None = None,
    alpha: float | None = None,
    weight_only: WeightOnly | None = None,
) -> tuple[tvm.IRModule, Smoothing | None]:
    """The canonical ``mod`` smoothed where the qparams ``document``'s statistics say the
    target's error drops (``enabled`` None: as the policy says; ``alpha``: one strength for
    every tensor, else each tensor's best), and what was done (None: nothing asked). With
    ``weight_only`` (dense layers' weights in 4 bits, activations FP32) the scales are AWQ's,
    chosen by the 4-bit error."""
    if not (policy.smooth_quant if enabled is None else enabled):
        return mod, None
    stats = dense_stats(document)
    if not stats:
        if enabled:
            raise RangeprofError(
                "--smooth-quant: the qparams hold no per-channel statistics of dense layers' "
                "inputs (calibrate them again from a profile of schema 1.3 or later)"
            )
        return mod, None
    if weight_only is not None:
        plan, method = plan_awq(stats, dense_inputs(mod), weight_only), AWQ
    else:
        alphas = ALPHAS if alpha is None else (alpha,)
        plan = plan_smoothing(stats, dense_inputs(mod), target_grid(policy), alphas)
        method = SMOOTH_QUANT
    smoothed, sites = smooth_quant(mod, plan.scales)
    return smoothed, Smoothing(plan, sites, method)
