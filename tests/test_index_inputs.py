"""Integer inputs that index an axis (token ids into an embedding table): a value outside
``[-n, n)`` is refused before any work by every face, naming its sample and position (CLI: one
line, exit 2; Python, profiling or running a build: a RangeprofError; API: 422 and no run row);
random data stays inside the table; and an index computed inside the model that falls outside
is clipped, never a read past the table (it crashed the process)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from typer.testing import CliRunner

import rangeprof
from rangeprof.cli import app
from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data
from rangeprof.service.limits import Limits

import onnx_builders as mb
from service_fixtures import BACKENDS, live_service, npz_bytes, row_counts, upload_model

runner = CliRunner()
REFUSAL = (
    "sample 2 holds 10 at position 1, outside [-10, 9]: input 'ids' indexes an axis of 10 in 'rows'"
)


def _ids(bad: int | None = 10) -> np.ndarray:
    ids = np.random.default_rng(0).integers(-10, 10, (4, 4))
    if bad is not None:
        ids[2, 1] = bad
    return ids


@pytest.fixture
def model_path(tmp_path):
    return mb.save(mb.embedding(), tmp_path)


def test_the_cli_refuses_an_id_past_the_table(model_path, tmp_path):
    np.savez(tmp_path / "d.npz", ids=_ids())
    out = tmp_path / "p.json"
    args = ["profile", str(model_path), "--data", f"{tmp_path}/d.npz", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line == f"error: {tmp_path}/d.npz:ids: {REFUSAL}"
    assert not out.exists()
    np.savez(tmp_path / "d.npz", ids=_ids(-10))  # the lowest valid index
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def test_python_refuses_an_id_past_the_table_and_random_ids_stay_inside(model_path):
    model = rangeprof.load(model_path)
    with pytest.raises(RangeprofError, match=r"sample 2 holds 10 at position 1, outside"):
        rangeprof.profile(model, {"ids": _ids()})
    (ids,) = model_inputs(load_model(model_path).facts)
    (batch,) = open_data("random", [ids], samples=64, batch_size=64).batches()
    assert batch["ids"].min() >= 0 and batch["ids"].max() == 9  # below the table's 10 rows
    rangeprof.profile(model, "random", samples=64)


def test_a_built_model_refuses_an_id_past_the_table(model_path, tmp_path):
    """The manifest records the axis an input indexes; ``Int8Model.run`` refuses what the
    build would clip."""
    model = rangeprof.load(model_path)
    built = rangeprof.quantize(model, {"ids": _ids(None)}, target="x86", out=tmp_path / "b")
    assert rangeprof.Int8Model.load(tmp_path / "b").manifest.inputs["ids"].index.extent == 10
    with pytest.raises(RangeprofError, match=r"^sample 2 holds 10 at position 1, outside"):
        built.run({"ids": _ids()})
    assert built.run({"ids": _ids(-10)})[0].shape == (4, 4, 3)


def test_an_index_computed_past_the_table_is_clipped(tmp_path):
    path = mb.save(mb.embedding(shift=1000), tmp_path)
    table = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    vm = relax.VirtualMachine(build(import_onnx(load_model(path)).mod), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(np.array([[0, 1, 2, 3]], np.int64))).numpy()
    np.testing.assert_array_equal(out, np.maximum(table[[9, 9, 9, 9]], 0)[None])


def _gather_model(op: str, indices_shape: tuple, out_shape: tuple, **attrs) -> onnx.ModelProto:
    """``op`` reading a 4x5 float table at int64 indices given as the input ``ids``."""
    table = np.arange(20, dtype=np.float32).reshape(4, 5)
    graph = helper.make_graph(
        [helper.make_node(op, ["table", "ids"], ["y"], name="g", **attrs)],
        "gather",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, indices_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(table, "table")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("op", "attrs", "ids", "clipped"),
    [
        (
            "GatherElements",
            {"axis": 1},
            [[0, -1], [4, 10**9], [-5, 2], [-(10**9), 1]],
            [[0, 4], [4, 4], [0, 2], [0, 1]],
        ),
        (
            "GatherND",
            {},
            [[1, 4], [3, -5], [10**9, 10**9], [-(10**9), 2]],
            [[1, 4], [3, 0], [3, 4], [0, 2]],
        ),
    ],
)
def test_gathers_at_indices_past_the_data_clip_and_agree_inside_it(
    op, attrs, ids, clipped, tmp_path
):
    """TOPI's gathers read wherever an index points: an index from data past the table read
    other memory (or crashed). Inside the table the build agrees with onnxruntime; outside,
    it reads the nearest edge."""
    ids, clipped = np.array(ids, np.int64), np.array(clipped, np.int64)
    shape = (4,) if op == "GatherND" else (4, 2)
    path = mb.save(_gather_model(op, ids.shape, shape, **attrs), tmp_path)
    vm = relax.VirtualMachine(build(import_onnx(load_model(path)).mod), tvm.cpu())
    ours = vm["main"](tvm.runtime.tensor(ids)).numpy()
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(ours, reference.run(None, {"ids": clipped})[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_api_refuses_an_id_past_the_table_with_422(backend, model_path, tmp_path):
    with live_service(backend, tmp_path, Limits()) as live:
        response = upload_model(live.owner, model_path)
        assert response.status_code == 201, response.text
        rows = row_counts(live.url)
        files = {"data": ("d.npz", npz_bytes(ids=_ids()))}
        response = live.owner.post(f"/api/models/{response.json()['id']}/runs", files=files)
        assert response.status_code == 422, response.text
        assert REFUSAL in response.json()["detail"]
        assert row_counts(live.url) == rows
