"""What the routes share: the app's database, blob store, worker and limits, and lookups that
only find what the calling token owns (anything else is "not found", never "forbidden", so a
token cannot learn which ids exist)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.routing import APIRoute
from sqlalchemy import func, select
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, selectinload

from .db import Database
from .jobs import NotCancellable, Worker, mark_cancelled
from .limits import Limits
from .models import Build, Evaluation, Model, Run, Token
from .storage import BlobStore

log = logging.getLogger(__name__)


# How long a read whose connection the database keeps dropping (a restart, killed backends)
# is tried again, each try on a fresh connection, before it answers 503. A count of tries was
# not enough: with a backend killer every 50 ms and both cores busy, four tries in a row lost
# their connection about once in 150 reads.
READ_RETRY_S = 2.0
_FIRST_PAUSE_S = 0.01


class RetriedReads(APIRoute):
    """A route whose GETs are tried again (for up to :data:`READ_RETRY_S`, pausing a little
    longer each time) when the database dropped or refused their connection: reads are
    idempotent, and the pool hands each try a fresh connection. Writes are not retried: a
    dropped one is 503."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not self.methods <= {"GET", "HEAD"}:
            return handler

        async def retried(request: Request) -> Response:
            deadline = time.monotonic() + READ_RETRY_S
            pause = _FIRST_PAUSE_S
            while True:
                try:
                    return await handler(request)
                except (OperationalError, InterfaceError):
                    if time.monotonic() + pause > deadline:
                        raise
                    log.warning(
                        "%s %s: database connection lost; retrying", request.method, self.path
                    )
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 0.25)

        return retried


@dataclass(frozen=True)
class Service:
    db: Database
    store: BlobStore
    worker: Worker | None  # None: a separate `rangeprof worker` executes the runs
    limits: Limits


def _service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(_service)]


def not_found(what: str, id_: int) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"{what} {id_} not found")


def own_model(session: Session, owner: int, model_id: int, *, layers: bool = False) -> Model:
    """The token's model; with ``layers``, its layers loaded here, in the same session, and not
    later by whatever reads the attribute (a response model's validation)."""
    options = [selectinload(Model.layers)] if layers else []
    model = session.get(Model, model_id, options=options)
    if model is None or model.owner_id != owner:
        raise not_found("model", model_id)
    return model


def own_run(session: Session, owner: int, run_id: int) -> Run:
    run = session.scalar(select(Run).join(Model).where(Run.id == run_id, Model.owner_id == owner))
    if run is None:
        raise not_found("run", run_id)
    return run


def done_run(session: Session, owner: int, run_id: int) -> Run:
    """An owned run whose profile exists; 409 while it is queued or running, or if it failed."""
    run = own_run(session, owner, run_id)
    if run.status != "done":
        why = f": {run.error}" if run.error else "; its profile exists once it is done"
        raise HTTPException(status.HTTP_409_CONFLICT, f"run {run_id} is {run.status}{why}")
    return run


def require_done(job, kind: str, job_id: int) -> None:
    """409 unless the evaluation or build ``job`` is done (queued, running, failed, cancelled)."""
    if job.status != "done":
        why = f": {job.error}" if job.error else ""
        raise HTTPException(status.HTTP_409_CONFLICT, f"{kind} {job_id} is {job.status}{why}")


def _queued(session: Session, owner: int) -> int:
    """The token's jobs waiting for a worker."""
    waiting = [
        select(func.count(Run.id)).join(Model).where(Run.status == "queued"),
        select(func.count(Build.id))
        .join(Model, Build.model_id == Model.id)
        .where(Build.status == "queued"),
        select(func.count(Evaluation.id))
        .join(Run, Evaluation.run_id == Run.id)
        .join(Model, Run.model_id == Model.id)
        .where(Evaluation.status == "queued"),
    ]
    return sum(session.scalar(q.where(Model.owner_id == owner)) for q in waiting)


def _queue_full(queued: int) -> HTTPException:
    return HTTPException(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"{queued} jobs of this token are queued, this server's limit; "
        "queue more once some have run",
        headers={"Retry-After": "30"},
    )


def check_queue(session: Session, owner: int, limits: Limits) -> None:
    """429 while the token already has its limit of jobs waiting for a worker: the early answer,
    before an upload is checked and stored (:func:`admit_jobs` makes the limit exact)."""
    queued = _queued(session, owner)
    if queued >= limits.max_queued_per_token:
        raise _queue_full(queued)


def _owner_of(session: Session, job: Run | Evaluation | Build) -> int | None:
    """The token owning a job about to be queued; ``None`` once its model is gone."""
    if isinstance(job, Evaluation):
        query = select(Model.owner_id).join(Run).where(Run.id == job.run_id)
    else:
        query = select(Model.owner_id).where(Model.id == job.model_id)
    return session.scalar(query)


def admit_jobs(db: Database, limits: Limits) -> None:
    """Make the per-token queue limit exact under a burst: every job entering the queue is
    counted in the transaction inserting it, under a lock on its token's row (``FOR UPDATE`` on
    PostgreSQL; SQLite's writers take turns already), so two requests never both see the last
    free place. Over the limit, the insert is refused with 429."""

    def admit(session: Session) -> None:
        jobs = [
            job
            for job in session.new
            if isinstance(job, Run | Evaluation | Build) and job.status in (None, "queued")
        ]
        with session.no_autoflush:
            for job in jobs:
                owner = _owner_of(session, job)
                if owner is None:  # its model was deleted: the insert fails on the foreign key
                    continue
                session.execute(select(Token.id).where(Token.id == owner).with_for_update())
                queued = _queued(session, owner)
                if queued >= limits.max_queued_per_token:
                    raise _queue_full(queued)

    db.on_flush(admit)


def cancelled(job) -> None:
    """Cancel an owned job for a request: 409 once it has ended."""
    try:
        mark_cancelled(job)
    except NotCancellable as err:
        raise HTTPException(status.HTTP_409_CONFLICT, str(err)) from None
