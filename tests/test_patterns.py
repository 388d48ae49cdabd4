"""What the x86 pattern table takes into a region, on the shapes MobileNetV3-style networks export:
bias-free convs, scalar adds straight after a conv, HardSwish reading the conv's output twice."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import helper

import rangeprof
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

from onnx_builders import mobilenet_v3_block, save, single_io_model

X86 = get_plugin("x86")


def _regions(path, data):
    profile = profile_model(path, {"x": data}, options=ProfileOptions(samples=len(data)))
    qparams = qparams_from_profile(profile, X86, "max", 99.99)
    return quantize_model(path, qparams, X86).regions


def _conv_then(nodes, inits, tmp_path):
    rng = np.random.default_rng(3)
    inits = {"w": rng.normal(size=(6, 3, 3, 3)) / 3, **inits}
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1] * 4)
    model = single_io_model([conv, *nodes], inits, (1, 3, 8, 8), (1, 6, 8, 8))
    return save(model, tmp_path), rng.normal(size=(8, 3, 8, 8)).astype(np.float32)


def _sqnr_db(got: np.ndarray, want: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(want**2) / np.sum((got - want) ** 2)))


def test_a_scalar_added_after_a_conv_is_a_bias_on_every_channel(tmp_path):
    nodes = [
        helper.make_node("Add", ["c", "three"], ["a"], name="plus3"),
        helper.make_node("Relu", ["a"], ["y"], name="act"),
    ]
    path, data = _conv_then(nodes, {"three": np.array(3.0)}, tmp_path)
    (region,) = _regions(path, data)
    assert region.pattern.endswith("conv2d_bias_relu")
    np.testing.assert_array_equal(region.float_region.bias, np.full(6, 3.0, np.float32))


def test_an_epilogue_whose_input_is_read_elsewhere_stays_outside_the_region(tmp_path):
    # HardSwish decomposed: x * Clip(x + 3, 0, 6) / 6 reads the conv's output x twice, so the
    # +3 and the clip cannot become the region's bias and clamp.
    nodes = [
        helper.make_node("Add", ["c", "three"], ["a"], name="plus3"),
        helper.make_node("Clip", ["a", "zero", "six"], ["b"], name="clip"),
        helper.make_node("Mul", ["c", "b"], ["m"], name="gate"),
        helper.make_node("Div", ["m", "six"], ["y"], name="div6"),
    ]
    consts = {"three": np.array(3.0), "zero": np.array(0.0), "six": np.array(6.0)}
    path, data = _conv_then(nodes, consts, tmp_path)
    (region,) = _regions(path, data)
    assert region.pattern.endswith(".conv2d")
    assert region.float_region.bias is None and region.float_region.clamp is None
    got = rangeprof.quantize(path, data, target="x86").run(data[:1])[0]
    want = ort.InferenceSession(str(path)).run(None, {"x": data[:1]})[0]
    assert _sqnr_db(got, want) > 30


def test_a_mobilenet_v3_style_network_builds_and_evaluates(tmp_path):
    path = save(mobilenet_v3_block(), tmp_path)
    rng = np.random.default_rng(0)
    data = rng.normal(size=(16, 3, 16, 16)).astype(np.float32)
    regions = _regions(path, data)
    # a Gemm's nodes are ``fc1#0``...: the node's own id, numbered
    sources = {pid.split("#")[0] for r in regions for pid in r.profile_ids}
    assert sources >= {"stem", "dw", "pw", "fc1", "fc2"}
    int8 = rangeprof.quantize(path, data, target="x86")
    session = ort.InferenceSession(str(path))
    held = rng.normal(size=(4, 3, 16, 16)).astype(np.float32)
    got = np.concatenate([int8.run(x[None])[0] for x in held])
    want = np.concatenate([session.run(None, {"x": x[None]})[0] for x in held])
    assert _sqnr_db(got, want) > 25
    profile = rangeprof.profile(path, data)
    report = rangeprof.evaluate(path, profile, held, target="x86")
    assert len(report.layers) == len(regions) and report.output_sqnr_db > 25
