"""Operator forms the ONNX backend suite (tests/conformance.py) found refused in TVM's words,
now converted: each model goes through the project's loader and importer, is compiled and run,
and every output must equal onnxruntime's. The forms still refused are refused in our words,
naming the node and the op.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from typer.testing import CliRunner

from rangeprof.cli import app
from rangeprof.profiler.errors import (
    ConversionError,
    ConverterFailure,
    DynamicShapeError,
    ValueInputError,
)
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
RNG = np.random.default_rng(0)
# TVM's own wording: Relax / TIR script, C++ checks, Python attribute errors
TOLERANCES = {
    "float16": {"rtol": 1e-3, "atol": 1e-3},
    "float32": {"rtol": 1e-5, "atol": 1e-6},
    "float64": {"rtol": 1e-9, "atol": 1e-12},
}
TVM_TEXT = re.compile(r"\b[RT]\.\w|\blv\d*\b|Check failed|\brelax\.|object has no attribute")


def _model(nodes, inputs, opset, initializers=(), outputs=("y",)) -> onnx.ModelProto:
    """A model of ``nodes``; ``inputs`` are (name, elem type, shape); output types inferred."""
    for k, node in enumerate(nodes):
        node.name = node.name or f"{node.op_type.lower()}{k}"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(v, n) for n, v in initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10  # what this onnxruntime reads
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model


def _check(tmp_path, model, feeds: dict, bound: dict | None = None) -> None:
    """Load, import, compile and run the model; every output equals onnxruntime's."""
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    loaded = load_model(path, bound=bound)
    vm = relax.VirtualMachine(tvm.compile(import_onnx(loaded).mod, target=TARGET), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(feeds[name]) for name in loaded.program_inputs])
    actual = [o.numpy() for o in out] if isinstance(out, Sequence) else [out.numpy()]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {**feeds, **(bound or {})})
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, **TOLERANCES.get(str(got.dtype), {"rtol": 0}))


def _refused(tmp_path, model, error=ConversionError, bound=None) -> str:
    """The one-line message importing the model raises: ours, naming its node and op."""
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    with pytest.raises(error) as info:
        import_onnx(load_model(path, bound=bound))
    message = str(info.value)
    node = model.graph.node[0]
    assert f"node '{node.name}' ({node.op_type})" in message
    assert "\n" not in message and not TVM_TEXT.search(message), message
    assert "TVM's converter failed" not in message
    return message


@pytest.mark.parametrize("op", ["Elu", "Selu", "ThresholdedRelu"])
@pytest.mark.parametrize(
    ("dtype", "elem"), [("float16", TensorProto.FLOAT16), ("float64", TensorProto.DOUBLE)], ids=str
)
def test_activations_keep_the_input_type(tmp_path, op, dtype, elem):
    model = _model([helper.make_node(op, ["x"], ["y"])], [("x", elem, [2, 6])], 18)
    x = RNG.uniform(-3, 3, (2, 6)).astype(dtype)
    _check(tmp_path, model, {"x": x})


def test_swish(tmp_path):
    """Against onnxruntime's run of ONNX's function body (of opset 24, which does not serve the
    later opsets, where onnxruntime has no Swish either)."""
    node = helper.make_node("Swish", ["x"], ["y"], alpha=0.7)
    model = _model([node], [("x", TensorProto.FLOAT, [2, 6])], 24)
    _check(tmp_path, model, {"x": RNG.uniform(-3, 3, (2, 6)).astype(np.float32)})


@pytest.mark.parametrize("op", ["BlackmanWindow", "HannWindow", "HammingWindow"])
@pytest.mark.parametrize("periodic", [None, 0])
def test_windows_with_default_attributes(tmp_path, op, periodic):
    """Expanded to their function bodies, which read attributes the node may omit."""
    attrs = {} if periodic is None else {"periodic": periodic}
    node = helper.make_node(op, ["n"], ["y"], **attrs)
    model = _model([node], [("n", TensorProto.INT32, [])], 17)
    model.graph.output[0].type.tensor_type.shape.dim.add(dim_value=10)  # what n gives
    _check(tmp_path, model, {}, bound={"n": np.array(10, np.int32)})


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu_of_an_empty_tensor(tmp_path, upper):
    node = helper.make_node("Trilu", ["x", "k"], ["y"], upper=upper)
    inputs = [("x", TensorProto.INT64, [3, 0, 5]), ("k", TensorProto.INT64, [])]
    model = _model([node], inputs, 14)
    _check(tmp_path, model, {"x": np.zeros((3, 0, 5), np.int64), "k": np.array(2)})


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_with_values_as_input(tmp_path, axis):
    node = helper.make_node("OneHot", ["indices", "depth", "values"], ["y"], axis=axis)
    inputs = [("indices", TensorProto.INT64, [2, 3]), ("values", TensorProto.FLOAT, [2])]
    depth = ("depth", np.array(5, np.int64))
    model = _model([node], inputs, 11, initializers=[depth])
    indices = np.array([[0, 4, -1], [-5, 7, 2]])  # negative and out of range
    _check(tmp_path, model, {"indices": indices, "values": np.array([-2, 3], np.float32)})


@pytest.mark.parametrize("k", [0, 2, -1])
def test_eye_like_of_another_type(tmp_path, k):
    node = helper.make_node("EyeLike", ["x"], ["y"], dtype=TensorProto.DOUBLE, k=k)
    model = _model([node], [("x", TensorProto.INT32, [3, 4])], 9)
    _check(tmp_path, model, {"x": np.zeros((3, 4), np.int32)})


def test_reshape_allowing_zero(tmp_path):
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1)
    model = _model([node], [("x", TensorProto.FLOAT, [0, 3, 4]), ("shape", 7, [3])], 14)
    x = np.zeros((0, 3, 4), np.float32)
    _check(tmp_path, model, {"x": x}, bound={"shape": np.array([3, 4, 0])})


def test_slice_by_attributes(tmp_path):
    """Opset 6 (PyTorch's export of ``x[0]``, ``aten::index``) gives starts and ends as
    attributes."""
    nodes = [
        helper.make_node("Slice", ["x"], ["s"], starts=[0, 1], ends=[1, 4], axes=[0, 2]),
        helper.make_node("Squeeze", ["s"], ["y"], axes=[0]),
    ]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 3, 5])], 6)
    _check(tmp_path, model, {"x": RNG.standard_normal((2, 3, 5)).astype(np.float32)})


@pytest.mark.parametrize("mode", ["nearest", "linear"])
@pytest.mark.parametrize("opset", [7, 9])
def test_upsample(tmp_path, mode, opset):
    scales = [1.0, 1.0, 2.0, 3.0]
    if opset == 7:
        node = helper.make_node("Upsample", ["x"], ["y"], mode=mode, scales=scales)
        initializers = []
    else:
        node = helper.make_node("Upsample", ["x", "scales"], ["y"], mode=mode)
        initializers = [("scales", np.array(scales, np.float32))]
    model = _model([node], [("x", TensorProto.FLOAT, [1, 2, 3, 4])], opset, initializers)
    _check(tmp_path, model, {"x": RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)})


def test_sequence_length_of_a_split(tmp_path):
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["seq"], axis=1),
        helper.make_node("SequenceLength", ["seq"], ["y"]),
    ]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 3, 4])], 12)
    _check(tmp_path, model, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})


@pytest.mark.parametrize("position", [-3, -2, -1, 0, 2, 3, None])
def test_sequence_insert_counts_negative_positions_from_the_back(tmp_path, position):
    """ONNX's ``-1`` inserts before the last tensor (TVM's converter appended); without a
    position the tensor is appended. Each tensor of the result is read back."""
    given = (
        [] if position is None else [helper.make_node("Constant", [], ["p"], value_int=position)]
    )
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
        *given,
        helper.make_node("SequenceInsert", ["seq", "t", *(["p"] if given else [])], ["out"]),
        *[helper.make_node("SequenceAt", ["out", f"i{k}"], [f"y{k}"]) for k in range(4)],
    ]
    indices = [(f"i{k}", np.array(k, np.int64)) for k in range(4)]
    inputs = [("x", TensorProto.FLOAT, [3, 2]), ("t", TensorProto.FLOAT, [2])]
    model = _model(nodes, inputs, 12, indices, outputs=[f"y{k}" for k in range(4)])
    feeds = {"x": RNG.standard_normal((3, 2)).astype(np.float32), "t": np.full(2, 7, np.float32)}
    _check(tmp_path, model, feeds)


def test_optional_has_element_without_input(tmp_path):
    nodes = [
        helper.make_node("OptionalHasElement", [], ["has"]),
        helper.make_node("Cast", ["has"], ["h"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "h"], ["y"]),
    ]
    model = _model(nodes, [("x", TensorProto.FLOAT, [2])], 18)
    _check(tmp_path, model, {"x": np.array([1.0, 2.0], np.float32)})


@pytest.mark.parametrize(
    ("attrs", "axis"),
    [({}, 1), ({"exclusive": 1}, 0), ({"reverse": 1}, -1), ({"exclusive": 1, "reverse": 1}, 1)],
    ids=["plain", "exclusive", "reverse", "both"],
)
def test_cumprod(tmp_path, attrs, axis):
    node = helper.make_node("CumProd", ["x", "axis"], ["y"], **attrs)
    model = _model([node], [("x", TensorProto.FLOAT, [2, 3, 4])], 26, [("axis", np.array(axis))])
    _check(tmp_path, model, {"x": RNG.uniform(0.5, 1.5, (2, 3, 4)).astype(np.float32)})


@pytest.mark.parametrize(("time_axis", "batch_axis"), [(0, 1), (1, 0)])
def test_reverse_sequence(tmp_path, time_axis, batch_axis):
    node = helper.make_node(
        "ReverseSequence", ["x", "lens"], ["y"], time_axis=time_axis, batch_axis=batch_axis
    )
    shape = [4, 3, 2] if time_axis == 0 else [3, 4, 2]
    inputs = [("x", TensorProto.FLOAT, shape), ("lens", TensorProto.INT64, [3])]
    model = _model([node], inputs, 10)
    x = RNG.standard_normal(shape).astype(np.float32)
    _check(tmp_path, model, {"x": x, "lens": np.array([4, 1, 3])})


SAME = {"kernel_shape": [3, 3], "strides": [2, 2]}
POOLS = {
    "3x3": ([1, 2, 7, 7], {"kernel_shape": [3, 3]}),
    "pads": ([2, 3, 8, 9], {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 0, 1, 2]}),
    "column-major": ([1, 2, 7, 6], {"kernel_shape": [3, 2], "storage_order": 1}),
    "ceil-dilated": (
        [1, 2, 9, 8],
        {"kernel_shape": [3, 2], "dilations": [2, 1], "ceil_mode": 1, "strides": [2, 2]},
    ),
    "same-upper": ([1, 2, 7, 6], {**SAME, "auto_pad": "SAME_UPPER"}),
    "same-lower": ([1, 2, 7, 6], {**SAME, "kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}),
    "1d": ([2, 3, 10], {"kernel_shape": [3], "strides": [2]}),
    "3d": ([1, 2, 5, 6, 7], {"kernel_shape": [2, 2, 3], "strides": [1, 2, 2]}),
}


@pytest.mark.parametrize("dtype", ["float32", "uint8"])
@pytest.mark.parametrize("case", POOLS)
def test_max_pool_indices(tmp_path, case, dtype):
    """Values drawn from few levels, so that windows hold ties (the first maximum counts) and
    padding sits next to zeros (it never wins)."""
    shape, attrs = POOLS[case]
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = _model([node], [("x", elem, shape)], 12, outputs=("y", "i"))
    _check(tmp_path, model, {"x": RNG.integers(0, 6, shape).astype(dtype)})


def test_max_unpool_to_a_given_shape(tmp_path):
    window = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p", "i"], **window),
        helper.make_node("MaxUnpool", ["p", "i", "shape"], ["y"], **window),
    ]
    inputs = [("x", TensorProto.FLOAT, [1, 2, 5, 5]), ("shape", TensorProto.INT64, [4])]
    model = _model(nodes, inputs, 11)
    model.graph.output[0].type.tensor_type.shape.dim.extend(  # what shape gives
        onnx.TensorShapeProto.Dimension(dim_value=d) for d in (1, 2, 5, 5)
    )
    x = RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)
    _check(tmp_path, model, {"x": x}, bound={"shape": np.array([1, 2, 5, 5])})


@pytest.mark.parametrize("zero_point", [False, True])
def test_blocked_quantize_dequantize(tmp_path, zero_point):
    """One scale (and zero point) per block of 2 along axis 1, the last block short."""
    names = ["scale", "zp"] if zero_point else ["scale"]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", *names], ["q"], axis=1, block_size=2),
        helper.make_node("DequantizeLinear", ["q", *names], ["y"], axis=1, block_size=2),
    ]
    initializers = [("scale", RNG.uniform(0.05, 0.2, (2, 3, 4)).astype(np.float32))]
    if zero_point:
        initializers.append(("zp", RNG.integers(-20, 20, (2, 3, 4)).astype(np.int8)))
    model = _model(nodes, [("x", TensorProto.FLOAT, [2, 5, 4])], 21, initializers, ("q", "y"))
    _check(tmp_path, model, {"x": RNG.uniform(-20, 20, (2, 5, 4)).astype(np.float32)})


@pytest.mark.parametrize(
    ("attrs", "scales", "sizes"),
    [
        ({"axes": [2, 3]}, [2.0, 3.0], None),
        ({"axes": [3, 2]}, None, [8, 6]),
        ({"keep_aspect_ratio_policy": "not_larger"}, None, [1, 2, 7, 8]),
        ({"keep_aspect_ratio_policy": "not_smaller", "axes": [2, 3]}, None, [6, 5]),
    ],
    ids=["scales-axes", "sizes-axes", "not-larger", "not-smaller-axes"],
)
def test_resize_over_some_axes(tmp_path, attrs, scales, sizes):
    given = [("scales", np.array(scales, np.float32))] if scales else []
    given += [("sizes", np.array(sizes, np.int64))] if sizes else []
    names = ["x", "", "scales" if scales else "", "sizes" if sizes else ""]
    node = helper.make_node("Resize", names, ["y"], mode="nearest", **attrs)
    model = _model([node], [("x", TensorProto.FLOAT, [1, 2, 3, 4])], 19, given)
    _check(tmp_path, model, {"x": RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)})


def test_resize_refusals_are_ours(tmp_path):
    """A kept aspect ratio that gives a fractional size, and a resize of the channel axis."""
    sizes = ("sizes", np.array([3, 3], np.int64))
    node = helper.make_node(
        "Resize", ["x", "", "", "sizes"], ["y"], axes=[2, 3], keep_aspect_ratio_policy="not_smaller"
    )
    model = _model([node], [("x", TensorProto.FLOAT, [1, 2, 2, 3])], 19, [sizes])
    assert "fractional size" in _refused(tmp_path, model)
    scales = ("scales", np.array([1.0, 2.0, 1.0, 1.0], np.float32))
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"])
    model = _model([node], [("x", TensorProto.FLOAT, [1, 2, 2, 4])], 19, [scales])
    assert "first two axes" in _refused(tmp_path, model)


def test_value_input_refused_without_its_value(tmp_path):
    """Imported without data (``inspect``), a node whose axes are a model input says which input
    it needs and where its value comes from; given the value, it imports."""
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)
    inputs = [("x", TensorProto.FLOAT, [2, 3, 4]), ("axes", TensorProto.INT64, [1])]
    model = _model([node], inputs, 18)
    model.graph.output[0].type.tensor_type.shape.dim.extend(  # what axes gives
        onnx.TensorShapeProto.Dimension(dim_value=d) for d in (2, 1, 4)
    )
    message = _refused(tmp_path, model, ValueInputError)
    assert "input 'axes'" in message and "rangeprof profile --data" in message
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "model.onnx")])
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    _check(tmp_path, model, {"x": x}, bound={"axes": np.array([1])})


def test_data_dependent_shape_named_plainly(tmp_path):
    """A shape that depends on the data is printed as the user reads it, not as Relax types."""
    model = _model(
        [helper.make_node("NonZero", ["x"], ["y"])], [("x", TensorProto.FLOAT, [2, 3])], 13
    )
    message = _refused(tmp_path, model, DynamicShapeError)
    assert "[2, ?]" in message


def test_unforeseen_converter_failure_is_one_line(tmp_path):
    """Where TVM's converter fails in a way no check of ours foresaw (a convolution over four
    spatial axes), the line names the node and the op and says whose words follow."""
    node = helper.make_node("Conv", ["x", "w"], ["y"])
    w = ("w", np.ones((1, 1, 1, 1, 1, 1), np.float32))
    model = _model([node], [("x", TensorProto.FLOAT, [1, 1, 2, 2, 2, 2])], 11, [w])
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    with pytest.raises(ConverterFailure) as info:
        import_onnx(load_model(path))
    message = str(info.value)
    assert message.startswith("node 'conv0' (Conv): TVM's converter failed: ")
    assert "\n" not in message
