"""INT8 builds of a run's ranges (``rangeprof build``), queued and executed by the worker like
runs; the artifact is a zip of ``model.so`` and ``manifest.json``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Form, Request, status
from fastapi.responses import FileResponse
from pydantic import ValidationError
from sqlalchemy import select

from rangeprof.workflows.options import STORED, QuantizeOptions
from rangeprof.workflows.requests import BuildRequest

from . import catalog
from .auth import Owner
from .catalog import ARTIFACT_SUFFIX
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
from .estimate import accept
from .execute import BUILD
from .job_requests import (
    ARTIFACT_FOLDER,
    PROFILE_FILE,
    QPARAMS_FILE,
    calibration_data,
    invalid_body,
    job_request,
    model_file,
    npz_ref,
)
from .limits import check_run_options
from .models import Build, Model, QParamsSet
from .schemas import (
    ENDED,
    BuildOptions,
    BuildOut,
    BuildSummary,
    BuildUpload,
    ErrorOut,
    ObjectId,
)
from .uploads import UploadError, stage_evaluation_data

router = APIRouter(tags=["builds"], route_class=RetriedReads)
_NOT_DONE = {409: {"model": ErrorOut, "description": "The run (or build) is not done."}}
_FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")
# Beside the form, which FastAPI documents, a build takes its options as a JSON object.
_JSON_BODY = {
    "requestBody": {"content": {"application/json": {"schema": BuildOptions.model_json_schema()}}}
}
_BUDGET_DATA = ("key", "labels", "labels_key", "samples")  # what goes with `data`


def _own_build(session, owner: int, build_id: int) -> Build:
    build = session.scalar(
        select(Build).join(Model).where(Build.id == build_id, Model.owner_id == owner)
    )
    if build is None:
        raise not_found("build", build_id)
    return build


def _summary(build: Build) -> dict:
    request = build.request
    derived = request.qparams is None  # else the stored set's method
    return {
        "id": build.id,
        "model_id": build.model_id,
        "run_id": build.run_id,
        "qparams_id": build.qparams_id,
        "target": request.target,
        "method": request.method if derived else None,
        "percentile": request.percentile if derived else None,
        "weight_bits": request.weight_bits,
        "data": npz_ref(request.data, build.data_sha256),
        "labels": npz_ref(request.labels, build.labels_sha256),
        "status": build.status,
        "progress": build.progress,
        "phase": build.phase,
        "artifact_sha256": build.artifact_sha256,
        "timings": build.timings,
        "created_at": build.created_at,
        "started_at": build.started_at,
        "finished_at": build.finished_at,
        "error": build.error,
        "request": request,
    }


def _build_out(build: Build) -> BuildOut:
    return BuildOut(**_summary(build), manifest=build.manifest)


async def _json_body(request: Request) -> BuildUpload | None:
    """The options of a build asked for with a JSON body (or none: the defaults), as the form
    without files they stand for; ``None`` for a form, which FastAPI reads."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in _FORMS:
        return None
    try:
        options = BuildOptions.model_validate_json(await request.body() or b"{}")
    except ValidationError as err:
        raise invalid_body(err) from None
    # A JSON null qparams_id is no stored set, as if left out (a form has no null).
    return BuildUpload.model_validate(options.model_dump(exclude_unset=True, exclude_none=True))


def _check_budget_data(body: BuildUpload) -> None:
    """The evaluation data's fields come with ``data``, and ``data`` with an accuracy budget
    (a budget without data is the request's own refusal)."""
    given = [name for name in _BUDGET_DATA if getattr(body, name) is not None]
    if body.data is None and given:
        fields = ", ".join(f"'{name}'" for name in given)
        raise UploadError(f"{fields}: these go with 'data', the accuracy budget's evaluation data")
    if body.data is not None and body.accuracy_budget is None:
        raise UploadError("'data' is the evaluation data of an accuracy budget: give one")


@router.post(
    "/api/runs/{run_id}/builds",
    status_code=status.HTTP_202_ACCEPTED,
    responses={400: {"model": ErrorOut}, 413: {"model": ErrorOut}, **_NOT_DONE},
    openapi_extra=_JSON_BODY,
)
def create_build(
    service: ServiceDep,
    owner: Owner,
    run_id: ObjectId,
    form: Annotated[BuildUpload, Form(media_type="multipart/form-data")],
    json_body: Annotated[BuildUpload | None, Depends(_json_body)],
) -> BuildOut:
    """Queue an INT8 build of the run's model for ``target``; poll ``GET /api/builds/{id}``.
    The options come as a JSON object or as a form; an accuracy budget needs a form, with the
    evaluation data (and labels) it is measured on, checked as an evaluation's before anything
    is stored."""
    body = form if json_body is None else json_body
    _check_budget_data(body)
    derived = body.qparams_id is None
    if not derived and body.model_fields_set & {"method", "percentile"}:
        raise UploadError("give qparams_id or method / percentile, not both")
    with service.db.session() as session:
        run = done_run(session, owner, run_id)
        model = run.model
        calibration = calibration_data(run, body.bias_correction)
        check_queue(session, owner, service.limits)
        if not derived and body.bias_correction == STORED:
            raise UploadError("'bias_correction' 'stored' reads the run's profile: not qparams_id")
        if not derived:
            qparams = session.get(QParamsSet, body.qparams_id)
            if qparams is None or qparams.run_id != run_id:
                raise UploadError(f"run {run_id} has no qparams {body.qparams_id}")
    check_run_options(service.limits, samples=body.samples)
    estimate = accept(service.db, model, BUILD, data=body.data is not None)
    with service.store.scratch() as folder:
        uploaded = None
        if body.data is not None:
            uploaded = stage_evaluation_data(
                folder,
                service.limits,
                model.inputs,
                body.data,
                body.key,
                body.labels,
                body.labels_key,
                body.samples,
                tokens=body.metric == "bpc",
            )
            estimate.refuse_over_time(uploaded.samples, service.limits.max_job_seconds)
        options = body.model_dump(include=set(QuantizeOptions.model_fields))
        if not derived:  # the stored set's method
            options = {k: v for k, v in options.items() if k not in ("method", "percentile")}
        request = job_request(
            BuildRequest,
            model=model_file(model),
            out=ARTIFACT_FOLDER,
            **({"profile": PROFILE_FILE} if derived else {"qparams": QPARAMS_FILE}),
            input_shapes=model.input_shapes,
            data=uploaded and uploaded.data,
            labels=uploaded and uploaded.labels,
            calibration_data=calibration,
            **options,
        )
        build = Build(
            model_id=model.id,
            run_id=run_id,
            qparams_id=body.qparams_id,
            request=request,
            data_sha256=uploaded and uploaded.data_sha256,
            labels_sha256=uploaded and uploaded.labels_sha256,
        )
        build_id = catalog.add_job(
            service.db, service.store, build, uploaded.staged if uploaded else {}
        )
    if service.worker is not None:
        service.worker.wake()
    return get_build(service, owner, build_id)


@router.get("/api/runs/{run_id}/builds")
def list_builds(service: ServiceDep, owner: Owner, run_id: ObjectId) -> list[BuildSummary]:
    """The run's builds without their manifests."""
    with service.db.read() as session:
        own_run(session, owner, run_id)
        builds = session.scalars(select(Build).where(Build.run_id == run_id).order_by(Build.id))
        return [BuildSummary(**_summary(b)) for b in builds]


@router.get("/api/builds/{build_id}")
def get_build(service: ServiceDep, owner: Owner, build_id: ObjectId) -> BuildOut:
    """Status and progress of a build and the request it runs; once done, the artifact's
    manifest (regions with their profileIDs, qparams and modes, layers kept FP32) and its
    sha256."""
    with service.db.read() as session:
        return _build_out(_own_build(session, owner, build_id))


@router.post(
    "/api/builds/{build_id}/cancel",
    responses=ENDED,
)
def cancel_build(service: ServiceDep, owner: Owner, build_id: ObjectId) -> BuildOut:
    """Cancel a queued or running build (see ``POST /api/runs/{id}/cancel``)."""
    with service.db.session() as session:
        cancelled(_own_build(session, owner, build_id))
    with service.db.session() as session:
        return _build_out(_own_build(session, owner, build_id))


@router.get(
    "/api/builds/{build_id}/artifact",
    response_class=FileResponse,
    responses={200: {"content": {"application/zip": {}}}, **_NOT_DONE},
)
def get_artifact(service: ServiceDep, owner: Owner, build_id: ObjectId) -> FileResponse:
    """The artifact: a zip of ``model.so`` and ``manifest.json``, as ``rangeprof build`` writes
    them to its ``--out`` folder."""
    with service.db.read() as session:
        build = _own_build(session, owner, build_id)
        require_done(build, "build", build_id)
        name = f"{build.model.name}-{build.request.target}-build{build.id}.zip"
        path = service.store.path(build.artifact_sha256, ARTIFACT_SUFFIX)
    return FileResponse(path, media_type="application/zip", filename=name)
