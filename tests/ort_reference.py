"""An independent FP32 reference: onnxruntime with every node output exposed."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort


def exposed_session(path: Path, input_shapes: dict | None = None) -> ort.InferenceSession:
    """A session on the original model that returns every node output."""
    model = onnx.load(path)
    for inp in model.graph.input:
        for k, dim in enumerate((input_shapes or {}).get(inp.name, ())):
            inp.type.tensor_type.shape.dim[k].dim_value = dim
    graph_outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name in data_dependent_tensors(model) and name not in graph_outputs:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                graph_outputs.add(name)
    if model.ir_version > 10:
        model.ir_version = 10
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])


def data_dependent_tensors(model: onnx.ModelProto) -> set[str]:
    """Node outputs that depend on a graph input (constant subgraphs are weights, not data)."""
    initializers = {t.name for t in model.graph.initializer}
    live = {i.name for i in model.graph.input if i.name not in initializers}
    for node in model.graph.node:
        if live.intersection(node.input):
            live.update(o for o in node.output if o)
    return live


def reference_ranges(
    session: ort.InferenceSession, feeds: Iterable[dict[str, np.ndarray]]
) -> dict[str, tuple[float, float]]:
    """Min and max of the finite values of every float node output over all feeds."""
    names = [o.name for o in session.get_outputs()]
    ranges: dict[str, tuple[float, float]] = {}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed), strict=True):
            value = np.asarray(value)
            if not np.issubdtype(value.dtype, np.floating) or value.size == 0:
                continue
            finite = value[np.isfinite(value)]
            if finite.size == 0:
                continue
            lo, hi = float(finite.min()), float(finite.max())
            if name in ranges:
                lo, hi = min(lo, ranges[name][0]), max(hi, ranges[name][1])
            ranges[name] = (lo, hi)
    return ranges


def assert_fidelity(doc, reference, model_path):
    """Every data-dependent float ONNX tensor matches the reference to 1e-4 of its range."""
    by_tensor = {t["source_tensor"]: t for t in doc["tensors"] if t["source_tensor"] is not None}
    by_id = {t["profile_id"]: t for t in doc["tensors"]}
    # An Identity-like node made no binding: its tensor is profiled under the value it names.
    for node in onnx.load(model_path, load_external_data=False).graph.node:
        fate = doc["lineage"]["fates"].get(node.name, "")
        if fate.startswith("aliases:"):
            by_tensor.update(dict.fromkeys(node.output, by_id[fate.removeprefix("aliases:")]))
    missing = sorted(set(reference) - set(by_tensor))
    assert not missing, missing
    for name, (lo, hi) in reference.items():
        entry = by_tensor[name]
        tol = 1e-4 * max(abs(lo), abs(hi), 1e-30)
        assert abs(entry["min"] - lo) <= tol, (name, entry["min"], lo)
        assert abs(entry["max"] - hi) <= tol, (name, entry["max"], hi)
