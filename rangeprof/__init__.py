"""rangeprof: tensor-range profiling with IR tracking for INT8 quantization on Apache TVM.

The Python API (:mod:`rangeprof.facade`)::

    import rangeprof

    model = rangeprof.load("model.onnx")
    profile = rangeprof.profile(model, {"input": calibration_array})
    qparams = profile.calibrate(method="entropy")
    int8 = rangeprof.build(model, profile, target="x86")
    int8 = rangeprof.quantize(model, calibration_array, target="x86")  # the three in one

Its names are imported on first use, so that ``import rangeprof`` (and the CLI) start fast.
The pipeline is :mod:`rangeprof.profiler`, the INT8 targets :mod:`rangeprof.byoc`, the jobs
:mod:`rangeprof.workflows`, the REST service :mod:`rangeprof.service`.
"""

from rangeprof.profiler.compile.threads import set_defaults

# TVM's thread pool reads its settings once, when a thread first runs a parallel kernel.
set_defaults()

__all__ = [
    "Int8Model",
    "Model",
    "Profile",
    "QParams",
    "RangeprofError",
    "TensorProfile",
    "build",
    "evaluate",
    "load",
    "profile",
    "quantize",
]


def __getattr__(name: str):
    if name in __all__:
        from rangeprof import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'rangeprof' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The API, not this module's own imports: the names are imported on first use.
    return sorted(__all__)
