"""Evaluations of a run's ranges: FP32 vs INT8 per layer (``rangeprof evaluate``), queued and
executed by the worker like runs, or uploaded as a ``rangeprof evaluate --json`` report."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, status
from fastapi.responses import Response
from sqlalchemy import select

from rangeprof.profiler.export.formats import MODEL_EXPLORER
from rangeprof.workflows.options import CalibrationOptions, QuantizeOptions
from rangeprof.workflows.profiling import calibration_options, evaluation_report, render_export
from rangeprof.workflows.requests import EvaluateRequest

from . import catalog
from .auth import Owner
from .context import (
    RetriedReads,
    ServiceDep,
    cancelled,
    check_queue,
    done_run,
    not_found,
    own_run,
    require_done,
)
from .documents import load_profile, zipped
from .estimate import accept
from .execute import EVALUATE
from .job_requests import PROFILE_FILE, calibration_data, job_request, model_file, npz_ref
from .limits import check_run_options
from .models import Evaluation, Model, Run, TensorStat, utcnow
from .schemas import (
    ENDED,
    ErrorOut,
    EvaluationOut,
    EvaluationReport,
    EvaluationRequest,
    EvaluationSummary,
    ObjectId,
    ProfileDocument,
)
from .uploads import UploadError, stage_evaluation_data

router = APIRouter(tags=["evaluations"], route_class=RetriedReads)
_REFUSED = {
    400: {"model": ErrorOut},
    409: {"model": ErrorOut, "description": "The run is not done."},
    413: {"model": ErrorOut},
}


def _summary(evaluation: Evaluation) -> dict:
    report = evaluation.report or {}
    request = evaluation.request
    if request is None:  # an uploaded report says what was run
        options = {
            "method": report["method"],
            "target": report["target"],
            "weight_bits": report.get("weight_bits", 8),
            "percentile": None,
            "samples": report["samples"],
        }
    else:
        options = request.model_dump(
            include={"method", "target", "weight_bits", "percentile", "samples"}
        )
    return {
        "id": evaluation.id,
        "run_id": evaluation.run_id,
        "source": evaluation.source,
        "status": evaluation.status,
        "progress": evaluation.progress,
        "phase": evaluation.phase,
        **options,
        "data": request and npz_ref(request.data, evaluation.data_sha256),
        "labels": request and npz_ref(request.labels, evaluation.labels_sha256),
        "created_at": evaluation.created_at,
        "started_at": evaluation.started_at,
        "finished_at": evaluation.finished_at,
        "error": evaluation.error,
        "output_sqnr_db": report.get("output_sqnr_db"),
        "agreement": report.get("agreement"),
        "int8_top1": report.get("int8_top1"),
        "request": request,
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
    """Queue an evaluation of the run's ranges with ``method`` (``all``: every method) on
    ``target``. Data and labels are checked (against the model's inputs; 1-D integer labels,
    enough of them) before anything is stored; poll ``GET /api/evaluations/{id}``."""
    with service.db.session() as session:
        run = done_run(session, owner, run_id)
        model = run.model
        calibration = calibration_data(run, form.bias_correction)
        check_queue(session, owner, service.limits)
    check_run_options(service.limits, samples=form.samples)
    estimate = accept(service.db, model, EVALUATE)
    with service.store.scratch() as folder:
        uploaded = stage_evaluation_data(
            folder,
            service.limits,
            model.inputs,
            form.data,
            form.key,
            form.labels,
            form.labels_key,
            form.samples,
            tokens=form.metric == "bpc",
        )
        estimate.refuse_over_time(uploaded.samples, service.limits.max_job_seconds)
        request = job_request(
            EvaluateRequest,
            model=model_file(model),
            profile=PROFILE_FILE,
            input_shapes=model.input_shapes,
            data=uploaded.data,
            labels=uploaded.labels,
            calibration_data=calibration,
            **form.model_dump(include=set(QuantizeOptions.model_fields)),
        )
        evaluation = Evaluation(
            run_id=run_id,
            source="service",
            request=request,
            data_sha256=uploaded.data_sha256,
            labels_sha256=uploaded.labels_sha256,
        )
        evaluation_id = catalog.add_job(service.db, service.store, evaluation, uploaded.staged)
    if service.worker is not None:
        service.worker.wake()
    return _get(service, owner, evaluation_id)


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
        progress=1.0,
        created_at=now,
        finished_at=now,
        report=report.to_json(),
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


@router.get(
    "/api/evaluations/{evaluation_id}/model-explorer",
    response_class=Response,
    responses={
        200: {"content": {"application/zip": {}}},
        409: {"model": ErrorOut, "description": "The evaluation is not done."},
    },
)
def evaluation_overlays(service: ServiceDep, owner: Owner, evaluation_id: ObjectId) -> Response:
    """The Model Explorer overlays of the evaluation's run with its figures (per-layer SQNR,
    layers kept FP32): the zip of what ``rangeprof export --format model-explorer --evaluation``
    writes."""
    with service.db.read() as session:
        evaluation = _own_evaluation(session, owner, evaluation_id)
        require_done(evaluation, "evaluation", evaluation_id)
        run = evaluation.run
        doc = ProfileDocument.from_json(load_profile(session, run))
        model = service.store.path(run.model.sha256, catalog.MODEL_SUFFIX)
        report = evaluation_report(evaluation.report)
    options, _ = calibration_options(CalibrationOptions())  # overlays show no scales
    files = render_export(doc, MODEL_EXPLORER, options, model, report)
    name = f"{doc.model.name}.evaluation{evaluation_id}.{MODEL_EXPLORER}.zip"
    return Response(
        zipped(files),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
