"""A fast CPU build path (FP32, and INT8 on the dot-product instruction of the target): NHWC
layout, prepacked weights, rule-based schedules per kernel.

``build(mod, target=None)`` compiles a Relax module as our importer produces it (NCHW) into a
``tvm.runtime.Executable``; ``relax_pipeline(target)`` is the same pipeline as a pass for
``tvm.compile``. :mod:`.pipeline` lists the passes; each operator family's module documents its
rules.
"""

from rangeprof.profiler.build.schedules.pipeline import build, host_target, relax_pipeline

__all__ = ["build", "host_target", "relax_pipeline"]
