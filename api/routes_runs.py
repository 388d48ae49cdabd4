"""Profiling runs and what is derived from them: the profile, exports, qparams and drift."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, HTTPException, Query, status
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from sqlalchemy import select

from rangeprof.profiler.calibrate.methods import CalibrationOptions
from rangeprof.profiler.export.formats import MODEL_EXPLORER, QDQ, export
from rangeprof.profiler.profiling.data import RANDOM
from rangeprof.workflows.options import ProfileOptions
from rangeprof.workflows.profiling import (
    calibrate_profile,
    calibration_options,
    evaluation_report,
    render_export,
    report_html,
)
from rangeprof.workflows.requests import ProfileRequest

from . import catalog
from .auth import Owner
from .context import (
    RetriedReads,
    ServiceDep,
    cancelled,
    check_queue,
    done_run,
    own_model,
    own_run,
    require_done,
)
from .documents import load_profile, tensor_rows, zipped
from .drift import tensor_drift
from .estimate import accept
from .execute import PROFILE
from .job_requests import job_request, model_file
from .limits import check_run_options, check_unpacked, copy_file
from .models import Evaluation, QParamsSet, Run
from .schemas import (
    ENDED,
    CalibrationRequest,
    DriftOut,
    ErrorOut,
    EvaluationReport,
    ExportQuery,
    ObjectId,
    ProfileDocument,
    QParamsOut,
    ReportQuery,
    RunData,
    RunOptions,
    RunOut,
    RunRequest,
)
from .uploads import UploadError, check_data, data_spec, file_stem, split_spec

router = APIRouter(tags=["runs"], route_class=RetriedReads)
_CONFLICT = {409: {"model": ErrorOut, "description": "The run is not done."}}
_JSON_FORMATS = ("aimet", "ort-json")


def run_out(run: Run) -> RunOut:
    request = run.request
    name, key = (None, None) if request.data == RANDOM else split_spec(request.data)
    return RunOut(
        id=run.id,
        model_id=run.model_id,
        status=run.status,
        progress=run.progress,
        samples_done=run.samples_done,
        samples_total=run.samples_total,
        options=RunOptions.model_validate(request),
        data=RunData(
            kind="random" if name is None else "npz", name=name, key=key, sha256=run.data_sha256
        ),
        request=request,
        created_at=run.created_at,
        started_at=run.started_at,
        finished_at=run.finished_at,
        timings=run.timings,
        error=run.error,
    )


def _check_source(form: RunRequest) -> None:
    if (form.data is None) == (form.random is None):
        raise UploadError(
            "give calibration data: an .npz file in field 'data', or a sample count in field "
            "'random' (one of them)"
        )
    if form.random is not None and (form.samples is not None or form.key is not None):
        raise UploadError("fields 'samples' and 'key' go with 'data'; 'random' is the count")


@router.post(
    "/api/models/{model_id}/runs",
    status_code=status.HTTP_202_ACCEPTED,
    responses={400: {"model": ErrorOut}, 413: {"model": ErrorOut}},
)
def create_run(
    service: ServiceDep,
    owner: Owner,
    model_id: ObjectId,
    form: Annotated[RunRequest, Form(media_type="multipart/form-data")],
) -> RunOut:
    """Queue a profiling run. The data is checked against the model's inputs (names, shapes,
    dtypes, no pickles) and read through before the run is stored; poll ``GET /api/runs/{id}``."""
    with service.db.session() as session:
        model = own_model(session, owner, model_id)
        check_queue(session, owner, service.limits)
    _check_source(form)
    limits = service.limits
    samples = form.random or form.samples
    check_run_options(limits, samples=samples, bins=form.bins, batch_size=form.batch_size)
    estimate = accept(service.db, model, PROFILE, batch=form.batch_size, bins=form.bins)
    with service.store.scratch() as folder:
        staged = sha256 = name = None
        if form.data is not None:
            name = file_stem(form.data.filename, ".npz") + ".npz"
            staged = folder / name
            sha256 = copy_file(form.data.file, staged, "the data file", limits.max_data_bytes)
            check_unpacked(staged, "the data file", limits.max_unpacked_bytes)
        spec = data_spec(name, form.key)
        count = check_data(
            folder,
            spec,
            model.inputs,
            samples=samples,
            seed=form.seed,
            max_samples=limits.max_samples,
            allow_nonfinite=form.allow_nonfinite,
            cast=form.cast,
        )
        estimate.refuse_over_time(count, limits.max_job_seconds)
        options = form.model_dump(include=set(ProfileOptions.model_fields))
        request = job_request(
            ProfileRequest,
            model=model_file(model),
            data=spec,
            input_shapes=model.input_shapes,
            **(options | {"samples": samples}),
        )
        run = Run(model_id=model_id, request=request, data_sha256=sha256)
        run_id = catalog.add_run(service.db, service.store, run, staged)
    if service.worker is not None:
        service.worker.wake()
    with service.db.session() as session:
        return run_out(own_run(session, owner, run_id))


@router.get("/api/models/{model_id}/runs")
def list_runs(service: ServiceDep, owner: Owner, model_id: ObjectId) -> list[RunOut]:
    with service.db.read() as session:
        own_model(session, owner, model_id)
        runs = session.scalars(select(Run).where(Run.model_id == model_id).order_by(Run.id))
        return [run_out(run) for run in runs]


@router.get("/api/runs/{run_id}")
def get_run(service: ServiceDep, owner: Owner, run_id: ObjectId) -> RunOut:
    """Status and progress of a run."""
    with service.db.read() as session:
        return run_out(own_run(session, owner, run_id))


@router.post(
    "/api/runs/{run_id}/cancel",
    responses=ENDED,
)
def cancel_run(service: ServiceDep, owner: Owner, run_id: ObjectId) -> RunOut:
    """Cancel a queued or running run: it ends ``cancelled``, its process (if any) stopped
    within seconds and its scratch files removed."""
    with service.db.session() as session:
        cancelled(own_run(session, owner, run_id))
    with service.db.session() as session:
        return run_out(own_run(session, owner, run_id))


@router.get("/api/runs/{run_id}/profile", response_model=ProfileDocument, responses=_CONFLICT)
def get_profile(service: ServiceDep, owner: Owner, run_id: ObjectId) -> JSONResponse:
    """The profile JSON, exactly as ``rangeprof profile`` writes it."""
    with service.db.read() as session:
        doc = load_profile(session, done_run(session, owner, run_id))
    return JSONResponse(doc)  # stored as written: served as is


def _calibration(options: ExportQuery) -> CalibrationOptions:
    """The pipeline's options of the asked ones: the target's policy where not given."""
    activations, _ = calibration_options(options, options.format)
    return activations


@router.get(
    "/api/runs/{run_id}/export",
    response_class=PlainTextResponse,
    responses={
        200: {
            "content": {
                "application/octet-stream": {},
                "application/json": {},
                "application/zip": {},
            }
        },
        400: {"model": ErrorOut},
        404: {"model": ErrorOut},
        **_CONFLICT,
    },
)
def export_run(
    service: ServiceDep,
    owner: Owner,
    run_id: ObjectId,
    query: Annotated[ExportQuery, Query()],
) -> Response:
    """The run's ranges in another tool's format, as ``rangeprof export`` writes them; ``qdq``:
    the run's model with QuantizeLinear / DequantizeLinear pairs (``application/octet-stream``);
    ``model-explorer``: a zip of the Model Explorer overlays ``rangeprof export --format
    model-explorer`` writes (an evaluation's figures too: ``GET
    /api/evaluations/{id}/model-explorer``)."""
    options = _calibration(query)
    with service.db.read() as session:
        run = done_run(session, owner, run_id)
        doc = load_profile(session, run)
        model_sha256 = run.model.sha256
    if query.format == QDQ:
        import onnx

        from rangeprof.profiler.export.qdq_model import qdq_model

        data = service.store.path(model_sha256, catalog.MODEL_SUFFIX).read_bytes()
        exported = qdq_model(onnx.load_model_from_string(data), doc, options)
        name = f"{doc['model']['name']}.run{run_id}.int8.onnx"
        return Response(
            exported.SerializeToString(),
            media_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )
    if query.format == MODEL_EXPLORER:
        model = service.store.path(model_sha256, catalog.MODEL_SUFFIX)
        files = render_export(ProfileDocument.from_json(doc), MODEL_EXPLORER, options, model)
        name = f"{doc['model']['name']}.run{run_id}.{MODEL_EXPLORER}.zip"
        return Response(
            zipped(files),
            media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )
    media = "application/json" if query.format in _JSON_FORMATS else "text/plain"
    return PlainTextResponse(export(doc, query.format, options), media_type=media)


def _evaluation(session, run_id: int, evaluation_id: int | None) -> EvaluationReport | None:
    """The report of evaluation ``evaluation_id`` of the run (the caller's, as the run is);
    404 for another run's, 409 while it is not done."""
    if evaluation_id is None:
        return None
    evaluation = session.get(Evaluation, evaluation_id)
    if evaluation is None or evaluation.run_id != run_id:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"evaluation {evaluation_id} of run {run_id} not found"
        )
    require_done(evaluation, "evaluation", evaluation_id)
    return evaluation_report(evaluation.report)


@router.get(
    "/api/runs/{run_id}/report",
    response_class=HTMLResponse,
    responses={400: {"model": ErrorOut}, 404: {"model": ErrorOut}, **_CONFLICT},
)
def report_run(
    service: ServiceDep, owner: Owner, run_id: ObjectId, query: Annotated[ReportQuery, Query()]
) -> HTMLResponse:
    """The static HTML report ``rangeprof report`` writes of the run's profile: its ranges, the
    scales the target uses (``target``; by default the evaluation's, else x86), histograms and,
    with a done evaluation of the run (``evaluation``), the per-layer error."""
    with service.db.read() as session:
        doc = ProfileDocument.from_json(load_profile(session, done_run(session, owner, run_id)))
        evaluation = _evaluation(session, run_id, query.evaluation)
    html = report_html(doc, evaluation, query.target)
    name = f"{doc.model.name}.run{run_id}.report.html"
    return HTMLResponse(html, headers={"Content-Disposition": f'inline; filename="{name}"'})


@router.post(
    "/api/runs/{run_id}/qparams",
    status_code=status.HTTP_201_CREATED,
    responses={400: {"model": ErrorOut}, **_CONFLICT},
)
def create_qparams(
    service: ServiceDep, owner: Owner, run_id: ObjectId, body: CalibrationRequest | None = None
) -> QParamsOut:
    """Quantization parameters from the run's statistics, as ``rangeprof calibrate``."""
    with service.db.session() as session:
        doc = load_profile(session, done_run(session, owner, run_id))
    document = calibrate_profile(doc, body or CalibrationRequest())
    qparams = QParamsSet(run_id=run_id, options=document["options"], document=document)
    with service.db.session() as session:
        session.add(qparams)
    return QParamsOut.model_validate(qparams)


@router.get("/api/runs/{run_id}/qparams")
def list_qparams(service: ServiceDep, owner: Owner, run_id: ObjectId) -> list[QParamsOut]:
    with service.db.read() as session:
        own_run(session, owner, run_id)
        sets = session.scalars(
            select(QParamsSet).where(QParamsSet.run_id == run_id).order_by(QParamsSet.id)
        )
        return [QParamsOut.model_validate(q) for q in sets]


@router.get("/api/runs/{a}/compare/{b}", responses=_CONFLICT)
def compare_runs(service: ServiceDep, owner: Owner, a: ObjectId, b: ObjectId) -> DriftOut:
    """Per-profileID drift from run ``a`` to run ``b``: range change, histogram distance."""
    with service.db.read() as session:
        rows = [tensor_rows(session, done_run(session, owner, r).id) for r in (a, b)]
    theirs = {row.profile_id: row for row in rows[1]}
    ours = {row.profile_id for row in rows[0]}
    if not ours & set(theirs):
        raise HTTPException(
            status.HTTP_400_BAD_REQUEST, f"runs {a} and {b} have no profileID in common"
        )
    return DriftOut(
        a=a,
        b=b,
        tensors=[
            tensor_drift(row.profile_id, row.kind, row.stats, theirs[row.profile_id].stats)
            for row in rows[0]
            if row.profile_id in theirs
        ],
        only_in_a=[row.profile_id for row in rows[0] if row.profile_id not in theirs],
        only_in_b=[row.profile_id for row in rows[1] if row.profile_id not in ours],
    )
