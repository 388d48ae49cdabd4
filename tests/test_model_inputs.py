"""Inputs as exported models have them: names that are no identifiers (PyTorch's ``0``), scalar
inputs, and state tensors without a sample axis, fed through ``rangeprof profile``."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper
from typer.testing import CliRunner

from rangeprof.cli import app
from rangeprof.profiler.ir.tracking import track_model

runner = CliRunner()


def _stateful_model(path):
    """``y = (x + state) * scale`` with a per-sample input ``0`` [2, 4], a state [1, 4] and a
    scalar ``scale``, as a PyTorch export names them."""
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["0", "state.1"], ["sum"], name="add"),
            helper.make_node("Mul", ["sum", "scale"], ["y"], name="mul"),
        ],
        "stateful",
        [
            helper.make_tensor_value_info("0", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("state.1", TensorProto.FLOAT, [1, 4]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_inputs_keep_their_onnx_names(tmp_path):
    tracked = track_model(_stateful_model(tmp_path / "m.onnx"))
    inputs = {r.profile_id: r.source_tensor for r in tracked.imported.layers if r.kind == "input"}
    assert inputs == {"input:0": "0", "input:state.1": "state.1", "input:scale": "scale"}


def test_profile_feeds_per_sample_constant_and_scalar_inputs(tmp_path):
    model = _stateful_model(tmp_path / "m.onnx")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4)).astype(np.float32)  # 6 samples: 3 runs of the model's 2
    state = rng.standard_normal((1, 4)).astype(np.float32)
    scale = np.float32(-2.5)
    data = tmp_path / "d.npz"
    np.savez(data, **{"0": x, "state.1": state, "scale": scale})
    out = tmp_path / "p.json"
    args = ["profile", str(model), "--data", str(data), "--out", str(out), "--bins", "16"]
    result = runner.invoke(app, [*args, "--constant-input", "state.1"])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    tensors = {t["source_tensor"]: t for t in doc["tensors"]}
    y = (x + state) * scale
    assert doc["run"]["samples"] == 6 and doc["run"]["batches"] == 3
    assert doc["run"]["options"]["constant_inputs"] == ["state.1"]
    assert tensors["0"]["count"] == x.size
    assert tensors["y"]["count"] == y.size
    assert np.isclose(tensors["y"]["min"], y.min()) and np.isclose(tensors["y"]["max"], y.max())
    assert tensors["scale"]["count"] == 3  # the scalar, fed in each of the 3 runs


def _fails_cleanly(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_constant_input_errors_are_one_line(tmp_path):
    model = _stateful_model(tmp_path / "m.onnx")
    data = tmp_path / "d.npz"
    x = np.zeros((4, 4), np.float32)
    np.savez(data, **{"0": x, "state.1": np.zeros((1, 4), np.float32), "scale": np.float32(1)})
    base = ["profile", str(model), "--data", str(data), "--out", str(tmp_path / "p.json")]
    _fails_cleanly([*base, "--constant-input", "nope"], "'nope'")
    # Without the flag the state's one row is read as one sample against x's four.
    _fails_cleanly(base, "different sample counts")
    np.savez(data, **{"0": x, "state.1": np.zeros((3, 4), np.float32), "scale": np.float32(1)})
    _fails_cleanly([*base, "--constant-input", "state.1"], "constant input 'state.1'")


def _value_input_model(path):
    """``top = TopK(x, k)``, ``z = Reshape(x, shape)``: ``k`` and ``shape`` are graph inputs
    whose values decide output shapes."""
    graph = helper.make_graph(
        [
            helper.make_node("TopK", ["x", "k"], ["top", "idx"], name="topk", axis=1),
            helper.make_node("Reshape", ["x", "shape"], ["z"], name="reshape"),
        ],
        "valued",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [
            helper.make_tensor_value_info("top", TensorProto.FLOAT, [1, None]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [1, None]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [None, None]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_value_inputs_are_bound_from_the_data(tmp_path):
    """Inputs that decide shapes are fed whole without being named, and the program is built
    for the values the data gives: another value, another program."""
    model = _value_input_model(tmp_path / "m.onnx")
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    for k in (3, 6):
        data = tmp_path / f"d{k}.npz"
        np.savez(data, x=x, k=np.array([k], np.int64), shape=np.array([2, 4], np.int64))
        out = tmp_path / f"p{k}.json"
        result = runner.invoke(
            app, ["profile", str(model), "--data", str(data), "--out", str(out), "--bins", "8"]
        )
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        assert doc["run"]["samples"] == 5
        assert doc["model"]["bound_inputs"] == {"k": [k], "shape": [2, 4]}
        tensors = {t["source_tensor"]: t for t in doc["tensors"]}
        top = np.sort(x, axis=1)[:, ::-1][:, :k]
        assert tensors["top"]["shape"] == [1, k]
        assert tensors["top"]["min"] == float(top.min()) and tensors["top"]["max"] == x.max()
        assert tensors["z"]["shape"] == [2, 4] and tensors["z"]["min"] == float(x.min())
        assert "input:k" not in {t["profile_id"] for t in doc["tensors"]}


def test_value_input_with_a_sample_axis_is_a_one_line_error(tmp_path):
    model = _value_input_model(tmp_path / "m.onnx")
    data = tmp_path / "d.npz"
    x = np.zeros((5, 8), np.float32)
    np.savez(data, x=x, k=np.full((5, 1), 3, np.int64), shape=np.array([2, 4], np.int64))
    result = runner.invoke(
        app, ["profile", str(model), "--data", str(data), "--out", str(tmp_path / "p.json")]
    )
    assert result.exit_code == 2
    assert "'k'" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()
