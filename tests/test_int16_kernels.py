"""int16 activations × int8 weights on the int16-pair dot instructions (the quantizer's int16
fallback for layers too sensitive for 8 bits).

Each layer (NCHW conv2d with its own zero padding, or matmul, to int32) is built with
the integer kernels (``integer_build.build``) for this machine and run; the int32 results must
equal numpy's int64 ones exactly, with activations at ±32767 and weights at ±127 where the sums
are largest (still within int32, as the quantizer guarantees). Kernels for instruction sets
this machine lacks are compiled and their assembly checked; those it has run too.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules import host_target

from integer_build import build

VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake"})
AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})  # AVX-512 BW, no VNNI
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
AARCH64 = tvm.target.Target(
    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]}
)
# target, the feature the host needs to run it, the int16-pair instruction, its registers
ISAS = {
    "avx512_vnni": (VNNI, "avx512vnni", "vpdpwssd", "zmm"),
    "avx512bw": (AVX512, "avx512bw", "vpmaddwd", "zmm"),
    "avx2": (AVX2, "avx2", "vpmaddwd", "ymm"),
}
X_MAX, W_MAX = 32767, 127
INT32_MAX = np.iinfo(np.int32).max


def _module(shape, body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "int16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(body(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _build(mod: tvm.IRModule, target=None) -> tvm.runtime.Executable:
    return build(mod, target or host_target(), fold_scales=False)


def _run(mod: tvm.IRModule, x: np.ndarray, target=None) -> np.ndarray:
    vm = relax.VirtualMachine(_build(mod, target), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _assembly(mod: tvm.IRModule, target) -> str:
    lib = _build(mod, target).mod
    llvm = lib if lib.kind == "llvm" else next(m for m in lib.imports if m.kind == "llvm")
    return llvm.inspect_source("asm")


def _random(shape, low: int, high: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high + 1, shape)


# ---------------------------------------------------------------------------------- conv2d

# name: (channels in, channels out, size, kernel, stride, dilation, padding, groups)
CONVS = {
    "3x3_pad1_stride2": (16, 32, 13, 3, 2, 1, 1, 1),
    "1x1": (32, 64, 7, 1, 1, 1, 0, 1),
    "3x3_dilation2": (16, 32, 12, 3, 1, 2, 2, 1),
    "3x3_odd_channels": (5, 16, 9, 3, 1, 1, 1, 1),
    "depthwise3x3": (32, 32, 10, 3, 1, 1, 1, 32),
    "depthwise3x3_stride2": (24, 24, 13, 3, 2, 1, 1, 24),
    "grouped_no_instruction": (16, 32, 8, 3, 1, 1, 1, 4),
}


def _conv_reference(x, w, stride: int, dilation: int, padding: int, groups: int) -> np.ndarray:
    """int64 NCHW conv of ``x`` (zero-padded) with OIHW ``w``."""
    x = np.pad(x.astype(np.int64), [(0, 0), (0, 0), (padding, padding), (padding, padding)])
    w = w.astype(np.int64)
    n, _, h, width = x.shape
    out_ch, per_group, kh, kw = w.shape
    oh = (h - (kh - 1) * dilation - 1) // stride + 1
    ow = (width - (kw - 1) * dilation - 1) // stride + 1
    per_out = out_ch // groups
    out = np.zeros((n, out_ch, oh, ow), np.int64)
    for g in range(groups):
        xs = x[:, g * per_group : (g + 1) * per_group]
        outs = slice(g * per_out, (g + 1) * per_out)
        for ky in range(kh):
            for kx in range(kw):
                y0, x0 = ky * dilation, kx * dilation
                patch = xs[:, :, y0 : y0 + (oh - 1) * stride + 1 : stride]
                patch = patch[:, :, :, x0 : x0 + (ow - 1) * stride + 1 : stride]
                out[:, outs] += np.einsum("nchw,oc->nohw", patch, w[outs, :, ky, kx])
    return out


def _conv_case(name: str, epilogue: bool = False):
    """(module, int16 input, expected output): random activations and weights, and the
    largest sums of either sign — output channels 0 and 1 all +127 and all -127 over a
    top-left corner of +32767 and a bottom-right one of -32767."""
    c_in, c_out, size, kernel, stride, dilation, pad, groups = CONVS[name]
    x = _random((1, c_in, size, size), -X_MAX, X_MAX, 1).astype("int16")
    w = _random((c_out, c_in // groups, kernel, kernel), -W_MAX, W_MAX, 2).astype("int8")
    half = size // 2
    x[:, :, :half, :half], x[:, :, half:, half:] = X_MAX, -X_MAX
    w[0], w[1] = W_MAX, -W_MAX
    bias = _random((c_out,), -1000, 1000, 3).astype("int32")
    scale = np.float32(2.0**-12)

    def body(bb, data):
        acc = bb.emit(
            relax.op.nn.conv2d(
                data,
                relax.const(w, "int8"),
                strides=stride,
                padding=pad,
                dilation=dilation,
                groups=groups,
                out_dtype="int32",
            )
        )
        if not epilogue:
            return acc
        acc = bb.emit(relax.op.add(acc, relax.const(bias.reshape(1, -1, 1, 1), "int32")))
        return bb.emit(relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(scale)))

    acc = _conv_reference(x, w, stride, dilation, pad, groups)
    per_in = c_in // groups * kernel * kernel
    assert np.abs(acc).max() >= per_in * X_MAX * W_MAX // 4  # the extremes are in the sums
    assert np.abs(acc).max() + 1000 <= INT32_MAX
    if epilogue:
        expected = (acc + bias.reshape(1, -1, 1, 1)).astype(np.float32) * scale
    else:
        expected = acc.astype(np.int32)
    return _module(x.shape, body), x, expected


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv2d_int16_exact(name):
    mod, x, expected = _conv_case(name)
    actual = _run(mod, x)
    assert actual.dtype == np.int32
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("name", ["3x3_pad1_stride2", "depthwise3x3"])
def test_conv2d_int16_with_epilogue_exact(name):
    """Bias add and float scaling fused after the integer core."""
    mod, x, expected = _conv_case(name, epilogue=True)
    np.testing.assert_array_equal(_run(mod, x), expected)


# ---------------------------------------------------------------------------------- matmul

# name: (input shape, output columns)
MATMULS = {
    "rows_3d": ((1, 128, 256), 64),
    "2d": ((4, 96), 48),
    "odd_k": ((3, 75), 32),
    "20_columns_no_instruction": ((2, 64), 20),
}


def _matmul_case(name: str, epilogue: bool = False):
    shape, columns = MATMULS[name]
    x = _random(shape, -X_MAX, X_MAX, 4).astype("int16")
    w = _random((shape[-1], columns), -W_MAX, W_MAX, 5).astype("int8")
    x[..., 0, :], x[..., 1, :] = X_MAX, -X_MAX
    w[:, 0], w[:, 1] = W_MAX, -W_MAX
    bias = _random((columns,), -1000, 1000, 6).astype("int32")
    scale = np.float32(2.0**-12)

    def body(bb, data):
        acc = bb.emit(relax.op.matmul(data, relax.const(w, "int8"), out_dtype="int32"))
        if not epilogue:
            return acc
        acc = bb.emit(relax.op.add(acc, relax.const(bias, "int32")))
        return bb.emit(relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(scale)))

    acc = x.astype(np.int64) @ w.astype(np.int64)
    assert np.abs(acc).max() == shape[-1] * X_MAX * W_MAX <= INT32_MAX - 1000
    expected = (acc + bias).astype(np.float32) * scale if epilogue else acc.astype(np.int32)
    return _module(x.shape, body), x, expected


@pytest.mark.parametrize("name", sorted(MATMULS))
def test_matmul_int16_exact(name):
    mod, x, expected = _matmul_case(name)
    actual = _run(mod, x)
    assert actual.dtype == np.int32
    np.testing.assert_array_equal(actual, expected)


def test_matmul_int16_with_epilogue_exact():
    mod, x, expected = _matmul_case("rows_3d", epilogue=True)
    np.testing.assert_array_equal(_run(mod, x), expected)


# ----------------------------------------------------------------- instructions per target


def test_host_uses_its_int16_pair_instruction():
    """An int16 conv runs our dot-product kernel on the host's int16-pair instruction:
    ``vpdpwssd`` with AVX-512 VNNI, else ``vpmaddwd``."""
    target = host_target()
    has = tvm.target.codegen.target_has_features
    if not has("avx2", target):
        pytest.skip("no AVX2 on this machine")
    expected = "vpdpwssd" if has("avx512vnni", target) else "vpmaddwd"
    asm = _assembly(_conv_case("3x3_pad1_stride2")[0], target)
    assert "conv2d_int8" in asm  # our kernel, not TVM's legalization
    assert re.search(rf"\b{expected}\b", asm)


@pytest.mark.parametrize("isa", sorted(ISAS))
@pytest.mark.parametrize("case", ["conv", "depthwise", "matmul"])
def test_int16_pair_instruction_in_assembly(case, isa):
    """Every x86 target with an int16-pair instruction uses it, in its widest registers."""
    target, _, instruction, register = ISAS[isa]
    mod = {
        "conv": lambda: _conv_case("3x3_pad1_stride2")[0],
        "depthwise": lambda: _conv_case("depthwise3x3")[0],
        "matmul": lambda: _matmul_case("rows_3d")[0],
    }[case]()
    asm = _assembly(mod, target)
    assert re.search(rf"{instruction}\s+%{register}", asm), (case, instruction, register)


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_int16_exact_on_each_pair_instruction(isa):
    target, feature, *_ = ISAS[isa]
    if not tvm.target.codegen.target_has_features(feature, host_target()):
        pytest.skip(f"no {feature} on this machine")
    for mod, x, expected in (
        _conv_case("3x3_dilation2"),
        _conv_case("depthwise3x3_stride2"),
        _matmul_case("2d"),
    ):
        np.testing.assert_array_equal(_run(mod, x, target), expected)


def test_aarch64_builds_int16_layers_without_an_int16_dot():
    """NEON's ``sdot`` is 8-bit only: int16 convs and matmuls still build (TVM's legalization;
    depthwise convs on the widening multiply-add kernel)."""
    for mod in (
        _conv_case("1x1")[0],
        _conv_case("depthwise3x3")[0],
        _matmul_case("2d")[0],
    ):
        assert "sdot" not in _assembly(mod, AARCH64)
