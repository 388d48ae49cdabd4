"""QDQ models: dequantized to the FP32 model beneath, their scales imported by profileID
(``rangeprof import-qparams``) and built through the x86 plugin without calibration data.

The QDQ models are made by ONNX Runtime's own quantizer (``quantize_static``, QDQ format,
per-channel int8 weights, uint8 activations), as users bring them."""

from __future__ import annotations

import json

import jsonschema
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
    quantize_static,
)
from tvm import relax
from typer.testing import CliRunner

from rangeprof.cli import app
from rangeprof.profiler.calibrate.methods import schema
from rangeprof.profiler.ir.qdq import dequantize

from conftest import SHARED, zoo_model
from onnx_builders import save, single_io_model

runner = CliRunner()


class _Reader(CalibrationDataReader):
    def __init__(self, name: str, batches: np.ndarray):
        self._it = iter([{name: b[None]} for b in batches])

    def get_next(self):
        return next(self._it, None)


def _quantized(fp32, out, name, calib):
    quantize_static(
        str(fp32),
        str(out),
        _Reader(name, calib),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return out


def _cnn() -> onnx.ModelProto:
    """conv → relu → conv → relu → pool → gemm, seeded weights with negative outputs."""
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], "relu2"),
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


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qdq")
    fp32 = save(_cnn(), folder, "cnn.onnx")
    calib = np.random.default_rng(3).normal(size=(16, 3, 12, 12)).astype(np.float32)
    qdq = _quantized(fp32, folder / "cnn.qdq.onnx", "x", calib)
    return fp32, qdq, calib


def _run(path_or_model, x: np.ndarray) -> np.ndarray:
    model = path_or_model if isinstance(path_or_model, bytes) else str(path_or_model)
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": b[None]})[0] for b in x])


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_dequantized_model_is_the_fp32_model_with_the_quantized_weights(cnn):
    fp32, qdq, calib = cnn
    quantized = onnx.load(qdq)
    result = dequantize(onnx.load(qdq))  # rewrites the model it is given
    model = result.model
    onnx.checker.check_model(model)
    assert not {"QuantizeLinear", "DequantizeLinear"} & set(_ops(model))
    # Pairs whose grid starts at 0 clamp (ONNX Runtime drops the ReLU in front of them): each
    # is a Clip named after its QuantizeLinear; every other pair is gone.
    starts_at_zero = {
        n.name
        for n in quantized.graph.node
        if n.op_type == "QuantizeLinear"
        and numpy_helper.to_array(
            next(t for t in quantized.graph.initializer if t.name == n.input[2])
        )
        == 0
    }
    assert starts_at_zero and {n.name for n in model.graph.node if n.op_type == "Clip"} == (
        starts_at_zero
    )
    assert [o.name for o in model.graph.output] == ["y"]
    assert result.fates and all(f.startswith("qdq:") for f in result.fates.values())
    # The FP32 model computes the same with its weights replaced by the dequantized ones, on
    # data well within every Clip's upper bound (the calibrated maxima).
    weights = {t.name: t for t in model.graph.initializer}
    reference = onnx.load(fp32)
    for i, t in enumerate(reference.graph.initializer):
        dequantized = weights.get(f"{t.name}_DequantizeLinear_Output", weights.get(t.name))
        reference.graph.initializer[i].CopyFrom(numpy_helper.from_array(
            numpy_helper.to_array(dequantized), t.name
        ))  # fmt: skip
    expected = _run(reference.SerializeToString(), calib / 2)
    got = _run(model.SerializeToString(), calib / 2)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(expected).max() > 0.1


def test_weight_pair_on_a_float_initializer_becomes_the_fake_quantized_weight(tmp_path):
    w = np.linspace(-1.0, 1.3, 12, dtype=np.float32).reshape(4, 3)
    nodes = [
        helper.make_node("QuantizeLinear", ["w", "s", "z"], ["wq"], "wq"),
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], "wd"),
        helper.make_node("MatMul", ["x", "wd"], ["y"], "mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array(0.02, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "z"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    result = dequantize(model)
    assert _ops(result.model) == ["MatMul"]
    value = numpy_helper.to_array(next(t for t in result.model.graph.initializer))
    np.testing.assert_allclose(value, np.clip(np.rint(w / 0.02), -128, 127) * 0.02, rtol=1e-6)
    assert [(e.tensor, e.kind, e.dtype) for e in result.embedded] == [("wd", "weight", "int8")]


def test_import_qparams_gives_each_pair_scale_to_its_profile_id(cnn, tmp_path):
    _, qdq, _ = cnn
    out = tmp_path / "q.json"
    result = runner.invoke(app, ["import-qparams", str(qdq), "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, schema())
    assert doc["options"]["method"] == "qdq"
    assert doc["options"]["scheme"] == "asym" and doc["options"]["dtype"] == "uint8"
    assert doc["options"]["granularity"] == "per-channel"
    by_tensor = {e["source_tensor"]: e for e in doc["qparams"]}
    quantized = onnx.load(qdq)
    values = {t.name: numpy_helper.to_array(t) for t in quantized.graph.initializer}
    pairs = [n for n in quantized.graph.node if n.op_type == "QuantizeLinear"]
    assert len(pairs) >= 6
    for q in pairs:
        # The graph output's producer takes the output's name in the dequantized model.
        tensor = "y" if q.input[0].startswith("y_") else q.input[0]
        entry = by_tensor[tensor]
        assert entry["scale"] == pytest.approx(float(values[q.input[1]]), rel=1e-7)
        assert entry["zero_point"] == int(values[q.input[2]]) and entry["dtype"] == "uint8"
        assert entry["note"] == f"from {q.name}"
    assert by_tensor["x"]["profile_id"] == "input:x"
    conv = [e for e in doc["qparams"] if e["kind"] == "weight" and e["axis"] == 0]
    assert len(conv) == 3 and all(len(e["scale"]) in (8, 10) for e in conv)


def test_build_from_imported_qparams_agrees_with_onnxruntime_on_the_qdq_model(cnn, tmp_path):
    _, qdq, calib = cnn
    q = tmp_path / "q.json"
    assert runner.invoke(app, ["import-qparams", str(qdq), "--out", str(q)]).exit_code == 0
    art = tmp_path / "art"
    result = runner.invoke(app, ["build", str(qdq), "--qparams", str(q), "--out", str(art)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((art / "manifest.json").read_text())
    assert [r["mode"] for r in manifest["regions"]] == ["int8"] * 3
    assert manifest["calibration"]["method"] == "qdq"
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(art / manifest["library"])), tvm.cpu())
    ours = np.concatenate([vm["main"](tvm.runtime.tensor(b[None])).numpy() for b in calib])
    theirs = _run(qdq, calib)
    # The same integer grids: apart from requantization rounding, the same numbers.
    output_scale = next(
        e for e in json.loads(q.read_text())["qparams"] if e["source_tensor"] == "y"
    )["scale"]
    assert np.abs(ours - theirs).max() <= 2 * output_scale
    sqnr = 10 * np.log10(np.mean(theirs**2) / np.mean((ours - theirs) ** 2))
    assert sqnr > 40


def test_import_qparams_refusals_are_one_line_exit_2(cnn, tmp_path):
    fp32, _, _ = cnn
    cases = [
        (fp32, "not a QDQ model", tmp_path / "b.json"),
        (fp32, "does not exist", tmp_path / "missing" / "c.json"),
    ]
    for model, words, out in cases:
        result = runner.invoke(app, ["import-qparams", str(model), "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert words in result.output and len(result.output.strip().splitlines()) == 1
        assert not out.exists()


@pytest.mark.zoo
def test_digits_qdq_model_builds_without_calibration_data_as_accurate_as_onnxruntime(tmp_path):
    """The trained digits CNN quantized by ONNX Runtime: our INT8 build from its own scales
    predicts what ONNX Runtime's run of the QDQ model predicts."""
    data = np.load(SHARED / "data" / "digits.npz")
    name = onnx.load(zoo_model("digits_cnn")).graph.input[0].name
    qdq = _quantized(zoo_model("digits_cnn"), tmp_path / "d.qdq.onnx", name, data["calib"][:64])
    q = tmp_path / "q.json"
    assert runner.invoke(app, ["import-qparams", str(qdq), "--out", str(q)]).exit_code == 0
    result = runner.invoke(
        app,
        [
            "evaluate", str(qdq), "--qparams", str(q), "--json",
            "--data", f"{SHARED}/data/digits.npz:test",
            "--labels", f"{SHARED}/data/digits.npz:test_labels",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    session = ort.InferenceSession(str(qdq), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {name: data["test"]})[0].argmax(1)
    ort_top1 = 100 * float(np.mean(theirs == data["test_labels"]))
    assert abs(report["int8_top1"] - ort_top1) <= 0.5
    assert report["int8_top1"] > 97
