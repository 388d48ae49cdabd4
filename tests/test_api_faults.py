"""The service under faults, through real HTTP: database connections killed under running jobs
(PostgreSQL), a busy worker killed, a full disk under the store and under the database, a model
deleted while a job of it is being created, a burst of jobs against the per-token queue limit,
every 405 with its ``Allow``, and two server processes on one database and storage."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from sqlalchemy import delete, func, select

from rangeprof.service.app import create_app
from rangeprof.service.auth import create_token
from rangeprof.service.db import Database
from rangeprof.service.jobs import Worker
from rangeprof.service.limits import Limits
from rangeprof.service.migrate import upgrade
from rangeprof.service.models import Model, Run, TensorStat
from rangeprof.service.storage import BlobStore

import onnx_builders as mb
from conftest import poll_until, zoo_model
from service_fixtures import (
    BACKENDS,
    Rangeprof,
    ThreadServer,
    client,
    connections_killed,
    connections_refused,
    database,
    free_port,
    live_service,
    npz_bytes,
    rangeprof,
    row_counts,
    serve,
    start_run,
    stored_files,
    upload_model,
    write_calib,
)

ENDED = ("done", "failed", "cancelled")


def _run(api: httpx.Client, run_id: int) -> dict | None:
    """The run, or ``None`` while the server answers 503 (the database away)."""
    response = api.get(f"/api/runs/{run_id}")
    if response.status_code == 503:
        return None
    assert response.status_code == 200, response.text
    return response.json()


def _ended(api: httpx.Client, run_id: int, timeout: float = 600) -> dict:
    def ended() -> dict | None:
        run = _run(api, run_id)
        return run if run and run["status"] in ENDED else None

    return poll_until(ended, timeout, 0.2, lambda: _run(api, run_id))


def test_runs_survive_database_connections_killed_every_half_second(tmp_path):
    """PostgreSQL terminates every connection of the service every half second for 20 s while
    three runs are in flight: the worker's reads, progress, heartbeats and results are retried,
    and the three runs end done."""
    with live_service("postgresql", tmp_path, Limits(), jobs=3) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        runs = [start_run(live.owner, model, random="3000")["id"] for _ in range(3)]
        seen = set()
        with connections_killed(live.url, 0.5) as kills:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                seen |= {(r, (_run(live.owner, r) or {}).get("status")) for r in runs}
                time.sleep(0.5)
        ended = [_ended(live.owner, run_id) for run_id in runs]
        assert sum(kills) > 20, kills  # connections were in fact killed under the jobs
        assert {(r, "running") for r in runs} <= seen  # each ran while they were
        assert [(r["status"], r["error"]) for r in ended] == [("done", None)] * 3


@contextmanager
def _outage(backend: str, url: str) -> Iterator[None]:
    """The database away (PostgreSQL: no connections; SQLite: locked by another writer)."""
    if backend == "postgresql":
        with connections_refused(url):
            yield
        return
    with sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None) as locker:
        locker.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            locker.execute("COMMIT")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_database_outage_fails_no_job(backend, tmp_path):
    """The database away for 8 s under a running job, with a second worker sweeping: the job's
    heartbeats are older than a dead worker's when it comes back, yet nobody sweeps it (both
    workers were cut off alike); it ends done at its first attempt."""
    with live_service(backend, tmp_path, Limits(), jobs=1) as live:
        db = Database(live.url)
        sweeper = Worker(db, BlobStore(live.storage), name="sweeper", jobs=0)
        sweeper.start()
        try:
            model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
            run_id = start_run(live.owner, model, random="3000")["id"]
            poll_until(lambda: _run(live.owner, run_id)["samples_done"] > 0, 120)
            with _outage(backend, live.url):
                time.sleep(8)
            run = _ended(live.owner, run_id)
        finally:
            sweeper.stop()
            db.dispose()
        assert (run["status"], run["error"]) == ("done", None)
        assert _db_run(live.url, run_id).attempts == 1


def _db_run(url: str, run_id: int) -> Run:
    db = Database(url)
    try:
        with db.read() as session:
            return session.get(Run, run_id)
    finally:
        db.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_busy_workers_run_is_queued_again_then_failed(backend, tmp_path):
    """Two workers each run a long job; one is killed: within 10 s the other's heartbeat thread
    queues its run again (its one retry), though that worker is busy. The worker that takes it
    next is killed too: within 10 s the run fails, its retries spent."""
    with database(backend, tmp_path) as url:
        rangeprof("db", "upgrade", "--db", url)
        token = rangeprof("token", "create", "me", "--db", url).strip()
        storage, port, log = tmp_path / "blobs", free_port(), tmp_path / "service.log"
        server = serve(url, storage, port, log, "--jobs", "0")
        workers: dict[str, Rangeprof] = {}

        def worker(name: str) -> None:
            args = ("worker", "--db", url, "--storage", str(storage), "--name", name)
            workers[name] = Rangeprof(log, *args)

        def running_on(run_id: int) -> str | None:
            run = _db_run(url, run_id)
            return run.worker if run.status == "running" and run.samples_done > 0 else None

        try:
            with client(f"http://127.0.0.1:{port}", token) as api:
                model = upload_model(api, zoo_model("digits_cnn")).json()["id"]
                worker("w1")
                worker("w2")
                long, other = (start_run(api, model, random="1000000")["id"] for _ in range(2))
                holder = poll_until(lambda: running_on(long), 120, what="the run makes progress")
                poll_until(lambda: running_on(other), 120, what="both workers are busy")
                workers[holder].kill()
                run = poll_until(
                    lambda: (r := _run(api, long))["status"] != "running" and r, 10, 0.1
                )
                assert (run["status"], run["progress"], run["error"]) == ("queued", 0, None)
                worker("w3")
                assert poll_until(lambda: running_on(long), 120, what="w3 takes the run") == "w3"
                assert _db_run(url, long).attempts == 2
                workers["w3"].kill()
                run = poll_until(
                    lambda: (r := _run(api, long))["status"] != "running" and r, 10, 0.1
                )
                assert run["status"] == "failed" and "no heartbeat" in run["error"], run
                assert running_on(other) not in (None, holder)  # the busy worker went on
                assert api.post(f"/api/runs/{other}/cancel").status_code == 200
        finally:
            for process in [server, *workers.values()]:
                process.kill()


@contextmanager
def _tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``folder`` (root in a sandbox that allows it; else skipped)."""
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def _fill(path: Path) -> None:
    """Write ``path`` until its disk is full."""
    with path.open("wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err


@contextmanager
def _service(url: str, storage: Path, jobs: int = 0) -> Iterator[httpx.Client]:
    """The app on a migrated database ``url`` and ``storage`` wherever the test puts them; a
    client with a token."""
    upgrade(url)
    db = Database(url)
    token = create_token(db, "owner")
    db.dispose()
    server = ThreadServer(create_app(url, storage=storage, jobs=jobs, worker_name="test"))
    try:
        with client(server.url, token) as api:
            yield api
    finally:
        server.stop()


def _refused_for_room(response: httpx.Response, what: str) -> None:
    assert response.status_code == 507, response.text
    assert response.json()["detail"] == (
        f"{what} is full: nothing was stored; retry once there is room"
    )


def test_uploads_to_a_full_store_are_507_and_leave_nothing(tmp_path):
    """The store's disk full: a model upload and a run's data upload are 507 with a JSON detail
    and leave no row and no file; once there is room, the same upload is stored."""
    url = f"sqlite:///{tmp_path / 'service.db'}"
    with _tmpfs(tmp_path / "disk", "1m") as disk, _service(url, disk / "blobs") as api:
        model = upload_model(api, zoo_model("digits_cnn")).json()["id"]
        calib = write_calib(tmp_path)
        filler = disk / "filler"
        _fill(filler)
        rows, files = row_counts(url), stored_files(disk / "blobs")
        _refused_for_room(upload_model(api, zoo_model("digits_cnn")), "the server's storage")
        data = {"data": (calib.name, calib.read_bytes())}
        _refused_for_room(api.post(f"/api/models/{model}/runs", files=data), "the server's storage")
        assert (row_counts(url), stored_files(disk / "blobs")) == (rows, files)
        filler.unlink()
        assert api.post(f"/api/models/{model}/runs", files=data).status_code == 202


def test_uploads_to_a_full_database_are_507_and_leave_nothing(tmp_path):
    """The database's disk full (SQLite): 507 naming the database (not 'unavailable'), no row,
    and the new blob the upload had put in the store removed."""
    storage = tmp_path / "blobs"
    with _tmpfs(tmp_path / "disk", "2m") as disk:
        url = f"sqlite:///{disk / 'service.db'}"
        with _service(url, storage) as api:
            assert upload_model(api, zoo_model("digits_cnn")).status_code == 201
            _fill(disk / "filler")
            rows, files = row_counts(url), stored_files(storage)
            other = mb.save(mb.conv_bias(), tmp_path, "conv.onnx")
            _refused_for_room(upload_model(api, other), "the database's disk")
            assert (row_counts(url), stored_files(storage)) == (rows, files)
            (disk / "filler").unlink()
            assert upload_model(api, other).status_code == 201


class _Records(logging.Handler):
    """The messages a logger emits, kept."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_run_whose_result_cannot_be_stored_fails_saying_so(tmp_path, monkeypatch):
    """The database's disk fills while a run is running: storing its profile is retried for
    ``RANGEPROF_DB_RETRY_S``, then the run fails saying why, with no half-stored profile; the
    failure is written once there is room again."""
    monkeypatch.setenv("RANGEPROF_DB_RETRY_S", "4")
    records = _Records()  # the retries' warnings
    logging.getLogger("rangeprof.service.db").addHandler(records)
    try:
        with _tmpfs(tmp_path / "disk", "16m") as disk:
            url = f"sqlite:///{disk / 'service.db'}"
            with _service(url, tmp_path / "blobs", jobs=1) as api:
                model = upload_model(api, zoo_model("digits_cnn")).json()["id"]
                run_id = start_run(api, model, random="3000")["id"]
                poll_until(lambda: _run(api, run_id)["samples_done"] > 0, 120, what="progress")
                _fill(disk / "filler")
                failing = f"failing run {run_id}"
                poll_until(  # the failure waits for room, unless it fits where the result failed
                    lambda: (
                        any(m.startswith(failing) for m in records.messages)
                        or _run(api, run_id)["status"] != "running"
                    ),
                    120,
                    what="the worker gives up storing the result",
                )
                (disk / "filler").unlink()
                run = _ended(api, run_id, 60)
                assert (run["status"], run["error"]) == (
                    "failed",
                    "its result could not be stored: the database's disk is full",
                )
                db = Database(url)
                try:
                    with db.read() as session:
                        stats = select(func.count()).where(TensorStat.run_id == run_id)
                        assert session.scalar(stats) == 0
                        assert session.get(Run, run_id).document is None
                finally:
                    db.dispose()
    finally:
        logging.getLogger("rangeprof.service.db").removeHandler(records)


@contextmanager
def _store_locked(storage: Path) -> Iterator[None]:
    """Hold the store's lock, as another server process would: a job being created waits for it
    after its checks, before its insert."""
    with (storage / "lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _created_while_deleted(live, path: str, model_id: int, **request) -> httpx.Response:
    """POST ``path`` (a job of model ``model_id``) and delete the model after the request's
    checks passed, before its insert (the model's row deleted as another process's delete
    would: the request waits for the store's lock meanwhile)."""
    scratch = live.storage / "tmp"
    with ThreadPoolExecutor(1) as pool, _store_locked(live.storage):
        before = set(scratch.iterdir())
        answer = pool.submit(live.owner.post, path, **request)
        poll_until(lambda: set(scratch.iterdir()) - before, 60, 0.02, "the upload is staged")
        db = Database(live.url)
        try:
            with db.session() as session:  # layers, runs and their jobs cascade
                session.execute(delete(Model).where(Model.id == model_id))
        finally:
            db.dispose()
    return answer.result()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_job_whose_model_is_deleted_while_it_is_created_is_409(backend, tmp_path):
    """A model deleted while its run or evaluation is being created: 409, no row, no file of
    the request; a delete racing a create through the API leaves either order, never a 5xx."""
    conv = mb.save(mb.conv_bias(), tmp_path, "conv.onnx")
    data = {"data": ("conv.npz", npz_bytes(x=np.ones((4, 3, 6, 6), np.float32)))}
    with live_service(backend, tmp_path, Limits(), jobs=1) as live:
        done = upload_model(live.owner, conv).json()["id"]
        run = start_run(live.owner, done, random="4")["id"]
        assert _ended(live.owner, run, 300)["status"] == "done"
        model = upload_model(live.owner, conv).json()["id"]
        rows = row_counts(live.url)
        for path, model_id in (
            (f"/api/models/{model}/runs", model),
            (f"/api/runs/{run}/evaluations", done),
        ):
            files = stored_files(live.storage)
            response = _created_while_deleted(live, path, model_id, files=data)
            assert response.status_code == 409, response.text
            assert response.json()["detail"] == (
                "what this request refers to was deleted meanwhile: nothing was stored"
            )
            assert row_counts(live.url)["evaluation"] == rows["evaluation"]
            assert stored_files(live.storage) == files  # the uploaded data's blob too
        assert row_counts(live.url)["run"] == rows["run"] - 1  # the deleted model's
        for _ in range(3):
            model = upload_model(live.owner, conv).json()["id"]
            runs = f"/api/models/{model}/runs"
            with ThreadPoolExecutor(2) as pool, _store_locked(live.storage):
                create = pool.submit(live.owner.post, runs, data={"random": "4"})
                remove = pool.submit(live.owner.delete, f"/api/models/{model}")
                time.sleep(0.2)  # both requests reach the lock (or not: either way is valid)
            statuses = (create.result().status_code, remove.result().status_code)
            assert statuses in ((202, 204), (409, 204), (404, 204)), create.result().text
            assert live.owner.get(runs).status_code == 404


def test_every_405_has_an_allow_header_listing_the_paths_methods(tmp_path):
    with live_service("sqlite", tmp_path, Limits(), jobs=0) as live:
        paths = live.owner.get("/openapi.json").json()["paths"]
        for template, operations in paths.items():
            methods = sorted(m.upper() for m in operations)
            path = template.format_map(_Ones())
            for method in {"PUT", "PATCH", "DELETE", "POST"} - set(methods):
                response = live.owner.request(method, path)
                assert response.status_code == 405, (method, path)
                assert response.headers["allow"] == ", ".join(methods), (method, path)
                assert response.json() == {"detail": "Method Not Allowed"}


class _Ones(dict):
    """Every path parameter 1."""

    def __missing__(self, key: str) -> str:
        return "1"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_burst_of_jobs_queues_exactly_the_per_token_limit(backend, tmp_path):
    """50 runs of random samples at once: exactly 16 queued (the limit), the others 429 — none
    503, though the server takes 8 uploads at a time: these carry no file."""
    with live_service(backend, tmp_path, Limits(max_queued_per_token=16), jobs=0) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        token = live.owner.headers["authorization"].split()[1]
        clients = [client(str(live.owner.base_url), token) for _ in range(50)]
        start = threading.Barrier(len(clients))

        def post(api: httpx.Client) -> int:
            start.wait()
            return api.post(f"/api/models/{model}/runs", data={"random": "16"}).status_code

        try:
            with ThreadPoolExecutor(len(clients)) as pool:
                statuses = list(pool.map(post, clients))
        finally:
            for api in clients:
                api.close()
        assert sorted(statuses) == [202] * 16 + [429] * 34, statuses
        runs = live.owner.get(f"/api/models/{model}/runs").json()
        assert [r["status"] for r in runs] == ["queued"] * 16


def test_two_server_processes_share_one_database_and_storage(tmp_path):
    """``rangeprof serve --workers 2``: two processes answer on one port; jobs run in both
    processes' workers; uploads and deletes of the same bytes racing across the processes never
    leave a model without its file; SIGTERM stops both."""
    with database("sqlite", tmp_path) as url:
        rangeprof("db", "upgrade", "--db", url)
        token = rangeprof("token", "create", "me", "--db", url).strip()
        storage, port, log = tmp_path / "blobs", free_port(), tmp_path / "service.log"
        server = serve(url, storage, port, log, "--jobs", "1", "--workers", "2")
        try:
            processes = poll_until(lambda: len(_servers(server)) == 2 and _servers(server), 60)
            with client(f"http://127.0.0.1:{port}", token) as api:
                conv = mb.save(mb.conv_bias(), tmp_path, "conv.onnx")
                kept = upload_model(api, conv).json()
                runs = [start_run(api, kept["id"], random="64")["id"] for _ in range(4)]
                _race_uploads_and_deletes(api, conv)
                ended = [_ended(api, run_id, 300) for run_id in runs]
                assert [r["status"] for r in ended] == ["done"] * 4, ended
                for model in api.get("/api/models").json():
                    blob = storage / model["sha256"][:2] / f"{model['sha256']}.onnx"
                    assert blob.is_file(), model
            names = {_db_run(url, run_id).worker for run_id in runs}
            assert names <= {f"serve@{socket.gethostname()}:{port}/{pid}" for pid in processes}
        finally:
            code = server.stop()
        assert code in (0, -signal.SIGTERM), log.read_text()


def _servers(server: Rangeprof) -> list[int]:
    """The server processes of ``serve --workers N`` (started by multiprocessing's spawn)."""
    return server.children_running(b"spawn_main")


def _race_uploads_and_deletes(api: httpx.Client, model: Path) -> None:
    """Rounds of: a model of these bytes deleted while another of the same bytes is uploaded
    (each request to whichever process takes it): the upload that is answered 201 has its
    file."""
    for _ in range(6):
        doomed = upload_model(api, model).json()["id"]
        with ThreadPoolExecutor(2) as pool:
            upload = pool.submit(upload_model, api, model)
            remove = pool.submit(api.delete, f"/api/models/{doomed}")
        assert (upload.result().status_code, remove.result().status_code) == (201, 204)
        sha256 = upload.result().json()["sha256"]
        assert api.get(f"/api/models/{upload.result().json()['id']}").status_code == 200
        assert sha256 == hashlib.sha256(model.read_bytes()).hexdigest()
