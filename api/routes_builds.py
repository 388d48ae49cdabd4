"""INT8 builds of a run's ranges (``rangeprof build``), queued and executed by the worker like
runs; the artifact is a zip of ``model.so`` and ``manifest.json``."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status
from fastapi.responses import FileResponse
from sqlalchemy import select

from .auth import Owner
from .catalog import ARTIFACT_SUFFIX
from .context import RetriedReads, ServiceDep, cancelled, check_queue, done_run, not_found, own_run
from .models import Build, Model, QParamsSet
from .schemas import ENDED, BuildOut, BuildRequest, BuildSummary, ErrorOut, ObjectId
from .uploads import UploadError

router = APIRouter(tags=["builds"], route_class=RetriedReads)
_NOT_DONE = {409: {"model": ErrorOut, "description": "The run (or build) is not done."}}


def _own_build(session, owner: int, build_id: int) -> Build:
    build = session.scalar(
        select(Build).join(Model).where(Build.id == build_id, Model.owner_id == owner)
    )
    if build is None:
        raise not_found("build", build_id)
    return build


@router.post(
    "/api/runs/{run_id}/builds",
    status_code=status.HTTP_202_ACCEPTED,
    responses={400: {"model": ErrorOut}, **_NOT_DONE},
)
def create_build(
    service: ServiceDep, owner: Owner, run_id: ObjectId, body: BuildRequest | None = None
) -> BuildOut:
    """Queue an INT8 build of the run's model for ``target``; poll ``GET /api/builds/{id}``."""
    body = body or BuildRequest()
    derived = body.qparams_id is None
    if not derived and body.model_fields_set & {"method", "percentile"}:
        raise UploadError("give qparams_id or method / percentile, not both")
    with service.db.session() as session:
        run = done_run(session, owner, run_id)
        check_queue(session, owner, service.limits)
        if not derived:
            qparams = session.get(QParamsSet, body.qparams_id)
            if qparams is None or qparams.run_id != run_id:
                raise UploadError(f"run {run_id} has no qparams {body.qparams_id}")
        build = Build(
            model_id=run.model_id,
            run_id=run_id,
            qparams_id=body.qparams_id,
            target=body.target,
            method=body.method if derived else None,
            percentile=body.percentile if derived else None,
            weight_bits=body.weight_bits,
        )
        session.add(build)
    if service.worker is not None:
        service.worker.wake()
    return get_build(service, owner, build.id)


@router.get("/api/runs/{run_id}/builds")
def list_builds(service: ServiceDep, owner: Owner, run_id: ObjectId) -> list[BuildSummary]:
    """The run's builds without their manifests."""
    with service.db.read() as session:
        own_run(session, owner, run_id)
        builds = session.scalars(select(Build).where(Build.run_id == run_id).order_by(Build.id))
        return [BuildSummary.model_validate(b) for b in builds]


@router.get("/api/builds/{build_id}")
def get_build(service: ServiceDep, owner: Owner, build_id: ObjectId) -> BuildOut:
    """Status and progress of a build; once done, the artifact's manifest (regions with their
    profileIDs, qparams and modes) and its sha256."""
    with service.db.read() as session:
        return BuildOut.model_validate(_own_build(session, owner, build_id))


@router.post(
    "/api/builds/{build_id}/cancel",
    responses=ENDED,
)
def cancel_build(service: ServiceDep, owner: Owner, build_id: ObjectId) -> BuildOut:
    """Cancel a queued or running build (see ``POST /api/runs/{id}/cancel``)."""
    with service.db.session() as session:
        cancelled(_own_build(session, owner, build_id))
    with service.db.session() as session:
        return BuildOut.model_validate(_own_build(session, owner, build_id))


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
        if build.status != "done":
            why = f": {build.error}" if build.error else ""
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"build {build_id} is {build.status}{why}"
            )
        name = f"{build.model.name}-{build.target}-build{build.id}.zip"
        path = service.store.path(build.artifact_sha256, ARTIFACT_SUFFIX)
    return FileResponse(path, media_type="application/zip", filename=name)
