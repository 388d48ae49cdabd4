"""The service's tables (SQLAlchemy 2 ORM); ``migrations/`` creates exactly these.

* ``token``: API tokens, stored as the sha256 of the token (the token itself is shown once).
* ``model``: an uploaded ONNX file (its bytes live in the blob store under ``sha256``), the
  input shapes it was loaded with, and the stage reports (lineage) of ``rangeprof inspect``;
  ``layer`` holds its layers (profileIDs) in order.
* ``run``: one profiling run of a model: status, its request (the workflow's, see below),
  progress, timings, error text, and the profile document minus its ``tensors``.
* ``tensor_stat``: one row per profileID and run, the document's tensor entry.
* ``qparams``: quantization-parameter sets derived from a run.
* ``build``: compiled INT8 artifacts of a run's ranges (``rangeprof build``), executed by the
  worker like a run; the artifact is a .zip blob.
* ``evaluation``: FP32 vs INT8 error of a run's ranges on data (``rangeprof evaluate``),
  executed by the worker like a run, or uploaded as a ``rangeprof evaluate --json`` report.

A job (run, evaluation, build) counts the ``attempts`` to execute it: a worker's claim adds one,
and a job whose worker died is queued again while it has retries left.

A job's options are one column, ``request``: the request of its workflow
(:mod:`rangeprof.workflows.requests`) exactly as the job process runs it, its paths the names
of the files in the job's folder (the model, ``calib.npz:calib``, ``profile.json``). It is
validated when written and when read, so a row never holds options the workflow would refuse.
Beside it, ``*_sha256`` columns name the stored blobs that the request's data files are.

Timestamps are timezone-aware UTC on every backend.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import BaseModel
from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from rangeprof.workflows.requests import BuildRequest, EvaluateRequest, ProfileRequest

RUN_STATUSES = ("queued", "running", "done", "failed", "cancelled")
BUILD_STATUSES = RUN_STATUSES
EVALUATION_SOURCES = ("service", "report")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """A timestamp with time zone that comes back aware on SQLite too (stored as UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC)


class JobRequest(TypeDecorator):
    """A workflow request as JSON (``model_dump(mode="json")``), validated on the way in and
    read back as ``request_type`` (``model_validate``)."""

    impl = JSON(none_as_null=True)  # no request (an uploaded report) is SQL NULL
    cache_ok = True

    def __init__(self, request_type: type[ProfileRequest | EvaluateRequest | BuildRequest]):
        super().__init__()
        self.request_type = request_type

    def process_bind_param(self, value: BaseModel | dict | None, dialect) -> dict | None:
        if value is None:
            return None
        # The JSON form is what is validated: what is stored is what reads back.
        document = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        return self.request_type.model_validate(document).model_dump(mode="json")

    def process_result_value(self, value: dict | None, dialect):
        return None if value is None else self.request_type.model_validate(value)


# On SQLite, tables whose ids are in URLs never reuse the id of a deleted row: a stale link then
# finds nothing instead of another token's newer object. (PostgreSQL sequences never reuse.)
NEVER_REUSED = {"sqlite_autoincrement": True}


def _in(column: str, choices: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(c) for c in choices)})"


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map: ClassVar = {dict[str, Any]: JSON, list[Any]: JSON, datetime: UTCDateTime}


class Token(Base):
    __tablename__ = "token"
    __table_args__ = (NEVER_REUSED,)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None]  # None: never
    revoked_at: Mapped[datetime | None]


class Model(Base):
    __tablename__ = "model"
    __table_args__ = (NEVER_REUSED,)

    id: Mapped[int] = mapped_column(primary_key=True)
    owner_id: Mapped[int] = mapped_column(ForeignKey("token.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(255))  # the file name without .onnx
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    opset: Mapped[int]
    input_shapes: Mapped[dict[str, Any]]  # as given at upload: name -> dims
    inputs: Mapped[list[Any]]  # as loaded: [{name, shape, dtype}]
    stages: Mapped[list[Any]]  # stage reports with lineage and fates (``inspect --json``)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    layers: Mapped[list[Layer]] = relationship(
        order_by="Layer.position", cascade="all, delete-orphan", passive_deletes=True
    )


class Layer(Base):
    __tablename__ = "layer"
    __table_args__ = (
        UniqueConstraint("model_id", "position"),
        UniqueConstraint("model_id", "profile_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("model.id", ondelete="CASCADE"))
    position: Mapped[int]
    profile_id: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))
    op: Mapped[str] = mapped_column(String(100))
    source_node: Mapped[str | None] = mapped_column(Text)
    source_op: Mapped[str | None] = mapped_column(String(100))
    source_tensor: Mapped[str | None] = mapped_column(Text)
    shape: Mapped[list[Any] | None]
    dtype: Mapped[str] = mapped_column(String(32))


class Run(Base):
    __tablename__ = "run"
    __table_args__ = (CheckConstraint(_in("status", RUN_STATUSES), name="status"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("model.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    request: Mapped[ProfileRequest] = mapped_column(JobRequest(ProfileRequest))
    # The uploaded .npz that ``request.data`` names; null for random data.
    data_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    # Progress, written by the worker.
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    samples_done: Mapped[int] = mapped_column(default=0)
    samples_total: Mapped[int | None]
    worker: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    timings: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    # The profile document without its tensors (they are rows of ``tensor_stat``).
    document: Mapped[dict[str, Any] | None]

    model: Mapped[Model] = relationship()


class TensorStat(Base):
    """A tensor entry of a profile. ``stats`` holds the statistics exactly as the document has
    them (min, max, mean, std, counts, exact moments, histogram, per-channel ranges); ``min`` and
    ``max`` are copies for SQL queries (SQLite's REAL would not keep the sign of -0.0)."""

    __tablename__ = "tensor_stat"
    __table_args__ = (
        UniqueConstraint("run_id", "position"),
        UniqueConstraint("run_id", "profile_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"))
    position: Mapped[int]
    profile_id: Mapped[str] = mapped_column(Text)
    source_node: Mapped[str | None] = mapped_column(Text)
    source_op: Mapped[str | None] = mapped_column(String(100))
    source_tensor: Mapped[str | None] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))
    op: Mapped[str] = mapped_column(String(100))
    shape: Mapped[list[Any] | None]
    dtype: Mapped[str] = mapped_column(String(32))
    static: Mapped[bool]
    min: Mapped[float | None] = mapped_column(Float)
    max: Mapped[float | None] = mapped_column(Float)
    stats: Mapped[dict[str, Any]]


class QParamsSet(Base):
    __tablename__ = "qparams"
    __table_args__ = (NEVER_REUSED,)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    options: Mapped[dict[str, Any]]  # CalibrationOptions.to_json()
    document: Mapped[dict[str, Any]]  # the QPARAMS document (profiler/schemas/qparams)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Build(Base):
    """An INT8 build of a model from a run's ranges (``rangeprof build``): the request's
    ``profile`` is the run's profile, calibrated with the target's policy, or its ``qparams``
    the stored ``qparams`` set. An accuracy budget measures on uploaded evaluation data (and
    labels). Executed by the worker like a run; the artifact (model.so and manifest.json,
    zipped) is the store's blob ``artifact_sha256``."""

    __tablename__ = "build"
    __table_args__ = (CheckConstraint(_in("status", BUILD_STATUSES), name="status"), NEVER_REUSED)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("model.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("run.id", ondelete="SET NULL"))
    qparams_id: Mapped[int | None] = mapped_column(ForeignKey("qparams.id", ondelete="SET NULL"))
    request: Mapped[BuildRequest] = mapped_column(JobRequest(BuildRequest))
    # The uploaded .npz files that ``request.data`` and ``request.labels`` name (a budget's).
    data_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    labels_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    # Progress, written by the worker: steps done and the one under way.
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    phase: Mapped[str | None] = mapped_column(String(64))
    worker: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    artifact_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    manifest: Mapped[dict[str, Any] | None]  # the artifact's manifest.json
    timings: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    model: Mapped[Model] = relationship()


class Evaluation(Base):
    """How much INT8 costs with a run's ranges: per-layer isolated and accumulated SQNR on
    evaluation data. ``source`` is ``service`` (queued with its ``request``, executed by the
    worker from the stored data and labels blobs) or ``report`` (a ``rangeprof evaluate
    --json`` report uploaded as is, done on arrival, with no request: the report says what
    was run)."""

    __tablename__ = "evaluation"
    __table_args__ = (
        CheckConstraint(_in("status", RUN_STATUSES), name="status"),
        CheckConstraint(_in("source", EVALUATION_SOURCES), name="source"),
        NEVER_REUSED,
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("run.id", ondelete="CASCADE"), index=True)
    source: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    request: Mapped[EvaluateRequest | None] = mapped_column(JobRequest(EvaluateRequest))
    # The uploaded .npz files that ``request.data`` and ``request.labels`` name (one file when
    # the labels are an array of the data); null for reports.
    data_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    labels_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    # Progress, written by the worker: a share of the work and what is being done.
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    phase: Mapped[str | None] = mapped_column(String(64))
    worker: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    # ``rangeprof evaluate --json`` of the request.
    report: Mapped[dict[str, Any] | None]

    run: Mapped[Run] = relationship()
