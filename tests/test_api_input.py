"""Bad input through real HTTP, on SQLite and PostgreSQL: every case gets its 4xx with a JSON
``detail`` naming the problem, leaves no row and no stored file behind, and the server goes on
serving."""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass

import numpy as np
import pytest
from onnx import TensorProto, helper

from rangeprof.service.limits import Limits

import onnx_builders as mb
from conftest import zoo_model
from service_fixtures import (
    BACKENDS,
    Live,
    connections_refused,
    live_service,
    npz_bytes,
    row_counts,
    stored_files,
    upload_model,
    wait_for_run,
)

LIMITS = Limits(
    max_model_bytes=300_000, max_data_bytes=100_000, max_unpacked_bytes=1_000_000, max_samples=1000
)


@dataclass
class Served:
    live: Live
    model_id: int  # digits_cnn: one input "image", float32 [1, 1, 8, 8]


@pytest.fixture(scope="module", params=BACKENDS)
def served(request, tmp_path_factory):
    with live_service(request.param, tmp_path_factory.mktemp(request.param), LIMITS) as live:
        response = upload_model(live.owner, zoo_model("digits_cnn"))
        assert response.status_code == 201, response.text
        yield Served(live, response.json()["id"])


def _refused(served: Served, send, status: int, *needles: str) -> None:
    """``send(client)`` gets ``status`` naming the problem, and changes nothing."""
    live = served.live
    rows, files = row_counts(live.url), stored_files(live.storage)
    response = send(live.owner)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail
    for needle in needles:
        assert needle in detail, detail
    assert row_counts(live.url) == rows
    assert stored_files(live.storage) == files
    assert str(live.storage) not in detail  # no server paths
    assert live.owner.get(f"/api/models/{served.model_id}").status_code == 200


def _model(name: str, data: bytes, **form):
    return lambda api: api.post("/api/models", files={"file": (name, data)}, data=form)


def _external(location: str) -> bytes:
    model = mb.gemm()
    weight = next(t for t in model.graph.initializer if t.name == "w")
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", location
    return model.SerializeToString()


def _custom_ops() -> bytes:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("FancyOp", ["a"], ["y"], name="f1", domain="acme"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("acme", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _big_model() -> bytes:
    rng = np.random.default_rng(0)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    model = mb.single_io_model([node], {"w": rng.normal(size=(300, 300))}, (1, 300), (1, 300))
    return model.SerializeToString()


GEMM = mb.gemm().SerializeToString()
_PART_HEAD = b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.onnx"\r\n\r\n'
MODEL_CASES = {
    "not onnx": (_model("notes.onnx", b"not a protobuf\n" * 20), 400, "notes.onnx", "ONNX"),
    "truncated": (_model("cut.onnx", GEMM[: len(GEMM) // 2]), 400, "cut.onnx", "truncated"),
    "external data": (_model("ext.onnx", _external("w.bin")), 400, "'w.bin'", "external data"),
    "external data outside": (
        _model("ext.onnx", _external("../secret.bin")),
        400,
        "'../secret.bin'",
        "outside",
    ),
    "unsupported op": (_model("custom.onnx", _custom_ops()), 400, "FancyOp"),
    "malformed shape": (_model("g.onnx", GEMM, input_shapes="x=2xbanana"), 400, "2xbanana"),
    "unknown input": (_model("g.onnx", GEMM, input_shapes="z=2x8"), 400, "no input named 'z'"),
    "shape misfit": (_model("g.onnx", GEMM, input_shapes="x=2x9"), 400, "does not fit"),
    "over the size limit": (_model("big.onnx", _big_model()), 413, "limit of 300000 bytes"),
    "no file": (lambda api: api.post("/api/models", data={"x": "1"}), 422, "file"),
    "streamed over the limit": (
        lambda api: api.post(
            "/api/models",
            content=iter([_PART_HEAD, *[b"x" * 100_000] * 5]),  # chunked: no Content-Length
            headers={"content-type": "multipart/form-data; boundary=b"},
        ),
        413,
        "the model upload",
    ),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_model_upload(served, case):
    send, status, *needles = MODEL_CASES[case]
    _refused(served, send, status, *needles)


def _run(files: dict | None = None, **form):
    return lambda api, model_id: api.post(f"/api/models/{model_id}/runs", files=files, data=form)


def _data(name: str, data: bytes, **form):
    return _run({"data": (name, data)}, **form)


def _digits(count: int = 4, **arrays) -> bytes:
    return npz_bytes(**(arrays or {"image": np.zeros((count, 1, 8, 8), np.float32)}))


def _zip_bomb() -> bytes:
    """A few kilobytes of .npz that unpack to 4 MB of zeros."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, image=np.zeros((16384, 1, 8, 8), np.float32))
    return buffer.getvalue()


def _truncated_member() -> bytes:
    """A valid zip whose array holds fewer samples than its header promises."""
    array = io.BytesIO()
    np.lib.format.write_array(array, np.zeros((16, 1, 8, 8), np.float32))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("image.npy", array.getvalue()[:-300])
    return buffer.getvalue()


RUN_CASES = {
    "pickled objects": (
        _data("p.npz", _digits(image=np.array([object()] * 4))),
        400,
        "pickled data",
    ),
    "wrong shape": (
        _data("s.npz", _digits(image=np.zeros((4, 1, 7, 7), np.float32))),
        400,
        "does not fit input 'image'",
    ),
    # What the data holds (dtype, names): 422, as tests/test_honest_inputs.py's cases.
    "unsafe dtype": (
        _data("c.npz", _digits(image=np.zeros((4, 1, 8, 8), np.complex64))),
        422,
        "holds complex64, input 'image' is float32",
    ),
    "two arrays, no key": (
        _data("two.npz", _digits(a=np.zeros((4, 1, 8, 8)), b=np.zeros((4, 1, 8, 8)))),
        422,
        "choose one",
    ),
    "missing key": (_data("k.npz", _digits(), key="nope"), 400, "no array 'nope'"),
    "not an npz": (_data("z.npz", b"PK but not really"), 400, "z.npz", "not an .npz"),
    "truncated array": (_data("t.npz", _truncated_member()), 400, "t.npz", "truncated"),
    "not an npz, named .npy": (_data("calib.npy", b"\x93NUMPY not a zip"), 400, "not an .npz"),
    "data and random": (_data("d.npz", _digits(), random="4"), 400, "one of them"),
    "no data": (_run(bins="8"), 400, "'data'", "'random'"),
    "random with samples": (_run(random="4", samples="2"), 400, "'random' is the count"),
    "negative bins": (_run(random="4", bins="-1"), 422, "bins"),
    "zero samples": (_data("d.npz", _digits(), samples="0"), 422, "samples"),
    "more samples than the data": (
        _data("d.npz", _digits(4), samples="5"),
        400,
        "5 samples asked for, but d.npz holds 4",
    ),
    "over the size limit": (_data("big.npz", _digits(1000)), 413, "the data upload"),
    "unpacks over the limit": (_data("bomb.npz", _zip_bomb()), 413, "the data file unpacked"),
    "samples over the schema's maximum": (_run(random=str(10**12)), 422, "random"),
    "bins over the schema's maximum": (_run(random="4", bins=str(10**9)), 422, "bins"),
    "batch over the schema's maximum": (_run(random="4", batch_size=str(10**9)), 422, "batch"),
    "samples over this server's limit": (
        _run(random="5000"),
        422,
        "samples 5000 is over this server's limit of 1000",
    ),
    "over the size limit, within the slack": (
        _data("big.npz", _digits(450)),
        413,
        "the data file",
    ),
}


@pytest.mark.parametrize("case", RUN_CASES)
def test_bad_run_request(served, case):
    send, status, *needles = RUN_CASES[case]
    _refused(served, lambda api: send(api, served.model_id), status, *needles)


@pytest.mark.parametrize(
    "path",
    [
        f"/api/models/{2**63}",
        f"/api/models/{2**31}/runs",
        "/api/runs/0",
        f"/api/runs/1/compare/{2**40}",
        f"/api/builds/{-1}",
        f"/api/evaluations/{2**64}",
        f"/api/models/1/layers?offset={2**63}",
        # PostgreSQL's text holds no NUL: a search or a profileID with one is refused, not a 500.
        "/api/models/1/layers?q=a%00b",
        "/api/runs/1/tensor?profile_id=%00",
        "/api/models/1/lineage?profile_id=x%00",
    ],
)
def test_ids_out_of_range_are_422_not_500(served, path):
    _refused(served, lambda api: api.get(path), 422)


def test_security_headers(served):
    api = served.live.owner
    for path in ("/dashboard/", "/api/health", f"/api/models/{served.model_id}"):
        headers = api.get(path).headers
        assert headers["x-frame-options"] == "DENY", path
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["referrer-policy"] == "no-referrer", path
    policy = api.get("/dashboard/").headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy


def test_run_limits_are_the_schema_maximum(served):
    schema = served.live.owner.get("/openapi.json").json()["components"]["schemas"]
    form = schema["RunRequest"]["properties"]
    maxima = {name: form[name].get("maximum") for name in ("random", "samples")}
    assert maxima == {"random": Limits().max_samples, "samples": Limits().max_samples}
    assert form["bins"]["maximum"] == Limits().max_bins


def test_unknown_model_is_not_found(served):
    _refused(served, lambda api: _run(random="2")(api, 999_999), 404, "model 999999 not found")


def test_good_input_after_bad_input(served):
    assert upload_model(served.live.owner, zoo_model("digits_cnn")).status_code == 201
    data = _digits()
    response = _data("good.npz", data, samples="2")(served.live.owner, served.model_id)
    assert response.status_code == 202, response.text
    assert response.json()["data"] == {
        "kind": "npz",
        "name": "good.npz",
        "key": None,
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_a_job_past_the_time_limit_fails_with_the_reason(tmp_path):
    """The worker stops a job at the server's wall-time limit: the run fails saying so, and
    leaves no scratch folder behind."""
    limits = Limits(max_job_seconds=1.0)
    with live_service("sqlite", tmp_path, limits) as live:
        model_id = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        # Samples the estimate lets in (at least 0.1 ns a value), far more than a second takes.
        run = _run(random="100000")(live.owner, model_id).json()
        done = wait_for_run(live.owner, run["id"], timeout=60)
        assert done["status"] == "failed"
        assert done["error"] == "stopped at this server's time limit for a job, 1 s"
        assert done["samples_done"] < 100000
        assert list((live.storage / "tmp").iterdir()) == []  # the scratch folders
        assert live.owner.get(f"/api/models/{model_id}").status_code == 200


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_cannot_fill_the_queue(backend, tmp_path):
    """Without a worker every job stays queued: a token's third is refused (429, nothing
    written) while another token still queues its own."""
    with live_service(backend, tmp_path, Limits(max_queued_per_token=2), jobs=0) as live:
        mine = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        theirs = upload_model(live.stranger, zoo_model("digits_cnn")).json()["id"]
        for _ in range(2):
            assert _run(random="2")(live.owner, mine).status_code == 202
        served = Served(live, mine)
        _refused(served, lambda api: _run(random="2")(api, mine), 429, "2 jobs of this token")
        assert _run(random="2")(live.stranger, theirs).status_code == 202


def test_a_lost_database_is_503_and_the_server_recovers(tmp_path):
    """PostgreSQL drops every connection and refuses new ones: requests get 503 with
    Retry-After (not 500); once it takes connections again, the same server serves."""
    with live_service("postgresql", tmp_path, LIMITS, jobs=0) as live:
        model_id = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        with connections_refused(live.url):
            response = live.owner.get(f"/api/models/{model_id}")
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "5"
            assert "database is unavailable" in response.json()["detail"]
        # Stale pooled connections are replaced on checkout (pre-ping): no error after.
        assert live.owner.get(f"/api/models/{model_id}").status_code == 200
