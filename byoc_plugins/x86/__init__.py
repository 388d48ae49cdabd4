"""x86: INT8 conv2d (dense, depthwise, 1×1), dense / matmul and matmuls of two activations
(attention's batch matmuls) compiled by LLVM for the host.

The integer cores are inlined into the program and built by the CPU build of the pipeline with
the integer kernels of :mod:`rangeprof.byoc.cpu`, on the dot-product instruction x86 chooses for
the host (:mod:`.isa`): ``vpdpbusd`` (AVX-512 VNNI) where the CPU has it; on AVX2 ``vpmaddubsw``
where every weight of the layer is within ±64 (``get_plugin("x86", weight_bits=7)``,
``--weight-bits 7``), else ``vpmaddwd``. Activations are asymmetric uint8 (the unsigned operand
of ``vpdpbusd`` and ``vpmaddubsw``), weights symmetric int8 per channel, requantization in
float32 (the policy's ``float``: AVX2 has no 64-bit multiply for fixed point). Layers an
accuracy budget finds too sensitive run on int16 activations first (``vpmaddwd`` /
``vpdpwssd``), FP32 only if that is not enough. Operators outside the pattern table stay FP32
between quantize / dequantize."""

from __future__ import annotations

from rangeprof.profiler.compile.schedules import host_target

from .. import cpu
from ..patterns import BATCH_MATMUL, WEIGHTED, pattern_table
from ..plugin import Plugin
from ..policy import POLICIES
from .isa import ISA


def compile_host(mod):
    """``mod`` built for the host, its integer kernels on x86's instructions."""
    return cpu.build(mod, host_target(), ISA, fold_scales=False)


PLUGIN = Plugin(
    name="x86",
    policy=POLICIES["x86"],
    patterns=lambda: pattern_table("rangeprof_x86", (*WEIGHTED, BATCH_MATMUL)),
    target=host_target,
    compile=compile_host,
)
