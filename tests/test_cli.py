"""The CLI: bad input gives one line naming the problem and exit code 2; --json is parseable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from html import escape as html_escape

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from rangeprof.cli import app

import onnx_builders as mb
from conftest import SHARED, zoo_model

runner = CliRunner()


def _fails_cleanly(args, *needles):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()  # exactly one: no blank line either
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_missing_file(tmp_path):
    _fails_cleanly(["inspect", str(tmp_path / "nope.onnx")], "nope.onnx")


def test_directory_is_not_a_model(tmp_path):
    _fails_cleanly(["inspect", str(tmp_path)], str(tmp_path))


def test_not_onnx(tmp_path):
    path = tmp_path / "notes.onnx"
    path.write_text("this is not a protobuf\n" * 20)
    _fails_cleanly(["inspect", str(path)], "notes.onnx")


def test_truncated_protobuf(tmp_path):
    data = mb.conv_bn_relu_scale().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    _fails_cleanly(["inspect", str(path)], "cut.onnx")


def test_every_unsupported_op_is_listed(tmp_path):
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("FancyOp", ["a"], ["b"], name="f1", domain="acme"),
        helper.make_node("OtherOp", ["b"], ["y"], name="f2", domain="acme"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)]
    )
    path = tmp_path / "custom.onnx"
    onnx.save(model, path)
    _fails_cleanly(["inspect", str(path)], "FancyOp", "OtherOp")


def test_bad_input_shape_argument(tmp_path):
    path = mb.save(mb.gemm(), tmp_path)
    _fails_cleanly(["inspect", str(path), "--input-shape", "x=2xbanana"], "2xbanana")


def test_inspect_json_shape_and_determinism_across_processes(tmp_path):
    path = mb.save(mb.conv_bn_relu_scale(), tmp_path)
    cmd = [sys.executable, "-m", "rangeprof", "inspect", str(path), "--json"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, check=True) for _ in range(2)]
    first, second = (json.loads(r.stdout) for r in runs)
    assert first == second
    assert set(first) == {"model", "layers", "stages"}
    assert set(first["model"]) >= {"name", "sha256", "inputs"}
    layer_keys = {"profile_id", "op", "source_node", "source_op", "source_tensor", "shape", "dtype"}
    assert all(layer_keys <= set(layer) for layer in first["layers"])
    for stage in first["stages"]:
        assert set(stage) >= {"name", "bindings", "tracked", "ops", "lineage", "fates"}
        assert stage["tracked"] == stage["bindings"]
        assert len(stage["lineage"]) == stage["bindings"]


def test_inspect_table(tmp_path):
    path = mb.save(mb.gemm(), tmp_path)
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "fc#1" in result.stdout and "fold_scale_axis" in result.stdout


def test_converter_rejection_names_the_node(tmp_path):
    rng = np.random.default_rng(0)
    inits = {
        "W": rng.normal(size=(1, 8, 3)).astype("float32"),
        "R": rng.normal(size=(1, 8, 2)).astype("float32"),
    }
    node = helper.make_node(
        "LSTM",
        ["x", "W", "R"],
        ["y"],
        name="rnn",
        hidden_size=2,
        activations=["LeakyRelu", "Tanh", "Tanh"],
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 1, 1, 2])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    path = tmp_path / "rnn.onnx"
    onnx.save(model, path)
    _fails_cleanly(["inspect", str(path)], "'rnn'", "LSTM", "LeakyRelu")


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    model = mb.gemm()
    weight = next(t for t in model.graph.initializer if t.name == "w")
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "../secrets.bin"
    folder = tmp_path / "models"
    folder.mkdir()
    (tmp_path / "secrets.bin").write_bytes(b"\0" * 160)
    path = mb.save(model, folder)
    _fails_cleanly(["inspect", str(path)], "secrets.bin")


def test_calibrate_and_export_commands(tmp_path):
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    doc = profile_model(mb.save(mb.gemm(), tmp_path), "random", options=ProfileOptions(samples=4))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(doc))
    out = tmp_path / "q.json"
    args = ["calibrate", str(profile), "--method", "percentile", "--percentile", "99.9"]
    result = runner.invoke(app, [*args, "--scheme", "asym", "--dtype", "uint8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    qparams = {q["profile_id"]: q for q in json.loads(out.read_text())["qparams"]}
    assert qparams["fc#2"]["dtype"] == "uint8" and qparams["fc#2"]["method"] == "percentile"

    trt = tmp_path / "cache.txt"
    result = runner.invoke(app, ["export", str(profile), "--format", "tensorrt", "--out", str(trt)])
    assert result.exit_code == 0, result.output
    lines = trt.read_text().splitlines()
    assert lines[0].startswith("TRT-") and any(line.startswith("y: ") for line in lines)

    _fails_cleanly(["calibrate", str(profile), "--method", "magic", "--out", str(out)], "magic")
    _fails_cleanly(["export", str(profile), "--format", "csv", "--out", str(trt)], "csv")
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema_version": "0.1"}')
    _fails_cleanly(["calibrate", str(broken), "--out", str(out)], "schema_version")
    # Histogram counts are checked too (in numpy, not item by item in the schema).
    k = next(k for k, t in enumerate(doc["tensors"]) if t["histogram"])
    for bad in (-1, 1.5, True):
        tampered = json.loads(json.dumps(doc))
        tampered["tensors"][k]["histogram"]["counts"][0] = bad
        broken.write_text(json.dumps(tampered))
        _fails_cleanly(
            ["calibrate", str(broken), "--out", str(out)],
            f"invalid profile at tensors/{k}/histogram/counts",
        )


def test_progress_is_plain_lines_when_piped(tmp_path):
    """In a pipe there is no bar, but no silence either: once the first seconds are past
    (compiling, the build cache off), plain progress lines, the last one the run's end."""
    model = mb.save(mb.conv_bias(), tmp_path)
    out = tmp_path / "p.json"
    command = [sys.executable, "-m", "rangeprof", "profile", str(model), "--data", "random"]
    result = subprocess.run(
        [*command, "--samples", "4096", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "RANGEPROF_CACHE": "off"},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "profiling: 4096/4096" in lines, lines
    assert lines[-1].startswith("profiled ") and not any("\x1b" in line for line in lines)


def test_report_command_writes_one_offline_html(tmp_path):
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    doc = profile_model(mb.save(mb.gemm(), tmp_path), "random", options=ProfileOptions(samples=4))
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(doc))
    out = tmp_path / "report.html"
    result = runner.invoke(app, ["report", str(profile), "--out", str(out)])
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert html.lower().startswith("<!doctype html>") and "http" not in html
    for entry in doc["tensors"]:
        assert html_escape(entry["profile_id"]) in html
    bad = tmp_path / "e.json"
    bad.write_text('{"layers": 3}')
    _fails_cleanly(
        ["report", str(profile), "--evaluation", str(bad), "--out", str(out)],
        "not the JSON of `rangeprof evaluate --json`",
    )
    _fails_cleanly(
        ["report", str(profile), "--out", str(tmp_path / "nope" / "r.html")], "does not exist"
    )


def test_evaluate_prints_its_summary_and_the_layer_table(tmp_path):
    """The readable output of ``evaluate`` (not ``--json``): the summary line, then the table
    of every layer's error by profileID."""
    digits = f"{SHARED}/data/digits.npz"
    profile = tmp_path / "p.json"
    args = ["profile", str(zoo_model("digits_cnn")), "--data", f"{digits}:calib"]
    result = runner.invoke(app, [*args, "--samples", "16", "--out", str(profile)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        app,
        [
            "evaluate", str(zoo_model("digits_cnn")), "--profile", str(profile),
            "--data", f"{digits}:test", "--labels", f"{digits}:test_labels", "--samples", "16",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "x86, 16 samples, method mse: top-1 FP32" in result.stdout
    assert "per layer, worst isolated SQNR first" in result.stdout
    assert "/fc2/Gemm" in result.stdout
