"""Rows and blobs together: adding a model, a run, an evaluation or a build stores its files and
its rows, or neither, and so does finishing a build with its artifact; deleting a model removes
its rows and every blob no row refers to any more.

The store's lock (:meth:`BlobStore.lock`, held by one thread of one process of this host at a
time) orders blob writes and deletions against the transactions that refer to them, so a delete
never removes a blob that a concurrent upload of the same bytes, in any server process, is about
to use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from .db import Database
from .models import Build, Evaluation, Layer, Model, Run
from .storage import BlobStore
from .uploads import ModelAnalysis

MODEL_SUFFIX = ".onnx"
DATA_SUFFIX = ".npz"
ARTIFACT_SUFFIX = ".zip"


def add_model(db: Database, store: BlobStore, owner_id: int, analysis: ModelAnalysis) -> int:
    with store.lock():
        sha256 = analysis.sha256
        created = store.adopt(analysis.staged, sha256, MODEL_SUFFIX)
        try:
            with db.session() as session:
                model = Model(
                    owner_id=owner_id,
                    name=analysis.name,
                    sha256=sha256,
                    size=analysis.size,
                    opset=analysis.opset,
                    input_shapes=analysis.input_shapes,
                    inputs=analysis.inputs,
                    stages=analysis.stages,
                    layers=[Layer(position=i, **layer) for i, layer in enumerate(analysis.layers)],
                )
                session.add(model)
                session.flush()
                return model.id
        except BaseException:
            if created:
                store.remove(sha256, MODEL_SUFFIX)
            raise


def add_run(db: Database, store: BlobStore, run: Run, staged: Path | None) -> int:
    """Queue ``run``; ``staged`` is its checked .npz (``run.data_sha256`` its hash), if any."""
    with store.lock():
        created = staged is not None and store.adopt(staged, run.data_sha256, DATA_SUFFIX)
        try:
            with db.session() as session:
                session.add(run)
                session.flush()
                return run.id
        except BaseException:
            if created:
                store.remove(run.data_sha256, DATA_SUFFIX)
            raise


def add_job(
    db: Database, store: BlobStore, job: Evaluation | Build, staged: dict[str, Path]
) -> int:
    """Queue an evaluation or a build; ``staged`` maps the sha256 of each checked .npz it refers
    to (evaluation data, labels) to its file."""
    with store.lock():
        created = [sha for sha, path in staged.items() if store.adopt(path, sha, DATA_SUFFIX)]
        try:
            with db.session() as session:
                session.add(job)
                session.flush()
                return job.id
        except BaseException:
            for sha256 in created:
                store.remove(sha256, DATA_SUFFIX)
            raise


def add_artifact(
    db: Database, store: BlobStore, staged: Path, sha256: str, finish: Callable[[Session], bool]
) -> bool:
    """Store a build's zipped artifact and mark the build done with ``finish``, which is false
    when the build is gone (its model deleted meanwhile): then the blob is not kept. The
    transaction is retried while the database error can pass (the worker's results are)."""

    def finished() -> bool:
        with db.session() as session:
            return finish(session)

    with store.lock():
        created = store.adopt(staged, sha256, ARTIFACT_SUFFIX)
        kept = False
        try:
            kept = db.retried(finished, "storing a build's artifact")  # and committed
        finally:
            if created and not kept:
                store.remove(sha256, ARTIFACT_SUFFIX)
    return kept


def delete_model(db: Database, store: BlobStore, owner_id: int, model_id: int) -> bool:
    """Delete a model of ``owner_id``; ``False`` if there is none."""
    with store.lock():
        with db.session() as session:
            model = session.get(Model, model_id)
            if model is None or model.owner_id != owner_id:
                return False
            blobs = {(model.sha256, MODEL_SUFFIX)}
            runs = select(Run.id).where(Run.model_id == model_id)
            shas = set(session.scalars(select(Run.data_sha256).where(Run.id.in_(runs))))
            for column in (Evaluation.data_sha256, Evaluation.labels_sha256):
                shas |= set(session.scalars(select(column).where(Evaluation.run_id.in_(runs))))
            for column in (Build.data_sha256, Build.labels_sha256):
                shas |= set(session.scalars(select(column).where(Build.model_id == model_id)))
            blobs |= {(sha, DATA_SUFFIX) for sha in shas if sha}
            artifacts = select(Build.artifact_sha256).where(Build.model_id == model_id)
            blobs |= {(sha, ARTIFACT_SUFFIX) for sha in session.scalars(artifacts) if sha}
            # layers, runs, statistics, qparams, builds, evaluations cascade
            session.delete(model)
        with db.session() as session:
            for sha256, suffix in blobs:
                if not _referenced(session, sha256, suffix):
                    store.remove(sha256, suffix)
    return True


def _referenced(session, sha256: str, suffix: str) -> bool:
    if suffix == MODEL_SUFFIX:
        return session.scalar(select(exists().where(Model.sha256 == sha256)))
    if suffix == ARTIFACT_SUFFIX:
        return session.scalar(select(exists().where(Build.artifact_sha256 == sha256)))
    # .npz blobs: calibration data of runs, evaluation data and labels (of evaluations, and of
    # builds with an accuracy budget).
    uses = (
        Run.data_sha256 == sha256,
        or_(Evaluation.data_sha256 == sha256, Evaluation.labels_sha256 == sha256),
        or_(Build.data_sha256 == sha256, Build.labels_sha256 == sha256),
    )
    return any(session.scalar(select(exists().where(use))) for use in uses)
