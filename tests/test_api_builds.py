"""INT8 builds through the REST API (uvicorn on a loopback port, the in-process worker), on SQLite
and PostgreSQL: a profiled digits_cnn run -> POST a build -> poll -> the zip, whose model.so
computes what an in-process ``build_artifact`` of the same model and qparams computes; builds
from stored qparams; refusals that leave nothing behind; deletion with the model."""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.byoc.artifact import build_artifact
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.service.limits import Limits

import onnx_builders as mb
from conftest import zoo_model
from service_fixtures import (
    BACKENDS,
    DIGITS,
    live_service,
    row_counts,
    start_run,
    stored_files,
    upload_model,
    wait_for_run,
    write_calib,
)

# What differs between two builds of the same model and qparams.
PER_BUILD = ("library_sha256", "timings")


@dataclass
class Digits:
    model: dict
    run: dict


@pytest.fixture(scope="module", params=BACKENDS)
def live(request, tmp_path_factory):
    with live_service(request.param, tmp_path_factory.mktemp(request.param), Limits()) as service:
        yield service


@pytest.fixture(scope="module")
def digits(live, tmp_path_factory) -> Digits:
    folder = tmp_path_factory.mktemp("calib")
    model = upload_model(live.owner, zoo_model("digits_cnn")).json()
    run = start_run(live.owner, model["id"], write_calib(folder, count=8))
    run = wait_for_run(live.owner, run["id"])
    assert run["status"] == "done", run["error"]
    return Digits(model, run)


def wait_for_build(api, build_id: int, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        build = api.get(f"/api/builds/{build_id}").json()
        if build["status"] in ("done", "failed"):
            assert build["status"] == "done", build["error"]
            return build
        assert time.monotonic() < deadline, build
        time.sleep(0.2)


def unzip(api, build: dict, folder: Path) -> dict:
    """The build's artifact in ``folder``; its manifest."""
    response = api.get(f"/api/builds/{build['id']}/artifact")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    assert hashlib.sha256(response.content).hexdigest() == build["artifact_sha256"]
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        assert sorted(archive.namelist()) == ["manifest.json", "model.so"]
        archive.extractall(folder)
    return json.loads((folder / "manifest.json").read_text())


def run_library(library: Path, x: np.ndarray) -> np.ndarray:
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def same_build(served: dict, built: dict) -> None:
    def stable(manifest: dict) -> dict:
        return {k: v for k, v in manifest.items() if k not in PER_BUILD}

    assert stable(served) == stable(built)


def test_x86_build_runs_as_an_in_process_build(live, digits, tmp_path):
    path = f"/api/runs/{digits.run['id']}/builds"
    response = live.owner.post(path, json={"target": "x86", "method": "mse"})
    assert response.status_code == 202, response.text
    queued = response.json()
    assert queued["status"] in ("queued", "running") and queued["manifest"] is None
    assert (queued["model_id"], queued["method"]) == (digits.model["id"], "mse")
    assert queued["weight_bits"] == 8
    build = wait_for_build(live.owner, queued["id"])
    assert build["progress"] == 1 and build["phase"] is None
    assert {"quantize_s", "compile_s", "export_s", "total_s"} <= set(build["timings"])
    manifest = unzip(live.owner, build, tmp_path / "served")
    assert manifest == build["manifest"]
    assert manifest["target"] == "x86" and manifest["calibration"]["method"] == "mse"
    profile_ids = {layer["profile_id"] for layer in digits.model["layers"]}
    assert manifest["regions"] and all(r["mode"] == "int8" for r in manifest["regions"])
    assert all(set(r["profile_ids"]) <= profile_ids for r in manifest["regions"])
    assert all(r["profile_ids"] for r in manifest["regions"])

    profile = live.owner.get(f"/api/runs/{digits.run['id']}/profile").json()
    x86 = get_plugin("x86")
    qparams = qparams_from_profile(profile, x86, "mse", 99.99)
    in_process = build_artifact(quantize_model(zoo_model("digits_cnn"), qparams, x86), tmp_path)
    same_build(manifest, in_process)
    x = np.load(DIGITS)["test"][:1].astype(np.float32)
    served = run_library(tmp_path / "served" / "model.so", x)
    assert np.array_equal(served, run_library(tmp_path / "model.so", x))

    listed = live.owner.get(path).json()
    assert [b["id"] for b in listed] == [build["id"]] and "manifest" not in listed[0]
    for url in (f"/api/builds/{build['id']}", f"/api/builds/{build['id']}/artifact", path):
        assert live.stranger.get(url).status_code == 404
        assert live.anonymous.get(url).status_code == 401


def test_a_build_from_stored_qparams_uses_them(live, digits, tmp_path):
    run_id = digits.run["id"]
    options = {"method": "max", "granularity": "per-channel"}
    qparams = live.owner.post(f"/api/runs/{run_id}/qparams", json=options).json()
    response = live.owner.post(
        f"/api/runs/{run_id}/builds",
        json={"target": "npu", "qparams_id": qparams["id"], "weight_bits": 7},
    )
    assert response.status_code == 202, response.text
    build = wait_for_build(live.owner, response.json()["id"])
    assert (build["qparams_id"], build["method"], build["target"]) == (qparams["id"], None, "npu")
    assert build["weight_bits"] == 7 and "7-bit" in build["manifest"]["policy"]["weights"]
    assert unzip(live.owner, build, tmp_path)["calibration"] == qparams["document"]["options"]
    assert build["manifest"]["calibration"] == qparams["document"]["options"]


def test_bad_requests_are_refused_and_leave_nothing_behind(live, digits, tmp_path):
    gemm = upload_model(live.owner, mb.save(mb.gemm(), tmp_path, "gemm.onnx"), input_shapes="x=2x8")
    failed = wait_for_run(
        live.owner, start_run(live.owner, gemm.json()["id"], random="4", batch_size="3")["id"]
    )
    other = wait_for_run(live.owner, start_run(live.owner, digits.model["id"], random="2")["id"])
    run_id = digits.run["id"]
    foreign = live.owner.post(f"/api/runs/{other['id']}/qparams").json()["id"]
    rows, files = row_counts(live.url), stored_files(live.storage)

    def post(body: dict, api=live.owner, run=run_id):
        return api.post(f"/api/runs/{run}/builds", json=body)

    refusals = [
        (post({"target": "gpu"}), 422, "body target: Input should be 'x86', 'aarch64' or 'npu'"),
        (post({"method": "median"}), 422, "body method"),
        (post({"qparams_id": foreign}), 400, f"run {run_id} has no qparams {foreign}"),
        (post({"qparams_id": 10**6}), 400, f"has no qparams {10**6}"),
        (post({"qparams_id": foreign, "method": "max"}, run=other["id"]), 400, "not both"),
        (post({"target": "x86", "cores": 4}), 422, "cores"),
        (post({"weight_bits": 6}), 422, "weight_bits"),
        (post({}, run=failed["id"]), 409, f"run {failed['id']} is failed"),
        (post({}, api=live.stranger), 404, f"run {run_id} not found"),
    ]
    for response, code, detail in refusals:
        assert response.status_code == code, response.text
        assert detail in response.json()["detail"]
    assert row_counts(live.url) == rows
    assert stored_files(live.storage) == files


def test_deleting_the_model_deletes_its_builds_and_artifacts(live, digits):
    builds = live.owner.get(f"/api/runs/{digits.run['id']}/builds").json()
    artifacts = [
        live.storage / b["artifact_sha256"][:2] / f"{b['artifact_sha256']}.zip" for b in builds
    ]
    assert builds and all(path.exists() for path in artifacts)
    assert live.owner.delete(f"/api/models/{digits.model['id']}").status_code == 204
    assert row_counts(live.url)["build"] == 0
    assert not any(path.exists() for path in artifacts)
    assert live.owner.get(f"/api/builds/{builds[0]['id']}").status_code == 404
