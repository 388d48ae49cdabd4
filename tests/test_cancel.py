"""Jobs that end early, through real HTTP and the CLI: cancelled (on SQLite and PostgreSQL: a
queued job never runs, a running one's process is stopped and its scratch files removed, an
ended one is 409) or killed (the job's process dies: its run fails at once)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rangeprof.cli import app as cli
from rangeprof.service.limits import Limits

from conftest import poll_until, zoo_model
from service_fixtures import BACKENDS, live_service, start_run, upload_model, wait_for_run

runner = CliRunner()


def _wait(api, path: str, status: str, timeout: float = 60) -> dict:
    def reached() -> dict | None:
        job = api.get(path).json()
        return job if job["status"] == status else None

    return poll_until(reached, timeout, what=lambda: api.get(path).json())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_running_run_is_stopped_and_the_worker_goes_on(backend, tmp_path):
    with live_service(backend, tmp_path, Limits(), jobs=1) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        long = start_run(live.owner, model, random=str(Limits().max_samples))["id"]
        _wait(live.owner, f"/api/runs/{long}", "running")
        cancelled = live.owner.post(f"/api/runs/{long}/cancel")
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json()["status"] == "cancelled"
        assert cancelled.json()["error"] == "cancelled by its owner"
        # The slot is free again once its process is stopped: the next run completes.
        after = wait_for_run(live.owner, start_run(live.owner, model, random="4")["id"])
        assert after["status"] == "done"
        assert live.owner.get(f"/api/runs/{long}").json()["status"] == "cancelled"
        assert list((live.storage / "tmp").iterdir()) == []
        ended = live.owner.post(f"/api/runs/{long}/cancel")
        assert ended.status_code == 409
        assert ended.json()["detail"] == f"run {long} is cancelled: nothing to cancel"
        assert live.stranger.post(f"/api/runs/{after['id']}/cancel").status_code == 404


def test_queued_jobs_are_cancelled_from_the_api_and_the_cli(tmp_path):
    with live_service("sqlite", tmp_path, Limits(), jobs=0) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        first, second = (start_run(live.owner, model, random="4")["id"] for _ in range(2))
        assert live.owner.post(f"/api/runs/{first}/cancel").json()["status"] == "cancelled"
        result = runner.invoke(cli, ["cancel", "run", str(second), "--db", live.url])
        assert result.exit_code == 0, result.output
        assert live.owner.get(f"/api/runs/{second}").json()["status"] == "cancelled"
        for args, words in (
            (["cancel", "run", str(second)], f"run {second} is cancelled: nothing to cancel"),
            (["cancel", "job", "1"], "unknown job kind 'job'"),
            (["cancel", "build", "99"], "no build 99"),
        ):
            result = runner.invoke(cli, [*args, "--db", live.url])
            assert result.exit_code == 2 and words in result.output, result.output
        assert live.owner.post("/api/builds/99/cancel").status_code == 404
        assert live.owner.post("/api/evaluations/99/cancel").status_code == 404


def _job_processes() -> list[int]:
    """This process's children running ``python -m rangeprof.service.execute`` (the worker's job
    processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if parent == os.getpid() and b"rangeprof.service.execute" in command:
            found.append(int(entry.name))
    return found


def test_a_killed_job_process_fails_its_run_through_its_worker(tmp_path):
    """SIGKILL of the job's process (out of memory, say) while the worker lives: its worker
    fails the run itself, saying so (not the sweep of jobs without a heartbeat, a minute later),
    and its scratch folder is gone."""
    with live_service("sqlite", tmp_path, Limits(), jobs=1) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        run = start_run(live.owner, model, random=str(Limits().max_samples))["id"]
        _wait(live.owner, f"/api/runs/{run}", "running")
        # A claimed job is ``running`` a moment before its process starts: wait for the process.
        (child,) = poll_until(_job_processes, 30, 0.05, "a job process starts")
        os.kill(child, signal.SIGKILL)
        failed = _wait(live.owner, f"/api/runs/{run}", "failed", timeout=30)
        assert failed["error"] == "the profiling process died (exit code -9)"
        assert list((live.storage / "tmp").iterdir()) == []


def test_a_starting_worker_removes_the_scratch_of_dead_processes(tmp_path):
    """Scratch folders are named by host and process: a worker starting up removes those whose
    process is gone (a killed server's), and no other."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    scratch = tmp_path / "blobs" / "tmp"  # the store live_service makes in tmp_path
    scratch.mkdir(parents=True)
    host = socket.gethostname()
    dead = scratch / f"{host}-{int(gone.stdout)}-abc123"
    live_one = scratch / f"{host}-{os.getpid()}-def456"
    other_host = scratch / f"elsewhere-{int(gone.stdout)}-ghi789"
    for folder in (dead, live_one, other_host):
        folder.mkdir()
        (folder / "partial.npz").write_bytes(b"half")
    with live_service("sqlite", tmp_path, Limits(), jobs=1) as live:
        assert live.owner.get("/api/health").status_code == 200  # started, worker included
        assert not dead.exists() and live_one.exists() and other_host.exists()
