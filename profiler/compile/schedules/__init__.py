"""A fast CPU build path (FP32): NHWC layout, prepacked weights, rule-based schedules per
kernel; a caller adds kernels of its own as :class:`~.pipeline.Rules` (the CPU targets' integer
kernels, :mod:`rangeprof.byoc.cpu`).

``build(mod, target=None, rules=...)`` compiles a Relax module as our importer produces it
(NCHW) into a ``tvm.runtime.Executable``; ``relax_pipeline(target)`` is the same pipeline as a
pass for ``tvm.compile``. :mod:`.pipeline` lists the passes; each operator family's module
documents its rules.
"""

from rangeprof.profiler.compile.schedules.pipeline import Rules, build, host_target, relax_pipeline

__all__ = ["Rules", "build", "host_target", "relax_pipeline"]
