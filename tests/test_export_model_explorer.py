"""``rangeprof export --format model-explorer``: Google Model Explorer node-data overlays, one
file per figure, checked against the node-data schema and keyed by the model's real nodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import onnx
import pytest
from onnx import helper
from typer.testing import CliRunner

from rangeprof.cli import app
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.export.model_explorer import FIGURES, explorer_node_ids, node_data
from rangeprof.workflows import profiling, quantize
from rangeprof.workflows.requests import EvaluateRequest, ProfileRequest

from conftest import SHARED, zoo_model

SCHEMA = json.loads((Path(__file__).parent / "model_explorer_node_data.schema.json").read_text())
DIGITS = SHARED / "data" / "digits.npz"
MODELS = {
    "digits_cnn": (DIGITS, {}),
    "ppocr_cls": (SHARED / "data" / "textlines.npz", {"x": (1, 3, 48, 192)}),
}
UNNAMED = re.compile(r"node(_\d+)?")  # the adapter's names for unnamed nodes


def _profile(name: str, tmp_path_factory) -> tuple[Path, dict, Path]:
    data, shapes = MODELS[name]
    model = zoo_model(name)
    request = ProfileRequest(model=model, data=f"{data}:calib", input_shapes=shapes, samples=8)
    doc = profiling.profile(request).to_json()
    path = tmp_path_factory.mktemp(name) / "profile.json"
    path.write_text(json.dumps(doc))
    return model, doc, path


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    model, doc, path = _profile("digits_cnn", tmp_path_factory)
    evaluation = quantize.evaluate(
        EvaluateRequest(model=model, profile=path, data=f"{DIGITS}:test", samples=20)
    ).to_json()
    report = path.with_name("evaluation.json")
    report.write_text(json.dumps(evaluation))
    return model, doc, path, report


def _check(figures: dict, model: onnx.ModelProto) -> None:
    """Each figure fits the schema, and every key is a node of the model: a node's own name,
    ``[value] <name>`` for a graph input or an initializer, or an unnamed node's adapter name."""
    graph = model.graph
    named = {n.name for n in graph.node if n.name}
    values = {f"[value] {v.name}" for v in [*graph.input, *graph.initializer]}
    unnamed = any(not n.name for n in graph.node)
    for figure, doc in figures.items():
        jsonschema.validate(doc, SCHEMA)
        assert doc["results"], figure
        for key in doc["results"]:
            assert key in named or key in values or (unnamed and UNNAMED.fullmatch(key)), key


def test_cli_writes_every_figure_keyed_by_node_names(digits, tmp_path):
    model_path, doc, profile_path, report = digits
    out = tmp_path / "overlays"
    args = ["export", str(profile_path), "--format", "model-explorer", "--out", str(out)]
    result = CliRunner().invoke(
        app, [*args, "--model", str(model_path), "--evaluation", str(report)]
    )
    assert result.exit_code == 0, result.output
    figures = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(figures) == set(FIGURES)
    model = onnx.load(model_path)
    _check(figures, model)
    names = {n.name for n in model.graph.node}
    ranges = figures["range"]["results"]
    assert ranges["[value] image"]["value"] == max(
        -doc["tensors"][0]["min"], doc["tensors"][0]["max"]
    )
    assert ranges["/c1/Conv"]["value"] > 0 and "/fc2/Gemm" in ranges
    evaluation = json.loads(report.read_text())
    by_id = {e["profile_id"]: e for e in doc["tensors"]}
    for layer in evaluation["layers"]:
        node = by_id[layer["profile_id"]]["source_node"]
        assert node in names
        assert figures["isolated_sqnr"]["results"][node]["value"] == layer["isolated_sqnr_db"]
        assert figures["accumulated_sqnr"]["results"][node]["value"] == layer["accumulated_sqnr_db"]
        assert figures["kept_fp32"]["results"][node]["value"] == int(layer["mode"] == "fp32")


def test_without_an_evaluation_only_the_range_and_the_model_is_needed(digits, tmp_path):
    model_path, _, profile_path, _ = digits
    out = tmp_path / "overlays"
    args = ["export", str(profile_path), "--format", "model-explorer", "--out", str(out)]
    missing = CliRunner().invoke(app, args)
    assert missing.exit_code == 2 and "--model" in missing.output
    assert CliRunner().invoke(app, [*args, "--model", str(model_path)]).exit_code == 0
    assert [p.name for p in out.iterdir()] == ["range.json"]


def test_an_evaluation_of_another_model_is_refused(digits):
    model_path, doc, _, _ = digits
    evaluation = {"layers": [{"profile_id": "/elsewhere", "mode": "int8"}]}
    with pytest.raises(RangeprofError, match="another model"):
        node_data(onnx.load(model_path), doc, evaluation)


def test_unnamed_nodes_take_the_adapters_names(tmp_path_factory):
    """ppocr_cls's Constant nodes have no names: the adapter calls them node, node_1, …"""
    model_path, doc, _ = _profile("ppocr_cls", tmp_path_factory)
    model = onnx.load(model_path)
    figures = node_data(model, doc)
    _check(figures, model)
    assert "node" in figures["range"]["results"]  # the first Constant: a weight


def test_adapter_naming_rule():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"], name="r"),
        helper.make_node("Relu", ["b"], ["c"], name="r"),
        helper.make_node("Relu", ["c"], ["d"]),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    ids = explorer_node_ids(graph)
    assert [ids[t] for t in "abcd"] == ["node", "r", "r_1", "node_1"]
