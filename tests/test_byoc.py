"""The BYOC core and the x86 plugin: qparams found by lineage, integer arithmetic equal to the
formulas, INT8 artifacts that load and run, evaluation (the accuracy budget's own tests, int16
then FP32, are in ``test_int16_fallback.py``).

Single-layer models check the integer code against an independent numpy reference: the
accumulator of ``(x_q − z_x)`` padded with zeros (the kernels multiply raw ``x_q`` padded with
``z_x`` and fold ``z_x`` into the bias), requantized with the policy's fixed-point multipliers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax
from typer.testing import CliRunner

from rangeprof.byoc.evaluate import evaluate, program
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.policy import (
    FIXED_POINT,
    FLOAT,
    REQUANTIZE,
    ActivationQ,
    QuantPolicy,
    fixed_point,
    float_requantize_reference,
    int32_bias,
    quantize_weights,
    requantize_reference,
)
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.cli import app
from rangeprof.profiler.errors import RangeprofError

from conftest import SHARED, zoo_model
from onnx_builders import conv_relu, save, single_io_model

X86 = get_plugin("x86")
POLICY = X86.policy
# x86 with every region output requantized (as integer-only targets do): integer results
INTEGER = dataclasses.replace(X86, policy=dataclasses.replace(POLICY, integer_outputs=True))


def _asym(lo: float, hi: float, pid: str) -> dict:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255
    return {
        "profile_id": pid,
        "dtype": "uint8",
        "axis": None,
        "scale": scale,
        "zero_point": int(np.clip(round(-lo / scale), 0, 255)),
    }


def _doc(path, entries: list[dict]) -> dict:
    full = [
        {
            "source_tensor": None,
            "kind": "activation",
            "method": "max",
            "range": [0, 0],
            "note": None,
            **e,
        }
        for e in entries
    ]
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    options = POLICY.calibration().to_json()
    return {
        "schema_version": "1.0",
        "model": {"name": "m", "sha256": sha, "inputs": {}},
        "options": options,
        "qparams": full,
    }


def _quantize(x: np.ndarray, q: dict) -> np.ndarray:
    # float32 division, as the program's quantize does
    return np.clip(np.round(x / np.float32(q["scale"])) + q["zero_point"], 0, 255).astype(np.int64)


def _conv_reference(xq, zx, wq, stride, pad, dilation, groups):
    """``Σ (x_q − z_x) · w_q`` with zero padding (an independent formulation)."""
    x = np.pad(xq - zx, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, _, h, w = x.shape
    o, cg, kh, kw = wq.shape
    oh = (h - dilation * (kh - 1) - 1) // stride + 1
    ow = (w - dilation * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, o, oh, ow), np.int64)
    og = o // groups
    for g in range(groups):
        xs, ws = x[:, g * cg : (g + 1) * cg], wq[g * og : (g + 1) * og].astype(np.int64)
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dilation, j * dilation
                patch = xs[
                    :,
                    :,
                    r0 : r0 + stride * (oh - 1) + 1 : stride,
                    c0 : c0 + stride * (ow - 1) + 1 : stride,
                ]
                out[:, g * og : (g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    return out


def _requantize(
    acc, bias_f, x_q, w_scales, out_q, axis_shape, lo=-math.inf, hi=math.inf, mode=FIXED_POINT
):
    multiplier = x_q["scale"] * w_scales / out_q["scale"]
    if mode == FLOAT:  # the bias unrounded, in accumulator units
        offset = (bias_f / (x_q["scale"] * w_scales)).reshape(axis_shape)
        y = float_requantize_reference(acc, multiplier.reshape(axis_shape), offset)
    else:
        bias_q = np.round(bias_f / (x_q["scale"] * w_scales)).astype(np.int64)
        acc = acc + bias_q.reshape(axis_shape)
        m, shift = fixed_point(multiplier)
        y = requantize_reference(acc, m.reshape(axis_shape), shift.reshape(axis_shape))
    y = y + out_q["zero_point"]
    z, s = out_q["zero_point"], out_q["scale"]
    qlo = max(0, z + math.floor(lo / s + 0.5)) if math.isfinite(lo) else 0
    qhi = min(255, z + math.floor(hi / s + 0.5)) if math.isfinite(hi) else 255
    return np.clip(y, qlo, qhi)


def _run_region(path, doc, x, plugin=INTEGER):
    """The region's output: integer (from the exposed, dequantized value:
    ``q = round(y / s) + z``) when the plugin requantizes it, else FP32."""
    qm = quantize_model(path, doc, plugin)
    assert len(qm.regions) == 1
    mod, _ = qm.lower(expose=True)
    vm = relax.VirtualMachine(plugin.compile(mod), tvm.cpu())
    y = vm["main"](tvm.runtime.tensor(x))[1].numpy()
    if not plugin.policy.integer_outputs:
        return qm, y
    (region,) = qm.regions
    return qm, np.round(y / region.output.scale).astype(np.int64) + region.output.zero_point


CONVS = {
    # name: (in channels, out channels, kernel, stride, pad, dilation, groups, activation)
    "3x3": (8, 16, 3, 1, 1, 1, 1, None),
    "3x3_stride2": (8, 16, 3, 2, 1, 1, 1, "Relu"),
    "1x1": (16, 8, 1, 1, 0, 1, 1, None),
    "depthwise": (16, 16, 3, 1, 1, 1, 16, "Clip"),
    "grouped_dilated": (8, 8, 3, 1, 2, 2, 2, "Relu"),
}


def _integer(weight_bits: int, requantize: str):
    """:data:`INTEGER` with ``weight_bits``-bit weights (7: ``vpmaddubsw`` on AVX2) and the
    ``requantize`` way."""
    policy = dataclasses.replace(INTEGER.policy, weight_bits=weight_bits, requantize=requantize)
    return dataclasses.replace(INTEGER, policy=policy)


@pytest.mark.parametrize("requantize", REQUANTIZE)
@pytest.mark.parametrize("weight_bits", [8, 7])
@pytest.mark.parametrize("case", sorted(CONVS))
def test_conv_region_equals_integer_formula(case, weight_bits, requantize, tmp_path):
    c_in, c_out, k, stride, pad, dilation, groups, act = CONVS[case]
    rng = np.random.default_rng(len(case))
    w = (rng.normal(size=(c_out, c_in // groups, k, k)) / k).astype(np.float32)
    b = rng.normal(size=c_out).astype(np.float32)
    nodes = [
        helper.make_node(
            "Conv",
            ["x", "w", "b"],
            ["c"],
            name="conv",
            pads=[pad] * 4,
            strides=[stride] * 2,
            dilations=[dilation] * 2,
            group=groups,
        )
    ]
    inits = {"w": w, "b": b}
    out_id, lo, hi = "conv#2", -math.inf, math.inf  # conv, bias reshape, bias add
    if act == "Relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"], name="act"))
        out_id, lo = "act", 0.0
    elif act == "Clip":
        inits.update(lo=np.float32(0.0), hi=np.float32(2.0))
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="act"))
        out_id, lo, hi = "act#5", 0.0, 2.0  # Clip imports as six bindings
    else:
        nodes[0].output[0] = "y"
    size = 10
    out = (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    path = save(
        single_io_model(nodes, inits, (1, c_in, size, size), (1, c_out, out, out)), tmp_path
    )
    x = rng.normal(size=(1, c_in, size, size)).astype(np.float32)
    x_q = _asym(-2.5, 3.0, "input:x")  # z_x ≈ 116: padding must pad with it
    out_q = _asym(-4.0, 5.0, out_id)
    plugin = _integer(weight_bits, requantize)
    qm, got = _run_region(path, _doc(path, [x_q, out_q]), x, plugin)

    wq, w_scales = quantize_weights(w, 0, plugin.policy)
    weight_max = 2 ** (weight_bits - 1) - 1
    assert np.array_equal(np.abs(wq).max(axis=(1, 2, 3)), np.full(c_out, weight_max))
    acc = _conv_reference(_quantize(x, x_q), x_q["zero_point"], wq, stride, pad, dilation, groups)
    want = _requantize(acc, b, x_q, w_scales, out_q, (1, c_out, 1, 1), lo, hi, requantize)
    assert np.array_equal(got, want)
    (region,) = qm.regions
    assert region.input.profile_id == "input:x" and region.output_id == out_id
    assert region.float_region.kind == "conv2d"


def test_region_feeding_fp32_leaves_as_scaled_accumulator(tmp_path):
    """x86 skips requantizing an output only FP32 operators read: ``s_x · s_c · (acc + β)``,
    the bias ``β`` unrounded."""
    rng = np.random.default_rng(7)
    model, w, b = conv_relu(rng, 4, 8, 6)
    path = save(model, tmp_path)
    x = rng.normal(size=(1, 4, 6, 6)).astype(np.float32)
    x_q = _asym(-2.0, 2.0, "input:x")
    _, got = _run_region(path, _doc(path, [x_q, _asym(0.0, 4.0, "act")]), x, X86)
    wq, w_scales = quantize_weights(w, 0, POLICY)
    acc = _conv_reference(_quantize(x, x_q), x_q["zero_point"], wq, 1, 1, 1, 1)
    offset = (b / (x_q["scale"] * w_scales)).astype(np.float32).reshape(1, -1, 1, 1)
    scale = (x_q["scale"] * w_scales).astype(np.float32).reshape(1, -1, 1, 1)
    want = np.maximum((acc.astype(np.float32) + offset) * scale, 0)
    assert got.dtype == np.float32 and np.array_equal(got, want)


def _gemm_case(seed: int, tmp_path):
    """A one-Gemm model ``fc`` (32 → 12, bias) saved under ``tmp_path``, its weight, bias and an
    input of 4 rows."""
    rng = np.random.default_rng(seed)
    w, b = rng.normal(size=(12, 32)).astype(np.float32), rng.normal(size=12).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1)
    path = save(single_io_model([node], {"w": w, "b": b}, (4, 32), (4, 12)), tmp_path)
    return path, w, b, rng.normal(size=(4, 32)).astype(np.float32)


@pytest.mark.parametrize("requantize", REQUANTIZE)
@pytest.mark.parametrize("weight_bits", [8, 7])
def test_dense_region_equals_integer_formula(weight_bits, requantize, tmp_path):
    path, w, b, x = _gemm_case(3, tmp_path)
    x_q, out_q = _asym(-3.0, 3.0, "input:x"), _asym(-8.0, 8.0, "fc#2")
    plugin = _integer(weight_bits, requantize)
    qm, got = _run_region(path, _doc(path, [x_q, out_q]), x, plugin)
    wq, w_scales = quantize_weights(w.T, 1, plugin.policy)
    assert np.abs(wq).max() == 2 ** (weight_bits - 1) - 1
    acc = (_quantize(x, x_q) - x_q["zero_point"]) @ wq.astype(np.int64)
    want = _requantize(acc, b, x_q, w_scales, out_q, (12,), mode=requantize)
    assert np.array_equal(got, want)
    script = qm.lower()[0].script()
    assert ("R.round(" in script) == (requantize == FLOAT)
    assert ("R.right_shift(" in script) == (requantize == FIXED_POINT)


def test_a_bias_added_in_front_is_read_as_the_bias(tmp_path):
    # ONNX exporters write Add(B, MatMul(x, W)) as often as Add(MatMul(x, W), B) (the shared
    # tiny BERT does): the pattern matches both, as add commutes, and both give the same region.
    rng = np.random.default_rng(4)
    w, b = rng.normal(size=(32, 12)).astype(np.float32), rng.normal(size=12).astype(np.float32)
    x = rng.normal(size=(4, 32)).astype(np.float32)
    results = []
    for order in (["y0", "b"], ["b", "y0"]):
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["y0"], name="fc"),
            helper.make_node("Add", order, ["y"], name="bias"),
        ]
        folder = tmp_path / "_".join(order)
        folder.mkdir()
        path = save(single_io_model(nodes, {"w": w, "b": b}, (4, 32), (4, 12)), folder)
        doc = _doc(path, [_asym(-3.0, 3.0, "input:x"), _asym(-8.0, 8.0, "bias")])
        qm, got = _run_region(path, doc, x)
        np.testing.assert_array_equal(qm.regions[0].float_region.bias, b)
        results.append(got)
    np.testing.assert_array_equal(results[0], results[1])


def test_float_requantization_keeps_fixed_point_where_the_scaled_accumulator_could_overflow(
    tmp_path,
):
    """A tiny output scale (multiplier ~10^4): ``Σ|w| · 255 · m`` passes 2^30, where float32
    would no longer convert back exactly, so the region requantizes in fixed point."""
    path, w, b, x = _gemm_case(5, tmp_path)
    x_q, out_q = _asym(-3.0, 3.0, "input:x"), _asym(-1e-6, 1e-6, "fc#2")
    plugin = _integer(8, FLOAT)
    qm, got = _run_region(path, _doc(path, [x_q, out_q]), x, plugin)
    script = qm.lower()[0].script()
    assert "R.right_shift(" in script and "R.round(" not in script
    wq, w_scales = quantize_weights(w.T, 1, plugin.policy)
    acc = (_quantize(x, x_q) - x_q["zero_point"]) @ wq.astype(np.int64)
    want = _requantize(acc, b, x_q, w_scales, out_q, (12,))
    assert np.array_equal(got, want) and {0, 255} <= set(np.unique(got).tolist())
    assert qm.regions[0].float_region.kind == "matmul"


def test_fixed_point_multiplier_is_within_one_part_in_2_to_30():
    m = np.array([1e-6, 0.0123, 0.5, 0.75, 0.9999999, 1.0, 3.7])
    mult, shift = fixed_point(m)
    assert np.all((mult >= 2**30) & (mult < 2**31))
    assert np.allclose(mult * np.exp2(-shift.astype(float)), m, rtol=2**-30, atol=0)
    # round half up, then shift: 7 * 0.5 = 3.5 -> 4, -7 * 0.5 = -3.5 -> -3
    half_m, half_s = fixed_point(np.array([0.5, 0.5]))
    assert list(requantize_reference(np.array([7, -7]), half_m, half_s)) == [4, -3]


def test_power_of_two_policy_gives_shift_only_requantization():
    w = np.random.default_rng(0).normal(size=(4, 3, 3, 3))
    _, scales = quantize_weights(w, 0, QuantPolicy(power_of_two=True))
    assert np.array_equal(np.log2(scales), np.round(np.log2(scales)))
    mult, _ = fixed_point(0.25 * scales / 0.5)
    assert np.all(mult == 2**30)


@pytest.mark.zoo
def test_digits_regions_follow_lineage_and_stay_int8_between_regions(digits_profile):
    qm = quantize_model(
        zoo_model("digits_cnn"), qparams_from_profile(digits_profile, X86, "max", 99.99), X86
    )
    boundaries = [(r.input.profile_id, r.output_id) for r in qm.regions]
    # The channel scale after block 1 folded backward into conv 1: its output is /Mul's tensor.
    # x86 smooths both dense layers' inputs (SmoothQuant): derived IDs that name their source.
    assert boundaries == [
        ("input:image", "/Mul"),
        ("/Mul", "/Relu_1"),
        ("/MaxPool", "/Relu_2"),
        ("/Flatten#smoothed", "/Relu_3"),
        ("/Relu_3#smoothed", "/fc2/Gemm#2"),
    ]
    assert [qm.smoothing.source(r.input.profile_id)[0] for r in qm.regions[3:]] == [
        "/Flatten",
        "/Relu_3",
    ]
    assert "/b1/BatchNormalization#0" in qm.regions[0].profile_ids
    text = qm.lower()[0]["main"].script()
    # Chained regions stay 8-bit; quantize only before a region that follows FP32 (the input,
    # max pool, mean + reshape + smoothing multiply, and /Relu_3's smoothing multiply: a ReLU
    # output's scales are inserted, not folded into its producer). Outputs read by FP32 leave
    # as scaled accumulators.
    assert text.count("R.quantize(") == 4 and text.count("R.dequantize(") == 0
    assert "def main(" in text


@pytest.mark.zoo
def test_missing_profile_is_an_error_or_an_explicit_fp32_fallback(digits_profile):
    doc = qparams_from_profile(digits_profile, X86, "max", 99.99)
    doc["qparams"] = [q for q in doc["qparams"] if q["profile_id"] != "/MaxPool"]
    with pytest.raises(RangeprofError, match=r"no qparams for its input.*MaxPool"):
        quantize_model(zoo_model("digits_cnn"), doc, X86)
    qm = quantize_model(zoo_model("digits_cnn"), doc, X86, fp32_fallback=True)
    fallback = [r for r in qm.regions if r.fallback]
    assert len(fallback) == 1 and "/c3/Conv" in fallback[0].profile_ids
    assert "R.nn.conv2d(lv" in qm.lower()[0]["main"].script()  # the FP32 conv, inline


@pytest.mark.zoo
def test_an_output_only_fp32_operators_read_needs_no_qparams(digits_profile):
    """``/Relu_2`` goes to a max pool: x86 leaves it as a scaled accumulator and needs no
    qparams for it (a QDQ model pairs no such tensor); integer-only hardware does."""
    doc = qparams_from_profile(digits_profile, X86, "max", 99.99)
    doc["qparams"] = [q for q in doc["qparams"] if q["profile_id"] != "/Relu_2"]
    qm = quantize_model(zoo_model("digits_cnn"), doc, X86)
    (region,) = [r for r in qm.regions if r.output_id == "/Relu_2"]
    assert region.output is None and region.fallback is None and region.input is not None
    full = qm.replanned(qparams_from_profile(digits_profile, X86, "max", 99.99))
    x = np.load(SHARED / "data" / "digits.npz")["test"][:1]
    got, want = (program(m, "int8", {}, {}).run([x])[0] for m in (qm, full))
    np.testing.assert_array_equal(got, want)  # its output never was requantized
    npu = get_plugin("npu")
    doc = qparams_from_profile(digits_profile, npu, "max", 99.99)
    doc["qparams"] = [q for q in doc["qparams"] if q["profile_id"] != "/Relu_2"]
    with pytest.raises(RangeprofError, match=r"no qparams for its output.*Relu_2"):
        quantize_model(zoo_model("digits_cnn"), doc, npu)


@pytest.mark.zoo
def test_digits_int8_accuracy_and_layer_errors(digits_profile):
    data = SHARED / "data" / "digits.npz"
    labels = np.load(data)["test_labels"][:200]
    qm = quantize_model(
        zoo_model("digits_cnn"), qparams_from_profile(digits_profile, X86, "max", 99.99), X86
    )
    result = evaluate(qm, f"{data}:test", labels, samples=200)
    doc = result.to_json()
    assert doc["samples"] == 200
    assert abs(doc["fp32_top1"] - doc["int8_top1"]) <= 1.0
    assert doc["fp32_top1"] > 95 and doc["agreement"] > 97
    assert 25 < doc["output_sqnr_db"] < 60
    layers = doc["layers"]
    assert [e["profile_id"] for e in layers] == [e.profile_id for e in result.ranked()]
    isolated = [e["isolated_sqnr_db"] for e in layers]
    assert isolated == sorted(isolated) and all(25 < v < 60 for v in isolated)
    # The first region sees no earlier quantization: isolated and accumulated are equal.
    first = next(e for e in layers if e["profile_id"] == "/Mul")
    assert first["isolated_sqnr_db"] == first["accumulated_sqnr_db"]
    # Within a step of the output grid: max calibration clips nothing.
    assert all(0 < e["isolated_rmse_per_scale"] < 1.0 for e in layers)


@pytest.mark.zoo
def test_cli_build_artifact_loads_and_matches_evaluate(digits_profile, tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(digits_profile))
    model = zoo_model("digits_cnn")
    runner = CliRunner()
    result = runner.invoke(
        app, ["build", str(model), "--profile", str(profile), "--out", str(tmp_path / "art")]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["target"] == "x86" and len(manifest["regions"]) == 5
    assert all(r["mode"] == "int8" and r["profile_ids"] for r in manifest["regions"])
    library = tmp_path / "art" / manifest["library"]
    assert hashlib.sha256(library.read_bytes()).hexdigest() == manifest["library_sha256"]
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    x = np.load(SHARED / "data" / "digits.npz")["test"][:1].astype(np.float32)
    deployed = vm["main"](tvm.runtime.tensor(x)).numpy()
    qparams = qparams_from_profile(digits_profile, X86, "mse", 99.99)
    qm = quantize_model(model, qparams, X86)
    mod, _ = qm.lower()  # the CLI's default method: mse
    in_process = relax.VirtualMachine(X86.compile(mod), tvm.cpu())["main"](tvm.runtime.tensor(x))
    assert np.array_equal(deployed, in_process.numpy())

    result = runner.invoke(
        app,
        [
            "evaluate",
            str(model),
            "--profile",
            str(profile),
            "--data",
            f"{SHARED}/data/digits.npz:test",
            "--labels",
            f"{SHARED}/data/digits.npz:test_labels",
            "--samples",
            "100",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in ("fp32_top1", "int8_top1", "agreement", "output_sqnr_db", "layers", "methods"):
        assert key in report
    assert {"profile_id", "isolated_sqnr_db", "accumulated_sqnr_db"} <= set(report["layers"][0])


@pytest.mark.zoo
def test_cli_seven_bit_weights_build_and_evaluate(digits_profile, tmp_path):
    """``--weight-bits 7``: the manifest says so, the artifact computes what evaluate measures
    (weights in [-63, 63]), and digits stay within a top-1 point of FP32."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(digits_profile))
    model, runner = zoo_model("digits_cnn"), CliRunner()
    common = ["--profile", str(profile), "--weight-bits", "7"]
    result = runner.invoke(app, ["build", str(model), "--out", str(tmp_path / "art"), *common])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert "7-bit ±63" in manifest["policy"]["weights"]
    library = str(tmp_path / "art" / manifest["library"])
    x = np.load(SHARED / "data" / "digits.npz")["test"][:1].astype(np.float32)
    deployed = relax.VirtualMachine(tvm.runtime.load_module(library), tvm.cpu())["main"]
    seven = get_plugin("x86", weight_bits=7)
    qm = quantize_model(model, qparams_from_profile(digits_profile, seven, "mse", 99.99), seven)
    in_process = relax.VirtualMachine(seven.compile(qm.lower()[0]), tvm.cpu())["main"]
    eight = relax.VirtualMachine(X86.compile(_digits_int8(digits_profile)), tvm.cpu())["main"]
    outputs = [f(tvm.runtime.tensor(x)).numpy() for f in (deployed, in_process, eight)]
    assert np.array_equal(outputs[0], outputs[1])
    assert not np.array_equal(outputs[1], outputs[2])  # other weights, other numbers

    data = SHARED / "data" / "digits.npz"
    args = ["--data", f"{data}:test", "--labels", f"{data}:test_labels", "--samples", "200"]
    result = runner.invoke(app, ["evaluate", str(model), *common, *args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["weight_bits"] == 7
    assert abs(report["fp32_top1"] - report["int8_top1"]) <= 1.0
    assert report["output_sqnr_db"] > 25


def _digits_int8(digits_profile) -> tvm.IRModule:
    doc = qparams_from_profile(digits_profile, X86, "max", 99.99)
    return quantize_model(zoo_model("digits_cnn"), doc, X86).lower()[0]


def test_cli_build_errors_are_one_line_exit_2(tmp_path):
    rng = np.random.default_rng(0)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1)
    path = save(
        single_io_model(
            [node], {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=3)}, (1, 4), (1, 3)
        ),
        tmp_path,
    )
    other = _doc(path, [_asym(-1, 1, "input:x"), _asym(-1, 1, "fc#2")])
    other["model"]["sha256"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    (tmp_path / "bad.json").write_text('{"schema_version": "1.0"}')
    runner = CliRunner()
    out = str(tmp_path / "art")
    cases = [
        (
            ["--target", "riscv", "--qparams", str(tmp_path / "other.json")],
            "--target: Input should be 'x86', 'aarch64' or 'npu'",
        ),
        ([], "exactly one of --qparams and --profile"),
        (["--qparams", str(tmp_path / "bad.json")], "not a QPARAMS document"),
        (["--qparams", str(tmp_path / "other.json")], "qparams are for model"),
        (["--qparams", str(tmp_path / "nope.json")], "No such file"),
        (
            ["--weight-bits", "9", "--qparams", str(tmp_path / "other.json")],
            "--weight-bits: weight bits must be one of 4, 7, 8 (got 9)",
        ),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["build", str(path), "--out", out, *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "art").exists()


def test_channel_of_near_zero_weights_keeps_its_bias_in_int32():
    """PP-OCR's detector has a conv channel with weights ~1e-9 under a bias of 0.37: at
    ``max|W_c| / 127`` its bias needs ~10^12 accumulator units. The channel's scale is raised
    until the bias fits, and the bias still dequantizes to itself."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(4, 3, 3, 3))
    w[2] *= 1e-9
    bias = np.array([0.1, -0.2, 0.369064, 0.0])
    x = ActivationQ("x", scale=0.0120177, zero_point=0, dtype="int8")
    with pytest.raises(RangeprofError, match="does not fit int32"):
        wq, scales = quantize_weights(w, 0, POLICY)
        int32_bias(bias, wq, 0, x, scales)
    wq, scales = quantize_weights(w, 0, POLICY, bias, x.scale)
    q = int32_bias(bias, wq, 0, x, scales)
    assert np.abs(q).max() <= 2**30
    assert np.allclose(q * x.scale * scales, bias, atol=x.scale * scales.max())
    assert np.array_equal(scales[[0, 1, 3]], quantize_weights(w, 0, POLICY)[1][[0, 1, 3]])
