"""``/api/models``: upload, list, show and delete ONNX models."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Response, status
from sqlalchemy import select

from . import catalog
from .auth import Owner
from .context import RetriedReads, ServiceDep, not_found, own_model
from .limits import copy_file
from .models import Model
from .schemas import ErrorOut, ModelOut, ModelSummary, ModelUpload, ObjectId
from .uploads import analyse_model

router = APIRouter(prefix="/api/models", tags=["models"], route_class=RetriedReads)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    responses={400: {"model": ErrorOut}, 413: {"model": ErrorOut}},
)
def upload_model(
    service: ServiceDep,
    owner: Owner,
    form: Annotated[ModelUpload, Form(media_type="multipart/form-data")],
) -> ModelOut:
    """Upload an ONNX model; it is loaded and tracked (as ``rangeprof inspect``) before
    anything is stored, and the response lists its layers with their profileIDs."""
    with service.store.scratch() as folder:
        staged = folder / "model.onnx"
        limit = service.limits.max_model_bytes
        sha256 = copy_file(form.file.file, staged, "the model file", limit)
        analysis = analyse_model(staged, sha256, form.file.filename, form.input_shapes)
        model_id = catalog.add_model(service.db, service.store, owner, analysis)
    with service.db.session() as session:
        return ModelOut.model_validate(own_model(session, owner, model_id, layers=True))


@router.get("")
def list_models(service: ServiceDep, owner: Owner) -> list[ModelSummary]:
    with service.db.read() as session:
        models = session.scalars(select(Model).where(Model.owner_id == owner).order_by(Model.id))
        return [ModelSummary.model_validate(m) for m in models]


@router.get("/{model_id}")
def get_model(service: ServiceDep, owner: Owner, model_id: ObjectId) -> ModelOut:
    with service.db.read() as session:
        return ModelOut.model_validate(own_model(session, owner, model_id, layers=True))


@router.delete("/{model_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_model(service: ServiceDep, owner: Owner, model_id: ObjectId) -> Response:
    """Delete the model, its runs and everything derived from them, and its stored files."""
    if not catalog.delete_model(service.db, service.store, owner, model_id):
        raise not_found("model", model_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
