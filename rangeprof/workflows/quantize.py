"""INT8 builds and evaluations, orchestrated once for every front end: qparams from a QPARAMS
document or from a profile with the target's policy, the model quantized by the target's
plugin, the accuracy budget fitted (the most sensitive layers kept FP32), then the artifact
built or the evaluation report assembled. ``progress(phase, done, total)`` reports as it goes.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from rangeprof.profiler.errors import RangeprofError

from .options import EVERY_METHOD, STORED, CalibrationOptions
from .requests import BuildRequest, EvaluateRequest, QuantizeRequest

if TYPE_CHECKING:
    from rangeprof.byoc.manifest import Manifest
    from rangeprof.byoc.reports import EvaluationReport
    from rangeprof.profiler.calibrate.records import QParamsDocument
    from rangeprof.profiler.profiling.records import ProfileDocument

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Held:
    """What the Python API holds in memory in place of a request's files: the evaluation
    ``data``, its ``labels`` and the ``calibration_data`` as arrays, the ``profile`` or the
    ``qparams`` as records (``None``: the request's file), and a ``metric(outputs, labels)`` of
    the evaluation and its budget. The request still names its source of qparams, ``profile``
    or ``qparams``: as :data:`HELD`."""

    data: Any = None
    labels: Any = None
    calibration_data: Any = None
    metric: Callable | None = None
    profile: ProfileDocument | None = None
    qparams: QParamsDocument | None = None


# What a request records as its profile or qparams when they are held in memory.
HELD = "(in memory)"


def _evaluation_data(request: QuantizeRequest, held: Held):
    """The evaluation data and labels: those held, else the request's files."""
    tokens = request.metric == "bpc"
    labels = read_labels(request.labels, tokens) if held.labels is None else held.labels
    return (request.data if held.data is None else held.data), labels


def _metric(request: QuantizeRequest, held: Held):
    """The caller's metric, else the request's built-in one (None: top-1)."""
    from rangeprof.byoc.evaluate import BitsPerCharacter

    if held.metric is not None:
        return held.metric
    return BitsPerCharacter() if request.metric == "bpc" else None


def _start(request: QuantizeRequest, qm) -> dict[str, frozenset[str]]:
    """The request's ``layer_modes``: the regions' output profileIDs by mode; a pattern that
    matches no quantized region's output is an error (a typo)."""
    outputs = [r.output_id for r in qm.regions if r.fallback is None and r.output_id]
    kept: dict[str, set[str]] = {}
    for entry in request.layer_modes:
        pattern, _, mode = entry.rpartition("=")
        matched = [o for o in outputs if fnmatchcase(o, pattern)]
        if not matched:
            raise RangeprofError(
                f"--layer-modes {entry}: {pattern!r} matches no quantized layer's output "
                "(profileIDs as the manifest's regions list them)"
            )
        kept.setdefault(mode, set()).update(matched)
    return {mode: frozenset(ids) for mode, ids in kept.items()}


def read_labels(spec: str | None, tokens: bool = False):
    """The integer labels of ``FILE.npz[:KEY]`` (default: its first array), 1-D (one class a
    sample) or, for ``tokens``, of any shape (a token a position); ``None``."""
    import numpy as np

    if spec is None:
        return None
    path, _, key = spec.partition(":")
    try:
        with np.load(path, allow_pickle=False) as arrays:
            key = key or next(iter(arrays.files))
            if key not in arrays.files:
                raise RangeprofError(f"{path}: no array {key!r} (has {', '.join(arrays.files)})")
            labels = arrays[key]
    except (OSError, ValueError) as err:
        raise RangeprofError(f"{path}: cannot read labels ({err})") from None
    if labels.dtype.kind not in "iu" or (labels.ndim != 1 and not (tokens and labels.ndim)):
        shape = "an integer array" if tokens else "a 1-D integer array"
        raise RangeprofError(f"{spec}: labels must be {shape}")
    return labels


def _profile(request: QuantizeRequest, held: Held) -> ProfileDocument | None:
    """The request's profile, held or read and checked once (None: the qparams are a QPARAMS
    document); stored bias correction needs its per-channel means."""
    from rangeprof.profiler.profiling.records import ProfileDocument

    if request.profile is None:
        return None
    profile = held.profile or ProfileDocument.from_json(request.profile)
    if request.bias_correction == STORED and not profile.run.options.channel_stats:
        source = "the profile" if held.profile else request.profile
        raise RangeprofError(
            f"--bias-correction stored: {source} has no per-channel means "
            "(profile with --channel-stats)"
        )
    return profile


def _ranges(
    request: QuantizeRequest, profile: ProfileDocument | None, held: Held
) -> Callable[[str], QParamsDocument]:
    """``qparams(method)``: the request's QPARAMS document, held or read, and checked for its
    target, or derived from its ``profile`` with the target's policy — the document
    ``rangeprof calibrate --target`` writes; either file is read once, however many methods
    ask."""
    from rangeprof.profiler.calibrate.records import QParamsDocument

    from .profiling import calibrate_profile

    if profile is not None:
        document = profile.to_json()  # once, however many methods ask
        return lambda method: QParamsDocument.model_validate(
            calibrate_profile(
                document,
                CalibrationOptions(
                    target=request.target, method=method, percentile=request.percentile
                ),
            )
        )
    document = held.qparams or QParamsDocument.from_json(request.qparams)
    _check_target(document, request.target)
    return lambda method: document


def _check_target(document: QParamsDocument, target: str) -> None:
    """A QPARAMS document the target's kernels cannot run exactly is refused before any work:
    their activations are 8-bit and per tensor; weights are the target's own, whatever the
    document says of them."""
    options = document.options
    if options.dtype not in ("int8", "uint8"):
        raise RangeprofError(
            f"the qparams' activations are {options.dtype}: {target} runs 8-bit activations "
            f"(calibrate with --target {target})"
        )
    made_for = options.target
    if made_for is not None and made_for != target:
        raise RangeprofError(
            f"the qparams were calibrated for target {made_for}, not {target} "
            f"(calibrate with --target {target})"
        )


def _quantized(request: QuantizeRequest, qparams: QParamsDocument, plugin):
    """The model quantized for ``plugin`` with ``qparams`` and the request's exclusions; with
    an accuracy budget, from the narrowest weights (the search widens what it must)."""
    from rangeprof.byoc.quantized import quantize_model

    qm = quantize_model(
        request.model,
        qparams.to_json(),  # the pipeline's regions read the document
        plugin,
        request.input_shapes,
        request.fp32_fallback,
        request.exclude,
        request.smooth_quant,
        request.smooth_alpha,
        _weight_only(request),
        narrowest=request.accuracy_budget is not None,
    )
    return _ends_fp32(request, qm)


def _plugin(request: QuantizeRequest):
    """The target's plugin with the request's weight bits (4: its own bits for the layers
    that stay 8-bit)."""
    from rangeprof.byoc.plugin import get_plugin
    from rangeprof.byoc.weight_only import WEIGHT_ONLY_BITS

    bits = request.weight_bits
    return get_plugin(request.target, None if bits == WEIGHT_ONLY_BITS else bits)


def _weight_only(request: QuantizeRequest):
    """How dense weights are stored in 4 bits, when the request asks for them."""
    from rangeprof.byoc.weight_only import WEIGHT_ONLY_BITS, WeightOnly

    if request.weight_bits != WEIGHT_ONLY_BITS:
        return None
    return WeightOnly(request.group_size, request.int4_scheme == "sym", request.int4_activations)


def _replanned(request: QuantizeRequest, qm, qparams: QParamsDocument):
    """``qm`` planned anew from ``qparams`` with the request's exclusions."""
    planned = qm.replanned(qparams.to_json(), request.fp32_fallback, request.exclude)
    return _ends_fp32(request, planned)


def _ends_fp32(request: QuantizeRequest, planned):
    """``planned``, with ``first_last_fp32`` its first and last quantized regions kept FP32."""
    if not request.first_last_fp32:
        return planned
    quantized = [r for r in planned.regions if r.fallback is None]
    ends = {glob.escape(r.output_id) for r in quantized[:1] + quantized[-1:]}
    exclude = (*request.exclude, *sorted(ends))
    return planned.replanned(planned.qparams, request.fp32_fallback, exclude)


def _runnable_here(plugin):
    """``plugin``, or for a cross-compiled target x86 with its policy: targets with the same
    policy compute the same integers, so measure where code runs."""
    from rangeprof.byoc.plugin import get_plugin

    return plugin if plugin.runs_here else replace(get_plugin("x86"), policy=plugin.policy)


def _host(plugin, request: QuantizeRequest, qm, qparams):
    """``qm``, or the same model for a plugin that runs here when ``plugin`` is cross-compiled."""
    if plugin.runs_here:
        return qm
    return _quantized(request, qparams, _runnable_here(plugin))


def _bias_corrections(
    request: QuantizeRequest,
    measured,
    profile: ProfileDocument | None,
    progress: Progress | None,
    compiled: dict | None = None,
    held: Held = Held(),
):
    """The bias corrections of ``measured``, derived from the profile's means (``stored``) or
    measured on the request's calibration data, and the record a manifest or report keeps of
    them; ``compiled``: the programs to reuse."""
    from rangeprof.byoc.bias_correction import derive, measure

    if request.bias_correction == STORED:
        corrections, skipped = derive(measured, profile.to_json())
        record = {"mode": STORED, "regions": len(corrections)}
        return corrections, record | ({"skipped": skipped} if skipped else {})
    data = request.calibration_data if held.calibration_data is None else held.calibration_data
    corrections = measure(measured, data, progress=progress, compiled=compiled)
    record = {"mode": "empirical", "data": request.calibration_data, "regions": len(corrections)}
    return corrections, record


def build(request: BuildRequest, progress: Progress | None = None, held: Held = Held()) -> Manifest:
    """Quantize and compile the model for ``request.target``; write ``model.so`` and
    ``manifest.json`` into ``request.out``; return the manifest. ``held``: data in memory."""
    from rangeprof.byoc.artifact import build_artifact
    from rangeprof.byoc.bias_correction import corrected
    from rangeprof.byoc.evaluate import fit_budget
    from rangeprof.byoc.lowering import FP32, INT8, INT16
    from rangeprof.byoc.manifest import Manifest

    report = progress or (lambda phase, done, total: None)
    plugin = _plugin(request)
    report("quantizing", 0, 3)
    profile = _profile(request, held)
    qparams = _ranges(request, profile, held)(request.method)
    qm = _quantized(request, qparams, plugin)
    measured = _host(plugin, request, qm, qparams)
    compiled: dict = {}  # the FP32 program serves bias correction and the budget
    if request.bias_correction is not None:
        corrections, record = _bias_corrections(
            request, measured, profile, progress, compiled, held
        )
        qm, measured = (corrected(m, corrections, record) for m in (qm, measured))
    kept = _start(request, qm)
    if request.accuracy_budget is not None:
        data, labels = _evaluation_data(request, held)
        fitted = fit_budget(
            measured, data, request.accuracy_budget, labels, request.samples, progress,
            compiled, _metric(request, held), kept,
        )  # fmt: skip
        kept = {FP32: fitted.kept_fp32, INT16: fitted.kept_int16, INT8: fitted.kept_int8}
    report("compiling", 1, 3)
    kept = [frozenset(kept.get(mode, ())) for mode in (FP32, INT16, INT8)]
    return Manifest.from_json(build_artifact(qm, request.out, *kept))


def evaluate(
    request: EvaluateRequest, progress: Progress | None = None, held: Held = Held()
) -> EvaluationReport:
    """FP32 against INT8 on the request's data (``held``: in memory); with ``method="all"``
    every calibration method of the profile, the best (the metric, else top-1, else agreement,
    then SQNR) reported, the others listed."""
    from rangeprof.byoc.bias_correction import corrected
    from rangeprof.byoc.evaluate import evaluate as run_evaluation
    from rangeprof.byoc.evaluate import fit_budget
    from rangeprof.byoc.lowering import FP32, INT8, INT16
    from rangeprof.profiler.calibrate.methods import CHOICES

    plugin = _runnable_here(_plugin(request))
    methods = list(CHOICES) if request.method == EVERY_METHOD else [request.method]
    data, labels = _evaluation_data(request, held)
    results, qm = [], None
    compiled: dict = {}  # the FP32 program serves every method
    profile = _profile(request, held)
    ranges = _ranges(request, profile, held)
    corrections: dict[str, dict] = {}  # each method's bias correction record
    for method in methods:
        qparams = ranges(method)
        if qm is None:
            qm = _quantized(request, qparams, plugin)
        else:
            qm = _replanned(request, qm, qparams)
        if request.bias_correction is not None:
            qm = corrected(qm, *_bias_corrections(request, qm, profile, progress, compiled, held))
            corrections[qparams.options.method] = qm.bias_correction
        kept, metric = _start(request, qm), _metric(request, held)
        if request.accuracy_budget is None:
            empty = frozenset()
            result = run_evaluation(
                qm, data, labels, request.samples, kept.get(FP32, empty), progress, compiled,
                kept.get(INT16, empty), metric, kept.get(INT8, empty),
            )  # fmt: skip
        else:
            result = fit_budget(
                qm, data, request.accuracy_budget, labels, request.samples, progress,
                compiled, metric, kept,
            )  # fmt: skip
        results.append((qparams.options.method, result.to_json()))
    return _report(request, results, corrections)


def _report(
    request: EvaluateRequest, results: list[tuple[str, dict]], corrections: dict
) -> EvaluationReport:
    """The report of the best of each
    method's ``results`` (the metric, else top-1, else agreement, then SQNR), the others listed;
    ``corrections``: each method's bias correction record."""
    from rangeprof.byoc.reports import EvaluationReport, MethodResult

    def rank(item):
        _, doc = item
        score = doc.get("int8_metric", doc.get("int8_top1", doc["agreement"]))
        return (score, doc["output_sqnr_db"] or math.inf)

    best_method, best = max(results, key=rank)
    report = EvaluationReport.model_validate(
        {"method": best_method, "target": request.target} | best  # best says its weight bits
    )
    if request.bias_correction is not None:
        report.bias_correction = corrections[best_method]
    report.methods = [
        MethodResult(
            method=name,
            output_sqnr_db=doc["output_sqnr_db"],
            agreement=doc["agreement"],
            **{k: doc[k] for k in ("int8_top1", "int8_metric") if k in doc},
        )
        for name, doc in results
    ]
    return report
