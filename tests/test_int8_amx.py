"""Integer dense layers and matmuls of two activations on AMX tiles (``tdpbusd``), where this
machine has them: the same integers as ``vpdpbusd`` (exact against numpy, and the same bits
as the VNNI build through a float epilogue), and ``vpdpbusd`` kept for shapes no whole tile
covers.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.byoc.cpu import amx
from rangeprof.profiler.compile.schedules import host_target

from int8_operands import matmul_operands
from integer_build import build

pytestmark = pytest.mark.skipif(
    not amx.available(host_target()), reason="no AMX tiles on this machine"
)
VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "icelake-server"})  # runs here, no AMX
# name: (left operand's shape, right operand's shape, right operand constant)
SHAPES = {
    "dense_768": ((1, 128, 256), (256, 768), True),
    "dense_one_tile": ((16, 64), (64, 16), True),
    "dense_rows_48": ((48, 128), (128, 48), True),
    "scores": ((1, 4, 128, 64), (1, 4, 64, 128), False),
    "context": ((1, 4, 128, 128), (1, 4, 128, 64), False),
}


def _module(a: np.ndarray, b: np.ndarray, constant: bool, scaled: bool = False):
    """``matmul(a, b)`` in int32, ``b`` a constant or a parameter; ``scaled``: then + a bias
    and times a scale per column in float32 (a dequantizing epilogue)."""
    bb = relax.BlockBuilder()
    x = relax.Var("a", relax.TensorType(a.shape, str(a.dtype)))
    params = [x] if constant else [x, relax.Var("b", relax.TensorType(b.shape, "int8"))]
    with bb.function("main", params):
        with bb.dataflow():
            right = relax.const(b) if constant else params[1]
            out = bb.emit(relax.op.matmul(x, right, out_dtype="int32"))
            if scaled:
                columns = b.shape[-1]
                bias = relax.const(np.arange(columns, dtype="int32") - columns // 2)
                out = bb.emit(relax.op.astype(relax.op.add(out, bias), "float32"))
                scale = np.linspace(1e-4, 3e-3, columns, dtype="float32")
                out = bb.emit(relax.op.multiply(out, relax.const(scale)))
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, target, a, b, constant: bool) -> np.ndarray:
    vm = relax.VirtualMachine(build(mod, target, fold_scales=False), tvm.cpu())
    args = [a] if constant else [a, b]
    return vm["main"](*(tvm.runtime.tensor(v) for v in args)).numpy()


def _assembly(mod, target) -> str:
    lib = build(mod, target, fold_scales=False).mod
    llvm = lib if lib.kind == "llvm" else next(m for m in lib.imports if m.kind == "llvm")
    return llvm.inspect_source("asm")


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tiles_exact(name, dtype):
    a_shape, b_shape, constant = SHAPES[name]
    a, b = matmul_operands(a_shape, b_shape, dtype)
    mod = _module(a, b, constant)
    expected = np.matmul(a.astype(np.int64), b.astype(np.int64))
    np.testing.assert_array_equal(_run(mod, host_target(), a, b, constant), expected)
    assert "tdpbusd" in _assembly(mod, host_target())


@pytest.mark.parametrize("name", ["dense_768", "scores"])
def test_same_bits_as_vnni_through_an_epilogue(name):
    """The accumulators stored by the tiles and read by a float epilogue: the VNNI build's
    outputs, bit for bit."""
    a_shape, b_shape, constant = SHAPES[name]
    a, b = matmul_operands(a_shape, b_shape, "uint8")
    mod = _module(a, b, constant, scaled=True)
    tiles = _run(mod, host_target(), a, b, constant)
    vnni = _run(mod, VNNI, a, b, constant)
    assert np.array_equal(tiles.view(np.uint32), vnni.view(np.uint32))
    assert "tdpbusd" not in _assembly(mod, VNNI)


def test_shapes_without_whole_tiles_keep_vnni():
    """A reduction of 40 (no whole 64-deep tile step) stays on ``vpdpbusd``, exact."""
    a, b = matmul_operands((32, 40), (40, 32), "uint8")
    mod = _module(a, b, True)
    expected = np.matmul(a.astype(np.int64), b.astype(np.int64))
    np.testing.assert_array_equal(_run(mod, host_target(), a, b, True), expected)
    asm = _assembly(mod, host_target())
    assert "tdpbusd" not in asm and "vpdpbusd" in asm
