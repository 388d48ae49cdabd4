"""The service as processes: a real ``rangeprof serve`` killed in the middle of a run, then
started again on the same database and storage (SQLite and PostgreSQL) — everything stored
survives, the run's child process dies with the server, and the run is failed with a reason
instead of staying ``running``; and a server that only queues beside a ``rangeprof worker``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from api.jobs import STOPPED

from conftest import zoo_model
from service_fixtures import (
    BACKENDS,
    ProcessServer,
    client,
    database,
    free_port,
    rangeprof,
    row_counts,
    start_run,
    upload_model,
    wait_for_run,
    write_calib,
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("backend", BACKENDS)
def test_restart_keeps_everything_and_fails_the_interrupted_run(backend, tmp_path):
    with database(backend, tmp_path) as url:
        rangeprof("db", "upgrade", "--db", url)
        token = rangeprof("token", "create", "me", "--db", url).strip()
        storage, port, log = tmp_path / "blobs", free_port(), tmp_path / "server.log"
        server = ProcessServer(url, storage, port, log, "--jobs", "2")
        try:
            with client(server.url, token) as api:
                model = upload_model(api, zoo_model("digits_cnn")).json()
                queued = start_run(api, model["id"], write_calib(tmp_path))
                long = start_run(api, model["id"], random="1000000")
                finished = wait_for_run(api, queued["id"])
                assert finished["status"] == "done", finished["error"]
                profile = api.get(f"/api/runs/{finished['id']}/profile").json()
                deadline = time.monotonic() + 60
                while api.get(f"/api/runs/{long['id']}").json()["samples_done"] == 0:
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
                children = server.children()
                rows = row_counts(url)
        finally:
            server.kill()
        assert children, "the run executes in a child process"
        deadline = time.monotonic() + 20
        while any(_alive(pid) for pid in children):
            assert time.monotonic() < deadline, "the run outlived its server"
            time.sleep(0.1)

        server = ProcessServer(url, storage, port, log, "--jobs", "2")
        try:
            with client(server.url, token) as api:
                interrupted = api.get(f"/api/runs/{long['id']}").json()
                assert (interrupted["status"], interrupted["error"]) == ("failed", STOPPED)
                assert 0 < interrupted["progress"] < 1 and interrupted["finished_at"]
                assert api.get(f"/api/models/{model['id']}").json() == model
                assert api.get(f"/api/runs/{finished['id']}").json() == finished
                assert api.get(f"/api/runs/{finished['id']}/profile").json() == profile
                assert row_counts(url) == rows
        finally:
            server.stop()


def test_a_separate_worker_executes_the_runs(tmp_path):
    """The compose deployment: the API queues (``--jobs 0``), ``rangeprof worker`` executes."""
    with database("postgresql", tmp_path) as url:
        rangeprof("db", "upgrade", "--db", url)
        token = rangeprof("token", "create", "me", "--db", url).strip()
        storage, log = tmp_path / "blobs", tmp_path / "server.log"
        command = [sys.executable, "-m", "profiler", "worker", "--db", url]
        with log.open("a") as out:
            worker = subprocess.Popen(
                [*command, "--storage", str(storage), "--name", "w1"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        server = ProcessServer(url, storage, free_port(), log, "--jobs", "0")
        try:
            with client(server.url, token) as api:
                model = upload_model(api, zoo_model("digits_cnn")).json()
                run = wait_for_run(api, start_run(api, model["id"], random="2")["id"])
                assert run["status"] == "done", run["error"] or log.read_text()
                assert api.get(f"/api/runs/{run['id']}/profile").json()["run"]["samples"] == 2
        finally:
            server.stop()
            worker.terminate()
            assert worker.wait(timeout=60) == 0, log.read_text()
        assert "run 1 done" in log.read_text()
