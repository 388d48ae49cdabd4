"""The service as processes, killed in the middle of a run and started again on the same
database and storage: everything stored survives, the run's child process dies with its worker,
and the run is failed with a reason instead of staying ``running``.

On SQLite the embedded deployment runs: one ``rangeprof serve`` with its own worker. On
PostgreSQL the deployment of ``docker/compose.yaml``: ``rangeprof serve --jobs 0`` queues runs
and a ``rangeprof worker`` executes them.
"""

from __future__ import annotations

import signal

import pytest

from rangeprof.service.jobs import STOPPED

from conftest import poll_until, zoo_model
from service_fixtures import (
    BACKENDS,
    Rangeprof,
    alive,
    client,
    database,
    free_port,
    rangeprof,
    row_counts,
    serve,
    start_run,
    upload_model,
    wait_for_run,
    write_calib,
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_restart_keeps_everything_and_fails_the_interrupted_run(backend, tmp_path):
    with database(backend, tmp_path) as url:
        rangeprof("db", "upgrade", "--db", url)
        token = rangeprof("token", "create", "me", "--db", url).strip()
        storage, port, log = tmp_path / "blobs", free_port(), tmp_path / "service.log"

        def start() -> list[Rangeprof]:
            """The deployment; the process executing runs comes last."""
            if backend == "sqlite":
                return [serve(url, storage, port, log, "--jobs", "2")]
            worker = ["worker", "--db", url, "--storage", str(storage), "--name", "w1"]
            return [serve(url, storage, port, log, "--jobs", "0"), Rangeprof(log, *worker)]

        processes = start()
        try:
            with client(f"http://127.0.0.1:{port}", token) as api:
                model = upload_model(api, zoo_model("digits_cnn")).json()
                queued = start_run(api, model["id"], write_calib(tmp_path))
                long = start_run(api, model["id"], random="1000000")
                finished = wait_for_run(api, queued["id"])
                assert finished["status"] == "done", finished["error"] or log.read_text()
                profile = api.get(f"/api/runs/{finished['id']}/profile").json()
                poll_until(
                    lambda: api.get(f"/api/runs/{long['id']}").json()["samples_done"] > 0,
                    120,
                    what="the long run makes progress",
                )
                children = processes[-1].children()
                rows = row_counts(url)
        finally:
            for process in processes:
                process.kill()
        assert children, "the run executes in a child process"
        poll_until(lambda: not any(map(alive, children)), 20, what="the run ends with its worker")

        processes = start()
        try:
            with client(f"http://127.0.0.1:{port}", token) as api:
                run = f"/api/runs/{long['id']}"
                poll_until(lambda: api.get(run).json()["status"] != "running", what="run stops")
                interrupted = api.get(run).json()
                assert (interrupted["status"], interrupted["error"]) == ("failed", STOPPED)
                assert 0 < interrupted["progress"] < 1 and interrupted["finished_at"]
                assert api.get(f"/api/models/{model['id']}").json() == model
                assert api.get(f"/api/runs/{finished['id']}").json() == finished
                assert api.get(f"/api/runs/{finished['id']}/profile").json() == profile
                assert row_counts(url) == rows
        finally:
            server, *worker = (process.stop() for process in processes)
        # uvicorn ends by re-raising the SIGTERM it handled; the worker returns.
        assert server in (0, -signal.SIGTERM) and worker in ([], [0]), log.read_text()
        assert "Application shutdown complete" in log.read_text()
