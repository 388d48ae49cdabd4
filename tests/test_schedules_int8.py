"""The INT8 build path: integer conv2d / dense kernels on the target's dot-product instruction.

Each shape family is built with the integer kernels (``integer_build.build``) for this machine and
run; integer results are compared exactly with numpy. Two forms per family: the bare 8-bit × int8 →
int32 operator, and the layer as the quantization layer writes it (quantize, pad with the zero
point, conv2d / matmul to int32, bias, int64 fixed-point requantization, zero point, clamp, uint8,
dequantize). Inputs are integer multiples of a power-of-two scale and the output scale is a power of
two, so quantize and dequantize are exact and the float output is compared exactly too. Kernels for
instruction sets this machine lacks (AVX-512 VNNI on most AMD hosts, aarch64 ``sdot`` everywhere)
are compiled and their assembly checked; those it has run too."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from rangeprof.profiler.compile.schedules import host_target

from integer_build import build

VNNI = tvm.target.Target({"kind": "llvm", "mcpu": "cascadelake"})
AARCH64 = tvm.target.Target(
    {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]}
)
X_SCALE, Y_SCALE, Y_ZERO = 1 / 16, 1 / 8, 5
ZERO_POINT = {"uint8": 7, "int8": -3}
RANGE = {"uint8": (0, 256), "int8": (-128, 128)}


def _const(value, dtype: str) -> relax.Constant:
    return relax.const(np.asarray(value).astype(dtype), dtype)


class _Layer:
    """Random int8 weights, bias and fixed-point requantization constants for ``channels``
    outputs, and the Relax (``emit``) and numpy (``reference``) forms of the layer."""

    def __init__(self, weight_shape, channels: int, shifts=(34, 40), weight_max: int = 128):
        rng = np.random.default_rng(0)
        self.w = rng.integers(-weight_max, min(weight_max + 1, 128), weight_shape).astype("int8")
        self.bias = rng.integers(-2000, 2000, channels).astype("int32")
        self.mult = rng.integers(2**30, 2**31, channels).astype("int64")
        self.shift = rng.integers(*shifts, channels).astype("int64")

    def requantize(self, bb: relax.BlockBuilder, acc, shape) -> relax.Var:
        def per_channel(value, dtype):
            return _const(value.reshape(shape), dtype)

        acc = bb.emit(relax.op.add(acc, per_channel(self.bias, "int32")))
        t = bb.emit(relax.op.astype(acc, "int64"))
        t = bb.emit(relax.op.multiply(t, per_channel(self.mult, "int64")))
        t = bb.emit(relax.op.add(t, per_channel(np.int64(1) << (self.shift - 1), "int64")))
        t = bb.emit(relax.op.right_shift(t, per_channel(self.shift, "int64")))
        t = bb.emit(relax.op.add(relax.op.astype(t, "int32"), _const(Y_ZERO, "int32")))
        t = bb.emit(relax.op.astype(relax.op.clip(t, 0, 255), "uint8"))
        scale, zero = _const(Y_SCALE, "float32"), _const(Y_ZERO, "int32")
        return bb.emit(relax.op.dequantize(t, scale, zero, axis=1, out_dtype="float32"))

    def requantize_reference(self, acc: np.ndarray, axis: int) -> np.ndarray:
        shape = [1] * acc.ndim
        shape[axis] = -1
        mult, shift = self.mult.reshape(shape), self.shift.reshape(shape)
        t = (acc.astype(np.int64) + self.bias.reshape(shape)) * mult
        t = (t + (np.int64(1) << (shift - 1))) >> shift
        q = np.clip(t.astype(np.int32) + Y_ZERO, 0, 255).astype(np.uint8)
        return ((q.astype(np.float32) - Y_ZERO) * np.float32(Y_SCALE)).astype(np.float32)


def _module(params, body) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _quantize(bb, x, dtype: str, axis: int):
    scale, zero = _const(X_SCALE, "float32"), _const(ZERO_POINT[dtype], "int32")
    return bb.emit(relax.op.quantize(x, scale, zero, axis=axis, out_dtype=dtype))


def _run(mod: tvm.IRModule, x: np.ndarray, target=None) -> np.ndarray:
    vm = relax.VirtualMachine(build(mod, target or host_target()), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _inputs(shape, dtype: str, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """8-bit values and the float input that quantizes exactly to them."""
    q = np.random.default_rng(seed).integers(*RANGE[dtype], shape)
    return q.astype(dtype), ((q - ZERO_POINT[dtype]) * X_SCALE).astype(np.float32)


# ---------------------------------------------------------------------------------- conv2d


def _conv_reference(x: np.ndarray, w: np.ndarray, stride: int, dilation: int, groups: int):
    """int64 NCHW conv (no padding) of integer ``x`` and OIHW ``w``."""
    n, _, h, width = x.shape
    out_ch, per_group, kh, kw = w.shape
    oh = (h - (kh - 1) * dilation - 1) // stride + 1
    ow = (width - (kw - 1) * dilation - 1) // stride + 1
    x, w = x.astype(np.int64), w.astype(np.int64)
    out = np.zeros((n, out_ch, oh, ow), np.int64)
    per_out = out_ch // groups
    for g in range(groups):
        xs = x[:, g * per_group : (g + 1) * per_group]
        ws = w[g * per_out : (g + 1) * per_out]
        for ky in range(kh):
            for kx in range(kw):
                y0, x0 = ky * dilation, kx * dilation
                patch = xs[:, :, y0 : y0 + (oh - 1) * stride + 1 : stride]
                patch = patch[:, :, :, x0 : x0 + (ow - 1) * stride + 1 : stride]
                out[:, g * per_out : (g + 1) * per_out] += np.einsum(
                    "nchw,oc->nohw", patch, ws[:, :, ky, kx]
                )
    return out


# name: (channels in, channels out, size, kernel, stride, dilation, padding, groups)
CONVS = {
    "3x3": (16, 32, 10, 3, 1, 1, 1, 1),
    "3x3_stride2_dilation2_odd_channels": (6, 16, 13, 3, 2, 2, 2, 1),
    "7x7_rgb_stride2": (3, 16, 20, 7, 2, 1, 3, 1),
    "1x1": (32, 64, 7, 1, 1, 1, 0, 1),
    "depthwise3x3": (32, 32, 10, 3, 1, 1, 1, 32),
    "depthwise3x3_stride2": (24, 24, 13, 3, 2, 1, 1, 24),
    "depthwise3x3_stride2_dilation2": (24, 24, 13, 3, 2, 2, 2, 24),
    "12_channels_half_width": (8, 12, 6, 3, 1, 1, 1, 1),
    "10_channels_no_instruction": (8, 10, 6, 3, 1, 1, 1, 1),
    "grouped_no_instruction": (16, 32, 8, 3, 1, 1, 1, 4),
}


def _extremes(w: np.ndarray, q: np.ndarray, dtype: str, weight_max: int, axes, q_axis: int):
    """Where weights are within ±``weight_max`` < 128: the largest products ``vpmaddubsw`` sums
    into int16 (``255 · 64 · 2``, either sign) — input channels 0 and 1 at the largest
    value, weights ``±weight_max`` on them for output channels 0 and 1 (``axes``: the weight's
    output and input axes, ``q_axis``: the input's channel axis)."""
    if weight_max >= 128:
        return
    top = np.moveaxis(w, axes, (0, 1))
    top[0, :2], top[1, :2] = weight_max, -weight_max
    np.moveaxis(q, q_axis, 0)[:2] = RANGE[dtype][1] - 1


def _conv_case(name: str, dtype: str, quantized: bool, shifts=(34, 40), weight_max: int = 128):
    """(module, input, expected output) for one conv family."""
    c_in, c_out, size, kernel, stride, dilation, pad, groups = CONVS[name]
    layer = _Layer((c_out, c_in // groups, kernel, kernel), c_out, shifts, weight_max)
    q, xf = _inputs((1, c_in, size, size), dtype)
    _extremes(layer.w, q, dtype, weight_max, (0, 1), 1)
    xf = ((q.astype(np.int64) - ZERO_POINT[dtype]) * X_SCALE).astype(np.float32)
    attrs = dict(strides=stride, dilation=dilation, groups=groups, out_dtype="int32")

    def body(bb, x):
        if quantized:
            x = _quantize(bb, x, dtype, axis=1)
        if pad:
            widths = [0, 0, 0, 0, pad, pad, pad, pad]
            x = bb.emit(relax.op.nn.pad(x, widths, pad_value=float(ZERO_POINT[dtype])))
        acc = bb.emit(relax.op.nn.conv2d(x, _const(layer.w, "int8"), padding=0, **attrs))
        return layer.requantize(bb, acc, (1, c_out, 1, 1)) if quantized else acc

    in_dtype = "float32" if quantized else dtype
    mod = _module([relax.Var("x", relax.TensorType(q.shape, in_dtype))], body)
    padded = np.pad(q, [(0, 0)] * 2 + [(pad, pad)] * 2, constant_values=ZERO_POINT[dtype])
    acc = _conv_reference(padded, layer.w, stride, dilation, groups)
    if quantized:
        return mod, xf, layer.requantize_reference(acc, axis=1)
    return mod, q, acc.astype(np.int32)


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv2d_int32_exact(name, dtype):
    mod, x, expected = _conv_case(name, dtype, quantized=False)
    actual = _run(mod, x)
    assert actual.dtype == np.int32
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("name", sorted(CONVS))
def test_quantized_conv_layer_exact(name):
    dtype = "int8" if "depthwise" in name else "uint8"
    mod, x, expected = _conv_case(name, dtype, quantized=True)
    np.testing.assert_array_equal(_run(mod, x), expected)


def test_requantize_shifts_below_32_exact():
    """Shifts below 32 keep the 64-bit shift (the 32-bit rewrite needs every shift ≥ 32)."""
    mod, x, expected = _conv_case("3x3", "uint8", quantized=True, shifts=(20, 36))
    np.testing.assert_array_equal(_run(mod, x), expected)


# ----------------------------------------------------------------------------------- dense

# name: (input shape, output columns)
DENSES = {
    "gemv": ((1, 64), 40),
    "rows_3d": ((2, 5, 64), 48),
    "classifier_k_not_multiple_of_4": ((3, 30), 1000),
    "37_columns_padded": ((1, 64), 37),  # no instruction's lanes divide 37: padded to 48
}


def _dense_case(name: str, dtype: str, quantized: bool, weight_max: int = 128):
    shape, columns = DENSES[name]
    layer = _Layer((shape[-1], columns), columns, weight_max=weight_max)
    q, xf = _inputs(shape, dtype)
    _extremes(layer.w, q, dtype, weight_max, (1, 0), -1)
    xf = ((q.astype(np.int64) - ZERO_POINT[dtype]) * X_SCALE).astype(np.float32)

    def body(bb, x):
        if quantized:
            x = _quantize(bb, x, dtype, axis=-1)
        acc = bb.emit(relax.op.matmul(x, _const(layer.w, "int8"), out_dtype="int32"))
        return layer.requantize(bb, acc, (columns,)) if quantized else acc

    in_dtype = "float32" if quantized else dtype
    mod = _module([relax.Var("x", relax.TensorType(shape, in_dtype))], body)
    acc = q.astype(np.int64) @ layer.w.astype(np.int64)
    if quantized:
        return mod, xf, layer.requantize_reference(acc, axis=-1)
    return mod, q, acc.astype(np.int32)


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("name", sorted(DENSES))
def test_dense_int32_exact(name, dtype):
    mod, x, expected = _dense_case(name, dtype, quantized=False)
    np.testing.assert_array_equal(_run(mod, x), expected)


@pytest.mark.parametrize("name", ["gemv", "rows_3d", "37_columns_padded"])
def test_quantized_dense_layer_exact(name):
    mod, x, expected = _dense_case(name, "uint8", quantized=True)
    np.testing.assert_array_equal(_run(mod, x), expected)


def test_columns_no_lanes_divide_run_on_the_dot_kernel():
    """37 columns: zero weight rows pad them to the widest lanes, the dense runs on the dot
    instruction's kernel and a copy drops the padding (before: TVM's scalar matmul, 12× slower
    on a text recognizer's 6625 classes)."""
    from rangeprof.byoc.cpu.dense_int8 import DENSE, legalize_matmul_int8
    from rangeprof.byoc.x86.isa import ISA
    from rangeprof.profiler.compile.schedules.dense import COLUMNS

    mod = _dense_case("37_columns_padded", "uint8", quantized=False)[0]
    legalize = {"relax.matmul": lambda bb, call: legalize_matmul_int8(bb, call, ISA)}
    with host_target():
        legalized = relax.transform.LegalizeOps(legalize)(mod)
    functions = legalized.functions_items()
    kernels = {gv.name_hint for gv, f in functions if isinstance(f, tirx.PrimFunc)}
    assert {DENSE, COLUMNS} <= kernels and "matmul" not in kernels, kernels


# ------------------------------------------------------------------------------- assembly


def _assembly(mod: tvm.IRModule, target) -> str:
    lib = build(mod, target).mod
    llvm = lib if lib.kind == "llvm" else next(m for m in lib.imports if m.kind == "llvm")
    return llvm.inspect_source("asm")


@pytest.mark.parametrize(
    "target, instruction",
    [(VNNI, "vpdpbusd"), (AARCH64, "sdot")],
    ids=["avx512_vnni", "aarch64_dotprod"],
)
@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("case", ["conv", "dense"])
def test_dot_instruction_in_assembly(case, dtype, target, instruction):
    if case == "conv":
        mod = _conv_case("3x3", dtype, quantized=True)[0]
    else:
        mod = _dense_case("rows_3d", dtype, quantized=True)[0]
    assert instruction in _assembly(mod, target)


def test_host_uses_its_widest_dot_instruction():
    target = host_target()
    has = tvm.target.codegen.target_has_features
    if not has("avx2", target):
        pytest.skip("no AVX2 on this machine")
    expected = "vpdpbusd" if has("avx512vnni", target) else "vpmaddwd"
    assert expected in _assembly(_conv_case("3x3", "uint8", quantized=True)[0], target)


# ------------------------------------------------------------ depthwise: pairs of int16 taps

AVX512 = tvm.target.Target({"kind": "llvm", "mcpu": "skylake-avx512"})  # AVX-512 BW, no VNNI
AVX2 = tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})
# target, the feature the host needs to run it, the instruction pairing taps, its registers
# for 32 channels (16 lanes divide them) and for 24 (8 lanes).
PAIR_TARGETS = {
    "avx512_vnni": (VNNI, "avx512vnni", "vpdpwssd", "zmm", "ymm"),
    "avx512bw": (AVX512, "avx512bw", "vpmaddwd", "zmm", "ymm"),
    "avx2": (AVX2, "avx2", "vpmaddwd", "ymm", "ymm"),
}
DEPTHWISE_CONVS = [name for name in CONVS if name.startswith("depthwise")]


@pytest.mark.parametrize("isa", sorted(PAIR_TARGETS))
def test_depthwise_tap_pairs_in_assembly(isa):
    """Two taps per instruction, in the widest registers whose lanes divide the channels."""
    target, _, instruction, wide, narrow = PAIR_TARGETS[isa]
    for name, register in (("depthwise3x3", wide), ("depthwise3x3_stride2", narrow)):
        asm = _assembly(_conv_case(name, "int8", quantized=True)[0], target)
        assert re.search(rf"{instruction}\s+%{register}", asm), (name, instruction, register)


@pytest.mark.parametrize("isa", sorted(PAIR_TARGETS))
@pytest.mark.parametrize("name", DEPTHWISE_CONVS)
def test_depthwise_exact_on_each_pair_instruction(name, isa):
    target, feature, *_ = PAIR_TARGETS[isa]
    if not tvm.target.codegen.target_has_features(feature, host_target()):
        pytest.skip(f"no {feature} on this machine")
    mod, x, expected = _conv_case(name, "int8", quantized=False)
    np.testing.assert_array_equal(_run(mod, x, target), expected)
    mod, x, expected = _conv_case(name, "int8", quantized=True)
    np.testing.assert_array_equal(_run(mod, x, target), expected)


# ------------------------------------------------------------- AVX2: 7-bit weights, vpmaddubsw

SEVEN_BIT_CONVS = ["3x3", "3x3_stride2_dilation2_odd_channels", "7x7_rgb_stride2", "1x1"]


def _avx2_or_skip():
    if not tvm.target.codegen.target_has_features("avx2", host_target()):
        pytest.skip("no AVX2 on this machine")


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("name", SEVEN_BIT_CONVS)
def test_avx2_seven_bit_weights_conv_exact_at_the_int16_limit(name, dtype):
    """Weights within ±64 go through vpmaddubsw's int16 pair sums: exact up to 255·64·2."""
    _avx2_or_skip()
    mod, x, expected = _conv_case(name, dtype, quantized=False, weight_max=64)
    assert np.abs(expected).max() >= 2 * 255 * 64  # the extremes are in the sums
    np.testing.assert_array_equal(_run(mod, x, AVX2), expected)
    mod, x, expected = _conv_case(name, dtype, quantized=True, weight_max=64)
    np.testing.assert_array_equal(_run(mod, x, AVX2), expected)


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
@pytest.mark.parametrize("name", ["gemv", "rows_3d", "classifier_k_not_multiple_of_4"])
def test_avx2_seven_bit_weights_dense_exact_at_the_int16_limit(name, dtype):
    _avx2_or_skip()
    mod, x, expected = _dense_case(name, dtype, quantized=False, weight_max=64)
    np.testing.assert_array_equal(_run(mod, x, AVX2), expected)
    mod, x, expected = _dense_case(name, dtype, quantized=True, weight_max=64)
    np.testing.assert_array_equal(_run(mod, x, AVX2), expected)


@pytest.mark.parametrize("case", ["conv", "dense"])
def test_avx2_instruction_follows_the_weight_range(case):
    """vpmaddubsw only where every weight is within ±64; one weight of -65 (or more) keeps the
    exact vpmaddwd."""

    def assembly(weight_max):
        if case == "conv":
            return _assembly(_conv_case("3x3", "uint8", True, weight_max=weight_max)[0], AVX2)
        return _assembly(_dense_case("rows_3d", "uint8", True, weight_max=weight_max)[0], AVX2)

    seven_bit, wider = assembly(64), assembly(65)
    assert "vpmaddubsw" in seven_bit
    assert "vpmaddubsw" not in wider and "vpmaddwd" in wider


# ------------------------------------------------------- RGB stems: channels padded in the graph


def _nhwc_conv(channels: int, padding: int) -> tuple[tvm.IRModule, np.ndarray, np.ndarray]:
    """An NHWC uint8 × int8 7×7 stride-2 conv, its input and numpy's int32 result."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (1, 15, 15, channels)).astype("uint8")
    w = rng.integers(-128, 128, (16, 7, 7, channels)).astype("int8")
    data = relax.Var("x", relax.TensorType(x.shape, "uint8"))

    def body(bb, data):
        conv = relax.op.nn.conv2d(
            data,
            _const(w, "int8"),
            strides=2,
            padding=padding,
            data_layout="NHWC",
            kernel_layout="OHWI",
            out_dtype="int32",
        )
        return bb.emit(conv)

    padded = np.pad(x, [(0, 0), (padding, padding), (padding, padding), (0, 0)])
    nchw = _conv_reference(padded.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2), 2, 1, 1)
    return _module([data], body), x, nchw.transpose(0, 2, 3, 1).astype(np.int32)


def test_unpadded_rgb_conv_takes_a_fourth_zero_channel():
    """A 3-channel conv without padding (the image padded before it, as the quantized graph
    does) convolves a graph-padded 4-channel input with a zero fourth weight channel: no stage
    in its kernel. With padding of its own (its stage pads channels too) or 4 channels, the
    graph stays as it was. Results are exact either way."""
    from rangeprof.byoc.cpu.prepare import pad_int8_channels

    def calls(mod, op):
        values = [b.value for blk in mod["main"].body.blocks for b in blk.bindings]
        return [c for c in values if isinstance(c, relax.Call) and c.op.name == op]

    def convs(mod):
        return calls(mod, "relax.nn.conv2d")

    mod, x, expected = _nhwc_conv(3, padding=0)
    rewritten = pad_int8_channels(mod)
    (conv,), (pad,) = convs(rewritten), calls(rewritten, "relax.nn.pad")
    data, weight = conv.args
    assert [int(d) for d in data.ty.shape] == [1, 15, 15, 4] and pad.args[0].same_as(
        mod["main"].params[0]
    )
    w = weight.value.numpy()
    assert w.shape == (16, 7, 7, 4) and not w[..., 3].any()
    np.testing.assert_array_equal(_run(mod, x), expected)
    for channels, padding in ((3, 3), (4, 0)):
        mod, x, expected = _nhwc_conv(channels, padding)
        (conv,) = convs(pad_int8_channels(mod))
        assert int(conv.args[0].ty.shape[3]) == channels
        np.testing.assert_array_equal(_run(mod, x), expected)
