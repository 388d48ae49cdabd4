"""Every option a user chooses, declared once: its type, default, bounds and help text.

Three groups, one per kind of job: :class:`ProfileOptions` (``rangeprof profile``),
:class:`CalibrationOptions` (``calibrate``, ``export``, ``report``) and :class:`QuantizeOptions`
(``build``, ``evaluate``). Every face derives from them, so none can drift:

* the workflow requests (:mod:`.requests`) inherit a group and add the job's files;
* the CLI (:mod:`rangeprof.cli`) makes its ``--options`` from the fields (:func:`cli_options`);
* the Python API (:mod:`rangeprof.facade`) validates its ``**options`` against the group;
* the REST API's bodies (:mod:`rangeprof.service.schemas`) inherit the group and add uploads;
* the dashboard reads defaults and choices from the OpenAPI document the bodies generate.

Adding an option is one field here and the line of the workflow (or pipeline) that reads it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
)

from rangeprof.byoc.policy import TARGETS, WEIGHT_BITS
from rangeprof.byoc.weight_only import INT4_ACTIVATIONS, WEIGHT_ONLY_BITS
from rangeprof.profiler.calibrate.methods import CHOICES, DTYPES, GRANULARITIES, SCHEMES
from rangeprof.profiler.calibrate.weight_only import GROUP_SIZES
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.statistics import DEFAULT_BINS

Target = Literal[TARGETS]
Method = Literal[CHOICES]
EVERY_METHOD = "all"  # evaluate: every method, the best reported
Scheme = Literal[SCHEMES]
Dtype = Literal[tuple(DTYPES)]
Granularity = Literal[GRANULARITIES]
Int4Activations = Literal[INT4_ACTIVATIONS]
STORED, MEASURED = "stored", "measured"


METRICS = ("top1", "bpc")


LAYER_MODES = ("int8", "int16", "fp32")


def _layer_mode(entry: str) -> str:
    pattern, _, mode = entry.rpartition("=")
    if not pattern or mode not in LAYER_MODES:
        raise ValueError(
            f"{entry!r} is not PROFILEID=MODE with MODE one of {', '.join(LAYER_MODES)}"
        )
    return entry


LayerMode = Annotated[str, AfterValidator(_layer_mode)]


def refusal(err: ValidationError, flags: bool = True) -> RangeprofError:
    """A request's or group's first refused value as one line naming the option: as the CLI
    spells it (``--weight-bits``), or as the Python API does (``weight_bits``)."""
    first = err.errors()[0]
    # The option alone: a union's member or a tuple's index in the location is no name.
    name = "_".join(str(part) for part in first["loc"][:1])
    if flags:
        name = "--" + name.replace("_", "-")
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return RangeprofError(f"{name}: no such option")
    shown = first.get("input")
    if isinstance(shown, str | int | float) and not isinstance(shown, bool):
        message += f" (got {shown!r})"
    return RangeprofError(f"{name}: {message}")


def _one_of(what: str, choices: tuple[int, ...]):
    def check(value: int | None) -> int | None:
        if value is not None and value not in choices:
            raise ValueError(f"{what} must be one of {', '.join(map(str, choices))}")
        return value

    return check


# Ints checked against their choices rather than Literals: form fields and CLI values arrive
# as text, which a Literal of ints refuses. One annotation each (not a union holding one), so
# that the CLI reads a plain ``int | None`` / ``int``.
BITS = (WEIGHT_ONLY_BITS, *WEIGHT_BITS)
WeightBits = Annotated[
    int | None,
    AfterValidator(_one_of("weight bits", BITS)),
    WithJsonSchema({"anyOf": [{"enum": list(BITS), "type": "integer"}, {"type": "null"}]}),
]
GroupSize = Annotated[
    int,
    AfterValidator(_one_of("group size", GROUP_SIZES)),
    WithJsonSchema({"enum": list(GROUP_SIZES), "type": "integer"}),
]


class Options(BaseModel):
    """A group of options: immutable, and an unknown name is an error, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class ProfileOptions(Options):
    """How calibration data is run through the instrumented FP32 model."""

    bins: int = Field(DEFAULT_BINS, ge=0, description="Histogram bins (0: no histograms).")
    batch_size: int | None = Field(
        None, ge=1, description="Samples per executor run (default: the model's batch, else 1)."
    )
    samples: int | None = Field(None, ge=1, description="Use at most this many samples.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of random data.")
    equalize: bool = Field(
        False,
        description="Profile the cross-layer equalized model (conv/dense pairs; builds of the "
        "profile equalize too).",
    )
    channel_stats: bool = Field(
        False,
        description="Also record per-channel min, max and mean of every activation (what bias "
        "correction 'stored' reads); profiling is slower.",
    )
    allow_nonfinite: bool = Field(
        False,
        description="Profile data holding NaN or infinity anyway (counted and shown per "
        "tensor); else such data is an error naming the array and sample.",
    )
    cast: bool = Field(
        False,
        description="Cast data whose dtype does not fit an input (integers for a float input, "
        "floats for an integer one); else that is an error naming both.",
    )


class CalibrationOptions(Options):
    """How stored statistics become quantization parameters. Scheme, dtype, granularity and
    power-of-two scales follow the target's policy unless given."""

    target: Target = Field(
        "x86",
        description="The target: x86, aarch64 or npu; its quantization policy gives the defaults.",
    )
    method: Method = Field(
        "mse", description="Clip range: max, percentile, entropy, mse, or best per tensor."
    )
    percentile: float = Field(99.99, gt=0, le=100, description="For method percentile.")
    scheme: Scheme | None = Field(
        None, description="Activations' scheme, sym or asym (default: the target's)."
    )
    dtype: Dtype | None = Field(
        None, description="Activations' integer type (default: the target's)."
    )
    granularity: Granularity | None = Field(
        None, description="Weights per-tensor or per-channel (default: the target's)."
    )
    power_of_two: bool | None = Field(
        None, description="Round scales up to powers of two (default: the target's)."
    )


class QuantizeOptions(Options):
    """How a model is quantized and compiled for a target (builds and evaluations)."""

    target: Target = CalibrationOptions.model_fields["target"]
    method: Method | Literal[EVERY_METHOD] = Field(
        CalibrationOptions.model_fields["method"].default,
        description="Calibration method of the profile's ranges (evaluate also takes 'all': "
        "every method, the best reported).",
    )
    percentile: float = CalibrationOptions.model_fields["percentile"]
    weight_bits: WeightBits = Field(
        None,
        description="8: weights in [-127, 127]; 7: in [-63, 63], which x86 CPUs without VNNI "
        "multiply with vpmaddubsw (faster, a little less accurate); 4: dense layers' weights "
        "in 4-bit groups, their activations FP32 (x86; weight-only, AWQ-scaled from the "
        "profile). Default: the target's choice (x86 on AVX2 without VNNI: 7 for each layer "
        "whose error budget allows it, from the profile's statistics; else 8).",
    )
    group_size: GroupSize = Field(
        32, description="With 4-bit weights: rows of a weight per scale (32, 64 or 128)."
    )
    int4_scheme: Scheme = Field(
        "asym", description="With 4-bit weights: each group's grid, asym (a zero point) or sym."
    )
    int4_activations: Int4Activations = Field(
        "fp32",
        description="With 4-bit weights: the dense layers' activations, fp32 (W4A16-style: "
        "the closer to FP32) or int8 (W4A8: quantized per row at run time and multiplied on "
        "the integer dot-product instruction, some 2x faster on x86; fp32 where the CPU has "
        "none).",
    )
    smooth_quant: bool | None = Field(
        None,
        description="SmoothQuant: move each dense layer input's outlier channels into its "
        "weights where the stored statistics say the INT8 error drops (no data run). Default: "
        "the target's choice (x86, aarch64: on; npu: off).",
    )
    smooth_alpha: float | None = Field(
        None,
        ge=0,
        le=1,
        description="SmoothQuant's migration strength for every input (default: each input's "
        "own, the one of the smallest estimated error).",
    )
    fp32_fallback: bool = Field(
        False, description="Regions whose tensors have no qparams stay FP32 (else an error)."
    )
    exclude: tuple[str, ...] = Field(
        (),
        description="Layers kept FP32: profileIDs or shell patterns of them (e.g. '/head/*'), "
        "matched against every layer a region holds.",
    )
    first_last_fp32: bool = Field(
        False,
        description="The first and last layers that would be INT8 stay FP32 (next to the input "
        "and the output, often the most sensitive).",
    )
    layer_modes: tuple[LayerMode, ...] = Field(
        (),
        description="Per-layer precision, 'PROFILEID=MODE' (a shell pattern of the layers' "
        "output profileIDs; MODE int8, int16 or fp32): the plan an accuracy budget's report "
        "lists; a 4-bit layer named int8 runs on 8-bit weights and activations.",
    )
    metric: Literal[METRICS] | None = Field(
        None,
        description="What the accuracy budget measures: bpc (bits per character of the first "
        "output's logits at the labels, the next tokens; the budget in % of FP32's), or top1 "
        "(the default: points of top-1, or of agreement with FP32 without labels).",
    )
    accuracy_budget: float | None = Field(
        None,
        ge=0,
        description="What INT8 may lose on the evaluation data, in the metric's points: the "
        "most sensitive layers are widened (4-bit to 8-bit, then int16, then FP32) until it "
        "holds.",
    )
    samples: int | None = Field(
        None, ge=1, description="Use at most this many samples of the evaluation data."
    )
    bias_correction: Literal[STORED, MEASURED] | None = Field(
        None,
        description="Fold each layer's INT8 mean shift into its bias: 'stored' derives it from "
        "the profile's per-channel means (profiled with channel statistics; no data run), "
        "'measured' runs the calibration data through FP32 and INT8 once.",
    )
