"""INT8 builds through the REST API (uvicorn on a loopback port, the in-process worker), on SQLite
and PostgreSQL: a profiled digits_cnn run -> POST a build -> poll -> the zip, whose model.so
computes what an in-process ``build_artifact`` of the same model and qparams computes; builds
from stored qparams; an accuracy budget measured on uploaded data, which keeps layers FP32 as
the same request does in process; an evaluation of every method; each job's stored request;
refusals that leave nothing behind; deletion with the model."""

from __future__ import annotations

import hashlib
import io
import json
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
from rangeprof.profiler.calibrate.methods import CHOICES
from rangeprof.service.limits import Limits
from rangeprof.workflows import quantize
from rangeprof.workflows.requests import BuildRequest, EvaluateRequest

import onnx_builders as mb
from conftest import poll_until, zoo_model
from service_fixtures import (
    BACKENDS,
    DIGITS,
    live_service,
    npz_bytes,
    row_counts,
    start_run,
    stored_files,
    upload_model,
    wait_for_run,
    write_calib,
)

# What differs between two builds of the same model and qparams.
PER_BUILD = ("library_sha256", "timings")
# Evaluation data for an accuracy budget: digits with their labels, in one .npz.
_DIGITS = np.load(DIGITS)
EVALUATION_DATA = npz_bytes(test=_DIGITS["test"][:32], test_labels=_DIGITS["test_labels"][:32])


@dataclass
class Digits:
    model: dict
    run: dict


# The module's service runs on each backend. What is about the database (stored requests and
# rows, refusals that leave nothing behind, deletion with the model) runs on both; the flows
# whose time is TVM's compiles and evaluations (the same on either backend) run on one each,
# spread over the two (marker `backend`, conftest.py), so that both backends serve builds,
# evaluations and uploaded data.
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


def wait_for(api, path: str, timeout: float = 120) -> dict:
    """The build or evaluation at ``path`` once done."""

    def ended() -> dict | None:
        job = api.get(path).json()
        return job if job["status"] in ("done", "failed") else None

    job = poll_until(ended, timeout, 0.2, lambda: api.get(path).json())
    assert job["status"] == "done", job["error"]
    return job


def wait_for_build(api, build_id: int) -> dict:
    return wait_for(api, f"/api/builds/{build_id}")


def stored_request(kind, served: dict):
    """The job's request as the API shows it, which reads back unchanged."""
    request = kind.model_validate(served)
    assert request.model_dump(mode="json") == served
    return request


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


@pytest.mark.backend("postgresql")
def test_x86_build_runs_as_an_in_process_build(live, digits, tmp_path):
    path = f"/api/runs/{digits.run['id']}/builds"
    response = live.owner.post(path, json={"target": "x86", "method": "mse"})
    assert response.status_code == 202, response.text
    queued = response.json()
    assert queued["status"] in ("queued", "running") and queued["manifest"] is None
    assert (queued["model_id"], queued["method"]) == (digits.model["id"], "mse")
    assert queued["weight_bits"] is None and queued["data"] is None  # the target's choice
    assert stored_request(BuildRequest, queued["request"]) == BuildRequest(
        model="digits_cnn.onnx", out="artifact", profile="profile.json", method="mse"
    )
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
    qm = quantize_model(zoo_model("digits_cnn"), qparams, x86)
    in_process = build_artifact(qm, tmp_path)
    same_build(manifest, in_process)
    x = np.load(DIGITS)["test"][:1].astype(np.float32)
    served = run_library(tmp_path / "served" / "model.so", x)
    assert np.array_equal(served, run_library(tmp_path / "model.so", x))

    listed = live.owner.get(path).json()
    assert [b["id"] for b in listed] == [build["id"]] and "manifest" not in listed[0]
    for url in (f"/api/builds/{build['id']}", f"/api/builds/{build['id']}/artifact", path):
        assert live.stranger.get(url).status_code == 404
        assert live.anonymous.get(url).status_code == 401


@pytest.mark.backend("sqlite")
def test_a_build_from_stored_qparams_uses_them(live, digits, tmp_path):
    run_id = digits.run["id"]
    options = {"target": "npu", "method": "max", "granularity": "per-channel"}
    qparams = live.owner.post(f"/api/runs/{run_id}/qparams", json=options).json()
    response = live.owner.post(
        f"/api/runs/{run_id}/builds",
        json={"target": "npu", "qparams_id": qparams["id"], "weight_bits": 7},
    )
    assert response.status_code == 202, response.text
    build = wait_for_build(live.owner, response.json()["id"])
    assert (build["qparams_id"], build["method"], build["target"]) == (qparams["id"], None, "npu")
    request = stored_request(BuildRequest, build["request"])
    assert (request.qparams, request.profile, request.target) == (Path("qparams.json"), None, "npu")
    assert build["weight_bits"] == 7 and "7-bit" in build["manifest"]["policy"]["weights"]
    assert unzip(live.owner, build, tmp_path)["calibration"] == qparams["document"]["options"]
    assert build["manifest"]["calibration"] == qparams["document"]["options"]


@pytest.mark.backend("sqlite")
def test_an_accuracy_budget_build_keeps_layers_fp32_as_its_request_does(live, digits, tmp_path):
    """A badly clipped calibration (percentile 50) costs top-1 points: a budget of 0 keeps the
    most sensitive layers FP32, exactly those the stored request keeps when run in process."""
    form = {
        "method": "percentile",
        "percentile": "50",
        "accuracy_budget": "0",
        "fp32_fallback": "true",
        "key": "test",
        "labels_key": "test_labels",
        "samples": "32",
    }
    response = live.owner.post(
        f"/api/runs/{digits.run['id']}/builds",
        files={"data": ("eval.npz", EVALUATION_DATA)},
        data=form,
    )
    assert response.status_code == 202, response.text
    queued = response.json()
    sha256 = hashlib.sha256(EVALUATION_DATA).hexdigest()
    assert queued["data"] == {"name": "eval.npz", "key": "test", "sha256": sha256}
    assert queued["labels"] == {"name": "eval.npz", "key": "test_labels", "sha256": sha256}
    request = stored_request(BuildRequest, queued["request"])
    assert request == BuildRequest(
        model="digits_cnn.onnx",
        out="artifact",
        profile="profile.json",
        method="percentile",
        percentile=50,
        fp32_fallback=True,
        accuracy_budget=0,
        data="eval.npz:test",
        labels="eval.npz:test_labels",
        samples=32,
    )
    assert (live.storage / sha256[:2] / f"{sha256}.npz").read_bytes() == EVALUATION_DATA
    build = wait_for_build(live.owner, queued["id"])
    manifest = unzip(live.owner, build, tmp_path / "served")
    kept = set(manifest["kept_fp32"])
    fp32 = {r["output"]["profile_id"] for r in manifest["regions"] if r["mode"] == "fp32"}
    assert kept and fp32 == kept and len(kept) < len(manifest["regions"])

    # The same request on local copies of its files.
    (tmp_path / "profile.json").write_text(
        json.dumps(live.owner.get(f"/api/runs/{digits.run['id']}/profile").json())
    )
    (tmp_path / "eval.npz").write_bytes(EVALUATION_DATA)
    local = request.model_copy(
        update={
            "model": zoo_model("digits_cnn"),
            "profile": tmp_path / "profile.json",
            "data": f"{tmp_path}/eval.npz:test",
            "labels": f"{tmp_path}/eval.npz:test_labels",
            "out": tmp_path / "local",
        }
    )
    same_build(manifest, quantize.build(local).to_json())


@pytest.mark.backend("postgresql")
def test_an_evaluation_of_every_method_reports_the_best(live, digits):
    response = live.owner.post(
        f"/api/runs/{digits.run['id']}/evaluations",
        files={"data": ("eval.npz", EVALUATION_DATA)},
        data={
            "key": "test",
            "labels_key": "test_labels",
            "method": "all",
            "fp32_fallback": "true",
            "accuracy_budget": "1.5",
        },
    )
    assert response.status_code == 202, response.text
    queued = response.json()
    request = stored_request(EvaluateRequest, queued["request"])
    assert (request.method, request.fp32_fallback, request.accuracy_budget) == ("all", True, 1.5)
    assert (request.data, request.labels) == ("eval.npz:test", "eval.npz:test_labels")
    evaluation = wait_for(live.owner, f"/api/evaluations/{queued['id']}")
    assert evaluation["method"] == "all" and evaluation["request"] == queued["request"]
    report = evaluation["report"]
    assert [m["method"] for m in report["methods"]] == list(CHOICES)
    best = next(m for m in report["methods"] if m["method"] == report["method"])
    assert best["int8_top1"] == max(m["int8_top1"] for m in report["methods"])
    assert report["fp32_top1"] - report["int8_top1"] <= 1.5  # within the budget


@pytest.mark.backend("sqlite")
def test_bias_correction_is_measured_on_the_runs_calibration_data(live, digits, tmp_path):
    path = f"/api/runs/{digits.run['id']}/builds"
    response = live.owner.post(path, json={"method": "mse", "bias_correction": "measured"})
    assert response.status_code == 202, response.text
    calibration = f"calibration/{digits.run['request']['data']}"
    request = stored_request(BuildRequest, response.json()["request"])
    assert (request.bias_correction, request.calibration_data) == ("measured", calibration)
    build = wait_for_build(live.owner, response.json()["id"])
    manifest = unzip(live.owner, build, tmp_path)
    assert manifest["bias_correction"]["data"] == calibration
    int8 = [r for r in manifest["regions"] if r["mode"] == "int8"]
    assert int8 and manifest["bias_correction"]["regions"] == len(int8)

    form = {"method": "max", "bias_correction": "measured", "samples": "16"}
    files = {"data": ("test.npz", EVALUATION_DATA)}
    response = live.owner.post(
        f"/api/runs/{digits.run['id']}/evaluations", files=files, data={**form, "key": "test"}
    )
    assert response.status_code == 202, response.text
    evaluation = wait_for(live.owner, f"/api/evaluations/{response.json()['id']}")
    record = evaluation["report"]["bias_correction"]
    assert record["mode"] == "empirical" and record["data"] == calibration
    # Stored correction reads the run's per-channel means: this run recorded none.
    response = live.owner.post(path, json={"method": "mse", "bias_correction": "stored"})
    assert response.status_code == 400 and "channel_stats" in response.json()["detail"]

    # A run of random samples has no calibration data to measure on: refused, nothing stored.
    random_run = start_run(live.owner, digits.model["id"], random="8")
    random_run = wait_for_run(live.owner, random_run["id"])
    before = row_counts(live.url)
    response = live.owner.post(
        f"/api/runs/{random_run['id']}/builds", json={"bias_correction": "measured"}
    )
    assert response.status_code == 400
    assert "bias_correction" in response.json()["detail"]
    assert row_counts(live.url) == before


@pytest.mark.backend("postgresql")
def test_stored_bias_correction_reads_the_runs_channel_means(live, digits, tmp_path):
    """A run profiled with channel statistics: its profile's means correct the biases, no data
    is linked into the build."""
    folder = tmp_path / "calib"
    folder.mkdir()
    run = start_run(
        live.owner, digits.model["id"], write_calib(folder, count=8), channel_stats="true"
    )
    run = wait_for_run(live.owner, run["id"])
    assert run["status"] == "done" and run["request"]["channel_stats"], run["error"]
    body = {"method": "max", "bias_correction": "stored"}
    response = live.owner.post(f"/api/runs/{run['id']}/builds", json=body)
    assert response.status_code == 202, response.text
    assert response.json()["request"]["bias_correction"] == "stored"
    manifest = unzip(live.owner, wait_for_build(live.owner, response.json()["id"]), tmp_path)
    assert manifest["bias_correction"]["mode"] == "stored"
    assert manifest["bias_correction"]["regions"] == sum(
        r["mode"] == "int8" for r in manifest["regions"]
    )


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

    def post_form(data: bytes | None = EVALUATION_DATA, labels: bytes | None = None, **form):
        files = {"data": ("eval.npz", data)} if data is not None else {}
        if labels is not None:
            files["labels"] = ("labels.npz", labels)
        return live.owner.post(f"/api/runs/{run_id}/builds", files=files or None, data=form)

    budget = {"accuracy_budget": "1", "key": "test"}

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
        (post({"accuracy_budget": 1}), 400, "'accuracy_budget' needs 'data'"),  # needs a form
        (live.owner.post(f"/api/runs/{run_id}/builds", content=b"{"), 422, "JSON"),
        (post_form(data=None, accuracy_budget="1"), 400, "'accuracy_budget' needs 'data'"),
        (post_form(key="test"), 400, "'data' is the evaluation data of an accuracy budget"),
        (post_form(data=None, labels_key="y"), 400, "'labels_key': these go with 'data'"),
        (post_form(**{**budget, "accuracy_budget": "-1"}), 422, "body accuracy_budget"),
        (post_form(**{**budget, "key": "test_labels"}), 422, "eval.npz"),  # labels, not images
        (post_form(**budget, labels=npz_bytes(y=np.arange(3))), 400, "3 labels for 32 samples"),
        (post_form(**budget, samples="33"), 400, "33 samples asked for"),
        (post_form(**budget, qparams_id=str(foreign)), 400, f"has no qparams {foreign}"),
    ]
    for response, code, detail in refusals:
        assert response.status_code == code, response.text
        assert detail in response.json()["detail"]
    assert row_counts(live.url) == rows
    assert stored_files(live.storage) == files


def test_deleting_the_model_deletes_its_builds_and_artifacts(live, digits):
    builds = live.owner.get(f"/api/runs/{digits.run['id']}/builds").json()
    evaluations = live.owner.get(f"/api/runs/{digits.run['id']}/evaluations").json()
    assert builds and evaluations
    blobs = [
        live.storage / b["artifact_sha256"][:2] / f"{b['artifact_sha256']}.zip" for b in builds
    ]
    # The evaluation data uploaded with an accuracy budget build (SQLite) or an evaluation
    # (both): one file, one blob, which the jobs share.
    blobs += {
        live.storage / job["data"]["sha256"][:2] / f"{job['data']['sha256']}.npz"
        for job in builds + evaluations
        if job["data"]
    }
    assert len(blobs) > len(builds) and all(path.exists() for path in blobs)
    assert live.owner.delete(f"/api/models/{digits.model['id']}").status_code == 204
    assert row_counts(live.url)["build"] == 0
    assert row_counts(live.url)["evaluation"] == 0
    assert not any(path.exists() for path in blobs)
    assert live.owner.get(f"/api/builds/{builds[0]['id']}").status_code == 404
