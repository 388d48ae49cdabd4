"""The worker's database side on both backends: a queued run is claimed by exactly one worker,
and runs whose worker is gone are failed with a reason instead of staying ``running``."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from rangeprof.service.db import Database
from rangeprof.service.jobs import STOPPED, Worker
from rangeprof.service.migrate import upgrade
from rangeprof.service.models import Model, Run, Token, utcnow
from rangeprof.service.storage import BlobStore
from rangeprof.workflows.requests import ProfileRequest

from service_fixtures import BACKENDS, database


@pytest.fixture(params=BACKENDS)
def db(request, tmp_path):
    with database(request.param, tmp_path) as url:
        upgrade(url)
        db = Database(url)
        yield db
        db.dispose()


def _runs(db: Database, *states: tuple[str, str | None, timedelta | None]) -> list[int]:
    """Runs of one model in the given (status, worker, heartbeat age) states."""
    now = utcnow()
    with db.session() as session:
        token = Token(name="t", token_hash="0" * 64)
        session.add(token)
        session.flush()
        model = Model(
            owner_id=token.id,
            sha256="0" * 64,
            name="m",
            size=1,
            opset=17,
            input_shapes={},
            inputs=[],
            stages=[],
        )
        session.add(model)
        session.flush()
        runs = [
            Run(
                model_id=model.id,
                status=status,
                worker=worker,
                heartbeat_at=None if age is None else now - age,
                request=ProfileRequest(model="m.onnx", data="random", samples=1, bins=0),
            )
            for status, worker, age in states
        ]
        session.add_all(runs)
        session.flush()
        return [run.id for run in runs]


def test_each_queued_run_is_claimed_once(db, tmp_path):
    ids = _runs(db, *[("queued", None, None)] * 24)
    store = BlobStore(tmp_path / "blobs")
    workers = [Worker(db, store, name=f"w{i}") for i in range(4)]
    claimed: dict[str, list[int]] = {w.name: [] for w in workers}

    def drain(worker: Worker) -> None:
        while (run_id := worker.claim()) is not None:
            claimed[worker.name].append(run_id)

    threads = [threading.Thread(target=drain, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [run_id for runs in claimed.values() for run_id in runs]
    assert sorted(everything) == ids
    with db.session() as session:
        for name, runs in claimed.items():
            for run_id in runs:
                run = session.get(Run, run_id)
                assert (run.status, run.worker) == ("running", name)
                assert run.started_at is not None and run.heartbeat_at is not None


def test_runs_of_gone_workers_are_failed_with_a_reason(db, tmp_path):
    old, live, mine, queued = _runs(
        db,
        ("running", "elsewhere", timedelta(minutes=10)),  # its worker stopped beating
        ("running", "alive", timedelta(seconds=1)),
        ("running", "me", timedelta(seconds=1)),  # held by this worker before it restarted
        ("queued", None, None),
    )
    worker = Worker(db, BlobStore(tmp_path / "blobs"), name="me", stale_after_s=60)
    assert worker.recover(own=True) == 2
    with db.session() as session:
        state = {i: session.get(Run, i) for i in (old, live, mine, queued)}
    assert state[old].status == "failed" and "heartbeat" in state[old].error
    assert (state[mine].status, state[mine].error) == ("failed", STOPPED)
    assert state[old].finished_at is not None and state[mine].finished_at is not None
    assert (state[live].status, state[live].error) == ("running", None)
    assert state[queued].status == "queued"
    other = Worker(db, BlobStore(tmp_path / "blobs"), name="alive")
    assert other.recover() == 0  # a stale check alone spares a live heartbeat
