"""The profiling jobs: inspect a model, profile it (in process or on Ray), calibrate a profile
and export it."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rangeprof.profiler.errors import RangeprofError

from .requests import CalibrateRequest, ExportRequest, InspectRequest, ProfileRequest

if TYPE_CHECKING:
    from rangeprof.byoc.reports import EvaluationReport
    from rangeprof.profiler.calibrate.methods import CalibrationOptions as Options
    from rangeprof.profiler.calibrate.records import QParamsDocument
    from rangeprof.profiler.profiling.records import ProfileDocument

    from .options import CalibrationOptions

Progress = Callable[[int, int | None], None]  # (samples done, samples in all if known)
# An export: a text file, a binary file (qdq), or files by name (model-explorer).
Exported = str | bytes | dict[str, str]


def inspect(request: InspectRequest) -> dict:
    """The document of ``rangeprof inspect --json``: every stage, ``partition`` as the request's
    target partitions."""
    from rangeprof.byoc.plugin import get_plugin
    from rangeprof.profiler.ir.tracking import track_model

    patterns = get_plugin(request.target).patterns()
    return track_model(request.model, request.input_shapes, patterns, request.equalize).to_json()


def profile(
    request: ProfileRequest, progress: Progress | None = None, arrays=None
) -> ProfileDocument:
    """The profile; ``arrays``, when given, are the calibration data instead of
    ``request.data`` (the Python API's in-memory data)."""
    from rangeprof.profiler.profiling.data import parse_preprocess
    from rangeprof.profiler.profiling.records import ProfileDocument
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    options = ProfileOptions(
        bins=request.bins,
        batch_size=request.batch_size,
        samples=request.samples,
        seed=request.seed,
        constant_inputs=request.constant_inputs,
        equalize=request.equalize,
        channel_stats=request.channel_stats,
        allow_nonfinite=request.allow_nonfinite,
        cast=request.cast,
    )
    preprocess = parse_preprocess(request.preprocess) if request.preprocess else None
    execute = profile_model
    if request.ray is not None:
        from rangeprof.profiler.profiling.distributed import profile_distributed, require_ray

        require_ray()  # before anything is loaded
        execute = functools.partial(
            profile_distributed,
            address=request.ray,
            workers=request.workers or 2,
            shards=request.shards,
        )
    document = execute(
        request.model,
        request.data if arrays is None else arrays,
        input_shapes=request.input_shapes,
        options=options,
        preprocess=preprocess,
        progress=progress,
    )
    return ProfileDocument.from_json(document)


_POLICY_FIELDS = ("scheme", "dtype", "granularity", "power_of_two")  # the target's unless given
# Formats that hold one grid only, which then replaces the target's where not given.
_FORMAT_GRIDS = {"tensorrt": {"scheme": "sym", "dtype": "int8"}}


def calibration_options(
    options: CalibrationOptions, fmt: str | None = None
) -> tuple[Options, Options]:
    """The pipeline's calibration options of activations and of weights that ``options`` ask
    for: the target's policy (or export format ``fmt``'s only grid), where an option is not
    given."""
    from rangeprof.byoc.policy import POLICIES

    policy = POLICIES[options.target]
    given = {k: getattr(options, k) for k in _POLICY_FIELDS if getattr(options, k) is not None}
    given = _FORMAT_GRIDS.get(fmt, {}) | given
    activations = policy.calibration(options.method, options.percentile, **given)
    return activations, policy.weight_calibration(given.get("granularity"))


def calibrate_profile(profile: dict | ProfileDocument, options: CalibrationOptions) -> dict:
    """The QPARAMS document of ``profile`` (a document or its record) with ``options``, which
    records their target: the document a build on that target derives itself from the same
    profile and method."""
    from rangeprof.profiler.calibrate.methods import calibrate as derive

    if not isinstance(profile, dict):
        profile = profile.to_json()
    activations, weights = calibration_options(options)
    return derive(profile, activations, weights=weights, target=options.target)


def calibrate(request: CalibrateRequest) -> QParamsDocument:
    """The qparams of the request's profile."""
    from rangeprof.profiler.calibrate.records import QParamsDocument
    from rangeprof.profiler.profiling.document import load_profile

    return QParamsDocument.from_json(calibrate_profile(load_profile(request.profile), request))


def export(request: ExportRequest) -> Exported:
    """The request's profile in its format (:func:`render_export`)."""
    from rangeprof.profiler.profiling.records import ProfileDocument

    evaluation = None if request.evaluation is None else evaluation_report(request.evaluation)
    profile = ProfileDocument.from_json(request.profile)
    activations, _ = calibration_options(request, request.format)
    return render_export(profile, request.format, activations, request.model, evaluation)


def _transformed(onnx_model, path: Path, profile: ProfileDocument):
    """The ONNX model as profiled (its initializers equalized as the profile's transforms say)
    and the profile, whose ranges are now that model's own."""
    from onnx import numpy_helper

    from rangeprof.profiler.ir.importer import import_onnx
    from rangeprof.profiler.ir.onnx_load import load_model
    from rangeprof.profiler.ir.passes.equalize import equalized_initializers
    from rangeprof.profiler.ir.tagging import WEIGHT_PREFIX

    shapes = {k: tuple(v) for k, v in profile.model.inputs.items()}
    imported = import_onnx(load_model(path, shapes))
    initializers = {t.name: t for t in onnx_model.graph.initializer}
    for profile_id, value in equalized_initializers(imported.mod).items():
        name = profile_id.removeprefix(WEIGHT_PREFIX)
        if not profile_id.startswith(WEIGHT_PREFIX) or name not in initializers:
            raise RangeprofError(
                f"{path}: equalization changed {profile_id}, which is no initializer of the "
                "file: cannot write the equalized model"
            )
        old = initializers[name]
        old.CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(old).dtype), name))
    document = profile.to_json()
    del document["model"]["transforms"]
    return onnx_model, document


def render_export(
    profile: ProfileDocument,
    fmt: str,
    options: Options,
    model: Path | None = None,
    evaluation: EvaluationReport | None = None,
) -> Exported:
    """``profile`` in format ``fmt``: a calibration table's text, the QDQ model's bytes (``qdq``),
    or ``{file name: JSON text}`` with one Model Explorer overlay per figure
    (``model-explorer``). ``model`` is the profiled ONNX file, ``evaluation`` a report of
    ``rangeprof evaluate --json`` (:func:`evaluation_report`)."""
    from rangeprof.profiler.export import formats

    formats.check_inputs(fmt, model, evaluation)
    if fmt not in formats.MODEL_FORMATS:
        return formats.export(profile.to_json(), fmt, options)
    onnx_model = _profiled_model(model, profile)
    if fmt == formats.QDQ:
        from rangeprof.profiler.export.qdq_model import qdq_model

        document = profile.to_json()
        if profile.model.transforms:
            onnx_model, document = _transformed(onnx_model, model, profile)
        return qdq_model(onnx_model, document, options).SerializeToString()
    from rangeprof.profiler.export.model_explorer import node_data

    report = None if evaluation is None else evaluation.to_json()
    figures = node_data(onnx_model, profile.to_json(), report)
    return {f"{name}.json": json.dumps(doc, indent=1) + "\n" for name, doc in figures.items()}


def _profiled_model(path: Path, profile: ProfileDocument):
    """The ONNX model in ``path``, which must be the profiled file (its sha256)."""
    import onnx

    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise RangeprofError(f"{path}: {err.strerror}") from None
    sha, expected = hashlib.sha256(data).hexdigest(), profile.model.sha256
    if sha != expected:
        raise RangeprofError(
            f"{path} is not the profiled model {profile.model.name!r} "
            f"(sha256 {sha[:12]}…, the profile's {expected[:12]}…)"
        )
    return onnx.load_model_from_string(data)


def evaluation_report(source: Path | dict | EvaluationReport) -> EvaluationReport:
    """The report of ``rangeprof evaluate --json`` in file ``source`` (or already read)."""
    from pydantic import ValidationError

    from rangeprof.byoc.reports import EvaluationReport

    if isinstance(source, EvaluationReport):
        return source
    doc = source
    if not isinstance(source, dict):
        try:
            doc = json.loads(Path(source).read_text())
        except OSError as err:
            raise RangeprofError(f"{source}: {err.strerror}") from None
        except ValueError as err:
            raise RangeprofError(f"{source}: not JSON ({err})") from None
    try:
        return EvaluationReport.model_validate(doc)
    except ValidationError as err:
        where = "the evaluation" if isinstance(source, dict) else str(source)
        first = err.errors()[0]
        at = "/".join(str(part) for part in first["loc"]) or "top level"
        raise RangeprofError(
            f"{where}: not the JSON of `rangeprof evaluate --json` ({at}: {first['msg']})"
        ) from None


def write_export(out: Path, exported: Exported) -> None:
    """Write an export to ``out``: a file, or for ``model-explorer`` a folder of files."""
    try:
        if isinstance(exported, dict):
            out.mkdir(exist_ok=True)
            for name, text in exported.items():
                (out / name).write_text(text)
        elif isinstance(exported, bytes):
            out.write_bytes(exported)
        else:
            out.write_text(exported)
    except OSError as err:
        raise RangeprofError(f"{out}: cannot write: {err.strerror}") from None


def report_html(
    profile: ProfileDocument,
    evaluation: EvaluationReport | None = None,
    target: str | None = None,
) -> str:
    """The static HTML report of ``profile`` (and ``evaluation``, a report of ``rangeprof
    evaluate --json``), its scales on ``target``'s grids: by default the evaluation's target,
    else x86's."""
    from rangeprof.byoc.policy import POLICIES
    from rangeprof.profiler.export.report import render_report

    target = target or (evaluation.target if evaluation else None) or "x86"
    if target not in POLICIES:
        raise RangeprofError(f"unknown target {target!r}; expected one of {', '.join(POLICIES)}")
    policy = POLICIES[target]
    return render_report(
        profile.to_json(),
        None if evaluation is None else evaluation.to_json(),
        target=target,
        activations=policy.calibration(),
        weights=policy.weight_calibration(),
    )
