"""4-bit weight dense kernels, built by the CPU build with their schedule rules: float32
activations × weights decoded inside the kernel (``rangeprof.byoc.cpu.dense_w4``), and 8-bit
activations quantized per row × the same weights on the dot-product instruction
(``rangeprof.byoc.cpu.dense_w4a8``).

Outputs against numpy's float64 ``x @ (s · (q − z)) + bias`` (W4A8: numpy's emulation of its
integer arithmetic, and the bound its activation rounding allows); the scheduled kernels and
their assembly (vector FMAs of the host's vector unit as ``schedules.isa`` reads it from the
target; the dot instruction the x86 plugin's ISA chooses for it); the exported library's size
against the FP32 layer's.
"""

from __future__ import annotations

import math
import re

import numpy as np
import onnxruntime as ort
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx

from rangeprof.byoc.aarch64.isa import ISA as AARCH64_ISA
from rangeprof.byoc.cpu import dense_w4a8
from rangeprof.byoc.cpu.dense_w4 import DECODE, DENSE, emit_dense_w4
from rangeprof.byoc.cpu.dense_w4a8 import SCHEDULES, emit_dense_w4a8
from rangeprof.byoc.cpu.dot import lower_dot_blocks
from rangeprof.byoc.x86.isa import ISA
from rangeprof.profiler.compile.schedules import Rules, build, host_target
from rangeprof.profiler.compile.schedules.isa import vector_unit
from rangeprof.profiler.compile.schedules.pipeline import relax_pipeline
from rangeprof.profiler.errors import RangeprofError

from matmul_nbits import matmul_nbits

RULES = Rules(schedules=SCHEDULES, lowering_passes=(lower_dot_blocks,))
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell", "num-cores": 2})


def _weights(k: int, n: int, group: int, asymmetric: bool, seed: int = 0):
    """Random nibbles (0 and 15 in the first column: the ends of the decode), group scales,
    zero points when ``asymmetric``."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    q[0, 0], q[-1, 0] = 0, 15
    groups = -(-k // group)
    scales = rng.uniform(0.005, 0.05, (groups, n)).astype(np.float32)
    zeros = rng.integers(0, 16, (groups, n)).astype(np.uint8) if asymmetric else None
    return q, scales, zeros


def _reference(x, q, scales, zeros, group, bias=None) -> np.ndarray:
    """``x @ W (+ bias)`` in float64, ``W[k, n] = s[k // g, n] · (q[k, n] − z[k // g, n])``."""
    rows = np.arange(q.shape[0]) // group
    z = 8.0 if zeros is None else zeros[rows].astype(np.float64)
    w = scales[rows].astype(np.float64) * (q.astype(np.float64) - z)
    out = x.astype(np.float64) @ w
    return out if bias is None else out + bias


def _module(shape, emit, epilogue=None) -> tvm.IRModule:
    """``main(x) = epilogue(emit(bb, x))`` for a float32 ``x`` of ``shape``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(emit(bb, x))
            if epilogue is not None:
                y = bb.emit(epilogue(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _w4_module(shape, q, scales, zeros, group, bias=None, epilogue=None) -> tvm.IRModule:
    return _module(
        shape, lambda bb, x: emit_dense_w4(bb, x, q, scales, zeros, group, bias), epilogue
    )


def _w4a8_module(shape, q, scales, zeros, group, bias=None) -> tvm.IRModule:
    return _module(
        shape, lambda bb, x: emit_dense_w4a8(bb, x, q, scales, zeros, group, bias, isa=ISA)
    )


def _run(mod: tvm.IRModule, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(build(mod, rules=RULES), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_matches_numpy(group, asymmetric):
    """K = 196: a multiple of no group size, nor of the 8 rows of a packed word; two
    leading axes; N = 64, whole blocks of two vectors."""
    q, scales, zeros = _weights(196, 64, group, asymmetric)
    x = np.random.default_rng(1).normal(size=(2, 12, 196)).astype(np.float32)
    got = _run(_w4_module(x.shape, q, scales, zeros, group), x)
    _assert_close(got, _reference(x, q, scales, zeros, group))


@pytest.mark.parametrize(
    "shape, n", [((40, 72), 40), ((1, 72), 48), ((3, 1, 72), 16)], ids=["padded", "gemv", "M1"]
)
def test_bias_and_column_padding(shape, n):
    """Columns no vector block divides (40: padded to 48, the padding dropped), one row,
    a bias."""
    q, scales, zeros = _weights(72, n, 32, True, seed=3)
    bias = np.random.default_rng(4).normal(size=n).astype(np.float32)
    x = np.random.default_rng(5).normal(size=shape).astype(np.float32)
    got = _run(_w4_module(shape, q, scales, zeros, 32, bias), x)
    _assert_close(got, _reference(x, q, scales, zeros, 32, bias))


def test_fused_epilogue():
    """FuseOps puts a following GELU in the kernel; the rule computes it per register tile."""
    q, scales, _ = _weights(128, 96, 64, False)
    x = np.random.default_rng(6).normal(size=(1, 32, 128)).astype(np.float32)
    mod = _w4_module(x.shape, q, scales, None, 64, epilogue=relax.op.nn.gelu)
    program = relax_pipeline(host_target(), rules=RULES)(mod)
    assert [gv.name_hint for gv, f in _kernels(program)] == ["fused_dense_w4_gelu"]
    linear = _reference(x, q, scales, None, 64)
    expected = 0.5 * linear * (1 + np.vectorize(math.erf)(linear / np.sqrt(2)))
    np.testing.assert_allclose(_run(mod, x), expected, rtol=1e-4, atol=1e-4)


def _kernels(program: tvm.IRModule) -> list:
    return [(gv, f) for gv, f in program.functions_items() if isinstance(f, tirx.PrimFunc)]


def test_decode_stays_in_the_kernel():
    """One kernel whose constants, after the whole pipeline (FoldConstant would have made a
    float32 [K, N] weight of a Relax decode), are the packed words and the group scales and
    offsets; its decoded weights a local buffer of the parallel column blocks."""
    q, scales, zeros = _weights(256, 128, 32, True)
    program = relax_pipeline(host_target(), rules=RULES)(
        _w4_module((64, 256), q, scales, zeros, 32)
    )
    ((_, kernel),) = _kernels(program)
    assert kernel.attrs["tirx.is_scheduled"]
    found = []
    tvm_ffi.structural_walk(program["main"], (tvm.ir.expr.GenericConst, found.append))
    constants = [c.value.numpy() for c in found if isinstance(c.value, tvm.runtime.Tensor)]
    assert [str(c.dtype) for c in constants] == ["uint32", "float32", "float32"]
    assert constants[0].size * 8 == q.size  # 4 bits a weight
    assert sum(c.nbytes for c in constants) <= 0.2 * q.size * 4
    script = kernel.script()
    assert re.search(rf'{DECODE}_local = T\.sblock_alloc_buffer\(.*scope="local"', script)
    assert "T.parallel" in script


def _assembly(mod: tvm.IRModule, target: tvm.target.Target) -> str:
    lib = build(mod, target, rules=RULES).mod
    llvm = lib if lib.kind == "llvm" else next(m for m in lib.imports if m.kind == "llvm")
    return llvm.inspect_source("asm")


def _fma_pattern(target: tvm.target.Target) -> str:
    """The vector FMA of ``target``'s vector unit: on ``zmm`` with 16 float32 lanes (AVX-512),
    ``ymm`` with 8 (AVX2)."""
    register = {16: "zmm", 8: "ymm"}[vector_unit(target).lanes]
    return rf"vfmadd\d+ps\s+[^\n]*%{register}"


@pytest.mark.parametrize("target", [None, AVX2], ids=["host", "avx2"])
def test_vector_fma_of_the_isa(target):
    """The host's own ISA (``schedules.isa``), and AVX2 built on any x86 host."""
    target = target or host_target()
    if vector_unit(target).lanes not in (8, 16):
        pytest.skip(f"no AVX2 or AVX-512 vector unit in {target}")
    q, scales, zeros = _weights(128, 64, 32, False)
    with target:  # packed for that target's vector unit
        mod = _w4_module((32, 128), q, scales, zeros, 32)
    asm = _assembly(mod, target)
    assert DENSE in asm
    assert len(re.findall(_fma_pattern(target), asm)) >= 8  # the unrolled register tile


def test_library_size_against_fp32(tmp_path):
    """A 512 × 1024 layer: the exported library of the 4-bit kernel is at most 0.3× the FP32
    one (FP32 weights 2 MiB; 4-bit: 256 KiB of nibbles and 16 KiB of scales)."""
    q, scales, _ = _weights(512, 1024, 128, False)
    w = _reference(np.eye(512, dtype=np.float32), q, scales, None, 128).astype(np.float32)
    libraries = {
        "fp32": build(_module((16, 512), lambda bb, x: relax.op.matmul(x, relax.const(w)))),
        "w4": build(_w4_module((16, 512), q, scales, None, 128), rules=RULES),
    }
    sizes = {}
    for name, executable in libraries.items():
        executable.export_library(str(tmp_path / f"{name}.so"))
        sizes[name] = (tmp_path / f"{name}.so").stat().st_size
    assert sizes["fp32"] > w.nbytes
    assert sizes["w4"] <= 0.3 * sizes["fp32"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "q": a["q"] + 2}, "above 15"),
        (lambda a: {**a, "q": a["q"][:-1]}, "are not \\[K=64, N\\]"),
        (lambda a: {**a, "scales": a["scales"][:1]}, "scales"),
        (lambda a: {**a, "zero_points": a["scales"].astype(np.uint8)[:, :3]}, "zero points"),
        (lambda a: {**a, "group_size": 0}, "group size"),
        (lambda a: {**a, "bias": np.zeros(3, np.float32)}, "bias"),
    ],
    ids=["values", "rows", "scales", "zero_points", "group", "bias"],
)
def test_refuses_inconsistent_operands(change, message):
    q, scales, zeros = _weights(64, 16, 32, True)
    args = {"q": q, "scales": scales, "zero_points": zeros, "group_size": 32, "bias": None}
    args = change(args)
    x = relax.Var("x", relax.TensorType((4, 64), "float32"))
    with pytest.raises(RangeprofError, match=message):
        emit_dense_w4(relax.BlockBuilder(), x, **args)


@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_matches_onnxruntime_matmul_nbits(asymmetric):
    """The same codes as onnxruntime's ``MatMulNBits`` (FP32 arithmetic) reads them: K = 200,
    a multiple of no block (group) of 32."""
    q, scales, zeros = _weights(200, 48, 32, asymmetric, seed=9)
    x = np.random.default_rng(10).normal(size=(2, 5, 200)).astype(np.float32)
    model = matmul_nbits(q, scales, zeros, 32, x.shape)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (expected,) = session.run(None, {"x": x})
    _assert_close(_run(_w4_module(x.shape, q, scales, zeros, 32), x), expected)


def test_rows_known_at_run_time():
    """A symbolic row count: no rule claims the kernel, the generic schedule keeps it exact."""
    q, scales, zeros = _weights(64, 32, 32, True)
    rows = tirx.Var("rows", "int64")
    x = np.random.default_rng(7).normal(size=(5, 64)).astype(np.float32)
    got = _run(_w4_module((rows, 64), q, scales, zeros, 32), x)
    _assert_close(got, _reference(x, q, scales, zeros, 32))


def _w4a8_reference(x, q, scales, zeros, group, bias=None):
    """numpy's W4A8: per-row scale ``a = max|x| / 127`` and codes ``rint(x · (1 / a))`` in
    float32 as the kernel computes them, then the exact products in float64; and the bound
    ``a / 2 · Σ_k |W[k, n]|`` of the difference to the float32 activations' result."""
    a = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-30)) / np.float32(127)
    codes = np.rint(x * (np.float32(1) / a))
    w = _reference(np.eye(q.shape[0]), q, scales, zeros, group)
    out = a.astype(np.float64) * (codes.astype(np.float64) @ w)
    bound = a / 2 * np.abs(w).sum(0)
    return (out if bias is None else out + bias), bound


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("asymmetric", [False, True], ids=["symmetric", "asymmetric"])
def test_w4a8_matches_its_emulation(group, asymmetric):
    """K = 196 (rows padded to whole groups), two leading axes; within float rounding of
    numpy's emulation, and within the activations' rounding of the FP32 result."""
    q, scales, zeros = _weights(196, 64, group, asymmetric)
    x = np.random.default_rng(1).normal(size=(2, 12, 196)).astype(np.float32)
    got = _run(_w4a8_module(x.shape, q, scales, zeros, group), x)
    emulated, bound = _w4a8_reference(x, q, scales, zeros, group)
    _assert_close(got, emulated)
    exact = _reference(x, q, scales, zeros, group)
    assert np.all(np.abs(got - exact) <= bound + 1e-5 * np.abs(exact).max())
    # the activations were rounded (~1 %): no FP32 path, whose rounding is ~1e-6
    assert np.abs(got - exact).max() > 1e-4 * np.abs(exact).max()


@pytest.mark.parametrize(
    "shape, n", [((40, 72), 40), ((1, 72), 48), ((3, 1, 72), 16)], ids=["padded", "gemv", "M1"]
)
def test_w4a8_bias_and_column_padding(shape, n):
    q, scales, zeros = _weights(72, n, 8, True, seed=3)
    bias = np.random.default_rng(4).normal(size=n).astype(np.float32)
    x = np.random.default_rng(5).normal(size=shape).astype(np.float32)
    got = _run(_w4a8_module(shape, q, scales, zeros, 8, bias), x)
    _assert_close(got, _w4a8_reference(x, q, scales, zeros, 8, bias)[0])


def _kernel_names(mod: tvm.IRModule, target=None) -> list[str]:
    program = relax_pipeline(target or host_target(), rules=RULES)(mod)
    return sorted(gv.name_hint for gv, _ in _kernels(program))


def test_w4a8_kernels():
    q, scales, zeros = _weights(64, 32, 32, True)
    names = _kernel_names(_w4a8_module((8, 64), q, scales, zeros, 32))
    assert names == [dense_w4a8.DENSE, dense_w4a8.QUANTIZE]


AARCH64 = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+dotprod"]})


@pytest.mark.parametrize(
    "group, target, isa",
    [(4, None, ISA), (32, AARCH64, AARCH64_ISA)],
    ids=["group_of_4", "signed_dot_only"],
)
def test_w4a8_falls_back_to_w4(group, target, isa):
    """Groups of 4 rows (no whole pair of instruction steps), or a target whose dot product
    is signed × signed (NEON's ``sdot``): the FP32-activation kernel, exact."""
    q, scales, zeros = _weights(64, 32, group, False)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 64), "float32"))
    with target or host_target(), bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(emit_dense_w4a8(bb, x, q, scales, zeros, group, isa=isa))
        bb.emit_func_output(out)
    assert _kernel_names(bb.get(), target) == [DENSE]
    if target is None:
        data = np.random.default_rng(8).normal(size=(8, 64)).astype(np.float32)
        _assert_close(_run(bb.get(), data), _reference(data, q, scales, zeros, group))


_MNEMONICS = {
    "llvm.x86.avx512.vpdpbusd.512": r"vpdpbusd\s+[^\n]*%zmm",
    "llvm.x86.avx512.vpdpbusd.256": r"vpdpbusd\s+[^\n]*%ymm",
    "llvm.x86.avx2.pmadd.ub.sw": r"vpmaddubsw\s+[^\n]*%ymm",
}


@pytest.mark.parametrize("target", [None, AVX2], ids=["host", "avx2"])
def test_w4a8_dot_instruction_of_the_isa(target):
    """The instruction the x86 plugin's ISA chooses for the target (the host's own, and AVX2's
    ``vpmaddubsw``, exact for ``|q − z| ≤ 15``), unrolled over the register tile."""
    target = target or host_target()
    instruction = ISA.dot(64, max_weight=15, target=target)
    if instruction is None or instruction.intrinsic not in _MNEMONICS:
        pytest.skip(f"no unsigned × signed 8-bit dot instruction in {target}")
    q, scales, zeros = _weights(128, 64, 32, False)
    with target:
        mod = _w4a8_module((32, 128), q, scales, zeros, 32)
    asm = _assembly(mod, target)
    assert dense_w4a8.DENSE in asm
    assert len(re.findall(_MNEMONICS[instruction.intrinsic], asm)) >= 8
