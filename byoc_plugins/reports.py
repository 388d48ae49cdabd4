"""The evaluation report typed: :class:`EvaluationReport`, the object ``rangeprof evaluate
--json`` prints (:mod:`.evaluate` says how its figures are measured), and what the service
takes as an uploaded report. Reports written before load: ``weight_bits`` and ``kept_int16``
were added later (absent: 8 and none), as were the layers' ``weight_bits`` (absent: the
report's), and keys these records do not name are kept."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from rangeprof.profiler.calibrate.methods import CHOICES, IMPORTED
from rangeprof.profiler.records import Record

from .policy import TARGETS


class _Open(Record):
    model_config = ConfigDict(extra="allow")


class EvaluatedLayer(_Open):
    """One region's error, by the profileID of its output."""

    profile_id: str
    region: str
    pattern: str
    mode: str
    weight_bits: int | None = Field(
        None, description="Its weights' bits; null: FP32, or no constant weights."
    )
    isolated_sqnr_db: float | None = Field(description="null: exact (no error).")
    accumulated_sqnr_db: float | None
    isolated_rmse_per_scale: float
    accumulated_rmse_per_scale: float


# The method a report names: a calibration method, or qdq for a QDQ model's own scales.
ReportedMethod = Literal[(*CHOICES, IMPORTED)]


class MethodResult(_Open):
    """One calibration method's figures, of an evaluation of every method."""

    method: ReportedMethod
    output_sqnr_db: float | None
    agreement: float
    int8_top1: float | None = None
    int8_metric: float | None = None


class EvaluationReport(_Open):
    """The object ``rangeprof evaluate --json`` prints."""

    method: ReportedMethod
    target: Literal[TARGETS]
    weight_bits: int | None = Field(
        8,
        description="The weights' bits, 7 or 8; null: chosen per layer (the layers' "
        "weight_bits). Absent in reports made before: 8.",
    )
    samples: int = Field(ge=1)
    agreement: float
    output_sqnr_db: float | None
    layers: list[EvaluatedLayer] = Field(description="Worst isolated SQNR first.")
    kept_fp32: list[str] = Field(default_factory=list)
    kept_int16: list[str] = Field(
        default_factory=list, description="Absent in reports made before: none."
    )
    kept_int8: list[str] = Field(
        default_factory=list, description="4-bit layers an accuracy budget raised to 8 bits."
    )
    plan: list[str] = Field(
        default_factory=list,
        description="The layers' modes the budget chose, as `layer_modes` entries "
        "(PROFILEID=MODE) a build takes.",
    )
    fp32_top1: float | None = None
    int8_top1: float | None = None
    fp32_metric: float | None = None
    int8_metric: float | None = None
    bias_correction: dict[str, Any] | None = Field(
        None, description="How the biases were corrected (with bias correction)."
    )
    methods: list[MethodResult] | None = Field(
        None, description="Every method tried (`method` all; the best is reported)."
    )
