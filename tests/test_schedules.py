"""The fast FP32 CPU build: every operator rule and the shared models match onnxruntime and TVM.

Small models cover each rule's shapes (dense / 1×1 / strided / depthwise / grouped convs, channel
counts that are no multiple of 16, Gemm, 3-D MatMul, pooling, a small attention block); each is
compared with onnxruntime and with TVM's default build. The zoo models are compared with
onnxruntime only (TVM's default build of ResNet-18 takes seconds per image).
"""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from onnx import helper
from tvm import relax

from rangeprof.profiler.compile.schedules import build, host_target
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model, load_model_bytes
from rangeprof.profiler.profiling.data import model_inputs, open_data

from conftest import ZOO_SHAPES, zoo_model
from onnx_builders import single_io_model

RTOL, ATOL = 1e-4, 1e-5


def _conv(c_in, c_out, size, hw=12, stride=1, pad=None, group=1, act="Relu", seed=0):
    """Conv (with bias) -> BatchNormalization -> activation, as the zoo models have them."""
    rng = np.random.default_rng(seed)
    pad = size // 2 if pad is None else pad
    inits = {
        "w": rng.normal(size=(c_out, c_in // group, size, size)) / np.sqrt(c_in * size * size),
        "b": rng.normal(size=c_out),
        "g": rng.uniform(0.5, 1.5, c_out),
        "beta": rng.normal(size=c_out),
        "m": rng.normal(size=c_out),
        "v": rng.uniform(0.5, 2.0, c_out),
    }
    conv = helper.make_node(
        "Conv", ["x", "w", "b"], ["c"], pads=[pad] * 4, strides=[stride] * 2, group=group
    )
    bn = helper.make_node("BatchNormalization", ["c", "g", "beta", "m", "v"], ["n"])
    if act == "Clip":
        inits.update(lo=np.float32(0.0), hi=np.float32(6.0))
        last = helper.make_node("Clip", ["n", "lo", "hi"], ["y"])
    else:
        last = helper.make_node(act, ["n"], ["y"])
    out = (hw + 2 * pad - size) // stride + 1
    return single_io_model([conv, bn, last], inits, (1, c_in, hw, hw), (1, c_out, out, out))


def _residual():
    """conv -> add of the input -> relu: a residual epilogue."""
    rng = np.random.default_rng(5)
    inits = {"w": rng.normal(size=(16, 16, 3, 3)) / 12, "b": rng.normal(size=16)}
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    return single_io_model(nodes, inits, (1, 16, 10, 10), (1, 16, 10, 10))


def _gemm(n_out=1000):
    rng = np.random.default_rng(6)
    inits = {"w": rng.normal(size=(n_out, 64)), "b": rng.normal(size=n_out)}
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)
    return single_io_model([node], inits, (3, 64), (3, n_out))


def _affine_between_convs():
    """conv → sigmoid → ``scale · x + bias`` with the scalar constants first (PP-LCNet's
    learnable affine block, as Paddle exports it) → padded conv."""
    rng = np.random.default_rng(11)
    inits = {
        "w1": rng.normal(size=(8, 4, 3, 3)),
        "w2": rng.normal(size=(8, 8, 3, 3)),
        "scale": [1.5],
        "bias": [-0.25],
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c1"], ["r"]),
        helper.make_node("Mul", ["scale", "r"], ["m"]),
        helper.make_node("Add", ["bias", "m"], ["a"]),
        helper.make_node("Conv", ["a", "w2"], ["y"], pads=[1, 1, 1, 1]),
    ]
    return single_io_model(nodes, inits, (1, 4, 6, 6), (1, 8, 6, 6))


def _matmul_odd_columns():
    """A classifier's MatMul without bias on a column count no vector width divides."""
    w = np.random.default_rng(8).normal(size=(24, 53))
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    return single_io_model([node], {"w": w}, (1, 7, 24), (1, 7, 53))


def _matmul_3d():
    """MatMul -> bias -> GELU (erf form): an epilogue that reads the matmul twice."""
    rng = np.random.default_rng(7)
    inits = {"w": rng.normal(size=(32, 48)), "b": rng.normal(size=48)}
    inits.update(r2=np.float32(np.sqrt(2)), one=np.float32(1), half=np.float32(0.5))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Div", ["a", "r2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["a", "e1"], ["p"]),
        helper.make_node("Mul", ["p", "half"], ["y"]),
    ]
    return single_io_model(nodes, inits, (2, 5, 32), (2, 5, 48))


def _pooling(kind):
    node = {
        "max": helper.make_node(
            "MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]
        ),
        "avg": helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2]),
        "global": helper.make_node("GlobalAveragePool", ["x"], ["y"]),
    }[kind]
    out = {"max": 8, "avg": 8, "global": 1}[kind]
    return single_io_model([node], {}, (1, 32, 16, 16), (1, 32, out, out))


def _attention():
    """LayerNorm -> Q, K, V projections -> softmax(Q Kᵀ / √d) V -> output projection."""
    rng = np.random.default_rng(8)
    seq, dim = 16, 32
    inits = {f"w{n}": rng.normal(size=(dim, dim)) / np.sqrt(dim) for n in "qkvo"}
    inits.update(gamma=rng.uniform(0.5, 1.5, dim), beta=rng.normal(size=dim))
    inits["scale"] = np.float32(1 / np.sqrt(dim))
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], axis=-1),
        *[helper.make_node("MatMul", ["ln", f"w{n}"], [n]) for n in "qkv"],
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Mul", ["s", "scale"], ["ss"]),
        helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["a"]),
        helper.make_node("MatMul", ["a", "wo"], ["o"]),
        helper.make_node("Add", ["o", "x"], ["y"]),
    ]
    return single_io_model(nodes, inits, (1, seq, dim), (1, seq, dim))


def _gelu():
    """A feed-forward layer as exported: MatMul -> erf GELU (x/√2, Erf, +1, ·x, ·½) -> MatMul."""
    rng = np.random.default_rng(9)
    inits = {"w1": rng.normal(size=(32, 128)) / 4, "w2": rng.normal(size=(128, 32)) / 8}
    inits.update(sqrt2=np.float32(np.sqrt(2)), one=np.float32(1), half=np.float32(0.5))
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["hs"]),
        helper.make_node("Erf", ["hs"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["h", "e1"], ["g"]),
        helper.make_node("Mul", ["g", "half"], ["gh"]),
        helper.make_node("MatMul", ["gh", "w2"], ["y"]),
    ]
    return single_io_model(nodes, inits, (1, 16, 32), (1, 16, 32))


CASES = {
    "conv3x3_bias_relu": lambda: _conv(16, 32, 3),
    "conv1x1": lambda: _conv(32, 64, 1),
    "conv3x3_stride2": lambda: _conv(8, 16, 3, hw=13, stride=2),
    "conv7x7_rgb": lambda: _conv(3, 16, 7, hw=20, stride=2, pad=3),
    "conv_24_channels": lambda: _conv(16, 24, 1, act="Clip"),
    "conv_10_channels": lambda: _conv(6, 10, 3, act="Sigmoid"),
    "depthwise_relu6": lambda: _conv(32, 32, 3, group=32, act="Clip"),
    "depthwise_stride2": lambda: _conv(24, 24, 3, hw=13, stride=2, group=24),
    "grouped_conv": lambda: _conv(16, 32, 3, group=4),
    "residual": _residual,
    "gemm": _gemm,
    "gemm_odd_columns": lambda: _gemm(37),
    "matmul_odd_columns": _matmul_odd_columns,
    "affine_between_convs": _affine_between_convs,
    "matmul_3d": _matmul_3d,
    "max_pool": lambda: _pooling("max"),
    "avg_pool": lambda: _pooling("avg"),
    "global_avg_pool": lambda: _pooling("global"),
    "attention": _attention,
    "gelu": _gelu,
}


def _run(executable, inputs: list[np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
    return (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()


def _assert_close(actual, expected):
    scale = max(float(np.abs(expected).max()), 1.0)
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale)


def _ort(model_bytes: bytes, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_onnxruntime_and_default_build(case):
    model = CASES[case]()
    data = model.SerializeToString()
    mod = import_onnx(load_model_bytes(data, f"{case}.onnx")).mod
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)

    ours = _run(build(mod), [x])
    _assert_close(ours, _ort(data, {"x": x}))
    _assert_close(ours, _run(tvm.compile(mod, target=host_target()), [x]))


def test_gelu_erf_is_vector_arithmetic_not_a_libm_call():
    """LLVM lowers ``erf`` to one ``erff`` call per element; the build's is plain arithmetic."""
    mod = import_onnx(load_model_bytes(_gelu().SerializeToString(), "gelu.onnx")).mod

    def assembly(executable) -> str:
        lib = executable.mod
        llvm = lib if lib.kind == "llvm" else next(m for m in lib.imports if m.kind == "llvm")
        return llvm.inspect_source("asm")

    assert "erff" not in assembly(build(mod))
    assert "erff" in assembly(tvm.compile(mod, target=host_target()))  # TVM's default


@pytest.mark.zoo
@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "tiny_bert", "digits_cnn"])
def test_zoo_matches_onnxruntime(name):
    path = zoo_model(name)
    mod = import_onnx(load_model(path, ZOO_SHAPES.get(name) or None)).mod
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = model_inputs(load_model(path, ZOO_SHAPES.get(name) or None))
    feeds = next(open_data("random", inputs, samples=1).batches())
    _assert_close(_run(build(mod), list(feeds.values())), session.run(None, feeds)[0])


def test_float_mod_is_numpys_at_infinities_and_signed_zeros():
    """ONNX ``Mod(fmod=0)`` on floats is numpy's ``mod``: ``-3 mod inf`` is ``inf``, ``1 mod
    -inf`` is ``-inf``, a zero takes the divisor's sign (TVM's ``x - floor(x / y) · y`` gives
    NaN and unsigned zeros); random values agree bit for bit, a broadcast divisor too."""
    from onnx import TensorProto

    edges = np.array([0, -0.0, 0, -0.0, -3, 3, -1, 1, np.inf, -np.inf, 1, 1, np.nan, 1], np.float32)
    divisors = np.array(
        [-2, 2, 2, -2, np.inf, np.inf, -np.inf, -np.inf, 2, 2, 0, -0.0, 2, np.nan], np.float32
    )
    rng = np.random.default_rng(12)
    cases = [
        (edges, divisors),
        (rng.normal(size=(3, 14)).astype(np.float32) * 10, rng.normal(size=14).astype(np.float32)),
    ]
    for x, y in cases:
        graph = helper.make_graph(
            [helper.make_node("Mod", ["x", "y"], ["z"], fmod=0)],
            "mod",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
                helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y.shape)),
            ],
            [helper.make_tensor_value_info("z", TensorProto.FLOAT, list(x.shape))],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        mod = import_onnx(load_model_bytes(model.SerializeToString(), "mod.onnx")).mod
        with np.errstate(invalid="ignore"):  # NaN for an infinite dividend or a zero divisor
            want = np.mod(x, y)
        got = _run(build(mod), [x, y])
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize(
    ("op", "attrs", "numpy"),
    [
        ("ReduceMax", {"keepdims": 1}, lambda x: np.max(x, axis=(1, 2), keepdims=True)),
        ("ReduceMin", {"keepdims": 0}, lambda x: np.min(x, axis=(1, 2))),
        ("ArgMax", {"axis": 2, "keepdims": 0}, lambda x: np.argmax(x, axis=2)),
        ("ArgMin", {"axis": 1, "keepdims": 1}, lambda x: np.argmin(x, axis=1, keepdims=True)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_extremes_of_rows_of_infinities_are_numpys(op, attrs, numpy):
    """A row of ``-inf`` (a fully masked attention row) has max ``-inf`` and argmax 0, a row of
    ``inf`` min ``inf`` and argmin 0 (TVM reduces from the lowest finite value: ``-3.4e38``, and
    index -1); ties take the first index; random rows agree exactly."""
    from onnx import TensorProto

    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)
    x[0] = -np.inf
    x[1] = np.inf
    x[2, :, 1:3] = x[2].max() + 1  # ties
    constant = helper.make_node("Constant", [], ["axes"], value_ints=[1, 2])
    axes = [] if "axis" in attrs else [constant]
    node = helper.make_node(op, ["x", "axes"] if axes else ["x"], ["y"], **attrs)
    want = numpy(x)
    elem = TensorProto.INT64 if want.dtype == np.int64 else TensorProto.FLOAT
    graph = helper.make_graph(
        [*axes, node],
        "extremes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", elem, list(want.shape))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    mod = import_onnx(load_model_bytes(model.SerializeToString(), "extremes.onnx")).mod
    got = _run(build(mod), [x])
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_a_constant_first_operand_keeps_the_layout():
    """``scale · x`` with the constant first stays NHWC between the convs: the only transposes
    left are the input's and the output's (before: one on each side of the affine op)."""
    from rangeprof.profiler.ir.passes.canonicalize import Canonicalize
    from rangeprof.profiler.ir.stages import canonical_passes

    data = _affine_between_convs().SerializeToString()
    mod = import_onnx(load_model_bytes(data, "affine.onnx")).mod
    layouts = {"relax.nn.conv2d": ["NHWC", "OHWI"]}
    passes = [*canonical_passes(), relax.transform.ConvertLayout(layouts), Canonicalize()]
    main = tvm.transform.Sequential(passes)(mod)["main"]
    calls = [b.value for block in main.body.blocks for b in block.bindings]
    ops = [str(c.op.name) for c in calls if isinstance(c, relax.Call)]
    assert ops.count("relax.permute_dims") == 2, ops


def test_a_dense_on_columns_no_vector_divides_is_padded_and_vectorised():
    """6625 classes (a text recognizer's) = 5³·53: packed 5 wide, the dense ran scalar at a
    sixteenth of its speed; padded to whole vectors of columns, the reduction is vectorised."""
    from tvm import s_tir

    from rangeprof.profiler.compile.schedules.dense import DENSE, legalize_matmul, schedule_dense

    x = relax.Var("x", relax.TensorType((40, 24), "float32"))
    w = np.random.default_rng(9).normal(size=(24, 6625)).astype(np.float32)
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        out = bb.emit(relax.op.matmul(x, relax.const(w)))
        bb.emit_func_output(out)
    legalized = relax.transform.LegalizeOps({"relax.matmul": legalize_matmul})(bb.get())
    dense = next(f for gv, f in legalized.functions_items() if gv.name_hint == DENSE)
    sch = s_tir.Schedule(dense.with_attr("global_symbol", "main"))
    with host_target():
        assert schedule_dense(sch)
    script = sch.mod["main"].script()
    assert "T.vectorized(" in script and "T.parallel(" in script

    data = np.random.default_rng(10).normal(size=(40, 24)).astype(np.float32)
    ours = _run(build(legalized), [data])
    np.testing.assert_allclose(ours, data @ w, rtol=RTOL, atol=ATOL * float(np.abs(data @ w).max()))


def test_narrow_transposes_go_row_by_row_and_plain_elementwise_stays_vectorised():
    """An NCHW 3-channel image padded into NHWC, and an NHWC one padded to 4 channels: rows in
    parallel, the channels unrolled (no lane gathers); an elementwise op on the same NHWC shape
    keeps its fused vector loop."""
    from tvm import s_tir, te, topi

    from rangeprof.profiler.compile.schedules.elementwise import schedule_generic

    x = te.placeholder((1, 3, 40, 50), "float32", name="x")
    image = topi.nn.pad(topi.transpose(x, [0, 2, 3, 1]), [0, 1, 1, 0], [0, 1, 1, 0], 0.5)
    y = te.placeholder((1, 42, 52, 3), "float32", name="y")
    doubled = topi.multiply(y, 2.0)
    data = np.random.default_rng(3).normal(size=(1, 3, 40, 50)).astype(np.float32)
    expected = np.pad(
        data.transpose(0, 2, 3, 1),
        [(0, 0), (1, 1), (1, 1), (0, 0)],
        "constant",
        constant_values=0.5,
    )
    four = topi.nn.pad(y, [0, 0, 0, 0], [0, 0, 0, 1], 0.0)
    cases = (
        (image, x, data, expected, 3),
        (four, y, expected, np.pad(expected, [(0, 0)] * 3 + [(0, 1)]), 4),
        (doubled, y, expected, expected * 2, None),
    )
    for out, arg, feed, want, unrolled in cases:
        sch = s_tir.Schedule(te.create_prim_func([arg, out]).with_attr("global_symbol", "main"))
        schedule_generic(sch)
        script = sch.mod["main"].script()
        if unrolled:
            pattern = rf"T\.unroll\((T\.int64\()?{unrolled}\b"
            assert "T.parallel(" in script and re.search(pattern, script)
            assert "T.vectorized(" not in script
        else:
            assert "T.vectorized(" in script
        f = tvm.compile(sch.mod, target=host_target())["main"]
        result = tvm.runtime.tensor(np.zeros(want.shape, np.float32))
        f(tvm.runtime.tensor(feed), result)
        np.testing.assert_array_equal(result.numpy(), want)


def test_elementwise_vectors_stay_within_rows_of_24_channels():
    """A transpose round trip around an elementwise op on 24 NHWC channels (a quantize at a
    residual in MobileNetV2): 8-lane vectors, which tile each row of 24 (16 would straddle two
    and gather lane by lane), and the values unchanged."""
    from tvm import s_tir, te, topi

    from rangeprof.profiler.compile.schedules.elementwise import schedule_generic

    x = te.placeholder((1, 6, 7, 24), "float32", name="x")
    scaled = topi.transpose(topi.multiply(topi.transpose(x, [0, 3, 1, 2]), 3.0), [0, 2, 3, 1])
    sch = s_tir.Schedule(te.create_prim_func([x, scaled]).with_attr("global_symbol", "main"))
    schedule_generic(sch)
    script = sch.mod["main"].script()
    assert re.search(r"T\.vectorized\((T\.int64\()?8\b", script), script
    data = np.random.default_rng(4).normal(size=(1, 6, 7, 24)).astype(np.float32)
    f = tvm.compile(sch.mod, target=host_target())["main"]
    result = tvm.runtime.tensor(np.zeros(data.shape, np.float32))
    f(tvm.runtime.tensor(data), result)
    np.testing.assert_array_equal(result.numpy(), data * np.float32(3.0))


def test_per_tensor_quantize_leaves_its_layout_round_trip():
    """``ConvertLayout`` wraps quantize in NHWC → NCHW → NHWC transposes; a per-tensor one
    loses them (so it can fuse into its producer), a per-channel one (axis 1 of NCHW) keeps
    them, and the program computes the same either way."""
    from rangeprof.byoc.cpu.prepare import untranspose_quantize

    shape = (1, 5, 6, 4)  # NHWC
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            nchw = bb.emit(relax.op.permute_dims(x, [0, 3, 1, 2]))
            scale, zero = relax.const(0.05, "float32"), relax.const(7, "int32")
            q = bb.emit(relax.op.quantize(nchw, scale, zero, axis=-1, out_dtype="uint8"))
            tensor = bb.emit(relax.op.permute_dims(q, [0, 2, 3, 1]))
            scales = relax.const(np.array([0.05, 0.1, 0.02, 0.2], np.float32))
            zeros = relax.const(np.array([0, 3, 5, 9], np.int32))
            c = bb.emit(relax.op.quantize(nchw, scales, zeros, axis=1, out_dtype="uint8"))
            channel = bb.emit(relax.op.permute_dims(c, [0, 2, 3, 1]))
            out = bb.emit_output(relax.Tuple([tensor, channel]))
        bb.emit_func_output(out)
    mod = bb.get()
    rewritten = untranspose_quantize(mod)
    calls = [b.value for blk in rewritten["main"].body.blocks for b in blk.bindings]
    ops = [str(c.op.name) for c in calls if isinstance(c, relax.Call)]
    assert ops.count("relax.quantize") == 2 and ops.count("relax.permute_dims") == 2
    quantizes = [c for c in calls if isinstance(c, relax.Call) and c.op.name == "relax.quantize"]
    assert [q.args[0].same_as(x) for q in quantizes] == [True, False]
    data = np.random.default_rng(6).normal(size=shape).astype(np.float32)
    results = []
    for m in (mod, rewritten):
        vm = relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())
        out = vm["main"](tvm.runtime.tensor(data))
        results.append([out[i].numpy() for i in range(2)])
    for want, got in zip(*results, strict=True):
        np.testing.assert_array_equal(got, want)
