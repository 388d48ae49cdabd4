"""x86: INT8 conv2d (dense, depthwise, 1×1), dense / matmul and matmuls of two activations
(attention's batch matmuls) compiled by LLVM for the host.

The integer cores are inlined into the program and built by the fast CPU path
(:mod:`rangeprof.profiler.build.schedules`), whose integer rules pick the dot-product instruction of
the target: ``vpdpbusd`` (AVX-512 VNNI) where the CPU has it; on AVX2 ``vpmaddubsw`` where every
weight of the layer is within ±64 (``get_plugin("x86", weight_bits=7)``, ``--weight-bits 7``), else
``vpmaddwd``. Activations are asymmetric uint8 (the unsigned operand of ``vpdpbusd`` and
``vpmaddubsw``), weights symmetric int8 per channel, requantization in float32 (the policy's
``float``: AVX2 has no 64-bit multiply for fixed point). Layers an accuracy budget finds too
sensitive run on int16 activations first (``vpmaddwd`` / ``vpdpwssd``), FP32 only if that is not
enough. Operators outside the pattern table stay FP32 between quantize / dequantize."""

from __future__ import annotations

from rangeprof.profiler.build.schedules import build, host_target

from ..patterns import BATCH_MATMUL, WEIGHTED, pattern_table
from ..plugin import Plugin
from ..policy import POLICIES


def _compile(mod):
    return build(mod, host_target(), fold_scales=False)


PLUGIN = Plugin(
    name="x86",
    description="INT8 conv2d / dense for the host CPU, LLVM (AVX-512 VNNI or AVX2)",
    policy=POLICIES["x86"],
    patterns=lambda: pattern_table("rangeprof_x86", (*WEIGHTED, BATCH_MATMUL)),
    target=host_target,
    compile=_compile,
)
