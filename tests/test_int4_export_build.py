"""A 4-bit weight-only build writes the same model as ONNX beside ``model.so``: MatMulNBits and
opset-21 int4 QDQ on the build's own codes, scales and zero points behind ``Mul(X, 1/s)``.
onnxruntime runs both, computing what a reference of dequantized weights computes, and what
the build computes where both keep the rest FP32; a layer no ONNX MatMul holds stays FP32 in
them, the manifest saying why. On char_gpt (zoo) the export's bits per character are the
build's."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import rangeprof
from rangeprof.byoc.artifact import build_artifact
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import QuantizedModel, qparams_from_profile, quantize_model
from rangeprof.byoc.weight_only import WeightOnly
from rangeprof.profiler.export.int4_onnx import MS_DOMAIN

import onnx_builders as mb
from conftest import SHARED, zoo_model

T, D = mb.TRANSFORMER_TOKENS, mb.TRANSFORMER_WIDTH
FILES = {"matmulnbits": "model.matmulnbits.onnx", "int4_qdq": "model.int4_qdq.onnx"}
DENSE = {"q", "k", "v", "o", "fc1", "fc2"}  # the tiny transformer's MatMuls with a weight


def _inputs(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, T, D)).astype(np.float32)


def _session(path, float_qdq: bool = False) -> ort.InferenceSession:
    """``float_qdq``: the fused DequantizeLinear + MatMul in float, as written (its default
    rounds ``X`` to int8)."""
    options = ort.SessionOptions()
    if float_qdq:
        options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    model = path.SerializeToString() if isinstance(path, onnx.ModelProto) else str(path)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, x: np.ndarray) -> np.ndarray:
    return np.stack([session.run(None, {"x": xi[None]})[0] for xi in x])


def _run_built(built: rangeprof.Int8Model, x: np.ndarray) -> np.ndarray:
    """One sample at a time: the output [T, 5] has no batch axis."""
    return np.stack([built.run(xi[None])[0] for xi in x])


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return mb.save(mb.pre_ln_transformer(hidden_outlier=10.0), tmp_path_factory.mktemp("w4x"))


@pytest.fixture(scope="module")
def profile(path):
    return rangeprof.profile(rangeprof.load(path), _inputs(1, 32))


def _build(path, profile, folder, exclude=()) -> tuple[QuantizedModel, dict]:
    """A W4 build on x86 (``build_artifact``, what ``rangeprof build`` runs) and its model."""
    plugin = get_plugin("x86")
    qparams = qparams_from_profile(profile.document, plugin, "max", 99.99)
    qm = quantize_model(path, qparams, plugin, exclude=exclude, weight_only=WeightOnly(32))
    return qm, build_artifact(qm, folder)


@pytest.fixture(scope="module")
def fp32_attention(path, profile, tmp_path_factory):
    """Attention's batch matmuls and the head kept FP32: every 4-bit layer a MatMul."""
    folder = tmp_path_factory.mktemp("fp32_attention")
    qm, manifest = _build(path, profile, folder, exclude=("qk", "att", "head*"))
    return qm, manifest, folder


def _reference(model: onnx.ModelProto, qm: QuantizedModel) -> tuple[onnx.ModelProto, set]:
    """``model`` with each MatMul of a 4-bit region (found by value: its weight is the region's
    divided by the scales ``s`` of its input) reading ``Int4Weights.dequantize()`` and
    ``X / s``; and those MatMuls' names."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dense = {
        n.name: inits[n.input[1]]
        for n in model.graph.node
        if n.op_type == "MatMul" and n.input[1] in inits
    }
    chosen = {}
    for region in (r for r in qm.regions if r.int4 is not None and r.fallback is None):
        scaled = qm.smoothing.source(region.input.profile_id)
        s = np.ones(region.int4.shape[0]) if scaled is None else scaled[1]
        w = region.float_region.weight / s[:, None]
        for name, b in dense.items():
            if b.shape == w.shape and np.allclose(b, w, rtol=1e-5, atol=1e-6):
                chosen[name] = (region.int4.dequantize(), s)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    weights = {t.name: t for t in out.graph.initializer}  # each read by one node here
    nodes = []
    for node in out.graph.node:
        if node.name in chosen:
            deq, s = chosen[node.name]
            weights[node.input[1]].CopyFrom(numpy_helper.from_array(deq, node.input[1]))
            scale = numpy_helper.from_array(s.astype(np.float32), f"{node.name}/s")
            out.graph.initializer.append(scale)
            nodes.append(helper.make_node("Div", [node.input[0], scale.name], [scale.name + "x"]))
            node.input[0] = scale.name + "x"
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, set(chosen)


def test_the_manifest_lists_both_files_beside_the_library(fp32_attention):
    _, manifest, folder = fp32_attention
    assert manifest["exports"] == FILES and "exports_fp32" not in manifest
    written = json.loads((folder / "manifest.json").read_text())
    assert written["exports"] == FILES
    for name in FILES.values():
        onnx.checker.check_model(onnx.load(folder / name), full_check=True)


def test_each_4_bit_layer_is_a_matmul_nbits_and_a_blocked_dequantize(fp32_attention):
    _, _, folder = fp32_attention
    nbits = onnx.load(folder / FILES["matmulnbits"])
    kinds = {n.name: (n.domain, n.op_type) for n in nbits.graph.node}
    assert {n for n, kind in kinds.items() if kind == (MS_DOMAIN, "MatMulNBits")} == DENSE
    assert kinds["qk"] == kinds["att"] == ("", "MatMul") and kinds["head"] == ("", "Gemm")
    assert sum(kind == ("", "Mul") for kind in kinds.values()) > 1  # the AWQ scales
    qdq = onnx.load(folder / FILES["int4_qdq"])
    dq = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dq) == len(DENSE)
    assert all(helper.get_node_attr_value(n, "block_size") == 32 for n in dq)
    types = {t.name: t.data_type for t in qdq.graph.initializer}
    assert types[dq[0].input[0]] == TensorProto.UINT4  # asymmetric: uint4 with zero points


def test_onnxruntime_computes_the_dequantized_reference(path, fp32_attention):
    """Both files in onnxruntime against the FP32 model with each MatMul on the build's
    dequantized weights and its input divided by ``s``: float rounding apart."""
    qm, _, folder = fp32_attention
    reference, replaced = _reference(onnx.load(path), qm)
    assert replaced == DENSE
    x = _inputs(7, 8)
    want = _run(_session(reference), x)
    fp32 = _run(_session(path), x)
    assert np.abs(want - fp32).max() > 1e-2 * np.abs(fp32).max()  # 4-bit weights show
    for got in (
        _run(_session(folder / FILES["matmulnbits"]), x),
        _run(_session(folder / FILES["int4_qdq"], float_qdq=True), x),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_onnxruntime_computes_what_the_build_computes(fp32_attention):
    """Where the build keeps attention and the head FP32 too, its outputs are the export's."""
    _, _, folder = fp32_attention
    x = _inputs(8, 8)
    built = _run_built(rangeprof.Int8Model.load(folder), x)
    exported = _run(_session(folder / FILES["matmulnbits"]), x)
    np.testing.assert_allclose(exported, built, rtol=1e-4, atol=1e-5 * np.abs(built).max())


def test_a_gemm_stays_fp32_in_the_export_and_the_manifest_says_so(path, profile, tmp_path):
    """The head is a Gemm: 4-bit in the build (its attention INT8, so outputs differ a little),
    FP32 in the files."""
    model = rangeprof.load(path)
    w4 = rangeprof.build(model, profile, method="max", weight_bits=4, out=tmp_path)
    head = next(r.name for r in w4.manifest.regions if "head#1" in r.profile_ids)
    assert w4.manifest.exports == FILES
    assert w4.manifest.exports_fp32 == {head: "not one ONNX MatMul among its nodes (head: Gemm)"}
    x = _inputs(9, 8)
    built = _run_built(w4, x)
    exported = _run(_session(tmp_path / FILES["matmulnbits"]), x)
    assert np.mean((exported - built) ** 2) < 0.05 * np.mean(built**2)


def test_an_int8_build_writes_no_onnx(path, profile, tmp_path):
    int8 = rangeprof.build(rangeprof.load(path), profile, method="max", out=tmp_path)
    assert int8.manifest.exports is None and not list(tmp_path.glob("*.onnx"))


def _column_scaled(folder) -> str:
    """``relu((x · d) @ W · c)``: the build folds ``c`` into ``W``'s columns."""
    rng = np.random.default_rng(3)
    k, n = 64, 32
    weights = {
        "w": rng.normal(size=(k, n)),
        "c": rng.uniform(0.5, 2, size=n),
        "d": rng.uniform(0.5, 2, size=k),
    }
    node = helper.make_node
    graph = helper.make_graph(
        [
            node("Mul", ["x", "d"], ["xd"], name="pre"),
            node("MatMul", ["xd", "w"], ["y"], name="mm"),
            node("Mul", ["y", "c"], ["z"], name="post"),
            node("Relu", ["z"], ["out"], name="relu"),
        ],
        "column_scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, k])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, n])],
        [numpy_helper.from_array(v.astype(np.float32), name) for name, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "column_scaled.onnx"
    onnx.save(model, path)
    return path


def test_a_weight_the_build_folded_a_scale_into_stays_fp32(tmp_path):
    """A constant multiply after the layer is in its 4-bit weights, not in the ONNX ones: the
    exports keep the MatMul FP32 rather than apply the multiply twice."""
    path = _column_scaled(tmp_path)
    x = np.random.default_rng(4).normal(size=(16, 8, 64)).astype(np.float32)
    profile = rangeprof.profile(rangeprof.load(path), x)
    qm, manifest = _build(path, profile, tmp_path / "out")
    (region,) = qm.regions
    assert "post" in region.profile_ids and region.int4 is not None
    assert manifest["exports_fp32"] == {
        region.name: "mm: the build folded other constants into its weight"
    }
    exported = onnx.load(tmp_path / "out" / FILES["matmulnbits"])
    assert [n.op_type for n in exported.graph.node] == ["Mul", "MatMul", "Mul", "Relu"]


def _bpc(logits: np.ndarray, targets: np.ndarray) -> float:
    logits = logits.astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(log_p, targets[..., None].astype(np.int64), -1)
    return float(-picked.mean() / np.log(2))


@pytest.mark.zoo
def test_char_gpt_matmul_nbits_bpc_is_the_builds(tmp_path):
    """char_gpt, W4 groups of 32 (its attention INT8 in the build, FP32 in the export): bits
    per character on 64 test windows within 0.5 % of each other."""
    path, data_path = zoo_model("char_gpt"), SHARED / "data" / "pycode.npz"
    if not data_path.exists():
        pytest.skip(f"shared data not available ({data_path})")
    data = np.load(data_path)
    model = rangeprof.load(path, {"input_ids": (1, 128)})
    profile = rangeprof.profile(model, {"input_ids": data["calib"][:32]})
    w4 = rangeprof.build(model, profile, weight_bits=4, group_size=32, out=tmp_path)
    assert w4.manifest.exports == FILES and w4.manifest.exports_fp32 is None
    ids, targets = data["test"][:64], data["test_next"][:64]
    session = _session(tmp_path / FILES["matmulnbits"])
    exported = np.concatenate([session.run(None, {"input_ids": i[None]})[0] for i in ids])
    built = w4.run({"input_ids": ids})[0]
    ours, theirs = _bpc(built, targets), _bpc(exported, targets)
    print(f"\nchar_gpt W4 g32 bpc on 64 test windows: build {ours:.4f}, MatMulNBits {theirs:.4f}")
    assert abs(theirs / ours - 1) < 0.005
