"""Integer matmuls of two activations (attention's ``Q·Kᵀ`` and ``P·V``, as the x86 quantizer
writes them: 8-bit ``[…, M, K]`` × int8 ``[…, K, N]`` → int32) on the target's dot-product
instruction, the right operand packed at run time.

Each matmul is built with the integer kernels (``integer_build.build``) for this machine and run;
the int32 results must equal numpy's int64 ones exactly, with activations at 255 (or ±128) and
the operand at −128 / 127 where the sums are largest. Kernels for instruction sets this machine
lacks are compiled and their assembly checked. Shapes no instruction fits keep TVM's matmul.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.byoc.cpu import amx
from rangeprof.byoc.cpu.dense_int8 import (
    DENSE,
    OFFSET_SUMS,
    PACK,
    dense_int8,
    offset_sums,
    pack_operand,
)
from rangeprof.byoc.cpu.isa import DOT_INSTRUCTIONS
from rangeprof.profiler.compile.schedules import host_target

from int8_operands import matmul_operands
from integer_build import build

VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake"})
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
AARCH64 = tvm.target.Target(
    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]}
)
# name: (left operand's shape, right operand's shape)
SHAPES = {
    "attention_scores": ((1, 4, 128, 64), (1, 4, 64, 128)),
    "attention_context": ((1, 4, 128, 128), (1, 4, 128, 64)),
    "batch_3d": ((2, 8, 24), (2, 24, 16)),
    "odd_k": ((2, 8, 20), (2, 20, 16)),
    "shared_2d": ((3, 20), (20, 32)),
}


def _module(a_shape, b_shape, dtype: str = "uint8") -> tvm.IRModule:
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, dtype))
    b = relax.Var("b", relax.TensorType(b_shape, "int8"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(a, b, out_dtype="int32"))
        bb.emit_func_output(out)
    return bb.get()


def _build(mod: tvm.IRModule, target=None) -> tvm.runtime.Executable:
    return build(mod, target or host_target(), fold_scales=False)


def _run(mod: tvm.IRModule, *args: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(_build(mod), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(x) for x in args)).numpy()


def _assembly(mod: tvm.IRModule, target) -> str:
    lib = _build(mod, target).mod
    llvm = lib if lib.kind == "llvm" else next(m for m in lib.imports if m.kind == "llvm")
    return llvm.inspect_source("asm")


def _exact(mod: tvm.IRModule, a: np.ndarray, b: np.ndarray) -> None:
    expected = np.matmul(a.astype(np.int64), b.astype(np.int64))
    assert np.abs(expected).max() < 2**31
    np.testing.assert_array_equal(_run(mod, a, b), expected)


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_batch_matmul_exact(name, dtype):
    a_shape, b_shape = SHAPES[name]
    _exact(_module(a_shape, b_shape, dtype), *matmul_operands(a_shape, b_shape, dtype))


def test_int16_batch_matmul_exact():
    """The quantizer's int16 fallback takes the int16 pairs, the operand widened by the pack."""
    a_shape, b_shape = SHAPES["batch_3d"]
    _exact(_module(a_shape, b_shape, "int16"), *matmul_operands(a_shape, b_shape, "int16"))


@pytest.mark.parametrize(
    "a_shape, b_shape",
    [((2, 6, 16), (2, 16, 6)), ((2, 8, 24), (1, 24, 16))],
    ids=["columns_no_lanes_divide", "broadcast_batch"],
)
def test_uncovered_shapes_keep_tvm_matmul(a_shape, b_shape):
    mod = _module(a_shape, b_shape)
    _exact(mod, *matmul_operands(a_shape, b_shape, "uint8"))
    assert DENSE not in _assembly(mod, host_target())


def test_offset_correction_per_batch_exact():
    """Activations that change type for the instruction (int8 on ``vpdpbusd``, uint8 on
    ``sdot``) are corrected by ``-offset · Σ_k b`` per batch and column. Built here directly
    on ``vpmaddubsw`` (uint8 × 7-bit weights) with int8 activations, which this machine runs
    when it has AVX2."""
    if not tvm.target.codegen.target_has_features("avx2", host_target()):
        pytest.skip("no AVX2 on this machine")
    instruction = DOT_INSTRUCTIONS["llvm.x86.avx2.pmadd.ub.sw"]
    offset = instruction.data_offset("int8")
    a_shape, b_shape = SHAPES["odd_k"]
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType(a_shape, "int8"))
    b = relax.Var("b", relax.TensorType(b_shape, "int8"))
    with bb.function("main", [a, b]):
        with bb.dataflow():
            packed = bb.emit_te(
                pack_operand, b, nb=16, instruction=instruction.intrinsic, primfunc_name_hint=PACK
            )
            fix = bb.emit_te(offset_sums, b, offset=offset, primfunc_name_hint=OFFSET_SUMS)
            out = bb.call_te(
                dense_int8,
                a,
                packed,
                fix,
                instruction=instruction.intrinsic,
                offset=offset,
                primfunc_name_hint=DENSE,
            )
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    x, w = matmul_operands(a_shape, b_shape, "int8")
    _exact(bb.get(), x, np.clip(w, -64, 64).astype("int8"))


def test_host_uses_its_dot_instruction():
    """AMX ``tdpbusd`` where the host has it (these shapes fill its tiles), else ``vpdpbusd``
    with AVX-512 VNNI, else (AVX2) ``vpmaddwd``: the run-time operand may hold any int8, which
    ``vpmaddubsw`` does not multiply exactly."""
    target = host_target()
    has = tvm.target.codegen.target_has_features
    if not has("avx2", target):
        pytest.skip("no AVX2 on this machine")
    expected = "vpdpbusd" if has("avx512vnni", target) else "vpmaddwd"
    if amx.available(target):
        expected = "tdpbusd"
    asm = _assembly(_module(*SHAPES["attention_scores"]), target)
    assert DENSE in asm and PACK in asm  # our kernels, not TVM's matmul
    assert re.search(rf"\b{expected}\b", asm)
    assert "vpmaddubsw" not in asm


@pytest.mark.parametrize(
    "target, pattern",
    [(VNNI, r"vpdpbusd\s+%zmm"), (AVX2, r"vpmaddwd\s+%ymm"), (AARCH64, r"\bsdot\b")],
    ids=["avx512_vnni", "avx2", "aarch64_dotprod"],
)
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_dot_instruction_in_assembly(dtype, target, pattern):
    asm = _assembly(_module(*SHAPES["attention_scores"], dtype), target)
    assert DENSE in asm and PACK in asm
    assert re.search(pattern, asm)
