"""A profile (and an evaluation) as Google Model Explorer node-data overlays.

Model Explorer (``ai-edge-model-explorer``) colours a graph's nodes by a "node data" JSON file:
its ``GraphNodeData`` (``model_explorer/node_data_builder.py``) is ``{"name", "results": {node
id: {"value": number}}, "gradient" | "thresholds"}``. :func:`node_data` gives one such document per
figure:

* ``range``: ``max(|min|, |max|)`` of the profiled tensor (the symmetric clip threshold ``max``
  calibration takes);
* ``isolated_sqnr`` and ``accumulated_sqnr``: each INT8 layer's SQNR in dB from an evaluation
  report (``rangeprof evaluate --json``): quantized alone, and after every quantized layer before
  it. Layers the report gives as exact (``null``: no error at all) have no value;
* ``kept_fp32``: 1 for a layer the evaluation kept in FP32 (the accuracy budget), else 0.

The SQNR and kept figures need the evaluation. Keys are the node ids of Model Explorer's ONNX
adapter (``model-explorer-onnx`` 0.4, through ``onnx_ir``'s ``NameFixPass``): a tensor's value
goes to the node that produces it, named as the adapter names it (its own name; an unnamed node
``node``, ``node_1``, …; a repeated name ``<name>_1``, …), and a graph input or an initializer to
its ``[value] <name>`` node. A node that produces several profiled tensors shows the largest range
(the worst SQNR). Tensors the model file does not hold (values of nodes the loader expanded) are
left out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import onnx

from rangeprof.profiler.errors import RangeprofError

FIGURES = ("range", "isolated_sqnr", "accumulated_sqnr", "kept_fp32")
_VALUE_PREFIX = "[value] "  # the adapter's id of a graph input's or an initializer's node
_LOW_HIGH = [{"stop": 0, "bgColor": "#fff7ec"}, {"stop": 1, "bgColor": "#d7301f"}]
_BAD_GOOD = [{"stop": 0, "bgColor": "#d7301f"}, {"stop": 1, "bgColor": "#1a9850"}]
_KEPT = [{"value": 0, "bgColor": "#1a9850"}, {"value": 1, "bgColor": "#d7301f"}]


def node_data(model: onnx.ModelProto, profile: dict, evaluation: dict | None = None) -> dict:
    """``{figure: GraphNodeData document}``: ``range`` always, the others with ``evaluation``."""
    nodes = explorer_node_ids(model.graph)
    by_id = {e["profile_id"]: e for e in profile["tensors"]}
    ranges = {}
    for entry in profile["tensors"]:
        if entry["min"] is not None:
            ranges[entry["profile_id"]] = max(-entry["min"], entry["max"])
    figures = {
        "range": _document("rangeprof: max |x|", _keyed(ranges, by_id, nodes, max), _LOW_HIGH)
    }
    if evaluation is None:
        return figures
    layers = evaluation["layers"]
    unknown = sorted({layer["profile_id"] for layer in layers} - set(by_id))
    if unknown:
        raise RangeprofError(
            f"the evaluation names layers the profile does not have ({', '.join(unknown[:3])}): "
            "it is of another model"
        )
    for kind in ("isolated", "accumulated"):
        values = {
            layer["profile_id"]: layer[f"{kind}_sqnr_db"]
            for layer in layers
            if layer[f"{kind}_sqnr_db"] is not None
        }
        name = f"rangeprof: {kind} SQNR (dB)"
        figures[f"{kind}_sqnr"] = _document(name, _keyed(values, by_id, nodes, min), _BAD_GOOD)
    kept = {layer["profile_id"]: int(layer["mode"] == "fp32") for layer in layers}
    figures["kept_fp32"] = _document(
        "rangeprof: kept FP32", _keyed(kept, by_id, nodes, max), thresholds=_KEPT
    )
    return figures


def explorer_node_ids(graph: onnx.GraphProto) -> dict[str, str]:
    """Tensor name -> the id of the node Model Explorer's ONNX adapter shows it on: its producer,
    or the ``[value]`` node of a graph input or initializer (see the module doc)."""
    ids = {name: _VALUE_PREFIX + name for name in _graph_values(graph)}
    names = _adapter_names(graph)
    for node in graph.node:
        name = next(names)
        for output in node.output:
            ids[output] = name
    return ids


def _graph_values(graph: onnx.GraphProto) -> Iterator[str]:
    yield from (i.name for i in graph.input)
    yield from (t.name for t in graph.initializer)


def _adapter_names(graph: onnx.GraphProto) -> Iterator[str]:
    """The names ``onnx_ir``'s ``NameFixPass`` gives the main graph's nodes, in order: nodes in
    subgraphs are named in the same walk (depth first, each graph a scope of its own) and share
    its counters, so they are walked too."""
    counter: Counter[str] = Counter()

    def walk(g: onnx.GraphProto, main: bool) -> Iterator[str]:
        used: set[str] = set()
        for node in g.node:
            base = node.name or "node"
            name = base
            while name in used:
                counter[base] += 1
                name = f"{base}_{counter[base]}"
            used.add(name)
            if main:
                yield name
            for attr in node.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs:
                    yield from walk(sub, False)

    return walk(graph, True)


def _keyed(
    values: dict[str, float],
    by_id: dict[str, dict],
    nodes: dict[str, str],
    pick: Callable[[float, float], float],
) -> dict[str, dict]:
    """``{node id: {"value": v}}`` from values by profileID, through each entry's tensor."""
    results: dict[str, float] = {}
    for profile_id, value in values.items():
        node = nodes.get(by_id[profile_id]["source_tensor"] or "")
        if node is not None:
            results[node] = pick(results[node], value) if node in results else value
    return {node: {"value": value} for node, value in results.items()}


def _document(name: str, results: dict, gradient=None, thresholds=None) -> dict:
    doc = {"name": name, "results": results}
    if gradient is not None:
        doc["gradient"] = gradient
    if thresholds is not None:
        doc["thresholds"] = thresholds
    return doc
