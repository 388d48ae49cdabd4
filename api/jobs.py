"""The worker: takes queued runs from the database and executes them off the request path.

It runs inside the server (``rangeprof serve``, ``--jobs`` slots) or on its own (``rangeprof
worker``), any number of them on one database. Each slot thread claims a queued run with an
atomic ``UPDATE ... WHERE status = 'queued'`` (two workers never get the same run), executes it
in a child process (:mod:`api.execute`), writes its progress and a heartbeat to the run row at
most every half second, and stores the profile when it is done.

No run stays ``running`` forever. A worker starting up fails the runs it held before a crash
(its name is the same: ``serve@HOST:PORT`` for the server's own worker) with "server stopped
while the run was running", and every worker fails runs whose heartbeat is older than
``stale_after_s`` (their worker is gone). Stopping a worker stops its runs the same way. A
worker whose run was deleted, or failed by another worker meanwhile, stops the child.
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

from . import execute
from .catalog import DATA_SUFFIX, MODEL_SUFFIX
from .db import Database
from .documents import store_profile
from .migrate import open_database
from .models import Model, Run, utcnow
from .storage import BlobStore, storage_root
from .uploads import data_spec

STOPPED = "server stopped while the run was running"
_WRITE_EVERY_S = 0.5
log = logging.getLogger("rangeprof.worker")


def default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _Lost(Exception):
    """The run is no longer ours (deleted, or failed by another worker)."""


class Worker:
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
    ):
        self.db, self.store = db, store
        self.name = name or default_name()
        self.jobs, self.poll_s = jobs, poll_s
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_recovery = 0.0

    def start(self) -> None:
        self.recover(own=True)
        for slot in range(self.jobs):
            thread = threading.Thread(target=self._slot, name=f"{self.name}/{slot}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        """A run was queued: look now rather than at the next poll."""
        self._wake.set()

    def stop(self) -> None:
        """Stop every slot; runs in progress are failed with :data:`STOPPED`."""
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def recover(self, own: bool = False) -> int:
        """Fail runs whose worker is gone; with ``own``, also those this worker held before."""
        now = utcnow()
        self._last_recovery = time.monotonic()
        stale = Run.heartbeat_at < now - timedelta(seconds=self.stale_after_s)
        reasons = [(stale, f"its worker sent no heartbeat for {self.stale_after_s:g} s")]
        if own:
            reasons.insert(0, (Run.worker == self.name, STOPPED))
        failed = []
        with self.db.session() as session:
            for gone, reason in reasons:
                failed += session.scalars(
                    update(Run)
                    .where(Run.status == "running", gone)
                    .values(status="failed", error=reason, finished_at=now)
                    .returning(Run.id)
                ).all()
        for run_id in failed:
            log.warning("run %s failed: its worker is gone", run_id)
        return len(failed)

    def claim(self) -> int | None:
        """Take the oldest queued run; ``None`` when there is none."""
        with self.db.session() as session:
            queued = select(Run.id).where(Run.status == "queued").order_by(Run.id).limit(8)
            candidates = list(session.scalars(queued))
        for run_id in candidates:
            now = utcnow()
            with self.db.session() as session:
                taken = session.execute(
                    update(Run)
                    .where(Run.id == run_id, Run.status == "queued")
                    .values(status="running", worker=self.name, started_at=now, heartbeat_at=now)
                ).rowcount
            if taken:
                return run_id
        return None

    def _slot(self) -> None:
        while not self._stopping.is_set():
            try:
                if time.monotonic() - self._last_recovery > self.heartbeat_s:
                    self.recover()
                run_id = self.claim()
                if run_id is None:
                    self._wake.wait(self.poll_s)
                    self._wake.clear()
                    continue
                self._execute(run_id)
            except Exception:  # a database hiccup must not end the slot
                log.exception("worker slot error")
                self._stopping.wait(self.poll_s)

    def _execute(self, run_id: int) -> None:
        log.info("run %s started", run_id)
        try:
            with self.store.scratch() as folder:
                child = execute.start(self._job(run_id, folder), folder)
                outcome = self._supervise(run_id, child)
        except _Lost:
            log.info("run %s was deleted or taken over; stopped", run_id)
            return
        except Exception as err:
            log.exception("run %s", run_id)
            outcome = {"failed": f"internal error: {type(err).__name__}: {err}"}
        if "done" in outcome:
            self._store(run_id, outcome["done"])
        else:
            self._fail(run_id, outcome["failed"])

    def _job(self, run_id: int, folder: Path) -> execute.Job:
        with self.db.session() as session:
            run = session.get(Run, run_id)
            model = session.get(Model, run.model_id)
        model_file = f"{model.name}{MODEL_SUFFIX}"
        (folder / model_file).symlink_to(self.store.path(model.sha256, MODEL_SUFFIX))
        if run.data_sha256:
            (folder / run.data_name).symlink_to(self.store.path(run.data_sha256, DATA_SUFFIX))
        return execute.Job(
            model_file=model_file,
            data=data_spec(run.data_name, run.data_key),
            input_shapes=model.input_shapes,
            options={
                "bins": run.bins,
                "batch_size": run.batch_size,
                "samples": run.samples,
                "seed": run.seed,
            },
        )

    def _supervise(self, run_id: int, child: subprocess.Popen) -> dict:
        """Relay the child's progress to the run row until it answers, dies or is stopped."""
        answers: queue.Queue[dict | None] = queue.Queue()

        def read() -> None:
            try:
                with child.stdout:
                    for line in child.stdout:
                        answers.put(json.loads(line))
            finally:
                answers.put(None)  # end of answers: the child is gone

        threading.Thread(target=read, daemon=True).start()
        progress, written, last_write = (0, None), None, 0.0
        try:
            while not self._stopping.is_set():
                try:
                    answer = answers.get(timeout=_WRITE_EVERY_S)
                except queue.Empty:
                    answer = {}
                if answer is None:
                    code = child.wait()
                    return {"failed": f"the profiling process died (exit code {code})"}
                if "progress" in answer:
                    progress = tuple(answer["progress"])
                elif answer:
                    return answer
                # Progress at most every half second; otherwise a heartbeat now and then.
                now = time.monotonic()
                pause = _WRITE_EVERY_S if progress != written else self.heartbeat_s
                if now - last_write >= pause:
                    self._progress(run_id, *progress)
                    written, last_write = progress, now
            return {"failed": STOPPED}
        finally:
            child.kill()
            child.wait()
            child.stdin.close()

    def _mine(self, run_id: int):
        return update(Run).where(Run.id == run_id, Run.status == "running", Run.worker == self.name)

    def _progress(self, run_id: int, done: int, total: int | None) -> None:
        values = {"samples_done": done, "samples_total": total, "heartbeat_at": utcnow()}
        if total:
            values["progress"] = done / total
        with self.db.session() as session:
            if not session.execute(self._mine(run_id).values(**values)).rowcount:
                raise _Lost

    def _store(self, run_id: int, doc: dict) -> None:
        with self.db.session() as session:
            finished = self._mine(run_id).values(
                status="done",
                progress=1.0,
                samples_done=doc["run"]["samples"],
                samples_total=doc["run"]["samples"],
                timings=doc["run"]["timings"],
                finished_at=utcnow(),
            )
            if not session.execute(finished).rowcount:
                log.info("run %s was deleted or taken over; result dropped", run_id)
                return
            store_profile(session, session.get(Run, run_id), doc)
        log.info("run %s done", run_id)

    def _fail(self, run_id: int, error: str) -> None:
        with self.db.session() as session:
            session.execute(
                self._mine(run_id).values(status="failed", error=error, finished_at=utcnow())
            )
        log.info("run %s failed: %s", run_id, error)


def run_worker(db_url: str | None, storage: str | None, *, jobs: int, name: str | None) -> None:
    """``rangeprof worker``: execute queued runs until SIGINT or SIGTERM."""
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
