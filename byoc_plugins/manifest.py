"""The manifest of a build typed: :class:`Manifest` and one :class:`RegionRecord` per region
(:mod:`.artifact` says what a build writes); reading one needs no TVM. Manifests written
before load: keys these records do not name are kept, after the named ones."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from rangeprof.profiler.calibrate.records import CalibrationRecord
from rangeprof.profiler.records import Number, Record


class _Open(Record):
    model_config = ConfigDict(extra="allow")


class ModelRef(_Open):
    name: str
    sha256: str


class IndexRecord(_Open):
    """The axis an integer input indexes (:class:`rangeprof.profiler.ir.index_inputs.IndexUse`)."""

    extent: int
    node: str


class InputSpec(_Open):
    """An argument of ``main``: the shape it was built for and its dtype."""

    shape: list[int]
    dtype: str
    index: IndexRecord | None = Field(
        None,
        description="For token ids: the axis the input indexes, its values in [-extent, extent). "
        "Absent in manifests made before, and for other inputs.",
    )


class ActivationRecord(_Open):
    """A region boundary's qparams (:class:`~rangeprof.byoc.policy.ActivationQ`)."""

    profile_id: str
    scale: Number
    zero_point: int
    dtype: str


class WeightRecord(_Open):
    dtype: str
    axis: int | None
    scale: list[Number]
    bits: int | None = Field(
        None,
        description="7 (within ±63) or 8 (±127), or 4 (int4 groups: scale holds each column's "
        "largest group step); absent: FP32, or a manifest made before.",
    )
    group_size: int | None = Field(None, description="4-bit weights: rows per group.")


class RegionRecord(_Open):
    """One region: its pattern, profileIDs and boundary qparams, its ``mode`` (``fallback``
    says why FP32) and what the target made of it (the npu's tile plan)."""

    name: str
    pattern: str
    op: str
    profile_ids: list[str]
    weight_id: str | None
    input: ActivationRecord | None
    output_id: str | None
    output: ActivationRecord | None
    operand: ActivationRecord | None = None
    fallback: str | None
    weight: WeightRecord | None = None
    mode: Literal["int8", "int16", "fp32", "w4"]
    target: dict[str, Any] | None = None


class Manifest(_Open):
    """``manifest.json`` beside a build's ``model.so``."""

    model: ModelRef
    inputs: dict[str, InputSpec]
    target: str
    target_options: dict[str, Any] | None = None
    policy: dict[str, str]
    calibration: CalibrationRecord | None
    bias_correction: dict[str, Any] | None = None
    # SmoothQuant: each smoothed input's strength, fold and estimated error ratio; and why the
    # other dense inputs were left (``rangeprof.byoc.smoothing.Smoothing.to_json``).
    smoothing: dict[str, Any] | None = None
    # 4-bit weight-only dense layers: bits, group size and scheme (``WeightOnly.to_json``)
    weight_only: dict[str, Any] | None = None
    regions: list[RegionRecord]
    library: str
    library_sha256: str
    exports: dict[str, str] | None = Field(
        None,
        description="A 4-bit weight-only build's ONNX files beside the library, by format "
        "(matmulnbits, int4_qdq): its 4-bit dense layers on the same codes, the rest FP32.",
    )
    exports_fp32: dict[str, str] | None = Field(
        None, description="4-bit regions the ONNX exports keep FP32, by region name: why."
    )
    kept_fp32: list[str]
    kept_int16: list[str] = Field(default_factory=list)
    kept_int8: list[str] = Field(default_factory=list, description="4-bit layers run on 8 bits.")
    timings: dict[str, Number]
