"""Operators imported as their ONNX function bodies (profiler/ir/expand.py)."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.ir.tracking import track_model
from rangeprof.profiler.profiling.data import model_inputs, open_data
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

from ort_reference import assert_fidelity, exposed_session, reference_ranges


def _attention(path):
    """ONNX-23 Attention on 4-D Q, K, V: TVM's converter wants ``num_heads`` (onnxruntime's
    contrib op), which the standard operator does not have."""
    shape = {"Q": [1, 2, 4, 8], "K": [1, 2, 6, 8], "V": [1, 2, 6, 8]}
    graph = helper.make_graph(
        [helper.make_node("Attention", ["Q", "K", "V"], ["Y"], name="attn", is_causal=1)],
        "attention",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shape.items()],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 2, 4, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


def test_attention_profiles_as_its_function_body(tmp_path):
    path = _attention(tmp_path / "attention.onnx")
    layers = track_model(path).imported.layers
    nodes = {layer.source_node for layer in layers if layer.kind == "activation"}
    assert nodes and all(node.startswith("attn/") for node in nodes), nodes
    doc = profile_model(path, "random", options=ProfileOptions(samples=2))
    loaded = load_model(path)
    batches = open_data("random", model_inputs(loaded), samples=2).batches()
    # Y is the body's last Identity: found through that node's alias fate, by its name
    expanded = tmp_path / "expanded.onnx"
    onnx.save(loaded.model, expanded)
    assert_fidelity(doc, reference_ranges(exposed_session(path), batches), expanded)
