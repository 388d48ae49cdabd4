"""npu: an NPU-style accelerator, programmed through an external codegen that emits C.

The integer cores of the INT8 and INT16 regions (conv2d — dense, depthwise, grouped, any stride,
dilation and padding — and matmul) are functions marked ``Codegen: rangeprof_npu``; the codegen
(:mod:`.codegen`, registered on import as ``relax.ext.rangeprof_npu``) emits C for them: kernels
of 8-bit or int16 activations by int8 weights with int32 accumulation, fixed-point
requantization (int32 multiplier + shift), tiled to the on-chip buffer
(:mod:`.tiling`), whose size the plugin holds: ``get_plugin("npu")`` reads
``$RANGEPROF_NPU_SRAM_KB`` (256 KB by default) once, into the plugin (:func:`make_plugin`),
which records it in the manifest. Everything else — the FP32 operators, quantize / dequantize
at the region boundaries — is the host's, built as x86 builds it
(:func:`rangeprof.byoc.x86.compile_host`). Both land in one shared library.

The policy is x86's (asymmetric uint8 activations, symmetric per-channel int8 weights, so the
same qparams), except that, being integer-only, the NPU requantizes every region output (to 8
bits, int16 in an int16 layer), also those x86 hands to FP32 operators as scaled int32
accumulators. The arithmetic is the
same bit for bit: an npu build's outputs equal those of an x86 build with this policy.

Like x86, the policy has int16 activations (``wide_activations``), so that an accuracy budget
keeps a layer too sensitive for 8 bits on the accelerator rather than sending it to the host in
FP32: the host quantizes its input to the symmetric int16 grid (levels capped so the int32
accumulator cannot overflow), the NPU runs the same core on it and requantizes the output to
int16 (integer-only), which the host dequantizes.
"""

from __future__ import annotations

from functools import partial

import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.settings import settings

from ..patterns import pattern_table
from ..plugin import Plugin
from ..policy import POLICIES
from ..x86 import compile_host
from .codegen import NAME, c_program, sram_bytes, tile_plans

__all__ = ["POLICY", "c_program", "compile_npu", "make_plugin", "tile_plans"]

POLICY = POLICIES["npu"]


def compile_npu(mod: tvm.IRModule, sram_kb: int) -> tvm.runtime.Executable:
    """The lowered module (``lower(..., external="rangeprof_npu")``) as one executable: the NPU
    regions as C for a buffer of ``sram_kb`` KB (compiled on export or first run), the rest for
    the host CPU."""
    # Read and tile every core here first: a core the NPU cannot run fails with its own
    # error, not one wrapped by RunCodegen's C++ frame.
    tile_plans(mod, sram_kb)
    mod = relax.transform.RunCodegen({NAME: {"sram_kb": sram_kb}})(mod)
    # RunCodegen also lifts the cores' constants into the module for runtimes that take them
    # at load time; the C embeds them, so keeping them would store every weight twice.
    mod = mod.without_attr("const_name_to_constant")
    return compile_host(mod)


def describe(mod: tvm.IRModule, sram_kb: int) -> dict[str, dict]:
    """Each offloaded region's tile plan, for the artifact's manifest."""
    return {symbol: plan.to_json() for symbol, plan in tile_plans(mod, sram_kb).items()}


def make_plugin(sram_kb: int | None = None) -> Plugin:
    """The npu plugin for an on-chip buffer of ``sram_kb`` KB, by default
    ``$RANGEPROF_NPU_SRAM_KB`` read now (what ``get_plugin("npu")`` calls): its code generation
    reads the size from the plugin, never from the environment."""
    sram_kb = settings().npu_sram_kb if sram_kb is None else sram_kb
    sram_bytes(sram_kb)  # a size no NPU has fails here, not in the build
    return Plugin(
        name="npu",
        policy=POLICY,
        patterns=lambda: pattern_table(NAME),
        target=host_target,
        compile=partial(compile_npu, sram_kb=sram_kb),
        external=NAME,
        describe=partial(describe, sram_kb=sram_kb),
        options={"sram_kb": sram_kb},
    )
