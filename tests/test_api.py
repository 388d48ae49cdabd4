"""The REST API through real HTTP (uvicorn on a loopback port, the in-process worker with two
slots), on SQLite and on PostgreSQL: upload -> run -> poll -> the CLI's profile; exports,
qparams and drift; concurrent and failing runs; deletion; tokens."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from rangeprof.profiler.calibrate.methods import schema as qparams_schema
from rangeprof.profiler.export.formats import export
from rangeprof.profiler.profiling.document import tensors_bytes, validate
from rangeprof.service.limits import Limits
from rangeprof.workflows.options import CalibrationOptions as Asked
from rangeprof.workflows.profiling import calibrate_profile, calibration_options
from rangeprof.workflows.requests import ProfileRequest

import onnx_builders as mb
from conftest import poll_until, zoo_model
from service_fixtures import (
    BACKENDS,
    cli_profile,
    live_service,
    npz_bytes,
    rangeprof,
    row_counts,
    same_document,
    start_run,
    stored_files,
    upload_model,
    wait_for_run,
    write_calib,
)

LIMITS = Limits(max_model_bytes=400_000, max_data_bytes=200_000)


@dataclass
class Digits:
    path: Path
    model: dict
    run: dict
    reference: dict  # what `rangeprof profile` writes for the same model, data and options


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    return write_calib(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(calib, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cli") / "digits.profile.json"
    return cli_profile(zoo_model("digits_cnn"), f"{calib}:calib", out)


@pytest.fixture(scope="module", params=BACKENDS)
def live(request, tmp_path_factory):
    with live_service(request.param, tmp_path_factory.mktemp(request.param), LIMITS) as service:
        yield service


@pytest.fixture(scope="module")
def digits(live, calib, reference) -> Digits:
    path = zoo_model("digits_cnn")
    response = upload_model(live.owner, path)
    assert response.status_code == 201, response.text
    model = response.json()
    queued = start_run(live.owner, model["id"], calib)
    assert queued["status"] in ("queued", "running") and queued["progress"] == 0
    return Digits(path, model, wait_for_run(live.owner, queued["id"]), reference)


def test_upload_returns_the_layers_and_lineage_of_inspect(live, digits):
    model = digits.model
    inspect = json.loads(rangeprof("inspect", str(digits.path), "--json"))
    assert model["name"] == "digits_cnn"
    assert model["sha256"] == hashlib.sha256(digits.path.read_bytes()).hexdigest()
    assert model["inputs"] == [{"name": "image", "shape": [1, 1, 8, 8], "dtype": "float32"}]
    assert model["layers"] == inspect["layers"]
    assert model["stages"] == inspect["stages"]
    assert live.owner.get(f"/api/models/{model['id']}").json() == model
    summary = next(m for m in live.owner.get("/api/models").json() if m["id"] == model["id"])
    assert summary == {k: v for k, v in model.items() if k not in ("layers", "stages")}


def test_profile_equals_the_cli_output(live, digits):
    run = digits.run
    assert run["status"] == "done", run["error"]
    assert (run["progress"], run["samples_done"], run["samples_total"]) == (1.0, 16, 16)
    assert run["data"]["name"] == "calib.npz" and run["timings"]["total_s"] > 0
    assert run["started_at"] <= run["finished_at"]
    # The request its process ran, as `rangeprof profile digits_cnn.onnx --data calib.npz`.
    request = ProfileRequest.model_validate(run["request"])
    assert request == ProfileRequest(model="digits_cnn.onnx", data="calib.npz")
    assert request.model_dump(mode="json") == run["request"]
    assert run["options"] == {"bins": 2048, "batch_size": None, "samples": None, "seed": 0}
    response = live.owner.get(f"/api/runs/{run['id']}/profile")
    assert response.status_code == 200
    served = validate(response.json())
    assert tensors_bytes(served) == tensors_bytes(digits.reference)
    same_document(served, digits.reference)
    assert served["run"]["data"] == "calib.npz"
    listed = live.owner.get(f"/api/models/{digits.model['id']}/runs").json()
    assert run["id"] in [r["id"] for r in listed]


@pytest.mark.parametrize(
    "fmt, options",
    [
        ("aimet", {"granularity": "per-channel"}),
        ("ort", {"method": "percentile", "percentile": "99.9"}),
        ("ort-json", {"scheme": "asym", "dtype": "uint8"}),
        ("tensorrt", {"method": "entropy"}),
    ],
)
def test_exports_are_the_cli_exports(live, digits, fmt, options):
    response = live.owner.get(
        f"/api/runs/{digits.run['id']}/export", params={"format": fmt, **options}
    )
    assert response.status_code == 200, response.text
    asked = Asked(**options)  # the target's policy where not given, the format's grid first
    assert response.text == export(digits.reference, fmt, calibration_options(asked, fmt)[0])


def test_qparams_are_stored_and_listed(live, digits):
    path = f"/api/runs/{digits.run['id']}/qparams"
    before = live.owner.get(path).json()
    body = {"method": "mse", "scheme": "asym", "granularity": "per-channel"}
    response = live.owner.post(path, json=body)
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["document"] == calibrate_profile(digits.reference, Asked(**body))
    jsonschema.validate(created["document"], qparams_schema())
    assert created["options"] == created["document"]["options"]
    assert created["options"]["target"] == "x86" and created["options"]["dtype"] == "uint8"
    assert live.owner.get(path).json() == [*before, created]


def test_concurrent_runs_do_not_interfere_and_drift_is_reported(live, digits, tmp_path):
    more = write_calib(tmp_path, "more.npz", start=16, count=32)
    model_id = digits.model["id"]
    queued = [
        start_run(live.owner, model_id, more, key="calib"),
        start_run(live.owner, model_id, random="8", seed="3"),
    ]
    runs = [wait_for_run(live.owner, r["id"]) for r in queued]
    assert [r["status"] for r in runs] == ["done", "done"], [r["error"] for r in runs]
    assert max(r["started_at"] for r in runs) < min(r["finished_at"] for r in runs)
    random = ("--samples", "8", "--seed", "3")
    expected = [
        cli_profile(digits.path, f"{more}:calib", tmp_path / "a.json"),
        cli_profile(digits.path, "random", tmp_path / "b.json", *random),
    ]
    for run, reference in zip(runs, expected, strict=True):
        same_document(live.owner.get(f"/api/runs/{run['id']}/profile").json(), reference)

    def compare(a: int, b: int) -> dict:
        response = live.owner.get(f"/api/runs/{a}/compare/{b}")
        assert response.status_code == 200, response.text
        return response.json()

    first, more_data, noise = digits.run["id"], runs[0]["id"], runs[1]["id"]
    same = compare(first, first)["tensors"]
    assert len(same) == len(digits.reference["tensors"])
    assert all(t["histogram_distance"] == 0 and t["range_change"] in (0, None) for t in same)
    drift = {t["profile_id"]: t for t in compare(first, more_data)["tensors"]}
    static = {t["profile_id"] for t in digits.reference["tensors"] if t["static"]}
    assert static and all(drift[p]["histogram_distance"] == 0 for p in static)
    assert 0 < drift["input:image"]["histogram_distance"] < 0.5
    away = compare(first, noise)
    image = next(t for t in away["tensors"] if t["profile_id"] == "input:image")
    assert image["histogram_distance"] > 0.5 and image["min_shift"] < 0
    assert image["range_change"] > 1 and away["only_in_a"] == away["only_in_b"] == []


def test_a_failing_run_is_failed_with_its_reason(live, tmp_path):
    path = mb.save(mb.gemm(), tmp_path, "gemm.onnx")
    model = upload_model(live.owner, path, input_shapes="x=2x8").json()
    assert model["input_shapes"] == {"x": [2, 8]}
    queued = start_run(live.owner, model["id"], random="4", batch_size="3")
    run = wait_for_run(live.owner, queued["id"])
    assert run["status"] == "failed" and "batch size 3 does not fit" in run["error"]
    response = live.owner.get(f"/api/runs/{run['id']}/profile")
    assert response.status_code == 409 and "batch size 3" in response.json()["detail"]


def test_delete_removes_the_model_its_runs_and_files(live, tmp_path):
    rows, files = row_counts(live.url), stored_files(live.storage)
    path = mb.save(mb.conv_bias(), tmp_path, "conv.onnx")
    model, twin = (upload_model(live.owner, path).json() for _ in range(2))
    assert model["sha256"] == twin["sha256"] and model["id"] != twin["id"]
    data = tmp_path / "conv.npz"
    data.write_bytes(npz_bytes(x=np.ones((4, 3, 6, 6), np.float32)))
    run = start_run(live.owner, model["id"], data)
    assert row_counts(live.url)["run"] == rows["run"] + 1
    blob = live.storage / model["sha256"][:2] / f"{model['sha256']}.onnx"
    sha = run["data"]["sha256"]
    assert blob.is_file() and (live.storage / sha[:2] / f"{sha}.npz").is_file()
    assert live.stranger.delete(f"/api/models/{model['id']}").status_code == 404
    assert live.owner.delete(f"/api/models/{model['id']}").status_code == 204
    assert live.owner.get(f"/api/models/{model['id']}").status_code == 404
    assert live.owner.get(f"/api/runs/{run['id']}").status_code == 404
    assert blob.is_file()  # the twin still refers to it
    assert live.owner.delete(f"/api/models/{twin['id']}").status_code == 204
    assert row_counts(live.url) == rows
    # the worker may still be tearing the stopped run down
    poll_until(lambda: stored_files(live.storage) == files, 20, what=lambda: live.storage)


def test_tokens_see_only_their_own(live, digits):
    model, run = digits.model["id"], digits.run["id"]
    for path in ("/api/models", f"/api/models/{model}", f"/api/runs/{run}"):
        response = live.anonymous.get(path)
        assert response.status_code == 401 and "bearer token" in response.json()["detail"]
        assert response.headers["www-authenticate"] == "Bearer"
    forged = live.anonymous.get("/api/models", headers={"Authorization": "Bearer rp_nope"})
    assert forged.status_code == 401 and forged.json()["detail"] == "invalid bearer token"
    assert live.stranger.get("/api/models").json() == []
    foreign = [
        ("get", f"/api/models/{model}"),
        ("get", f"/api/models/{model}/runs"),
        ("post", f"/api/models/{model}/runs"),
        ("delete", f"/api/models/{model}"),
        ("get", f"/api/runs/{run}"),
        ("get", f"/api/runs/{run}/profile"),
        ("get", f"/api/runs/{run}/export?format=aimet"),
        ("get", f"/api/runs/{run}/qparams"),
        ("post", f"/api/runs/{run}/qparams"),
        ("get", f"/api/runs/{run}/compare/{run}"),
    ]
    for method, path in foreign:
        kwargs = {"data": {"random": "2"}} if path.endswith("/runs") and method == "post" else {}
        response = live.stranger.request(method, path, **kwargs)
        assert response.status_code == 404, (path, response.text)
        assert "not found" in response.json()["detail"]
    assert live.owner.get(f"/api/runs/{run}/profile").status_code == 200  # nothing was touched


def test_openapi_describes_every_route(live):
    spec = live.anonymous.get("/openapi.json").json()
    assert {
        "/api/models",
        "/api/models/{model_id}",
        "/api/models/{model_id}/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/profile",
        "/api/runs/{run_id}/export",
        "/api/runs/{run_id}/qparams",
        "/api/runs/{a}/compare/{b}",
    } <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert {"ModelUpload", "RunRequest", "RunOut", "ModelOut", "DriftOut", "ErrorOut"} <= set(
        schemas
    )
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    upload = spec["paths"]["/api/models"]["post"]
    assert "multipart/form-data" in upload["requestBody"]["content"]
    assert upload["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorOut"
    }
