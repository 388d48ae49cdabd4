"""Operator-oriented quantized ONNX models (:mod:`rangeprof.profiler.ir.operator_quantized`): the
QDQ form computes what ONNX Runtime computes on the integer operators, the QDQ import reads the
scales in the file, and the x86 build agrees with ONNX Runtime's run of the quantized model.

The models are made by ONNX Runtime's own quantizer, as users bring them: ``quantize_static`` in
the ``QOperator`` format (``QLinearConv``, ``QGemm``, ``QLinearAdd``…, ``QLinearMatMul``,
``QLinearMul``; per-channel int8 weights, uint8 activations) and ``quantize_dynamic``
(``DynamicQuantizeLinear`` → ``ConvInteger`` / ``MatMulInteger`` → ``Cast`` → ``Mul``;
``DynamicQuantizeLSTM``)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)
from tvm import relax
from typer.testing import CliRunner

from rangeprof.cli import app
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model

from onnx_builders import save, single_io_model

runner = CliRunner()
QUANTIZED = "_quantized"  # ONNX Runtime's suffix of a quantized tensor's name


def _conv_net() -> onnx.ModelProto:
    """conv → relu → conv → + residual → relu → pool → flatten → gemm."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a"], "residual"),
        helper.make_node("Relu", ["a"], ["r2"], "relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], "pool"),
        helper.make_node("Flatten", ["p"], ["f"], "flatten"),
        helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], "fc", transB=1),
    ]
    inits = {
        "w1": rng.normal(0, 0.4, (8, 3, 3, 3)),
        "b1": rng.normal(0, 0.1, 8),
        "w2": rng.normal(0, 0.2, (8, 8, 3, 3)),
        "b2": rng.normal(0, 0.1, 8),
        "w3": rng.normal(0, 0.5, (10, 8)),
        "b3": rng.normal(0, 0.1, 10),
    }
    return single_io_model(nodes, inits, (1, 3, 12, 12), (1, 10))


def _matmul_net() -> onnx.ModelProto:
    """matmul → + bias → relu → matmul → × the relu's output."""
    rng = np.random.default_rng(8)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], "mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], "bias1"),
        helper.make_node("Relu", ["a1"], ["r1"], "relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"], "mm2"),
        helper.make_node("Mul", ["m2", "r1"], ["y"], "gate"),
    ]
    inits = {
        "w1": rng.normal(0, 0.4, (16, 24)),
        "b1": rng.normal(0, 0.1, 24),
        "w2": rng.normal(0, 0.2, (24, 24)),
    }
    return single_io_model(nodes, inits, (4, 16), (4, 24))


def _pooling_net() -> onnx.ModelProto:
    """conv → leaky relu → (average pool, max pool) → concat → sigmoid → flatten."""
    rng = np.random.default_rng(10)
    pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], "conv", pads=[1, 1, 1, 1]),
        helper.make_node("LeakyRelu", ["c"], ["l"], "leaky", alpha=0.1),
        helper.make_node("AveragePool", ["l"], ["pa"], "average", **pool),
        helper.make_node("MaxPool", ["l"], ["pm"], "max", **pool),
        helper.make_node("Concat", ["pa", "pm"], ["cat"], "concat", axis=1),
        helper.make_node("Sigmoid", ["cat"], ["s"], "sigmoid"),
        helper.make_node("Flatten", ["s"], ["y"], "flatten"),
    ]
    inits = {"w": rng.normal(0, 0.4, (4, 3, 3, 3))}
    return single_io_model(nodes, inits, (1, 3, 8, 8), (1, 128))


def _lstm_net() -> onnx.ModelProto:
    """lstm → squeeze of its direction axis."""
    rng = np.random.default_rng(9)
    hidden, features, steps = 8, 6, 5
    inits = {
        "W": rng.normal(0, 0.3, (1, 4 * hidden, features)).astype(np.float32),
        "R": rng.normal(0, 0.3, (1, 4 * hidden, hidden)).astype(np.float32),
        "B": rng.normal(0, 0.1, (1, 8 * hidden)).astype(np.float32),
        "axis": np.array([1], np.int64),
    }
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R", "B"], ["h"], "lstm", hidden_size=hidden),
        helper.make_node("Squeeze", ["h", "axis"], ["y"], "squeeze"),
    ]
    graph = helper.make_graph(
        nodes,
        "lstm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 1, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [steps, 1, hidden])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class _Reader(CalibrationDataReader):
    def __init__(self, batches: np.ndarray):
        self._it = iter([{"x": b} for b in batches])

    def get_next(self):
        return next(self._it, None)


NETS = {
    "conv": (_conv_net, (1, 3, 12, 12)),
    "matmul": (_matmul_net, (4, 16)),
    "pooling": (_pooling_net, (1, 3, 8, 8)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per net: its float model, its static QOperator quantization (8-bit weights, and 7-bit
    ones: ``exact``), its dynamic one, and data. Compared with ONNX Runtime's own run of the
    integer operators, a model needs 7-bit weights (``reduce_range``, ONNX Runtime's advice for
    CPUs without VNNI): on those, its u8 × s8 kernels add pairs of products in int16 and
    saturate on 8-bit weights (up to hundreds of output steps off on a Zen 3)."""
    folder = tmp_path_factory.mktemp("operator_quantized")
    made = {}
    for name, (build, shape) in NETS.items():
        fp32 = save(build(), folder, f"{name}.onnx")
        calib = np.random.default_rng(3).normal(size=(16, *shape)).astype(np.float32)
        static, dynamic = folder / f"{name}.qop.onnx", folder / f"{name}.dyn.onnx"
        exact = folder / f"{name}.qop7.onnx"
        for out, reduce_range in ((static, False), (exact, True)):
            quantize_static(
                str(fp32), str(out), _Reader(calib), quant_format=QuantFormat.QOperator,
                per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                reduce_range=reduce_range,
            )  # fmt: skip
        quantize_dynamic(str(fp32), str(dynamic), weight_type=QuantType.QInt8, reduce_range=True)
        data = folder / f"{name}.npz"
        np.savez(data, x=calib[:, 0] if shape[0] == 1 else calib)  # samples without the batch
        made[name] = {
            "static": static, "exact": exact, "dynamic": dynamic, "data": data, "calib": calib
        }  # fmt: skip
    return made


def _ort(model, batches: np.ndarray, optimized: bool = True) -> np.ndarray:
    """ONNX Runtime's outputs; unoptimized, it runs every node as written (it fuses QDQ pairs
    back into integer operators otherwise)."""
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    return np.stack([session.run(None, {"x": b})[0] for b in batches])


def _values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _output_step(model: onnx.ModelProto) -> float:
    """The scale of the quantized model's output ``y`` (its DequantizeLinear's)."""
    dequantize = next(n for n in model.graph.node if n.output[0] == "y")
    return float(_values(model)[dequantize.input[1]])


# Each integer operator's float operator and the input positions of its output's (scale, zero
# point), as ONNX and ONNX Runtime define them.
_INTEGER_OPS = {
    "QLinearConv": ("Conv", (6, 7)), "QLinearMatMul": ("MatMul", (6, 7)),
    "QGemm": ("Gemm", (7, 8)), "QLinearAdd": ("Add", (6, 7)), "QLinearMul": ("Mul", (6, 7)),
    "QLinearGlobalAveragePool": ("GlobalAveragePool", (3, 4)),
    "QLinearAveragePool": ("AveragePool", (3, 4)), "QLinearLeakyRelu": ("LeakyRelu", (3, 4)),
    "QLinearSigmoid": ("Sigmoid", (3, 4)), "QLinearConcat": ("Concat", (0, 1)),
}  # fmt: skip


@pytest.mark.parametrize("net", NETS)
def test_static_qdq_form_computes_what_onnxruntime_computes(models, net):
    path, calib = models[net]["exact"], models[net]["calib"]
    source = onnx.load(path)
    integer = [n for n in source.graph.node if n.domain in ("", "com.microsoft") and (
        n.op_type.startswith("Q") and n.op_type != "QuantizeLinear")]  # fmt: skip
    assert {"QLinearConv", "QLinearMatMul"} & {n.op_type for n in integer}
    model = load_model(path).model
    # Each integer operator is its float operator of the same name; no other is left.
    by_name = {n.name: n.op_type for n in model.graph.node}
    assert all(by_name[n.name] == _INTEGER_OPS[n.op_type][0] for n in integer)
    floats = {op for op, _ in _INTEGER_OPS.values()} | {"Flatten", "MaxPool"}
    assert set(by_name.values()) <= floats | {"QuantizeLinear", "DequantizeLinear"}
    # Run node by node (unoptimized): the same integers up to the requantization's rounding,
    # one step of the output grid on a tie.
    theirs, ours = _ort(path, calib), _ort(model, calib, optimized=False)
    step = _output_step(source)
    assert np.abs(ours - theirs).max() <= step * 1.001
    assert np.mean(ours == theirs) > 0.99 and np.abs(theirs).max() > 10 * step


@pytest.mark.parametrize("net", ["conv", "matmul"])
def test_dynamic_qdq_form_computes_what_onnxruntime_computes(models, net):
    path, calib = models[net]["dynamic"], models[net]["calib"]
    source = onnx.load(path)
    integer = [n for n in source.graph.node if n.op_type in ("ConvInteger", "MatMulInteger")]
    loaded = load_model(path)
    ops = [n.op_type for n in loaded.model.graph.node]
    assert integer and not {"ConvInteger", "MatMulInteger", "Cast"} & set(ops)
    # Each weight, and each activation quantized at run time, read through a DequantizeLinear.
    assert ops.count("DequantizeLinear") == len(integer) + ops.count("DynamicQuantizeLinear")
    # ORT's Cast and Mul by s_x · s_w (and that product) are folded into the float operator.
    for node in integer:
        cast = next(n for n in source.graph.node if node.output[0] in n.input)
        assert loaded.fates[cast.name] == f"folded_into:{node.name}"
    theirs, ours = _ort(path, calib), _ort(loaded.model, calib, optimized=False)
    # The same integers, scaled before the int32 sum instead of after it: float32 rounding.
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())


def test_import_qparams_gives_the_scales_in_the_file(models, tmp_path):
    path = models["conv"]["static"]
    out = tmp_path / "q.json"
    result = runner.invoke(app, ["import-qparams", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["options"]["method"] == "qdq" and doc["options"]["granularity"] == "per-channel"
    by_tensor = {e["source_tensor"]: e for e in doc["qparams"]}
    source = onnx.load(path)
    values = _values(source)
    checked = 0
    for node in source.graph.node:
        if node.op_type == "QuantizeLinear":
            tensor, (scale, zero) = node.input[0], node.input[1:3]
        elif node.op_type in _INTEGER_OPS:
            tensor = node.output[0].removesuffix(QUANTIZED)
            scale, zero = (node.input[k] for k in _INTEGER_OPS[node.op_type][1])
        else:
            continue
        entry = by_tensor[tensor]
        assert entry["scale"] == pytest.approx(float(values[scale]), rel=1e-7), tensor
        assert entry["zero_point"] == int(values[zero]) and entry["dtype"] == "uint8"
        checked += 1
    assert checked == 6
    # Weights: per channel, as stored (QLinearConv's axis 0, QGemm's with transB=1 too).
    for name in ("w1", "w2", "w3"):
        entry = by_tensor[name]
        assert entry["kind"] == "weight" and entry["axis"] == 0
        np.testing.assert_allclose(entry["scale"], values[f"{name}_scale"], rtol=1e-7)
        assert entry["zero_point"] == values[f"{name}_zero_point"].tolist()


def _built_outputs(art, batches: np.ndarray) -> np.ndarray:
    manifest = json.loads((art / "manifest.json").read_text())
    assert all(r["mode"] == "int8" for r in manifest["regions"]) and manifest["regions"]
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(art / manifest["library"])), tvm.cpu())
    return np.stack([vm["main"](tvm.runtime.tensor(b)).numpy() for b in batches])


@pytest.mark.parametrize("net", ["conv", "matmul"])
def test_build_from_the_files_scales_agrees_with_onnxruntime(models, net, tmp_path):
    path, calib = models[net]["static"], models[net]["calib"]
    q, art = tmp_path / "q.json", tmp_path / "art"
    assert runner.invoke(app, ["import-qparams", str(path), "--out", str(q)]).exit_code == 0
    result = runner.invoke(app, ["build", str(path), "--qparams", str(q), "--out", str(art)])
    assert result.exit_code == 0, result.output
    # ORT's run of the QDQ form, node by node: the integer operators' arithmetic, exact on every
    # CPU (the test above: within a step of ORT's integer kernels where those are exact).
    ours, theirs = _built_outputs(art, calib), _ort(load_model(path).model, calib, False)
    # The same grids and integer weights. The build's output is the float it computes, ORT's
    # one rounded to the output grid (half a step); ORT rounds the inputs of QLinearAdd /
    # QLinearMul to theirs too, where the build adds and multiplies in FP32: within one step
    # of the output scale on most elements, two at most.
    step = _output_step(onnx.load(path))
    error = np.abs(ours - theirs)
    assert np.mean(error <= step) >= 0.95 and error.max() <= 2 * step


def test_dynamic_model_profiles_calibrates_and_builds(models, tmp_path):
    """A dynamic activation scale has no static range: import-qparams refuses, and the
    profile of the model gives the qparams its build takes."""
    path, data, calib = models["conv"]["dynamic"], models["conv"]["data"], models["conv"]["calib"]
    result = runner.invoke(app, ["import-qparams", str(path), "--out", str(tmp_path / "i.json")])
    assert result.exit_code == 2 and "profile and calibrate" in result.output
    assert len(result.output.strip().splitlines()) == 1
    profile, q, art = tmp_path / "p.json", tmp_path / "q.json", tmp_path / "art"
    steps = [
        ["profile", str(path), "--data", f"{data}:x", "--out", str(profile)],
        ["calibrate", str(profile), "--target", "x86", "--out", str(q)],
        ["build", str(path), "--qparams", str(q), "--out", str(art)],
    ]
    for args in steps:
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    ours, theirs = _built_outputs(art, calib), _ort(path, calib)
    sqnr = 10 * np.log10(np.mean(theirs**2) / np.mean((ours - theirs) ** 2))
    assert sqnr > 35  # static int8 grids from the profile vs ORT's dynamic ones (~48 dB seen)


def test_dynamic_lstm_becomes_the_lstm_of_its_dequantized_weights(tmp_path):
    fp32 = save(_lstm_net(), tmp_path, "lstm.onnx")
    path = tmp_path / "lstm.dyn.onnx"
    quantize_dynamic(  # 7-bit weights: see models()
        str(fp32), str(path), weight_type=QuantType.QInt8, per_channel=True, reduce_range=True
    )
    source = onnx.load(path)
    assert "DynamicQuantizeLSTM" in [n.op_type for n in source.graph.node]
    loaded = load_model(path)
    lstm = next(n for n in loaded.model.graph.node if n.op_type == "LSTM")
    assert lstm.name == "lstm_quant" and lstm.domain == ""
    values, stored = _values(loaded.model), _values(source)
    weight = (stored["W_quantized"] - stored["W_zero_point"][:, None].astype(np.float32)) * (
        stored["W_scale"][:, None]
    )  # fmt: skip
    np.testing.assert_allclose(values[lstm.input[1]], weight.transpose(0, 2, 1), rtol=1e-6)
    import_onnx(loaded)  # TVM converts it
    x = np.random.default_rng(5).normal(size=(8, 5, 1, 6)).astype(np.float32)
    theirs, ours = _ort(path, x), _ort(loaded.model, x)
    # ORT also quantizes the input and the hidden state at every step; the float LSTM does not.
    assert np.abs(ours - theirs).max() <= 0.02 * np.abs(theirs).max()


def test_an_integer_operator_of_another_form_is_refused_in_one_line(tmp_path):
    """A ConvInteger whose scales no Mul gives cannot be dequantized: named, one line."""
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], "quantize"),
        helper.make_node("ConvInteger", ["xq", "w", "xz"], ["acc"], "conv"),
        helper.make_node("Cast", ["acc"], ["y"], "to_float", to=TensorProto.FLOAT),
    ]
    w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.int8), "w")
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = save(model, tmp_path, "conv_integer.onnx")
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2 and "ConvInteger" in result.output
    assert len(result.output.strip().splitlines()) == 1
