"""Evaluations of a run's ranges: FP32 vs INT8 per layer (``rangeprof evaluate``), queued and
executed by the worker like runs, or uploaded as a ``rangeprof evaluate --json`` report."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, status
from sqlalchemy import select

from . import catalog
from .auth import Owner
from .context import RetriedReads, ServiceDep, cancelled, check_queue, done_run, not_found, own_run
from .limits import check_run_options, check_unpacked, copy_file
from .models import Evaluation, Model, Run, TensorStat, utcnow
from .schemas import (
    ENDED,
    ErrorOut,
    EvaluationOut,
    EvaluationReport,
    EvaluationRequest,
    EvaluationSummary,
    NpzRef,
    ObjectId,
)
from .uploads import UploadError, check_data, check_labels, data_spec, file_stem

router = APIRouter(tags=["evaluations"], route_class=RetriedReads)
_REFUSED = {
    400: {"model": ErrorOut},
    409: {"model": ErrorOut, "description": "The run is not done."},
    413: {"model": ErrorOut},
}


def _npz(name: str | None, key: str | None, sha256: str | None) -> NpzRef | None:
    return None if name is None else NpzRef(name=name, key=key, sha256=sha256)


def _summary(evaluation: Evaluation) -> dict:
    report = evaluation.report or {}
    return {
        "id": evaluation.id,
        "run_id": evaluation.run_id,
        "source": evaluation.source,
        "status": evaluation.status,
        "progress": evaluation.progress,
        "phase": evaluation.phase,
        "method": evaluation.method,
        "target": evaluation.target,
        "weight_bits": evaluation.weight_bits,
        "percentile": evaluation.percentile,
        "samples": evaluation.samples,
        "data": _npz(evaluation.data_name, evaluation.data_key, evaluation.data_sha256),
        "labels": _npz(evaluation.labels_name, evaluation.labels_key, evaluation.labels_sha256),
        "created_at": evaluation.created_at,
        "started_at": evaluation.started_at,
        "finished_at": evaluation.finished_at,
        "error": evaluation.error,
        "output_sqnr_db": report.get("output_sqnr_db"),
        "agreement": report.get("agreement"),
        "int8_top1": report.get("int8_top1"),
    }


def _own_evaluation(session, owner: int, evaluation_id: int) -> Evaluation:
    evaluation = session.scalar(
        select(Evaluation)
        .join(Run)
        .join(Model)
        .where(Evaluation.id == evaluation_id, Model.owner_id == owner)
    )
    if evaluation is None:
        raise not_found("evaluation", evaluation_id)
    return evaluation


@router.post(
    "/api/runs/{run_id}/evaluations", status_code=status.HTTP_202_ACCEPTED, responses=_REFUSED
)
def create_evaluation(
    service: ServiceDep,
    owner: Owner,
    run_id: ObjectId,
    form: Annotated[EvaluationRequest, Form(media_type="multipart/form-data")],
) -> EvaluationOut:
    """Queue an evaluation of the run's ranges with ``method`` on ``target``. Data and labels
    are checked (against the model's inputs; 1-D integer labels, enough of them) before
    anything is stored; poll ``GET /api/evaluations/{id}``."""
    with service.db.session() as session:
        inputs = done_run(session, owner, run_id).model.inputs
        check_queue(session, owner, service.limits)
    limits = service.limits
    limit = limits.max_data_bytes
    check_run_options(limits, samples=form.samples)
    with service.store.scratch() as folder:
        data_name = file_stem(form.data.filename, ".npz") + ".npz"
        data_sha = copy_file(form.data.file, folder / data_name, "the data file", limit)
        check_unpacked(folder / data_name, "the data file", limits.max_unpacked_bytes)
        spec = data_spec(data_name, form.key)
        count = check_data(
            folder, spec, inputs, samples=form.samples, seed=0, max_samples=limits.max_samples
        )
        staged = {data_sha: folder / data_name}
        labels_name = labels_sha = labels_key = None
        if form.labels is not None:
            uploaded = file_stem(form.labels.filename, ".npz") + ".npz"
            path = folder / "labels" / uploaded  # a folder of its own: the names may be equal
            path.parent.mkdir()
            labels_sha = copy_file(form.labels.file, path, "the labels file", limit)
            check_unpacked(path, "the labels file", limits.max_unpacked_bytes)
            labels_key = check_labels(path, uploaded, form.labels_key, count)
            staged.setdefault(labels_sha, path)
            labels_name = _labels_name(uploaded, labels_sha, data_name, data_sha)
        elif form.labels_key is not None:
            labels_key = check_labels(folder / data_name, data_name, form.labels_key, count)
            labels_name, labels_sha = data_name, data_sha
        evaluation = Evaluation(
            run_id=run_id,
            source="service",
            method=form.method,
            target=form.target,
            weight_bits=form.weight_bits,
            percentile=form.percentile,
            samples=form.samples,
            data_name=data_name,
            data_key=form.key,
            data_sha256=data_sha,
            labels_name=labels_name,
            labels_key=labels_key,
            labels_sha256=labels_sha,
        )
        evaluation_id = catalog.add_evaluation(service.db, service.store, evaluation, staged)
    if service.worker is not None:
        service.worker.wake()
    return _get(service, owner, evaluation_id)


def _labels_name(uploaded: str, sha256: str, data_name: str, data_sha: str) -> str:
    """The name the evaluation's process sees the labels under, beside the data."""
    if sha256 == data_sha:
        return data_name  # one file for both
    return f"labels-{uploaded}" if uploaded == data_name else uploaded


@router.post(
    "/api/runs/{run_id}/evaluations/report",
    status_code=status.HTTP_201_CREATED,
    responses=_REFUSED,
)
def upload_report(
    service: ServiceDep, owner: Owner, run_id: ObjectId, report: EvaluationReport
) -> EvaluationOut:
    """Store a report of ``rangeprof evaluate --json`` made with this run's profile; its layers
    must be profileIDs of the run."""
    with service.db.session() as session:
        done_run(session, owner, run_id)
        known = set(
            session.scalars(select(TensorStat.profile_id).where(TensorStat.run_id == run_id))
        )
    unknown = [layer.profile_id for layer in report.layers if layer.profile_id not in known]
    if unknown:
        raise UploadError(
            f"the report's layer {unknown[0]!r} is not a profileID of run {run_id} "
            "(a report of another model?)"
        )
    now = utcnow()
    evaluation = Evaluation(
        run_id=run_id,
        source="report",
        status="done",
        method=report.method,
        target=report.target,
        weight_bits=report.weight_bits,
        samples=report.samples,
        progress=1.0,
        created_at=now,
        finished_at=now,
        report=report.model_dump(mode="json", exclude_unset=True),
    )
    with service.db.session() as session:
        session.add(evaluation)
    return _get(service, owner, evaluation.id)


@router.get("/api/runs/{run_id}/evaluations")
def list_evaluations(
    service: ServiceDep, owner: Owner, run_id: ObjectId
) -> list[EvaluationSummary]:
    """The run's evaluations without their per-layer reports."""
    with service.db.read() as session:
        own_run(session, owner, run_id)
        evaluations = session.scalars(
            select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.id)
        )
        return [EvaluationSummary(**_summary(e)) for e in evaluations]


@router.get("/api/evaluations/{evaluation_id}")
def get_evaluation(service: ServiceDep, owner: Owner, evaluation_id: ObjectId) -> EvaluationOut:
    """Status and progress of an evaluation; once done, its report: per layer (by the
    profileID of its output) isolated and accumulated SQNR, worst isolated first."""
    return _get(service, owner, evaluation_id)


@router.post(
    "/api/evaluations/{evaluation_id}/cancel",
    responses=ENDED,
)
def cancel_evaluation(service: ServiceDep, owner: Owner, evaluation_id: ObjectId) -> EvaluationOut:
    """Cancel a queued or running evaluation (see ``POST /api/runs/{id}/cancel``)."""
    with service.db.session() as session:
        cancelled(_own_evaluation(session, owner, evaluation_id))
    return _get(service, owner, evaluation_id)


def _get(service, owner: int, evaluation_id: int) -> EvaluationOut:
    with service.db.session() as session:
        evaluation = _own_evaluation(session, owner, evaluation_id)
        return EvaluationOut(**_summary(evaluation), report=evaluation.report)
