"""Exports: AIMET encodings, ONNX Runtime calibration tables (checked with ORT itself), TensorRT
calibration caches."""

from __future__ import annotations

import json
import struct

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import quantize_static
from onnxruntime.quantization.calibrate import (
    CalibrationCacheEncoder,
    CalibrationMethod,
    TensorData,
    TensorsData,
    load_tensors_data,
)
from onnxruntime.quantization.quant_utils import write_calibration_table

from rangeprof.profiler.calibrate.methods import CalibrationOptions, qparams_for
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.export.formats import AIMET_VERSION, TENSORRT_HEADER, export

from profile_builders import entry, profile

RNG = np.random.default_rng(7)
X = RNG.standard_normal((8, 4)).astype(np.float32) * 2 + 0.5
W = RNG.standard_normal((4, 3)).astype(np.float32)
Y = X @ W
Z = np.maximum(Y, 0)


def matmul_profile() -> dict:
    """The profile of ``z = relu(x @ w)``, plus a static weight transform and a Relax-internal
    binding with no ONNX name."""
    transposed = {**entry(W.T, channel_axis=0, name="tr", source_tensor="w_t"), "static": True}
    return profile(
        entry(X, kind="input", name="input:x", source_tensor="x"),
        entry(W, kind="weight", channel_axis=1, name="weight:w", source_tensor="w"),
        transposed,
        entry(Y, name="mm", source_tensor="y"),
        entry(Y * 2, name="mm#1", source_tensor=None),
        entry(Z, name="relu", source_tensor="z"),
    )


def by_name(doc: dict, options: CalibrationOptions) -> dict:
    return {e["source_tensor"]: qparams_for(e, options) for e in doc["tensors"]}


# --- AIMET ----------------------------------------------------------------------------------


def test_aimet_encodings():
    doc = matmul_profile()
    options = CalibrationOptions(granularity="per-channel", scheme="asym", dtype="uint8")
    out = json.loads(export(doc, "aimet", options))
    assert out["version"] == AIMET_VERSION == "2.0.0"
    encodings = {e["name"]: e for e in out["encodings"]}
    assert list(encodings) == ["x", "w", "w_t", "y", "z"]  # the unnamed binding is left out
    expected = by_name(doc, options)
    x = encodings["x"]
    assert x == {
        "name": "x",
        "output_dtype": "uint8",
        "y_scale": expected["x"].scale,
        "y_zero_point": expected["x"].zero_point,
    }
    w = encodings["w"]
    assert w["axis"] == 1 and w["output_dtype"] == "uint8"
    assert w["y_scale"] == list(expected["w"].scale) and len(w["y_scale"]) == 3
    assert w["y_zero_point"] == list(expected["w"].zero_point)
    assert encodings["w_t"]["axis"] == 0 and len(encodings["w_t"]["y_scale"]) == 3
    for e in encodings.values():
        assert isinstance(e["y_scale"], float | list) and e["y_scale"]


def test_aimet_symmetric_int8_zero_points():
    out = json.loads(export(matmul_profile(), "aimet", CalibrationOptions()))
    assert {e["output_dtype"] for e in out["encodings"]} == {"int8"}
    assert {e["y_zero_point"] for e in out["encodings"]} == {0}
    assert all("axis" not in e for e in out["encodings"])


# --- ONNX Runtime ---------------------------------------------------------------------------


def ort_tensors_data(doc: dict, options: CalibrationOptions) -> TensorsData:
    """What ORT's own MinMax calibrator holds for our ranges (0-d float32 arrays)."""
    data = {}
    for e in doc["tensors"]:
        if e["source_tensor"] and e["kind"] != "weight":
            lo, hi = qparams_for(e, options).range
            data[e["source_tensor"]] = TensorData(
                lowest=np.array(lo, dtype=np.float32), highest=np.array(hi, dtype=np.float32)
            )
    return TensorsData(CalibrationMethod.MinMax, data)


@pytest.mark.parametrize(
    "options",
    [CalibrationOptions(), CalibrationOptions(method="percentile", scheme="asym", dtype="uint8")],
)
def test_ort_json_is_what_ort_writes(options):
    doc = matmul_profile()
    ours = json.loads(export(doc, "ort-json", options))
    theirs = ort_tensors_data(doc, options).to_dict()
    theirs["smooth_quant"] = False  # as save_tensors_data writes it
    assert ours == json.loads(json.dumps(theirs, cls=CalibrationCacheEncoder))
    assert list(ours["data"]) == ["x", "w_t", "y", "z"]  # no weights, ONNX names only


def test_ort_lines_are_what_ort_writes(tmp_path):
    doc = matmul_profile()
    options = CalibrationOptions(method="entropy", granularity="per-channel")
    cache = tmp_path / "calibration.json"
    cache.write_text(export(doc, "ort-json", options))
    write_calibration_table(load_tensors_data(cache), dir=str(tmp_path))
    ours = export(doc, "ort", options)
    assert ours == (tmp_path / "calibration.cache").read_text()
    lines = [line.split(" ") for line in ours.splitlines()]
    assert [name for name, _ in lines] == ["w_t", "x", "y", "z"]  # sorted, per-tensor
    expected = by_name(doc, CalibrationOptions(method="entropy"))
    for name, value in lines:
        assert float(value) == float(np.float32(expected[name].threshold))


def test_ort_lines_use_the_threshold_of_asymmetric_ranges():
    # ORT would print max(lowest, highest), dropping a larger negative side.
    doc = profile(entry([-4.0, 1.0], source_tensor="a"))
    options = CalibrationOptions(scheme="asym", dtype="uint8")
    (line,) = export(doc, "ort", options).splitlines()
    lo, hi = qparams_for(doc["tensors"][0], options).range
    assert -lo > hi and line == f"a {float(np.float32(-lo))}"


def matmul_relu_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
            helper.make_node("Relu", ["y"], ["z"], name="relu"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 3])],
        [numpy_helper.from_array(W, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_quantize_static_reproduces_our_parameters(tmp_path):
    # ORT's defaults: int8 activations, asymmetric; per-tensor symmetric int8 weights.
    doc = matmul_profile()
    options = CalibrationOptions(method="mse", scheme="asym", dtype="int8")
    cache = tmp_path / "calibration.json"
    cache.write_text(export(doc, "ort-json", options))
    onnx.save(matmul_relu_model(), tmp_path / "model.onnx")
    quantize_static(
        tmp_path / "model.onnx", tmp_path / "q.onnx", None, calibration_cache_path=cache
    )
    init = {
        i.name: numpy_helper.to_array(i) for i in onnx.load(tmp_path / "q.onnx").graph.initializer
    }
    ours = by_name(doc, options)
    for name in ("x", "z"):  # MatMul and Relu fuse: y is not quantized on its own
        assert init[f"{name}_scale"] == pytest.approx(ours[name].scale, rel=1e-6)
        assert int(init[f"{name}_zero_point"]) == ours[name].zero_point
    weight = qparams_for(doc["tensors"][1], CalibrationOptions())  # max|w| / 127
    assert init["w_scale"] == pytest.approx(weight.scale, rel=1e-6)


# --- TensorRT -------------------------------------------------------------------------------


def test_tensorrt_cache_round_trips_to_the_scale():
    doc = matmul_profile()
    options = CalibrationOptions(method="percentile", percentile=99.9)
    header, *lines = export(doc, "tensorrt", options).splitlines()
    assert header == TENSORRT_HEADER == "TRT-8601-EntropyCalibration2"
    expected = by_name(doc, options)
    names = []
    for line in lines:
        name, hexbits = line.split(": ")
        assert len(hexbits) == 8
        (scale,) = struct.unpack(">f", bytes.fromhex(hexbits))
        assert scale == float(np.float32(expected[name].scale))
        assert scale == pytest.approx(expected[name].threshold / 127, rel=1e-7)
        names.append(name)
    assert names == ["x", "w_t", "y", "z"]


def test_tensorrt_needs_symmetric_int8():
    with pytest.raises(RangeprofError, match="symmetric int8"):
        export(matmul_profile(), "tensorrt", CalibrationOptions(scheme="asym"))
    with pytest.raises(RangeprofError, match="symmetric int8"):
        export(matmul_profile(), "tensorrt", CalibrationOptions(dtype="int16"))


def test_unknown_format():
    with pytest.raises(RangeprofError, match=r"unknown export format 'onnx'.*aimet, ort"):
        export(matmul_profile(), "onnx", CalibrationOptions())
