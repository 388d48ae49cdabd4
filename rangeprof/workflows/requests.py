"""The jobs' requests: one typed, validated record per job, the same whichever front end (CLI,
service worker, Python API) asks. A request holds only plain values and paths, so it serialises
to JSON and back unchanged (``model_dump(mode="json")`` / ``model_validate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rangeprof.profiler.errors import RangeprofError

Target = Literal["x86", "aarch64", "npu"]
Method = Literal["max", "percentile", "entropy", "mse", "best"]
Shapes = dict[str, tuple[int, ...]]
STORED = "stored"  # bias correction from the profile's per-channel means, not from data


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class InspectRequest(_Request):
    """``rangeprof inspect``: the model's layers and their lineage through every stage."""

    model: Path
    input_shapes: Shapes = {}
    target: Target = Field("x86", description="Whose partition the last stage shows.")
    equalize: bool = Field(False, description="Cross-layer equalization first.")


class ProfileRequest(_Request):
    """``rangeprof profile``: calibration data through the instrumented FP32 model."""

    model: Path
    data: str = Field(description="FILE.npz[:KEY,...], FILE.npy, an image folder, or random.")
    input_shapes: Shapes = {}
    bins: int = Field(2048, ge=0, description="Histogram bins (0: no histograms).")
    batch_size: int | None = Field(None, ge=1)
    samples: int | None = Field(None, ge=1)
    seed: int = Field(0, ge=0)
    constant_inputs: tuple[str, ...] = ()
    preprocess: str | None = Field(None, description="Image preprocessing, for a folder.")
    ray: str | None = Field(None, description="A Ray cluster's address, or local.")
    workers: int | None = Field(None, ge=1)
    shards: int | None = Field(None, ge=1)
    equalize: bool = Field(False, description="Profile the cross-layer equalized model.")
    channel_stats: bool = Field(
        False,
        description="Per-channel min, max and mean of every activation (what bias correction "
        "from the profile reads).",
    )

    @model_validator(mode="after")
    def _ray_options(self):
        if self.ray is None and (self.workers is not None or self.shards is not None):
            raise RangeprofError("--workers and --shards apply to profiling on Ray: add --ray")
        return self


class CalibrateRequest(_Request):
    """``rangeprof calibrate``: qparams from a stored profile (the choices are checked by
    :class:`~rangeprof.profiler.calibrate.methods.CalibrationOptions`, which names them)."""

    profile: Path
    method: str = "max"
    percentile: float = 99.99
    scheme: str = "sym"
    dtype: str = "int8"
    granularity: str = "per-tensor"
    power_of_two: bool = False


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


class QuantizeRequest(_Request):
    """What an INT8 build and an evaluation share: the model, where its qparams come from (a
    QPARAMS document, or a profile calibrated with the target's policy), and how to quantize."""

    model: Path
    target: Target = "x86"
    qparams: Path | None = Field(None, description="A QPARAMS document (`rangeprof calibrate`).")
    profile: Path | None = Field(None, description="A profile: qparams by `method`.")
    method: Method = "max"
    percentile: float = Field(99.99, gt=0, le=100)
    input_shapes: Shapes = {}
    fp32_fallback: bool = Field(False, description="Regions without qparams stay FP32.")
    accuracy_budget: float | None = Field(
        None, ge=0, description="Top-1 points INT8 may lose; the most sensitive layers stay FP32."
    )
    data: str | None = Field(None, description="Evaluation data, FILE.npz:KEY.")
    labels: str | None = Field(None, description="Labels for top-1, FILE.npz:KEY.")
    samples: int | None = Field(None, ge=1)
    weight_bits: Literal[7, 8] = 8
    bias_correction: str | None = Field(
        None,
        description="Fold each layer's INT8 mean shift into its bias: 'stored' derives it from "
        "the profile's per-channel means (no data run), calibration data (FILE.npz:KEY) "
        "measures it.",
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
        return self


class BuildRequest(QuantizeRequest):
    """``rangeprof build``: the deployable ``model.so`` and ``manifest.json`` in ``out``."""

    out: Path


class EvaluateRequest(QuantizeRequest):
    """``rangeprof evaluate``: FP32 against INT8 on ``data``; ``method="all"`` tries every
    calibration method on the profile and reports the best."""

    method: Method | Literal["all"] = "max"
    target: Literal["x86", "npu"] = "x86"
    data: str

    @model_validator(mode="after")
    def _all_needs_profile(self):
        if self.method == "all" and self.profile is None:
            raise RangeprofError("--method all needs --profile")
        return self
