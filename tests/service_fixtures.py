"""Helpers for the service tests: a fresh database on either backend, live servers (in a thread
or a process), small uploads, and the observable state (rows, stored files) that bad input must
leave untouched."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psycopg
import pytest
import uvicorn
from sqlalchemy import create_engine, func, select
from typer.testing import CliRunner

from rangeprof.cli import app as cli
from rangeprof.service.app import create_app
from rangeprof.service.auth import create_token
from rangeprof.service.db import Database
from rangeprof.service.limits import Limits
from rangeprof.service.migrate import upgrade
from rangeprof.service.models import Base

from conftest import BACKENDS as BACKENDS  # defined there for its hook; tests import it here
from conftest import SHARED, poll_until

# PostgreSQL of the test machines and CI: trust auth, an existing database to connect to.
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"
DIGITS = SHARED / "data" / "digits.npz"


@contextmanager
def database(backend: str, folder: Path) -> Iterator[str]:
    """The URL of an empty database of its own; a PostgreSQL one is dropped afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'service.db'}"
        return
    name = f"rangeprof_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as err:
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN}: {err}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"postgresql://postgres@127.0.0.1:5432/{name}"
        finally:
            admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def rangeprof(*args: str) -> str:
    """Run a CLI command in this process; return its stdout (it must succeed)."""
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def row_counts(url: str) -> dict[str, int]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as connection:
            return {
                name: connection.scalar(select(func.count()).select_from(table))
                for name, table in Base.metadata.tables.items()
            }
    finally:
        engine.dispose()


def stored_files(root: Path) -> list[str]:
    """Every file and folder in the blob store, scratch folders included."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving ``app`` on a loopback port, in a thread of this process."""

    def __init__(self, app):
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        poll_until(
            lambda: self.server.started or not self.thread.is_alive(), 30, 0.05, "server starts"
        )
        assert self.server.started, "server did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


class Rangeprof:
    """A ``rangeprof`` command (``serve``, ``worker``) in a process of its own, so that it can
    be killed; its output goes to ``log``."""

    def __init__(self, log: Path, *args: str):
        with log.open("a") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "rangeprof", *args], stdout=out, stderr=subprocess.STDOUT
            )
        self.log = log

    def children(self) -> list[int]:
        """Processes it started (profiling runs)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid:
                found.append(int(stat.parent.name))
        return found

    def children_running(self, marker: bytes) -> list[int]:
        """Its child processes whose command line holds ``marker``."""
        found = []
        for pid in self.children():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if marker in command:
                found.append(pid)
        return found

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(timeout=60)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rss(pid: int) -> int:
    """The resident memory of ``pid`` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@dataclass
class Peak:
    """The resident memory of a process before and at its highest while watched."""

    baseline: int
    peak: int

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


@contextmanager
def _in_background(work: Callable[[threading.Event], None]) -> Iterator[None]:
    """``work(stop)`` in a thread of its own while the block runs; ``stop`` is set at its end."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextmanager
def rss_peak(pid: int) -> Iterator[Peak]:
    """Samples ``pid``'s resident memory every 10 ms while the block runs."""
    seen = Peak(rss(pid), rss(pid))

    def sample(stop: threading.Event) -> None:
        while not stop.wait(0.01):
            seen.peak = max(seen.peak, rss(pid))

    with _in_background(sample):
        yield seen


@contextmanager
def connections_killed(url: str, every: float) -> Iterator[list[int]]:
    """PostgreSQL terminates every connection to ``url``'s database each ``every`` seconds
    while the block runs; yields how many it killed each time."""
    name = url.rsplit("/", 1)[1]
    kills = []

    def kill(stop: threading.Event) -> None:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            while not stop.wait(every):
                killed = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = %s AND pid <> pg_backend_pid()",
                    (name,),
                ).fetchone()[0]
                kills.append(killed)

    with _in_background(kill):
        yield kills


@contextmanager
def connections_refused(url: str) -> Iterator[None]:
    """PostgreSQL takes no connection to ``url``'s database (those open are ended) while the
    block runs."""
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        try:
            yield
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


def serve(url: str, storage: Path, port: int, log: Path, *options: str) -> Rangeprof:
    """``rangeprof serve``, once it answers."""
    args = ["serve", "--db", url, "--port", str(port), "--storage", str(storage), *options]
    server = Rangeprof(log, *args)

    def healthy() -> bool:
        assert server.process.poll() is None, log.read_text()
        try:
            return httpx.get(f"http://127.0.0.1:{port}/api/health").status_code == 200
        except httpx.TransportError:
            return False

    poll_until(healthy, 60, what="server starts")
    return server


def client(base_url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=base_url, headers=headers, timeout=60)


@dataclass
class Live:
    """A running service and clients for two tokens and for no token."""

    url: str  # of the database
    storage: Path
    owner: httpx.Client
    stranger: httpx.Client
    anonymous: httpx.Client


@contextmanager
def live_service(backend: str, folder: Path, limits: Limits, jobs: int = 2) -> Iterator[Live]:
    """A fresh migrated database and the app on it, with a ``jobs``-slot in-process worker."""
    with database(backend, folder) as url:
        upgrade(url)
        db = Database(url)
        owner, stranger = (create_token(db, name) for name in ("owner", "stranger"))
        db.dispose()
        storage = folder / "blobs"
        app = create_app(url, storage=storage, jobs=jobs, worker_name="test", limits=limits)
        server = ThreadServer(app)
        clients = [client(server.url, token) for token in (owner, stranger, None)]
        try:
            yield Live(url, storage, *clients)
        finally:
            for c in clients:
                c.close()
            server.stop()


def wait_for_run(api: httpx.Client, run_id: int, timeout: float = 120) -> dict:
    def ended() -> dict | None:
        run = api.get(f"/api/runs/{run_id}").json()
        return run if run["status"] in ("done", "failed", "cancelled") else None

    return poll_until(ended, timeout, 0.2, lambda: api.get(f"/api/runs/{run_id}").json())


def npz_bytes(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def write_calib(folder: Path, name: str = "calib.npz", start: int = 0, count: int = 16) -> Path:
    """``count`` digits calibration samples as an .npz, under digits_cnn's input name ``image``
    (what a run without a key takes) and as ``calib`` (what ``FILE.npz:calib`` names)."""
    path = folder / name
    samples = np.load(DIGITS)["calib"][start : start + count]
    np.savez(path, image=samples, calib=samples)
    return path


def upload_model(api: httpx.Client, path: Path, **form) -> httpx.Response:
    return api.post("/api/models", files={"file": (path.name, path.read_bytes())}, data=form)


def start_run(api: httpx.Client, model_id: int, data: Path | None = None, **form) -> dict:
    files = {"data": (data.name, data.read_bytes())} if data else None
    response = api.post(f"/api/models/{model_id}/runs", files=files, data=form)
    assert response.status_code == 202, response.text
    return response.json()


def cli_profile(model: Path, data: str, out: Path, *options: str) -> dict:
    rangeprof("profile", str(model), "--data", data, "--out", str(out), *options)
    return json.loads(out.read_text())


def same_document(served: dict, written: dict) -> None:
    """Equal as JSON text, except the run facts that differ between any two runs."""
    per_run = ("timings", "build_cache", "data")

    def text(doc: dict) -> str:
        run = {k: v for k, v in doc["run"].items() if k not in per_run}
        return json.dumps({**doc, "run": run})

    assert list(served) == list(written)
    assert list(served["run"]) == list(written["run"])
    assert text(served) == text(written)


def environment_with(**values: str) -> dict[str, str]:
    return {**os.environ, **values}
