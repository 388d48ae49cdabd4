"""The worker: takes queued jobs from the database and executes them off the request path.

Jobs are profiling runs (``run`` rows), evaluations (``evaluation`` rows) and INT8 builds (``build``
rows), taken in that order. The worker runs inside the server (``rangeprof serve``, ``--jobs``
slots) or on its own (``rangeprof worker``), any number of them on one database. Each slot thread
claims a queued job with an atomic ``UPDATE ... WHERE status = 'queued'`` (two workers never get the
same job), executes it in a child process (:mod:`rangeprof.service.execute`), writes its progress
and a heartbeat to the job's row at most every half second, and stores the result (the profile, the
evaluation report, the build's artifact and manifest) when it is done.

No job stays ``running`` forever. A worker starting up fails the jobs it held before a crash
(its name is the same: ``serve@HOST:PORT`` for the server's own worker) with "server stopped
while the run was running", and every worker fails jobs whose heartbeat is older than
``stale_after_s`` (their worker is gone). Stopping a worker stops its jobs the same way. A
worker whose job was deleted, or failed by another worker meanwhile, stops the child.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select, update

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.settings import settings

from . import catalog, execute
from .catalog import DATA_SUFFIX, MODEL_SUFFIX
from .db import Database
from .documents import load_profile, store_profile
from .job_requests import CALIBRATION_FOLDER
from .limits import DEFAULT_LIMITS
from .migrate import open_database
from .models import Build, Evaluation, Model, QParamsSet, Run, utcnow
from .storage import BlobStore, storage_root
from .uploads import split_spec

STOPPED = "server stopped while the run was running"
_WRITE_EVERY_S = 0.5
# What a worker executes, in the order it looks for queued jobs.
Table = type[Run] | type[Evaluation] | type[Build]
_TABLES: tuple[Table, ...] = (Run, Evaluation, Build)
_PROCESS = {Run: "profiling", Evaluation: "evaluation", Build: "build"}
log = logging.getLogger("rangeprof.worker")


def default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ray_setting() -> dict | None:
    """How profiling runs execute: on the Ray cluster that ``RANGEPROF_RAY`` names (``local``:
    one started on this machine for each run) with ``RANGEPROF_RAY_WORKERS`` workers (default
    2), or, unset, in the job's own process. A bad value or a missing ray package fails now, when
    the worker starts, rather than run after run."""
    current = settings()
    if not current.ray:
        return None
    from rangeprof.profiler.profiling.distributed import (
        require_ray,  # here: it brings TVM, which only runs need
    )

    require_ray()
    return {"address": current.ray, "workers": current.ray_workers}


CANCELLED = "cancelled by its owner"


class NotCancellable(RangeprofError):
    """The job has ended already."""


def mark_cancelled(job: Run | Evaluation | Build) -> None:
    """End a queued or running job as ``cancelled``. No worker claims it then, and the worker
    running it finds its row no longer running at its next heartbeat: it stops the process and
    removes its scratch folder (``_Lost``)."""
    if job.status not in ("queued", "running"):
        raise NotCancellable(f"{job.__tablename__} {job.id} is {job.status}: nothing to cancel")
    job.status, job.error, job.finished_at = "cancelled", CANCELLED, utcnow()


def cancel_job(db: Database, kind: str, job_id: int) -> None:
    """``rangeprof cancel KIND ID``: cancel any job on this database (the server's operator)."""
    table = next((t for t in _TABLES if t.__tablename__ == kind), None)
    if table is None:
        kinds = ", ".join(t.__tablename__ for t in _TABLES)
        raise NotCancellable(f"unknown job kind {kind!r}; use {kinds}")
    with db.session() as session:
        job = session.get(table, job_id)
        if job is None:
            raise NotCancellable(f"no {kind} {job_id}")
        mark_cancelled(job)


class _Lost(Exception):
    """The job is no longer ours (deleted, or failed by another worker)."""


class Worker:
    """Slot threads that claim queued jobs, run each in a child process and relay its progress;
    the sweep of jobs whose worker is gone. A job's folder is laid out by :class:`_Layout`, its
    row written by :class:`_Rows`."""

    def __init__(
        self,
        db: Database,
        store: BlobStore,
        *,
        name: str | None = None,
        jobs: int = 1,
        poll_s: float = 1.0,
        heartbeat_s: float = 5.0,
        stale_after_s: float = 60.0,
        time_limit_s: float = DEFAULT_LIMITS.max_job_seconds,
    ):
        self.db, self.store = db, store
        self.time_limit_s = time_limit_s
        self.name = name or default_name()
        self.jobs, self.poll_s = jobs, poll_s
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_recovery = 0.0
        self.ray = ray_setting()
        self._layout = _Layout(db, store, self.ray)
        self._rows = _Rows(db, store, self.name)

    def start(self) -> None:
        self.recover(own=True)
        for folder in self.store.reap_scratch():
            log.info("removed %s, left by a process that is gone", folder.name)
        for slot in range(self.jobs):
            thread = threading.Thread(target=self._slot, name=f"{self.name}/{slot}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        """A job was queued: look now rather than at the next poll."""
        self._wake.set()

    def stop(self) -> None:
        """Stop every slot; jobs in progress are failed with :data:`STOPPED`."""
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def recover(self, own: bool = False) -> int:
        """Fail jobs whose worker is gone; with ``own``, also those this worker held before."""
        now = utcnow()
        self._last_recovery = time.monotonic()
        failed = []
        with self.db.session() as session:
            for table in _TABLES:
                stale = table.heartbeat_at < now - timedelta(seconds=self.stale_after_s)
                reasons = [(stale, f"its worker sent no heartbeat for {self.stale_after_s:g} s")]
                if own:
                    reasons.insert(0, (table.worker == self.name, STOPPED))
                for gone, reason in reasons:
                    ids = session.scalars(
                        update(table)
                        .where(table.status == "running", gone)
                        .values(status="failed", error=reason, finished_at=now)
                        .returning(table.id)
                    ).all()
                    failed += [(table.__tablename__, job_id) for job_id in ids]
        for kind, job_id in failed:
            log.warning("%s %s failed: its worker is gone", kind, job_id)
        return len(failed)

    def claim(self, table: Table = Run) -> int | None:
        """Take the oldest queued job of ``table``; ``None`` when there is none."""
        with self.db.session() as session:
            queued = select(table.id).where(table.status == "queued").order_by(table.id).limit(8)
            candidates = list(session.scalars(queued))
        for job_id in candidates:
            now = utcnow()
            with self.db.session() as session:
                taken = session.execute(
                    update(table)
                    .where(table.id == job_id, table.status == "queued")
                    .values(status="running", worker=self.name, started_at=now, heartbeat_at=now)
                ).rowcount
            if taken:
                return job_id
        return None

    def _next(self) -> tuple[Table, int] | None:
        for table in _TABLES:
            job_id = self.claim(table)
            if job_id is not None:
                return table, job_id
        return None

    def _slot(self) -> None:
        while not self._stopping.is_set():
            try:
                if time.monotonic() - self._last_recovery > self.heartbeat_s:
                    self.recover()
                job = self._next()
                if job is None:
                    self._wake.wait(self.poll_s)
                    self._wake.clear()
                    continue
                self._execute(*job)
            except Exception:  # a database hiccup must not end the slot
                log.exception("worker slot error")
                self._stopping.wait(self.poll_s)

    def _execute(self, table: Table, job_id: int) -> None:
        kind = table.__tablename__
        log.info("%s %s started", kind, job_id)
        try:
            with self.store.scratch() as folder:
                child = execute.start(self._layout.job(table, job_id, folder), folder)
                outcome = self._supervise(table, job_id, child)
                if "done" in outcome:  # stored from the folder: a build's artifact is there
                    self._rows.done(table, job_id, outcome["done"], folder)
                    return
        except _Lost:
            log.info("%s %s was deleted or taken over; stopped", kind, job_id)
            return
        except Exception as err:
            log.exception("%s %s", kind, job_id)
            outcome = {"failed": f"internal error: {type(err).__name__}: {err}"}
        self._rows.fail(table, job_id, outcome["failed"])

    def _supervise(self, table: Table, job_id: int, child: subprocess.Popen) -> dict:
        """Relay the child's progress to the job's row until it answers, dies or is stopped."""
        answers: queue.Queue[dict | None] = queue.Queue()

        def read() -> None:
            try:
                with child.stdout:
                    for line in child.stdout:
                        answers.put(json.loads(line))
            finally:
                answers.put(None)  # end of answers: the child is gone

        threading.Thread(target=read, daemon=True).start()
        progress, written, last_write = {"progress": [0, None]}, None, 0.0
        deadline = time.monotonic() + self.time_limit_s
        try:
            while not self._stopping.is_set():
                if time.monotonic() > deadline:
                    limit = f"{self.time_limit_s:g} s"
                    return {"failed": f"stopped at this server's time limit for a job, {limit}"}
                try:
                    answer = answers.get(timeout=_WRITE_EVERY_S)
                except queue.Empty:
                    answer = {}
                if answer is None:
                    code = child.wait()
                    return {"failed": f"the {_PROCESS[table]} process died (exit code {code})"}
                if "progress" in answer:
                    progress = answer
                elif answer:
                    return answer
                # Progress at most every half second; otherwise a heartbeat now and then.
                now = time.monotonic()
                pause = _WRITE_EVERY_S if progress != written else self.heartbeat_s
                if now - last_write >= pause:
                    self._rows.progress(table, job_id, progress)
                    written, last_write = progress, now
            return {"failed": STOPPED}
        finally:
            child.kill()
            child.wait()
            child.stdin.close()


class _Layout:
    """Lays out a job's scratch folder for its child process: the model and the data linked from
    the store under the file names the request gives, the profile or qparams document written
    out; gives the job the child executes."""

    def __init__(self, db: Database, store: BlobStore, ray: dict | None):
        self.db, self.store, self.ray = db, store, ray

    def job(self, table: Table, job_id: int, folder: Path) -> execute.Job:
        prepare = {Run: self._run_job, Evaluation: self._eval_job, Build: self._build_job}[table]
        return prepare(job_id, folder)

    def _link_model(self, model: Model, folder: Path, name: Path) -> None:
        (folder / name).symlink_to(self.store.path(model.sha256, MODEL_SUFFIX))

    def _link_data(self, folder: Path, spec: str | None, sha256: str | None) -> None:
        """Link the stored .npz ``sha256`` under the file name of the data option ``spec``."""
        if sha256:
            (folder / split_spec(spec)[0]).symlink_to(self.store.path(sha256, DATA_SUFFIX))

    def _link_evaluation_data(self, folder: Path, job: Evaluation | Build) -> None:
        # Labels first: when data and labels are one file, both links would have its name.
        self._link_data(folder, job.request.labels, job.labels_sha256)
        if job.labels_sha256 != job.data_sha256:
            self._link_data(folder, job.request.data, job.data_sha256)

    def _link_calibration(self, folder: Path, job: Evaluation | Build, run: Run) -> None:
        """The run's calibration data, where a bias-corrected job's request names it."""
        spec = job.request.calibration_data
        if spec is not None:  # bias correction 'measured'
            (folder / CALIBRATION_FOLDER).mkdir()
            self._link_data(folder, spec, run.data_sha256)

    def _run_job(self, run_id: int, folder: Path) -> execute.Job:
        with self.db.session() as session:
            run = session.get(Run, run_id)
            model = session.get(Model, run.model_id)
        self._link_model(model, folder, run.request.model)
        self._link_data(folder, run.request.data, run.data_sha256)
        return execute.Job(execute.PROFILE, run.request.model_dump(mode="json"), ray=self.ray)

    def _eval_job(self, evaluation_id: int, folder: Path) -> execute.Job:
        with self.db.session() as session:
            evaluation = session.get(Evaluation, evaluation_id)
            run = session.get(Run, evaluation.run_id)
            model = session.get(Model, run.model_id)
            profile = load_profile(session, run)
        request = evaluation.request
        self._link_model(model, folder, request.model)
        self._link_evaluation_data(folder, evaluation)
        self._link_calibration(folder, evaluation, run)
        (folder / request.profile).write_text(json.dumps(profile))
        return execute.Job(execute.EVALUATE, request.model_dump(mode="json"))

    def _build_job(self, build_id: int, folder: Path) -> execute.Job:
        with self.db.session() as session:
            build = session.get(Build, build_id)
            model = session.get(Model, build.model_id)
            request = build.request
            if request.qparams is not None:
                qparams = session.get(QParamsSet, build.qparams_id).document
                (folder / request.qparams).write_text(json.dumps(qparams))
            else:
                profile = load_profile(session, session.get(Run, build.run_id))
                (folder / request.profile).write_text(json.dumps(profile))
            run = session.get(Run, build.run_id) if build.run_id is not None else None
        self._link_model(model, folder, request.model)
        self._link_evaluation_data(folder, build)
        if run is not None:
            self._link_calibration(folder, build, run)
        return execute.Job(execute.BUILD, request.model_dump(mode="json"))


class _Rows:
    """A worker's writes to the rows of the jobs it holds: progress and heartbeats, the result,
    the failure. Each applies only while the row is running under the worker's name; a progress
    write that finds it otherwise raises :class:`_Lost`."""

    def __init__(self, db: Database, store: BlobStore, name: str):
        self.db, self.store, self.name = db, store, name

    def _mine(self, table: Table, job_id: int):
        return update(table).where(
            table.id == job_id, table.status == "running", table.worker == self.name
        )

    def progress(self, table: Table, job_id: int, answer: dict) -> None:
        done, total = answer["progress"]
        values = {"heartbeat_at": utcnow()}
        if table is Run:
            values |= {"samples_done": done, "samples_total": total}
        else:
            values["phase"] = answer.get("phase")
        if total:
            values["progress"] = done / total
        with self.db.session() as session:
            if not session.execute(self._mine(table, job_id).values(**values)).rowcount:
                raise _Lost

    def done(self, table: Table, job_id: int, result: dict, folder: Path) -> None:
        """Stores the job's result (a build's artifact from ``folder``) and marks it done."""
        kind = table.__tablename__
        if table is Build:
            self._store_build(job_id, result, folder)
            return
        with self.db.session() as session:
            finished = {"status": "done", "progress": 1.0, "finished_at": utcnow()}
            if table is Run:
                samples = result["run"]["samples"]
                finished |= {
                    "samples_done": samples,
                    "samples_total": samples,
                    "timings": result["run"]["timings"],
                }
            else:
                finished |= {"phase": None, "report": result}
            if not session.execute(self._mine(table, job_id).values(**finished)).rowcount:
                log.info("%s %s was deleted or taken over; result dropped", kind, job_id)
                return
            if table is Run:
                store_profile(session, session.get(Run, job_id), result)
        log.info("%s %s done", kind, job_id)

    def _store_build(self, build_id: int, result: dict, folder: Path) -> None:
        sha256 = result["sha256"]
        finished = {
            "status": "done",
            "progress": 1.0,
            "phase": None,
            "finished_at": utcnow(),
            "artifact_sha256": sha256,
            "manifest": result["manifest"],
            "timings": result["timings"],
        }

        def finish(session) -> bool:
            return bool(session.execute(self._mine(Build, build_id).values(**finished)).rowcount)

        staged = folder / execute.ARTIFACT
        if catalog.add_artifact(self.db, self.store, staged, sha256, finish):
            log.info("build %s done", build_id)
        else:
            log.info("build %s was deleted or taken over; result dropped", build_id)

    def fail(self, table: Table, job_id: int, error: str) -> None:
        with self.db.session() as session:
            session.execute(
                self._mine(table, job_id).values(status="failed", error=error, finished_at=utcnow())
            )
        log.info("%s %s failed: %s", table.__tablename__, job_id, error)


def run_worker(db_url: str | None, storage: str | None, *, jobs: int, name: str | None) -> None:
    """``rangeprof worker``: execute queued jobs until SIGINT or SIGTERM."""
    db = open_database(db_url)
    worker = Worker(db, BlobStore(storage_root(db.url, storage)), name=name, jobs=jobs)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    worker.start()
    log.info("worker %s: %d slot(s) on %s", worker.name, jobs, db.engine.url)
    stop.wait()
    worker.stop()
    db.dispose()
