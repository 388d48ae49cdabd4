"""4-bit weight-only dense layers in a build (``--weight-bits 4``): which regions, their codes,
and the activation-aware scaling of their inputs, all from the qparams document's stored
statistics (:mod:`rangeprof.profiler.calibrate.weight_only` has the numerics).

Every dense region (a matmul with a constant weight) keeps its activations in FP32 and its
weights in groups of ``group_size`` 4-bit codes along the axis it sums over; the target's
``dense_w4`` kernel decodes them in registers (``activations="int8"``: its ``dense_w4a8``
kernel, which quantizes the activations per row at run time and multiplies on the integer
dot-product instruction). Other regions (convolutions, attention's batch
matmuls) stay INT8 as the target quantizes them. A tensor read by dense layers is scaled as AWQ
does where the stored statistics say the 4-bit error drops (the same rewrite as SmoothQuant's,
:mod:`.smoothing`), and each layer's clipping is searched with its input's per-channel
``E[X_j²]`` as weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rangeprof.profiler.calibrate.smoothing import (
    Choice,
    DenseInput,
    SmoothingPlan,
    per_tensor_range,
    smoothed_range,
)
from rangeprof.profiler.calibrate.weight_only import (
    GROUP_SIZES,
    Int4Weights,
    choose_awq,
    search_clip,
)
from rangeprof.profiler.errors import RangeprofError

WEIGHT_ONLY_BITS = 4
INT4_ACTIVATIONS = ("fp32", "int8")  # a 4-bit dense layer's activations: as given, or W4A8


@dataclass(frozen=True)
class WeightOnly:
    """How a build stores dense layers' weights in 4 bits."""

    group_size: int = 32
    symmetric: bool = False
    activations: str = INT4_ACTIVATIONS[0]

    def __post_init__(self):
        if self.group_size not in GROUP_SIZES:
            sizes = ", ".join(map(str, GROUP_SIZES))
            raise RangeprofError(f"group size must be one of {sizes}, not {self.group_size}")

    def quantize(self, weight: np.ndarray, x: DenseInput | None, scales=None) -> Int4Weights:
        """``weight`` ``[K, N]`` in 4-bit groups, each group's clipping chosen by the output
        error with ``x``'s per-channel ``E[X_j²]`` (divided by ``scales²`` where the layer reads
        ``X / scales``); plain MSE without statistics."""
        channel_weight = None
        if x is not None and len(x.lo) == weight.shape[0]:
            channel_weight = x.channel_mean_squares()
            if scales is not None:
                channel_weight = channel_weight / np.asarray(scales) ** 2
        return search_clip(weight, self.group_size, self.symmetric, channel_weight)

    def to_json(self) -> dict:
        return {
            "bits": WEIGHT_ONLY_BITS,
            "group_size": self.group_size,
            "scheme": "sym" if self.symmetric else "asym",
            "activations": self.activations,
        }


def plan_awq(
    stats: Mapping[str, DenseInput],
    dense_inputs: Mapping[str, Sequence[np.ndarray]],
    weight_only: WeightOnly,
) -> SmoothingPlan:
    """AWQ's scaling of every tensor dense layers read, as a :class:`SmoothingPlan` (the
    rewrite is SmoothQuant's): a tensor is scaled where an ``alpha`` lowers the estimated 4-bit
    output error, its range that of its scaled channels."""
    plan = SmoothingPlan()
    for profile_id, weights in dense_inputs.items():
        x = stats.get(profile_id)
        if x is None or any(np.shape(w)[0] != len(x.lo) for w in weights):
            plan.skipped[profile_id] = "no per-channel statistics that fit its weights"
            continue
        awq = choose_awq(x, weights, weight_only.group_size, weight_only.symmetric)
        span = per_tensor_range(*smoothed_range(x, awq.scales))
        plan.choices[profile_id] = Choice(
            awq.alpha, awq.scales, awq.error, awq.unscaled, awq.errors, span
        )
    return plan
