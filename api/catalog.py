"""Rows and blobs together: adding a model or a run stores its file and its rows, or neither;
deleting a model removes its rows and every blob no row refers to any more.

A process-wide lock orders blob writes and deletions against the transactions that refer to
them, so a delete never removes a blob that a concurrent upload of the same bytes is about to
use.
"""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy import exists, select

from .db import Database
from .models import Layer, Model, Run
from .storage import BlobStore
from .uploads import ModelAnalysis

MODEL_SUFFIX = ".onnx"
DATA_SUFFIX = ".npz"
_LOCK = threading.Lock()


def add_model(db: Database, store: BlobStore, owner_id: int, analysis: ModelAnalysis) -> int:
    with _LOCK:
        sha256, created = store.put_bytes(analysis.data, MODEL_SUFFIX)
        try:
            with db.session() as session:
                model = Model(
                    owner_id=owner_id,
                    name=analysis.name,
                    sha256=sha256,
                    size=len(analysis.data),
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
    with _LOCK:
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


def delete_model(db: Database, store: BlobStore, owner_id: int, model_id: int) -> bool:
    """Delete a model of ``owner_id``; ``False`` if there is none."""
    with _LOCK:
        with db.session() as session:
            model = session.get(Model, model_id)
            if model is None or model.owner_id != owner_id:
                return False
            blobs = {(model.sha256, MODEL_SUFFIX)}
            data = select(Run.data_sha256).where(Run.model_id == model_id)
            blobs |= {(sha, DATA_SUFFIX) for sha in session.scalars(data) if sha}
            session.delete(model)  # layers, runs, statistics, qparams, builds cascade
        with db.session() as session:
            for sha256, suffix in blobs:
                if not _referenced(session, sha256, suffix):
                    store.remove(sha256, suffix)
    return True


def _referenced(session, sha256: str, suffix: str) -> bool:
    column = Model.sha256 if suffix == MODEL_SUFFIX else Run.data_sha256
    return session.scalar(select(exists().where(column == sha256)))
