"""Request and response bodies of the REST API (pydantic 2); OpenAPI is generated from these.

Calibration choices (method, scheme, dtype, granularity, export format) are checked by
:class:`rangeprof.profiler.calibrate.methods.CalibrationOptions` and
:func:`rangeprof.profiler.export.formats.export`, so the API accepts exactly what the CLI accepts
and reports the same messages."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Path, UploadFile
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# The report the service takes as an upload and the profile it serves are the pipeline's records.
from rangeprof.byoc.reports import EvaluationReport  # noqa: F401
from rangeprof.profiler.export.formats import FORMATS, MODEL_FORMATS
from rangeprof.profiler.profiling.records import (
    ProfileDocument,  # noqa: F401
    StageReport,
)
from rangeprof.workflows.options import (
    CalibrationOptions,
    Dtype,
    ProfileOptions,
    QuantizeOptions,
    Scheme,
    Target,
)
from rangeprof.workflows.requests import BuildRequest, EvaluateRequest, ProfileRequest

from .limits import DEFAULT_LIMITS as _MAX

RunStatus = Literal["queued", "running", "done", "failed", "cancelled"]
_REQUEST = (
    "The job as its process runs it: the workflow's request (rangeprof.workflows), paths named "
    "as in the job's folder."
)
ExportFormat = Literal[(*FORMATS, *MODEL_FORMATS)]  # qdq, model-explorer: of the run's model

# Ids are 32-bit integers in the database (PostgreSQL's integer): a larger one names nothing,
# and would overflow the query, so it is refused (422) before any query is made.
MAX_ID = 2**31 - 1
ObjectId = Annotated[int, Path(ge=1, le=MAX_ID, description="An object's id.")]


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("text may not hold a NUL character")
    return text


class _NoNulPattern:
    """The schema's side of :func:`_no_nul` (clients and fuzzers read the rule from it)."""

    def __get_pydantic_json_schema__(self, schema, handler):
        return {**handler(schema), "pattern": "^[^\\x00]*$"}


# Text a query compares or a row stores: PostgreSQL's text holds no NUL, so one is refused (422)
# rather than failing the query (500).
Text = Annotated[str, AfterValidator(_no_nul), _NoNulPattern()]


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ErrorOut(BaseModel):
    detail: str = Field(description="What is wrong, in one line.")


# The response of cancelling a job that has ended.
ENDED = {409: {"model": ErrorOut, "description": "The job has ended: nothing to cancel."}}


class HealthOut(BaseModel):
    status: Literal["ok"] = "ok"


class TokenOut(_Out):
    name: str
    created_at: datetime
    expires_at: datetime | None = Field(description="null: never.")


# Models


class ModelUpload(BaseModel):
    """multipart/form-data: the ONNX file, with all its weights inside it."""

    model_config = ConfigDict(extra="forbid")

    file: UploadFile = Field(description="The .onnx file.")
    input_shapes: str = Field(
        None,
        description="Static shapes of inputs, NAME=DIMS separated by ';' "
        "(e.g. 'x=1x3x48x192;y=1x10'), as `--input-shape` of the CLI.",
    )


class InputOut(BaseModel):
    name: str
    shape: list[int]
    dtype: str


class LayerOut(_Out):
    profile_id: str
    kind: str
    op: str
    source_node: str | None
    source_op: str | None
    source_tensor: str | None
    shape: list[int] | None
    dtype: str


class ModelSummary(_Out):
    id: int
    name: str
    sha256: str
    size: int
    opset: int
    input_shapes: dict[str, list[int]] = Field(description="The shapes given at upload.")
    inputs: list[InputOut] = Field(description="The inputs as loaded (batch dim first).")
    created_at: datetime


class ModelOut(ModelSummary):
    layers: list[LayerOut] = Field(description="Every profileID of the initial IR, in order.")
    stages: list[StageReport] = Field(description="Lineage after every compiler stage.")


# Runs


def _limits(**fields: int):
    """The default limits of fields (``limits.Limits``) as their ``maximum`` in the OpenAPI
    document: the options declare no server's limit, a server checks its own (422)."""

    def document(schema: dict) -> None:
        for name, limit in fields.items():
            schema["properties"][name]["maximum"] = limit

    return document


class RunRequest(ProfileOptions):
    """multipart/form-data: calibration data (an .npz upload, or ``random`` with a sample
    count) and the options of ``rangeprof profile``. Optional fields are left out, never null
    (multipart has no null)."""

    model_config = ConfigDict(
        json_schema_extra=_limits(
            samples=_MAX.max_samples, bins=_MAX.max_bins, batch_size=_MAX.max_batch_size
        )
    )

    data: UploadFile = Field(
        None, description=".npz file, one array per input, [N, *sample_shape]; no pickles."
    )
    key: Text = Field(
        None, description="Array(s) of the .npz to use, comma-separated in input order."
    )
    random: int = Field(
        None, ge=1, le=_MAX.max_samples, description="Instead of data: this many samples."
    )


class RunOptions(_Out):
    """The options of ``rangeprof profile``, from the run's request."""

    bins: int
    batch_size: int | None
    samples: int | None
    seed: int


class RunData(BaseModel):
    kind: Literal["npz", "random"]
    name: str | None = Field(description="The uploaded file's name.")
    key: str | None
    sha256: str | None


class _Job(BaseModel):
    """What every job of the service reports: a profiling run, an evaluation, a build."""

    id: int
    status: RunStatus
    progress: float = Field(
        ge=0,
        le=1,
        description="Share done: of a run's samples, of an evaluation's current phase, of a "
        "build's steps.",
    )
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    error: str | None = Field(description="Why the job failed.")


class RunOut(_Job):
    model_id: int
    samples_done: int
    samples_total: int | None
    options: RunOptions
    data: RunData
    request: ProfileRequest = Field(description=_REQUEST)
    timings: dict[str, float] | None = Field(description="Seconds, from the profile.")


# Calibration and exports


class CalibrationRequest(CalibrationOptions):
    """The options of ``rangeprof calibrate`` and ``rangeprof export``."""


class ExportQuery(CalibrationRequest):
    """A calibration table (text), or the run's model with QDQ pairs (``qdq``, binary)."""

    format: ExportFormat


class QParamsOut(_Out):
    id: int
    run_id: int
    options: dict[str, Any]
    created_at: datetime
    document: dict[str, Any] = Field(
        description="The QPARAMS JSON of `rangeprof calibrate` (profiler/schemas/qparams)."
    )


_EVALUATION_ID = "A done evaluation of the run (`GET /api/runs/{id}/evaluations`)"


class ReportQuery(BaseModel):
    """The options of ``rangeprof report``."""

    model_config = ConfigDict(extra="forbid")

    evaluation: int | None = Field(
        None, ge=1, le=MAX_ID, description=f"{_EVALUATION_ID}: its per-layer error."
    )
    target: Target | None = Field(
        None,
        description="Whose grid the scales are on (default: the evaluation's target, else x86).",
    )


# Drift


class Range(BaseModel):
    min: float | None
    max: float | None


class TensorDrift(BaseModel):
    profile_id: str
    kind: str
    a: Range
    b: Range
    min_shift: float | None = Field(description="b.min - a.min.")
    max_shift: float | None = Field(description="b.max - a.max.")
    range_change: float | None = Field(
        description="Relative change of the range width, (w_b - w_a) / w_a; null when a's "
        "range is empty or zero-width."
    )
    histogram_distance: float | None = Field(
        description="Jensen-Shannon distance (base 2: 0 same distribution, 1 disjoint) of the "
        "two histograms on a common bin grid; null without histograms."
    )


class DriftOut(BaseModel):
    a: int = Field(description="Run id.")
    b: int = Field(description="Run id.")
    tensors: list[TensorDrift] = Field(description="Tensors in both runs, in a's order.")
    only_in_a: list[str]
    only_in_b: list[str]


# Layer table, tensor detail and lineage (what the dashboard reads)

LayerSort = Literal["position", "profile_id", "kind", "op", "source_node", "min", "max"]


class LayerQuery(BaseModel):
    """Search, sort and page a model's layers, with a run's ranges and suggested scales."""

    model_config = ConfigDict(extra="forbid")

    run: int | None = Field(
        None, ge=1, le=MAX_ID, description="A done run of the model: its min/max and scales."
    )
    q: Text | None = Field(
        None, max_length=200, description="Case-insensitive substring of profileID, op or node."
    )
    sort: LayerSort = "position"
    order: Literal["asc", "desc"] = "asc"
    offset: int = Field(0, ge=0, le=MAX_ID)
    limit: int = Field(50, ge=1, le=500)
    target: Target = CalibrationOptions.model_fields["target"]
    scheme: Scheme | None = Field(
        None, description="Scales on this scheme (default: the target's, weights' and others')."
    )
    dtype: Dtype | None = Field(None, description="Scales on this type (default: the target's).")
    percentile: float = CalibrationOptions.model_fields["percentile"]


class LayerRow(BaseModel):
    position: int
    profile_id: str
    kind: str
    op: str
    source_node: str | None
    source_op: str | None
    shape: list[int] | None
    dtype: str
    min: float | None = Field(description="Of the run; null without a run or finite values.")
    max: float | None
    scales: dict[str, float] = Field(
        description="Suggested per-tensor scale per calibration method, on the target's grid "
        "for the tensor's kind (or the query's scheme and dtype), as `rangeprof calibrate` "
        "computes it; empty without a run."
    )


class LayerPage(BaseModel):
    model_id: int
    run_id: int | None
    total: int = Field(description="Layers matching the search.")
    offset: int
    limit: int
    rows: list[LayerRow]


class TensorQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    profile_id: Text
    target: Target = CalibrationOptions.model_fields["target"]
    scheme: Scheme | None = LayerQuery.model_fields["scheme"]
    dtype: Dtype | None = LayerQuery.model_fields["dtype"]
    percentile: float = CalibrationOptions.model_fields["percentile"]


class TensorOut(BaseModel):
    run_id: int
    model_id: int
    entry: dict[str, Any] = Field(description="The profile's tensor entry (with the histogram).")
    qparams: dict[str, dict[str, Any]] = Field(
        description="Per calibration method, the per-tensor QPARAMS record (its `range` is the "
        "clipping range)."
    )


class LineageBinding(BaseModel):
    key: str = Field(description="`<function>/<var>` at that stage.")
    function: str = Field(description="`main`, or the fused function / BYOC region holding it.")
    layers: list[str] = Field(description="The initial profileIDs it derives from.")


class LineageStage(BaseModel):
    name: str
    bindings: list[LineageBinding] = Field(description="The bindings the layer became.")
    fate: str | None = Field(description="Why no binding carries it: folded_into:…, eliminated:…")


class LineageOut(BaseModel):
    model_id: int
    profile_id: str
    stages: list[LineageStage]


# Evaluations and builds


class EvaluationRequest(QuantizeOptions):
    """multipart/form-data: evaluation data, optional labels and the options of ``rangeprof
    evaluate``; bias correction 'measured' runs the run's own calibration data."""

    model_config = ConfigDict(json_schema_extra=_limits(samples=_MAX.max_samples))

    data: UploadFile = Field(description=".npz file, one array per input, [N, *sample_shape].")
    key: Text = Field(
        None, description="Array(s) of the .npz to use, comma-separated in input order."
    )
    labels: UploadFile = Field(
        None, description=".npz holding a 1-D integer array of labels (top-1 accuracy)."
    )
    labels_key: str = Field(
        None, description="The labels' array: in `labels`, or without it in `data`."
    )


class NpzRef(BaseModel):
    name: str
    key: str | None
    sha256: str


class _QuantizeJob(_Job):
    """An evaluation's or a build's: the target and weights asked for."""

    target: str
    weight_bits: int | None = Field(description="null: the target's choice, per layer.")


class EvaluationSummary(_QuantizeJob):
    run_id: int
    source: Literal["service", "report"] = Field(
        description="Computed by the service, or an uploaded `rangeprof evaluate --json`."
    )
    phase: str | None = Field(description="compiling fp32 / int8 / shadow, evaluating.")
    method: str = Field(description="As asked (all: see the report's method and methods).")
    percentile: float | None = Field(description="null for uploaded reports.")
    samples: int | None
    data: NpzRef | None
    labels: NpzRef | None
    output_sqnr_db: float | None = Field(description="From the report, once done.")
    agreement: float | None
    int8_top1: float | None
    request: EvaluateRequest | None = Field(description=f"{_REQUEST} null for uploaded reports.")


class EvaluationOut(EvaluationSummary):
    report: dict[str, Any] | None = Field(description="`rangeprof evaluate --json`, once done.")


_QPARAMS_ID = "A stored qparams set of the run (`GET /api/runs/{id}/qparams`)."
_STORED_SET = {"type": "integer"}


class BuildOptions(QuantizeOptions):
    """A JSON body: the options of ``rangeprof build``, qparams derived from the run's profile
    with the target's policy (``method``, ``percentile``), or a stored qparams set of the run.
    An accuracy budget needs evaluation data: see :class:`BuildUpload`."""

    # One source of qparams: a stored set excludes method and percentile (also in the schema,
    # where a null qparams_id is no stored set, as the route reads it).
    model_config = ConfigDict(
        json_schema_extra={
            "not": {
                "anyOf": [
                    {"required": ["qparams_id", other], "properties": {"qparams_id": _STORED_SET}}
                    for other in ("method", "percentile")
                ]
            }
        },
    )

    qparams_id: int | None = Field(None, ge=1, le=MAX_ID, description=_QPARAMS_ID)


class BuildUpload(BuildOptions):
    """multipart/form-data: the options of :class:`BuildOptions` and an accuracy budget with
    the evaluation data it is measured on (and labels), as an evaluation takes them. Optional
    fields are left out, never null."""

    qparams_id: int = Field(None, ge=1, le=MAX_ID, description=_QPARAMS_ID)  # not null here
    data: UploadFile = Field(
        None,
        description="The accuracy budget's evaluation data: .npz, one array per input, "
        "[N, *sample_shape].",
    )
    key: str = Field(None, description="Array(s) of `data` to use, comma-separated in input order.")
    labels: UploadFile = Field(
        None, description=".npz holding a 1-D integer array of labels (top-1 accuracy)."
    )
    labels_key: str = Field(
        None, description="The labels' array: in `labels`, or without it in `data`."
    )


class BuildSummary(_QuantizeJob):
    model_id: int
    run_id: int | None
    qparams_id: int | None
    method: str | None = Field(description="null when built from stored qparams.")
    percentile: float | None
    data: NpzRef | None = Field(description="The accuracy budget's evaluation data.")
    labels: NpzRef | None
    phase: str | None = Field(
        description="quantizing, compiling, packing (with an accuracy budget, first the "
        "evaluation's: compiling fp32 / int8 / shadow, evaluating)."
    )
    artifact_sha256: str | None = Field(description="Of the zip, once done.")
    timings: dict[str, Any] | None
    request: BuildRequest = Field(description=_REQUEST)


class BuildOut(BuildSummary):
    manifest: dict[str, Any] | None = Field(
        description="The artifact's manifest.json (`rangeprof build`), once done."
    )
