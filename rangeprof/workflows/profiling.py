"""The profiling jobs: inspect a model, profile it (in process or on Ray), calibrate a profile
and export it."""

from __future__ import annotations

import functools
from collections.abc import Callable

from .requests import CalibrateRequest, ExportRequest, InspectRequest, ProfileRequest

Progress = Callable[[int, int | None], None]  # (samples done, samples in all if known)


def inspect(request: InspectRequest) -> dict:
    """The document of ``rangeprof inspect --json``: every stage, ``partition`` as the request's
    target partitions."""
    from rangeprof.byoc.plugin import get_plugin
    from rangeprof.profiler.ir.tracking import track_model

    patterns = get_plugin(request.target).patterns()
    return track_model(request.model, request.input_shapes, patterns, request.equalize).to_json()


def profile(request: ProfileRequest, progress: Progress | None = None, arrays=None) -> dict:
    """The profile document; ``arrays``, when given, are the calibration data instead of
    ``request.data`` (the Python API's in-memory data)."""
    from rangeprof.profiler.profiling.data import parse_preprocess
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    options = ProfileOptions(
        bins=request.bins,
        batch_size=request.batch_size,
        samples=request.samples,
        seed=request.seed,
        constant_inputs=request.constant_inputs,
        equalize=request.equalize,
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
    return execute(
        request.model,
        request.data if arrays is None else arrays,
        input_shapes=request.input_shapes,
        options=options,
        preprocess=preprocess,
        progress=progress,
    )


def _options(request: CalibrateRequest):
    from rangeprof.profiler.calibrate.methods import CalibrationOptions

    return CalibrationOptions(**request.model_dump(exclude={"profile", "format"}))


def calibrate(request: CalibrateRequest) -> dict:
    """The QPARAMS document of the request's profile."""
    from rangeprof.profiler.calibrate.methods import calibrate as derive
    from rangeprof.profiler.profiling.document import load_profile

    options = _options(request)
    return derive(load_profile(request.profile), options)


def export(request: ExportRequest) -> str:
    """The profile's ranges as the file ``request.format`` names."""
    from rangeprof.profiler.export.formats import export as render
    from rangeprof.profiler.profiling.document import load_profile

    options = _options(request)
    return render(load_profile(request.profile), request.format, options)
