"""x86: INT8 conv2d (dense, depthwise, 1×1), dense / matmul and matmuls of two activations
(attention's batch matmuls) compiled by LLVM for an x86 CPU: this machine's, or the one
``$RANGEPROF_X86_MCPU`` names (:func:`make_plugin`; e.g. ``haswell`` to build for AVX2 hosts
here: AMD names' code holds SSE4A, which Intel hosts lack).

The integer cores are inlined into the program and built by the CPU build of the pipeline with
the integer kernels of :mod:`rangeprof.byoc.cpu`, on the dot-product instruction x86 chooses for
the CPU (:mod:`.isa`): ``vpdpbusd`` (AVX-512 VNNI) where the CPU has it; on AVX2 ``vpmaddubsw``
where every weight of the layer is within ±64 (7-bit weights), else ``vpmaddwd``. The weight
bits follow (:func:`policy_for`): 8 with VNNI; on AVX2, where ``vpmaddubsw`` is ~1.35× faster,
7 for each layer whose error budget allows it, else 8 (:func:`~..policy.layer_weight_bits`); an
explicit ``weight_bits`` (``--weight-bits``) applies to every layer. Activations are asymmetric
uint8 (the unsigned operand of ``vpdpbusd`` and ``vpmaddubsw``), weights symmetric int8 per
channel, requantization in float32 (the policy's ``float``: AVX2 has no 64-bit multiply for
fixed point). Layers an accuracy budget finds too sensitive run on int16 activations first
(``vpmaddwd`` / ``vpdpwssd``), FP32 only if that is not enough. Operators outside the pattern
table stay FP32 between quantize / dequantize."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial

import tvm

from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.settings import settings

from .. import cpu
from ..patterns import BATCH_MATMUL, WEIGHTED, pattern_table
from ..plugin import Plugin
from ..policy import POLICIES, QuantPolicy
from .isa import ISA

__all__ = ["PLUGIN", "compile_host", "cpu_target", "make_plugin", "policy_for"]


def policy_for(target: tvm.target.Target) -> QuantPolicy:
    """x86's policy for ``target``: 8-bit weights, or per layer where 7-bit ones take a faster
    kernel (AVX2 without VNNI)."""
    policy = POLICIES["x86"]
    return replace(policy, weight_bits=None) if ISA.narrow_weights_faster(target) else policy


def cpu_target(mcpu: str) -> tvm.target.Target:
    """The LLVM target of the x86 CPU ``mcpu`` (an LLVM name), with this machine's cores."""
    known = tvm.target.codegen.llvm_get_cpu_archlist(tvm.target.Target({"kind": "llvm"}))
    if mcpu not in known:
        raise RangeprofError(
            f"x86 CPU {mcpu!r}: LLVM knows no such CPU (e.g. znver3, znver4, haswell, "
            "skylake-avx512, sapphirerapids)"
        )
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": os.cpu_count()})


def compile_host(mod):
    """``mod`` built for this machine, its integer kernels on x86's instructions."""
    return cpu.build(mod, host_target(), ISA, fold_scales=False)


def _patterns():
    return pattern_table("rangeprof_x86", (*WEIGHTED, BATCH_MATMUL))


PLUGIN = Plugin(
    name="x86",
    policy=policy_for(host_target()),
    patterns=_patterns,
    target=host_target,
    compile=compile_host,
    dense_w4=cpu.emit_dense_w4,
    dense_w4a8=partial(cpu.emit_dense_w4a8, isa=ISA),
)
"""x86's plugin for this machine (the environment not read)."""


def make_plugin(mcpu: str | None = None) -> Plugin:
    """x86's plugin for the CPU ``mcpu``, by default ``$RANGEPROF_X86_MCPU`` read now, else
    this machine's (what ``get_plugin("x86")`` calls): kernels and weight bits for that CPU.
    Evaluations run the code here: name a CPU whose instructions this machine has."""
    mcpu = mcpu or settings().x86_mcpu
    if mcpu is None:
        return PLUGIN
    target = cpu_target(mcpu)
    return Plugin(
        name="x86",
        policy=policy_for(target),
        patterns=_patterns,
        target=lambda: target,
        compile=lambda mod: cpu.build(mod, target, ISA, fold_scales=False),
        options={"mcpu": mcpu},
        # Emitted while lowering, outside the build's target: packed for (and, W4A8, on the
        # instruction of) this CPU.
        dense_w4=partial(cpu.emit_dense_w4, target=target),
        dense_w4a8=partial(cpu.emit_dense_w4a8, isa=ISA, target=target),
    )
