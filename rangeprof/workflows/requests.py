"""The jobs' requests: one typed, validated record per job, the same whichever front end (CLI,
service worker, Python API) asks. A request holds only plain values and paths, so it serialises
to JSON and back unchanged (``model_dump(mode="json")`` / ``model_validate``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from rangeprof.profiler.errors import RangeprofError

from .options import (
    EVERY_METHOD,
    MEASURED,
    STORED,
    CalibrationOptions,
    Options,
    ProfileOptions,
    QuantizeOptions,
    Target,
)

Shapes = dict[str, tuple[int, ...]]


class InspectRequest(Options):
    """``rangeprof inspect``: the model's layers and their lineage through every stage."""

    model: Path
    input_shapes: Shapes = Field(default_factory=dict)
    target: Target = Field("x86", description="Whose partition the last stage shows.")
    equalize: bool = ProfileOptions.model_fields["equalize"]


class ProfileRequest(ProfileOptions):
    """``rangeprof profile``: calibration data through the instrumented FP32 model."""

    model: Path
    data: str = Field(description="FILE.npz[:KEY,...], FILE.npy, an image folder, or random.")
    input_shapes: Shapes = Field(default_factory=dict)
    constant_inputs: tuple[str, ...] = ()
    preprocess: str | None = Field(None, description="Image preprocessing, for a folder.")
    ray: str | None = Field(None, description="A Ray cluster's address, or local.")
    workers: int | None = Field(None, ge=1)
    shards: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _ray_options(self):
        if self.ray is None and (self.workers is not None or self.shards is not None):
            raise RangeprofError("--workers and --shards apply to profiling on Ray: add --ray")
        return self


class CalibrateRequest(CalibrationOptions):
    """``rangeprof calibrate``: qparams from a stored profile, with the target's policy where
    an option is not given."""

    profile: Path


class ExportRequest(CalibrateRequest):
    """``rangeprof export``: the profile's ranges in another tool's format; ``qdq`` and
    ``model-explorer`` read the profiled model too, ``model-explorer`` an evaluation report."""

    format: str
    model: Path | None = Field(None, description="The profiled ONNX model (qdq, model-explorer).")
    evaluation: Path | None = Field(
        None, description="A `rangeprof evaluate --json` report (model-explorer)."
    )

    @model_validator(mode="after")
    def _inputs(self):
        from rangeprof.profiler.export.formats import check_inputs

        check_inputs(self.format, self.model, self.evaluation)
        return self


class QuantizeRequest(QuantizeOptions):
    """What an INT8 build and an evaluation share: the model, where its qparams come from (a
    QPARAMS document, or a profile calibrated with the target's policy), and the data files."""

    model: Path
    qparams: Path | None = Field(None, description="A QPARAMS document (`rangeprof calibrate`).")
    profile: Path | None = Field(None, description="A profile: qparams by `method`.")
    input_shapes: Shapes = Field(default_factory=dict)
    data: str | None = Field(None, description="Evaluation data, FILE.npz:KEY.")
    labels: str | None = Field(None, description="Labels for top-1, FILE.npz:KEY.")
    calibration_data: str | None = Field(
        None, description="Calibration data of bias correction 'measured', FILE.npz:KEY."
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.qparams is None) == (self.profile is None):
            raise RangeprofError("give exactly one of --qparams and --profile")
        if self.accuracy_budget is not None and self.data is None:
            raise RangeprofError("--accuracy-budget needs --data to measure the drop")
        if self.bias_correction == STORED and self.profile is None:
            raise RangeprofError(
                "--bias-correction stored reads the per-channel means of a --profile "
                "(a QPARAMS document has none)"
            )
        if (self.bias_correction == MEASURED) != (self.calibration_data is not None):
            raise RangeprofError(
                "--bias-correction measured runs --calibration-data, which goes with it alone"
            )
        return self


class BuildRequest(QuantizeRequest):
    """``rangeprof build``: the deployable ``model.so`` and ``manifest.json`` in ``out``."""

    out: Path

    @model_validator(mode="after")
    def _one_method(self):
        if self.method == EVERY_METHOD:
            raise RangeprofError("--method all is for evaluate: a build takes one method")
        return self


class EvaluateRequest(QuantizeRequest):
    """``rangeprof evaluate``: FP32 against INT8 on ``data``; ``method="all"`` tries every
    calibration method on the profile and reports the best. A cross-compiled target (aarch64)
    is measured on x86 with its policy: the same integers."""

    data: str

    @model_validator(mode="after")
    def _evaluable(self):
        if self.method == EVERY_METHOD and self.profile is None:
            raise RangeprofError("--method all needs --profile")
        return self
