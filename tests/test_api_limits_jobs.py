"""Jobs under memory limits, through real ``rangeprof serve`` and ``rangeprof worker`` processes:
a run whose estimated memory is over the server's limit is refused before any job (an 83-byte
model declaring 10^9 input values), a job past its worker's memory limit fails with "memory
limit" while the worker and the server go on, and a job held to its own estimate as its limit
completes (the estimate is enough)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from onnx import helper

from rangeprof.service.estimate import ModelShapes, estimate
from rangeprof.service.execute import PROFILE
from rangeprof.service.limits import MB, Limits

import onnx_builders as mb
from conftest import zoo_model
from service_fixtures import (
    Rangeprof,
    client,
    free_port,
    live_service,
    rangeprof,
    row_counts,
    serve,
    start_run,
    upload_model,
    wait_for_run,
    write_calib,
)


def _relu(folder: Path, shape: list[int], name: str) -> Path:
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    return mb.save(mb.single_io_model([node], {}, shape, shape), folder, name)


class _Deployment:
    """``rangeprof serve --jobs 0`` on a fresh SQLite database, and workers started on it."""

    def __init__(self, folder: Path):
        self.url = f"sqlite:///{folder / 'service.db'}"
        self.folder, self.storage, self.log = folder, folder / "blobs", folder / "service.log"
        rangeprof("db", "upgrade", "--db", self.url)
        token = rangeprof("token", "create", "owner", "--db", self.url).strip()
        port = free_port()
        self.processes = [serve(self.url, self.storage, port, self.log, "--jobs", "0")]
        self.api = client(f"http://127.0.0.1:{port}", token)

    def worker(self, name: str) -> Rangeprof:
        args = ["worker", "--db", self.url, "--storage", str(self.storage), "--name", name]
        self.processes.append(Rangeprof(self.log, *args))
        return self.processes[-1]

    def close(self) -> None:
        self.api.close()
        for process in self.processes:
            process.stop()


@pytest.fixture
def deployment(tmp_path):
    served = _Deployment(tmp_path)
    yield served
    served.close()


def test_a_run_estimated_over_the_memory_limit_is_refused_before_any_job(deployment, tmp_path):
    model = _relu(tmp_path, [1, 1000, 1000, 1000], "giga.onnx")
    assert model.stat().st_size < 120
    uploaded = upload_model(deployment.api, model)
    assert uploaded.status_code == 201, uploaded.text
    runs = f"/api/models/{uploaded.json()['id']}/runs"
    refused = deployment.api.post(runs, data={"random": "1"})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert detail.startswith("the run would need about ") and detail.endswith(
        "MB of memory (estimated from the model's shapes), over this server's limit of 8192 MB "
        "per job"
    )
    # Its input alone is 4 GB, read, cast and observed in copies of it.
    assert int(detail.split()[5]) > 10 * 4000
    assert deployment.api.get(runs).json() == []
    assert row_counts(deployment.url)["run"] == 0


def test_a_job_past_its_memory_limit_fails_and_the_worker_goes_on(
    deployment, tmp_path, monkeypatch
):
    """The server's estimate lets the run in (its limit is the default 8 GB); the worker holds
    its jobs to 1500 MB, which a 400 MB sample and its copies pass."""
    monkeypatch.setenv("RANGEPROF_JOB_MEMORY_MB", "1500")
    worker = deployment.worker("small")
    api = deployment.api
    wide = upload_model(api, _relu(tmp_path, [1, 100, 1000, 1000], "wide.onnx")).json()
    failed = wait_for_run(api, start_run(api, wide["id"], random="1")["id"])
    assert (failed["status"], failed["error"]) == (
        "failed",
        "stopped at this server's memory limit for a job, 1500 MB",
    )
    assert worker.process.poll() is None, deployment.log.read_text()
    digits = upload_model(api, zoo_model("digits_cnn")).json()
    done = wait_for_run(api, start_run(api, digits["id"], write_calib(tmp_path))["id"])
    assert done["status"] == "done", done["error"]
    assert api.get(f"/api/runs/{failed['id']}").json() == failed


def test_a_job_held_to_its_estimate_completes(deployment, tmp_path, monkeypatch):
    """The estimate is an upper bound of what the job needs: each run, on a worker whose memory
    limit is the run's estimate, completes."""
    api = deployment.api
    cases = [
        (zoo_model("digits_cnn"), {"random": "8", "bins": "65536"}),
        (_relu(tmp_path, [1, 10, 1000, 1000], "wide.onnx"), {"random": "2"}),
    ]
    for number, (path, form) in enumerate(cases):
        model = upload_model(api, path).json()
        shapes = ModelShapes.from_layers(model["layers"], model["inputs"])
        peak = estimate(shapes, PROFILE, bins=int(form.get("bins", 2048))).peak
        monkeypatch.setenv("RANGEPROF_JOB_MEMORY_MB", str(math.ceil(peak / MB)))
        worker = deployment.worker(f"w{number}")
        run = wait_for_run(api, start_run(api, model["id"], **form)["id"], timeout=300)
        assert run["status"] == "done", (path.name, run["error"])
        worker.stop()


def test_evaluations_and_builds_are_estimated_before_any_job(tmp_path, monkeypatch):
    """A done run's evaluation and build are refused (422, no row) when their estimate is over
    the job memory, which the server reads afresh for each request."""
    with live_service("sqlite", tmp_path, Limits()) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()
        calib = write_calib(tmp_path)
        run = wait_for_run(live.owner, start_run(live.owner, model["id"], calib)["id"])
        assert run["status"] == "done", run["error"]
        monkeypatch.setenv("RANGEPROF_JOB_MEMORY_MB", "100")
        evaluations, builds = (
            f"/api/runs/{run['id']}/{kind}" for kind in ("evaluations", "builds")
        )
        data = {"data": (calib.name, calib.read_bytes())}
        refusals = {
            "evaluation": live.owner.post(evaluations, files=data),
            "build": live.owner.post(builds, json={}),
        }
        for what, refused in refusals.items():
            assert refused.status_code == 422, refused.text
            detail = refused.json()["detail"]
            assert detail.startswith(f"the {what} would need about "), detail
            assert detail.endswith("over this server's limit of 100 MB per job"), detail
        assert live.owner.get(evaluations).json() == []
        assert live.owner.get(builds).json() == []


def test_a_run_that_cannot_end_within_the_time_limit_is_refused(tmp_path):
    """Even at a rate no host reaches, a million samples take the model past a 1 s limit."""
    with live_service("sqlite", tmp_path, Limits(max_job_seconds=1.0), jobs=0) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        runs = f"/api/models/{model}/runs"
        refused = live.owner.post(runs, data={"random": "1000000"})
        assert refused.status_code == 422, refused.text
        detail = refused.json()["detail"]
        assert detail.startswith("the run would take at least 2 s (1000000 samples at "), detail
        assert detail.endswith("over this server's time limit of 1 s per job"), detail
        assert live.owner.get(runs).json() == []
        assert live.owner.post(runs, data={"random": "1000"}).status_code == 202
