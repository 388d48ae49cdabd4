"""The worker: takes queued jobs from the database and executes them off the request path.

Jobs are profiling runs (``run`` rows), evaluations (``evaluation`` rows) and INT8 builds (``build``
rows), taken in that order. The worker runs inside the server (``rangeprof serve``, ``--jobs``
slots in each server process) or on its own (``rangeprof worker``), any number of them on one
database. Each slot thread claims a queued job with an atomic ``UPDATE ... WHERE status =
'queued'`` (two workers never get the same job), executes it in a child process
(:mod:`rangeprof.service.execute`) and stores the result (the profile, the evaluation report, the
build's artifact and manifest) when it is done. The worker's heartbeat thread writes the progress
of the jobs it holds at most every half second and a heartbeat every ``heartbeat_s``, whatever
the slots are doing.

Database hiccups do not fail jobs: every read and write of the worker is retried, with backoff,
while its error can pass (a lost connection, a serialization failure, a locked SQLite, a full
disk) for ``RANGEPROF_DB_RETRY_S``; a job fails for its own error, or when its result cannot be
stored past that, saying why.

No job stays ``running`` forever. A worker starting up fails the jobs it held before a crash
(its name is the same: ``serve@HOST:PORT`` for the server's own worker) with "server stopped
while the run was running"; stopping a worker stops its jobs the same way. The heartbeat thread
of every worker sweeps jobs whose heartbeat is older than ``stale_after_s`` (their worker died):
each is queued again while it has retries left (``RANGEPROF_JOB_RETRIES``, default 1: every job
here is idempotent), then failed; with the defaults within 8 s of the death. A worker whose job
was deleted, cancelled, or swept meanwhile stops the child at its next heartbeat.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from sqlalchemy import and_, case, or_, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.settings import settings

from . import catalog, execute
from .catalog import DATA_SUFFIX, MODEL_SUFFIX
from .db import Database, disk_full
from .documents import load_profile, store_profile
from .job_requests import CALIBRATION_FOLDER
from .limits import DEFAULT_LIMITS
from .migrate import open_database
from .models import Build, Evaluation, Model, QParamsSet, Run, utcnow
from .settings import settings as service_settings
from .storage import BlobStore, out_of_space, storage_root
from .uploads import split_spec

STOPPED = "server stopped while the run was running"
_WRITE_EVERY_S = 0.5  # progress at most this often; the heartbeat thread's tick
# A heartbeat every second; a job whose heartbeat is 6 s old has lost its worker. A sweep every
# second then finds a dead worker's jobs within 8 s of its last heartbeat.
HEARTBEAT_S, STALE_AFTER_S = 1.0, 6.0
# What a worker executes, in the order it looks for queued jobs.
Table = type[Run] | type[Evaluation] | type[Build]
_TABLES: tuple[Table, ...] = (Run, Evaluation, Build)
_PROCESS = {Run: "profiling", Evaluation: "evaluation", Build: "build"}
Row = TypeVar("Row")
T = TypeVar("T")
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
    """The job is no longer ours (deleted, cancelled, or failed or queued again by another
    worker)."""


class _Held:
    """A job a slot executes, as the heartbeat thread sees it: the latest progress its process
    reported, what was last written of it and when, and whether the job is no longer ours."""

    def __init__(self, table: Table, job_id: int):
        self.table, self.id = table, job_id
        self.progress: dict = {"progress": [0, None]}  # replaced whole by the slot: no lock
        self.written: dict | None = None
        self.written_at = 0.0
        self.lost = threading.Event()


class Worker:
    """Slot threads that claim queued jobs, run each in a child process and relay its progress;
    a heartbeat thread that writes the progress and heartbeats of the jobs held and sweeps the
    jobs of workers that are gone. A job's folder is laid out by :class:`_Layout`, its row
    written by :class:`_Rows`; every database access is retried while its error can pass
    (:meth:`Database.retried`)."""

    def __init__(
        self,
        db: Database,
        store: BlobStore,
        *,
        name: str | None = None,
        jobs: int = 1,
        poll_s: float = 1.0,
        heartbeat_s: float = HEARTBEAT_S,
        stale_after_s: float = STALE_AFTER_S,
        time_limit_s: float = DEFAULT_LIMITS.max_job_seconds,
        retries: int | None = None,
    ):
        self.db, self.store = db, store
        self.time_limit_s = time_limit_s
        self.name = name or default_name()
        self.jobs, self.poll_s = jobs, poll_s
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.retries = service_settings().job_retries if retries is None else retries
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._held: dict[tuple[str, int], _Held] = {}
        self._held_lock = threading.Lock()
        self.ray = ray_setting()
        self._layout = _Layout(db, store, self.ray, self._stopping)
        self._rows = _Rows(db, store, self.name, self._stopping)

    def start(self) -> None:
        self.db.retried(lambda: self.recover(own=True), "recovering jobs")
        for folder in self.store.reap_scratch():
            log.info("removed %s, left by a process that is gone", folder.name)
        threads = [(self._beat, f"{self.name}/heartbeat")]
        threads += [(self._slot, f"{self.name}/{slot}") for slot in range(self.jobs)]
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
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
        """Queue again the jobs whose heartbeat is older than ``stale_after_s`` (their worker
        is gone) while they have retries left, and fail the others; with ``own``, fail those
        this worker held before it started (:data:`STOPPED`). Running jobs from before attempts
        were counted have none left."""
        now = utcnow()
        stale_before = now - timedelta(seconds=self.stale_after_s)
        gone = f"its worker sent no heartbeat for {self.stale_after_s:g} s"
        ended = []
        with self.db.session() as session:
            for table in _TABLES:
                running = table.status == "running"
                if own:
                    mine = update(table).where(running, table.worker == self.name)
                    stopped = mine.values(status="failed", error=STOPPED, finished_at=now)
                    ended += [(table, i, "failed") for i in _ids(session, stopped, table)]
                stale = update(table).where(running, table.heartbeat_at < stale_before)
                again = stale.where(table.attempts.between(1, self.retries))
                again = again.values(**_queued_again(table))
                ended += [(table, i, "queued again") for i in _ids(session, again, table)]
                failed = stale.values(status="failed", error=gone, finished_at=now)
                ended += [(table, i, "failed") for i in _ids(session, failed, table)]
        for table, job_id, fate in ended:
            log.warning("%s %s %s: its worker is gone", table.__tablename__, job_id, fate)
        return len(ended)

    def claim(self, table: Table = Run) -> int | None:
        """Take the oldest queued job of ``table``; ``None`` when there is none."""

        def queued() -> list[int]:
            with self.db.read() as session:
                query = select(table.id).where(table.status == "queued").order_by(table.id)
                return list(session.scalars(query.limit(8)))

        for job_id in self.db.retried(queued, "looking for jobs", self._stopping):
            take = functools.partial(self._take, table, job_id, utcnow())
            what = f"claiming {table.__tablename__} {job_id}"
            if self.db.retried(take, what, self._stopping):
                return job_id
        return None

    def _take(self, table: Table, job_id: int, now: datetime) -> bool:
        """Mark a queued job as this worker's, as started ``now``. Tried again after a commit
        whose answer was lost, the claim finds its own mark (and counts no second attempt)."""
        ours = and_(table.status == "running", table.worker == self.name, table.started_at == now)
        queued = table.status == "queued"
        claim = (
            update(table)
            .where(table.id == job_id, or_(queued, ours))
            .values(
                status="running",
                worker=self.name,
                started_at=now,
                heartbeat_at=now,
                attempts=case((queued, table.attempts + 1), else_=table.attempts),
            )
        )
        with self.db.session() as session:
            return bool(session.execute(claim).rowcount)

    def _next(self) -> tuple[Table, int] | None:
        for table in _TABLES:
            job_id = self.claim(table)
            if job_id is not None:
                return table, job_id
        return None

    def _slot(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._next()
                if job is None:
                    self._wake.wait(self.poll_s)
                    self._wake.clear()
                    continue
                self._execute(*job)
            except Exception:  # the database away past the retries must not end the slot
                log.exception("worker slot error")
                self._stopping.wait(self.poll_s)

    def _execute(self, table: Table, job_id: int) -> None:
        kind = table.__tablename__
        log.info("%s %s started", kind, job_id)
        held = _Held(table, job_id)
        with self._held_lock:
            self._held[kind, job_id] = held
        try:  # the heartbeat goes on until the job's end is written
            failure = self._outcome(held)
            if failure is not None:
                self._rows.fail(table, job_id, failure)
        except _Lost:
            log.info("%s %s was deleted or taken over; stopped", kind, job_id)
        finally:
            with self._held_lock:
                del self._held[kind, job_id]

    def _outcome(self, held: _Held) -> str | None:
        """Execute the job and store its result; why it failed, if it did."""
        table, job_id = held.table, held.id
        try:
            with self.store.scratch() as folder:
                child = execute.start(self._layout.job(table, job_id, folder), folder)
                outcome = self._supervise(held, child)
                if "done" in outcome:  # stored from the folder: a build's artifact is there
                    self._rows.done(table, job_id, outcome["done"], folder)
                    return None
                return outcome["failed"]
        except _Lost:
            raise
        except DBAPIError as err:
            return _database_failure(err)
        except Exception as err:
            if out_of_space(err):  # laying the job out, or storing a build's artifact
                return f"no space left on the server's storage: {err}"
            log.exception("%s %s", table.__tablename__, job_id)
            return f"internal error: {type(err).__name__}: {err}"

    def _supervise(self, held: _Held, child: subprocess.Popen) -> dict:
        """Hand the child's progress to the heartbeat thread until it answers, dies, is
        stopped, or the job is lost."""
        answers: queue.Queue[dict | None] = queue.Queue()

        def read() -> None:
            try:
                with child.stdout:
                    for line in child.stdout:
                        answers.put(json.loads(line))
            finally:
                answers.put(None)  # end of answers: the child is gone

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + self.time_limit_s
        try:
            while not self._stopping.is_set():
                if held.lost.is_set():
                    raise _Lost
                if time.monotonic() > deadline:
                    limit = f"{self.time_limit_s:g} s"
                    return {"failed": f"stopped at this server's time limit for a job, {limit}"}
                try:
                    answer = answers.get(timeout=_WRITE_EVERY_S)
                except queue.Empty:
                    continue
                if answer is None:
                    code = child.wait()
                    return {"failed": f"the {_PROCESS[held.table]} process died (exit code {code})"}
                if "progress" not in answer:
                    return answer
                held.progress = answer
            return {"failed": STOPPED}
        finally:
            child.kill()
            child.wait()
            child.stdin.close()

    def _beat(self) -> None:
        """The heartbeat thread: every half second, the progress of the jobs held (when it
        changed, else a heartbeat every ``heartbeat_s``); every ``heartbeat_s``, the sweep of
        jobs whose worker is gone. After this thread could not reach the database for a while
        (it was away, slow, locked, or the thread did not run), no sweep for ``stale_after_s``:
        the live workers were likely held up too, and their heartbeats are as old as that."""
        held_up = (self.stale_after_s - self.heartbeat_s) / 2
        reached = next_sweep = sweep_from = time.monotonic()
        failing = False
        while not self._stopping.wait(_WRITE_EVERY_S):
            try:
                contacted = self._write_held(time.monotonic())
                now = time.monotonic()
                if now - reached > held_up:
                    sweep_from = now + self.stale_after_s
                if now >= next_sweep:
                    next_sweep = now + self.heartbeat_s
                    if now >= sweep_from:
                        self.recover()  # stale as of its start: a wait inside it spares all
                    else:
                        self._reach()
                    contacted = True
            except DBAPIError as err:
                if not failing:
                    log.warning("heartbeat: the database is away (%s)", type(err.orig).__name__)
                failing = True
                continue
            if contacted or not failing:  # a tick that wrote nothing proves no reach
                if failing:
                    log.info("heartbeat: the database is back")
                end = time.monotonic()
                if end - reached > held_up:  # held up within this tick
                    sweep_from = max(sweep_from, end + self.stale_after_s)
                reached, failing = end, False

    def _reach(self) -> None:
        """Touch the database: while the sweep waits, its reach is still measured."""
        with self.db.read() as session:
            session.execute(select(1))

    def _write_held(self, now: float) -> bool:
        """Write what is due of the jobs held; mark those whose row is no longer theirs. Tell
        whether anything was written."""
        with self._held_lock:
            held = list(self._held.values())
        due = [
            (h, h.progress)
            for h in held
            if h.progress != h.written or now - h.written_at >= self.heartbeat_s
        ]
        if not due:
            return False
        with self.db.session() as session:
            lost = [h for h, progress in due if not self._rows.progress(session, h, progress)]
        for h, progress in due:
            h.written, h.written_at = progress, now
        for h in lost:
            h.lost.set()
        return True


def _ids(session: Session, statement, table: Table) -> list[int]:
    """The ids of the rows an UPDATE changed."""
    return list(session.scalars(statement.returning(table.id)))


def _queued_again(table: Table) -> dict:
    """A job's row as queued again: its progress starts over."""
    values = {"status": "queued", "worker": None, "started_at": None, "heartbeat_at": None}
    values |= {"progress": 0.0}
    if table is Run:
        return values | {"samples_done": 0, "samples_total": None}
    return values | {"phase": None}


def _database_failure(err: DBAPIError) -> str:
    """Why a job failed when the database refused its reads or its result past the retries."""
    if disk_full(err):
        return "its result could not be stored: the database's disk is full"
    reason = next(iter(str(err.orig).strip().splitlines()), "")
    return f"the database stayed unavailable ({type(err.orig).__name__}: {reason})"


class _Layout:
    """Lays out a job's scratch folder for its child process: the model and the data linked from
    the store under the file names the request gives, the profile or qparams document written
    out; gives the job the child executes. A job whose row is gone is :class:`_Lost`."""

    def __init__(self, db: Database, store: BlobStore, ray: dict | None, stopping: threading.Event):
        self.db, self.store, self.ray, self._stopping = db, store, ray, stopping

    def job(self, table: Table, job_id: int, folder: Path) -> execute.Job:
        prepare = {Run: self._run_job, Evaluation: self._eval_job, Build: self._build_job}[table]
        return prepare(job_id, folder)

    def _read(self, read: Callable[[Session], T], what: str) -> T:
        """``read(session)`` in a read transaction, retried while its error can pass."""

        def attempt() -> T:
            with self.db.read() as session:
                return read(session)

        return self.db.retried(attempt, f"reading {what}", self._stopping)

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
        def read(session: Session) -> tuple[Run, Model]:
            run = _found(session.get(Run, run_id))
            return run, _found(session.get(Model, run.model_id))

        run, model = self._read(read, f"run {run_id}")
        self._link_model(model, folder, run.request.model)
        self._link_data(folder, run.request.data, run.data_sha256)
        return execute.Job(execute.PROFILE, run.request.model_dump(mode="json"), ray=self.ray)

    def _eval_job(self, evaluation_id: int, folder: Path) -> execute.Job:
        def read(session: Session) -> tuple[Evaluation, Run, Model, dict]:
            evaluation = _found(session.get(Evaluation, evaluation_id))
            run = _found(session.get(Run, evaluation.run_id))
            model = _found(session.get(Model, run.model_id))
            return evaluation, run, model, load_profile(session, run)

        evaluation, run, model, profile = self._read(read, f"evaluation {evaluation_id}")
        request = evaluation.request
        self._link_model(model, folder, request.model)
        self._link_evaluation_data(folder, evaluation)
        self._link_calibration(folder, evaluation, run)
        (folder / request.profile).write_text(json.dumps(profile))
        return execute.Job(execute.EVALUATE, request.model_dump(mode="json"))

    def _build_job(self, build_id: int, folder: Path) -> execute.Job:
        def read(session: Session) -> tuple[Build, Model, Run | None, dict]:
            build = _found(session.get(Build, build_id))
            model = _found(session.get(Model, build.model_id))
            run = session.get(Run, build.run_id) if build.run_id is not None else None
            if build.request.qparams is not None:
                document = _found(session.get(QParamsSet, build.qparams_id)).document
            else:
                document = load_profile(session, _found(run))
            return build, model, run, document

        build, model, run, document = self._read(read, f"build {build_id}")
        request = build.request
        (folder / (request.qparams or request.profile)).write_text(json.dumps(document))
        self._link_model(model, folder, request.model)
        self._link_evaluation_data(folder, build)
        if run is not None:
            self._link_calibration(folder, build, run)
        return execute.Job(execute.BUILD, request.model_dump(mode="json"))


def _found(row: Row | None) -> Row:
    """A job's row, or the model, run or qparams set it needs: gone, the job is lost."""
    if row is None:
        raise _Lost
    return row


class _Rows:
    """A worker's writes to the rows of the jobs it holds: progress and heartbeats, the result,
    the failure. Each applies only while the row is running under the worker's name; the
    result and the failure are retried while the database error can pass."""

    def __init__(self, db: Database, store: BlobStore, name: str, stopping: threading.Event):
        self.db, self.store, self.name, self._stopping = db, store, name, stopping

    def _mine(self, table: Table, job_id: int):
        return update(table).where(
            table.id == job_id, table.status == "running", table.worker == self.name
        )

    def progress(self, session: Session, held: _Held, answer: dict) -> bool:
        """Write a held job's progress (``answer``) and heartbeat; false if it is not ours."""
        table = held.table
        done, total = answer["progress"]
        values = {"heartbeat_at": utcnow()}
        if table is Run:
            values |= {"samples_done": done, "samples_total": total}
        else:
            values["phase"] = answer.get("phase")
        if total:
            values["progress"] = done / total
        return bool(session.execute(self._mine(table, held.id).values(**values)).rowcount)

    def done(self, table: Table, job_id: int, result: dict, folder: Path) -> None:
        """Stores the job's result (a build's artifact from ``folder``) and marks it done."""
        kind = table.__tablename__
        if table is Build:
            self._store_build(job_id, result, folder)
            return
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

        def store() -> bool:
            with self.db.session() as session:
                if not session.execute(self._mine(table, job_id).values(**finished)).rowcount:
                    return False
                if table is Run:
                    store_profile(session, session.get(Run, job_id), result)
                return True

        if self.db.retried(store, f"storing {kind} {job_id}", self._stopping):
            log.info("%s %s done", kind, job_id)
        else:
            log.info("%s %s was deleted or taken over; result dropped", kind, job_id)

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
        failed = self._mine(table, job_id).values(
            status="failed", error=error, finished_at=utcnow()
        )

        def write() -> None:
            with self.db.session() as session:
                session.execute(failed)

        self.db.retried(write, f"failing {table.__tablename__} {job_id}", self._stopping)
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
