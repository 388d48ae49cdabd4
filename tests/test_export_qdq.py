"""``rangeprof export --format qdq``: the profiled model with QuantizeLinear / DequantizeLinear
pairs, run by ONNX Runtime against our own INT8 build, and read back by ``import-qparams``."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from rangeprof.byoc.evaluate import program
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import quantize_model
from rangeprof.cli import app
from rangeprof.profiler.calibrate.imported import import_qparams
from rangeprof.profiler.calibrate.methods import CalibrationOptions, calibrate, qparams_for
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.export.qdq_model import qdq_model
from rangeprof.workflows import profiling, quantize
from rangeprof.workflows.requests import EvaluateRequest, ProfileRequest

from conftest import SHARED, zoo_model


@dataclass(frozen=True)
class Case:
    data: Path
    input: str
    shapes: dict
    calib_samples: int
    test_samples: int  # the same first samples on both sides


CASES = {
    "digits_cnn": Case(SHARED / "data" / "digits.npz", "image", {}, 200, 300),
    "ppocr_cls": Case(
        SHARED / "data" / "textlines.npz",
        "x",
        {"x": (1, 3, 48, 192)},
        32,
        200,
    ),
}
# What the x86 plugin computes with: asymmetric uint8 activations, symmetric int8 weights per
# output channel (the export's weights are always symmetric int8).
X86 = replace(get_plugin("x86").policy.calibration("max"), granularity="per-channel")
SYM_INT8 = CalibrationOptions(scheme="sym", dtype="int8")


@dataclass(frozen=True)
class Profiled:
    name: str
    case: Case
    model: Path
    profile: dict
    profile_path: Path


# ppocr_cls's cases (a deep net: minutes of builds and runs) go with the slow zoo checks.
@pytest.fixture(
    scope="module",
    params=["digits_cnn", pytest.param("ppocr_cls", marks=pytest.mark.zoo)],
)
def profiled(request, tmp_path_factory) -> Profiled:
    name, case = request.param, CASES[request.param]
    model = zoo_model(name)
    doc = profiling.profile(
        ProfileRequest(
            model=model,
            data=f"{case.data}:calib",
            input_shapes=case.shapes,
            samples=case.calib_samples,
        )
    ).to_json()
    path = tmp_path_factory.mktemp(name) / "profile.json"
    path.write_text(json.dumps(doc))
    return Profiled(name, case, model, doc, path)


def _exported(p: Profiled, options: CalibrationOptions) -> onnx.ModelProto:
    exported = qdq_model(onnx.load(p.model), p.profile, options)
    onnx.checker.check_model(exported, full_check=True)
    return exported


def _test_set(case: Case) -> tuple[np.ndarray, np.ndarray]:
    with np.load(case.data) as arrays:
        n = case.test_samples
        return arrays["test"][:n], arrays["test_labels"][:n]


def _ort_outputs(model: onnx.ModelProto, case: Case, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {case.input: x})[0]


@pytest.mark.parametrize("options", [SYM_INT8, X86], ids=["sym-int8", "asym-uint8-per-channel"])
def test_onnxruntime_runs_the_exported_model(profiled, options):
    exported = _exported(profiled, options)
    x, _ = _test_set(profiled.case)
    x = x[:8]
    fp32 = _ort_outputs(onnx.load(profiled.model), profiled.case, x)
    int8 = _ort_outputs(exported, profiled.case, x)
    assert int8.shape == fp32.shape and np.isfinite(int8).all()
    assert (int8.argmax(1) == fp32.argmax(1)).mean() >= 0.75

    nodes = exported.graph.node
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    quantizes = [n for n in nodes if n.op_type == "QuantizeLinear"]
    dequantizes = [n for n in nodes if n.op_type == "DequantizeLinear"]
    assert quantizes and len(dequantizes) > len(quantizes)  # weights: DequantizeLinear alone
    activation_type = np.uint8 if options.dtype == "uint8" else np.int8
    assert all(inits[q.input[2]].dtype == activation_type for q in quantizes)
    # Every Conv / Gemm / MatMul reads a dequantized input and a dequantized weight.
    produced = {n.output[0]: n for n in nodes}
    for node in nodes:
        if node.op_type in ("Conv", "Gemm", "MatMul"):
            assert produced[node.input[0]].op_type == "DequantizeLinear", node.name
            weight = produced[node.input[1]]
            assert weight.op_type == "DequantizeLinear", node.name
            assert inits[weight.input[0]].dtype == np.int8  # symmetric int8 weights
            per_channel = any(a.name == "axis" for a in weight.attribute)
            assert per_channel == (options.granularity == "per-channel"), node.name
    opset = next(o.version for o in exported.opset_import if o.domain in ("", "ai.onnx"))
    assert opset >= (13 if options.granularity == "per-channel" else 10)


def test_biases_are_int32_in_input_times_weight_scale(profiled):
    exported = _exported(profiled, X86)
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    produced = {n.output[0]: n for n in exported.graph.node}
    biased = [n for n in exported.graph.node if n.op_type in ("Conv", "Gemm") and len(n.input) > 2]
    for node in biased:
        bias, x, w = (produced[node.input[k]] for k in (2, 0, 1))
        assert inits[bias.input[0]].dtype == np.int32 and not inits[bias.input[2]].any()
        expected = inits[x.input[1]] * inits[w.input[1]]
        np.testing.assert_array_equal(inits[bias.input[1]], expected.astype(np.float32))


def test_top1_is_our_int8_builds(profiled, tmp_path):
    """ONNX Runtime on the export vs ``rangeprof evaluate`` with the same qparams, on the same
    samples: within 0.2 top-1 points."""
    case = profiled.case
    qparams = tmp_path / "qparams.json"
    qparams.write_text(json.dumps(calibrate(profiled.profile, X86)))
    report = quantize.evaluate(
        EvaluateRequest(
            model=profiled.model,
            qparams=qparams,
            data=f"{case.data}:test",
            labels=f"{case.data}:test_labels",
            samples=case.test_samples,
            target="x86",
            weight_bits=8,  # the export's (CPUs without VNNI otherwise take 7 in some layers)
            input_shapes=case.shapes,
        )
    ).to_json()
    x, labels = _test_set(case)
    outputs = _ort_outputs(_exported(profiled, X86), case, x)
    ort_top1 = 100.0 * (outputs.reshape(len(x), -1).argmax(1) == labels).mean()
    assert report["samples"] == len(x)
    assert abs(ort_top1 - report["int8_top1"]) <= 0.2, (ort_top1, report["int8_top1"])


@pytest.mark.parametrize("options", [SYM_INT8, X86], ids=["sym-int8", "asym-uint8-per-channel"])
def test_import_qparams_gives_back_the_exported_qparams(profiled, options, tmp_path):
    path = tmp_path / "model.int8.onnx"
    onnx.save(_exported(profiled, options), path)
    imported = {e["profile_id"]: e for e in import_qparams(path, profiled.case.shapes)["qparams"]}
    weights = replace(options, scheme="sym", dtype="int8")
    exported_ids = set()
    for entry in profiled.profile["tensors"]:
        record = imported.get(entry["profile_id"])
        if record is None:
            continue
        static = entry["kind"] == "weight" or entry["static"]
        expected = qparams_for(entry, weights if static else options)
        np.testing.assert_array_equal(
            np.float32(record["scale"]), np.float32(expected.scale), entry["profile_id"]
        )
        assert record["zero_point"] == _listed(expected.zero_point), entry["profile_id"]
        assert record["axis"] == expected.axis and record["dtype"] == expected.dtype
        exported_ids.add(entry["profile_id"])
    kinds = {e["kind"] for e in profiled.profile["tensors"] if e["profile_id"] in exported_ids}
    assert {"input", "activation", "weight"} <= kinds
    # Import-only IDs are the Clips that pairs from 0 become (rangeprof.profiler.ir.qdq).
    assert all("QuantizeLinear" in pid for pid in set(imported) - exported_ids)


def test_a_build_of_the_export_is_our_build_of_the_profile(profiled, tmp_path):
    """``rangeprof build`` of the QDQ model on its own pairs (``import-qparams``) computes what
    the build of the profile does: the pairs sit on exactly the tensors the x86 build
    quantizes, and the outputs it leaves in FP32 need none. The export holds no SmoothQuant
    scales and 8-bit weights: it is the build without smoothing, with 8-bit weights (CPUs
    without VNNI otherwise take 7 in some layers)."""
    path = tmp_path / "model.int8.onnx"
    onnx.save(_exported(profiled, X86), path)
    x86 = get_plugin("x86", 8)
    shapes = profiled.case.shapes
    qparams = calibrate(profiled.profile, X86)
    ours = quantize_model(profiled.model, qparams, x86, shapes, smooth_quant=False)
    theirs = quantize_model(path, import_qparams(path, shapes), x86, shapes)
    # The same grids (the import holds a pair as a Clip to its range, under the Clip's ID).
    grids = [[(r.input.scale, r.input.zero_point) for r in m.regions] for m in (ours, theirs)]
    np.testing.assert_allclose(grids[1], grids[0], rtol=1e-6)
    x, _ = _test_set(profiled.case)
    runs = [program(m, "int8", {}, {}) for m in (ours, theirs)]
    for sample in x[:4]:
        want, got = (p.run([sample[None]])[0] for p in runs)
        # float32 scales in the model against the profile's float64: a last-place difference
        np.testing.assert_allclose(got, want, atol=1e-3 * np.abs(want).max())


def _listed(value):
    return list(value) if isinstance(value, tuple) else value


def test_a_profile_of_an_equalized_model_is_refused(profiled):
    doc = {**profiled.profile, "model": {**profiled.profile["model"], "transforms": ["cle"]}}
    with pytest.raises(RangeprofError, match="after cle"):
        qdq_model(onnx.load(profiled.model), doc, X86)


def test_an_equalized_profile_exports_the_equalized_model(tmp_path):
    """The export writes the equalized weights: the FP32 model beneath the pairs computes what
    the original does, and ORT's top-1 on the export is our build's with the same profile."""
    case = CASES["digits_cnn"]
    model = zoo_model("digits_cnn")
    profile = profiling.profile(
        ProfileRequest(model=model, data=f"{case.data}:calib", equalize=True)
    )
    exported = onnx.load_from_string(profiling.render_export(profile, "qdq", X86, model))
    onnx.checker.check_model(exported, full_check=True)
    equalized, _ = profiling._transformed(onnx.load(model), model, profile)
    x, labels = _test_set(case)
    original = _ort_outputs(onnx.load(model), case, x)
    np.testing.assert_allclose(_ort_outputs(equalized, case, x), original, rtol=1e-4, atol=1e-4)
    changed = {
        t.name
        for t, u in zip(
            equalized.graph.initializer, onnx.load(model).graph.initializer, strict=True
        )
        if not np.array_equal(onnx.numpy_helper.to_array(t), onnx.numpy_helper.to_array(u))
    }
    assert changed  # conv weights, their bias and batch norm shifts

    path = tmp_path / "profile.json"
    path.write_text(profile.dumps())
    qparams = tmp_path / "qparams.json"
    qparams.write_text(json.dumps(calibrate(profile.to_json(), X86)))
    report = quantize.evaluate(
        EvaluateRequest(
            model=model,
            qparams=qparams,
            data=f"{case.data}:test",
            labels=f"{case.data}:test_labels",
            samples=case.test_samples,
        )
    ).to_json()
    outputs = _ort_outputs(exported, case, x)
    ort_top1 = 100.0 * (outputs.argmax(1) == labels).mean()
    assert abs(ort_top1 - report["int8_top1"]) <= 0.2


def test_cli_needs_the_model_and_writes_one_onnx_loads(profiled, tmp_path):
    out = tmp_path / "model.int8.onnx"
    args = ["export", str(profiled.profile_path), "--format", "qdq", "--out", str(out)]
    missing = CliRunner().invoke(app, args)
    assert missing.exit_code == 2
    assert missing.output.strip().count("\n") == 0 and "--model" in missing.output
    assert not out.exists()
    written = CliRunner().invoke(app, [*args, "--model", str(profiled.model), "--scheme", "asym"])
    assert written.exit_code == 0, written.output
    onnx.checker.check_model(onnx.load(out))
    other = next(zoo_model(n) for n in CASES if n != profiled.name)
    wrong = CliRunner().invoke(app, [*args, "--model", str(other)])
    assert wrong.exit_code == 2 and "not the profiled model" in wrong.output


def test_matmuls_of_two_activations_get_a_pair_on_each_operand(tmp_path):
    """Attention's ``Q·Kᵀ``: both operands paired, the second on the symmetric int8 grid the x86
    build multiplies it on; ONNX Runtime's outputs on the export are our INT8 build's."""
    from onnx import helper

    from rangeprof.byoc.evaluate import program
    from rangeprof.byoc.quantized import qparams_from_profile, quantize_model

    from onnx_builders import save, single_io_model

    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "xt"], ["y"], name="scores"),
    ]
    weights = {"wq": rng.normal(size=(16, 16)) / 4}
    path = save(single_io_model(nodes, weights, (1, 8, 16), (1, 8, 8)), tmp_path)
    doc = profiling.profile(ProfileRequest(model=path, data="random", samples=32)).to_json()
    exported = qdq_model(onnx.load(path), doc, X86)
    onnx.checker.check_model(exported, full_check=True)
    scores = next(n for n in exported.graph.node if n.name == "scores")
    pairs = {n.output[0]: n for n in exported.graph.node if n.op_type == "DequantizeLinear"}
    a, b = (pairs[name] for name in scores.input)
    init = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    assert init[a.input[2]].dtype == np.uint8
    assert init[b.input[2]].dtype == np.int8 and int(init[b.input[2]]) == 0

    x86 = get_plugin("x86", 8)  # the export's weights (CPUs without VNNI may take 7 bits)
    qm = quantize_model(path, qparams_from_profile(doc, x86, "max", 99.99), x86)
    (matmul,) = [r for r in qm.regions if r.float_region.kind == "batch_matmul"]
    assert matmul.operand.scale == pytest.approx(float(init[b.input[1]]), rel=1e-6)
    x = rng.normal(size=(4, 1, 8, 16)).astype(np.float32)
    # The QDQ semantics, unfused: on AVX2, ORT's fused u8 × s8 kernels saturate int16 pair
    # sums with full-range int8 weights (ORT's reduce_range), off by 10 % here on `q`.
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        exported.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    ours = program(qm, "int8", {}, {})
    for sample in x:
        theirs = session.run(None, {"x": sample})[0]
        got, _ = ours.run([sample])
        # Same integers up to float rounding of the scales: a last-place difference of the
        # output's 8-bit grid at most.
        assert np.abs(got - theirs).max() <= 1e-3 * np.abs(theirs).max()
