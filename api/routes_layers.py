"""A model's layers as the dashboard reads them: the searchable, sortable, paged layer table,
one tensor's statistics with every method's clipping range, and a layer's lineage."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from sqlalchemy import select

from rangeprof.profiler.calibrate.methods import METHODS, qparams_for

from .auth import Owner
from .context import RetriedReads, ServiceDep, done_run, not_found, own_model
from .layer_table import calibration, layer_page, tensor_entry
from .lineage import layer_lineage
from .models import Layer, TensorStat
from .schemas import (
    ErrorOut,
    LayerPage,
    LayerQuery,
    LineageOut,
    ObjectId,
    TensorOut,
    TensorQuery,
    Text,
)

router = APIRouter(tags=["layers"], route_class=RetriedReads)
_BAD = {400: {"model": ErrorOut}, 409: {"model": ErrorOut, "description": "The run is not done."}}


def _missing(profile_id: str, where: str) -> HTTPException:
    return HTTPException(status.HTTP_404_NOT_FOUND, f"no layer {profile_id!r} in {where}")


@router.get("/api/models/{model_id}/layers", responses=_BAD)
def list_layers(
    service: ServiceDep, owner: Owner, model_id: ObjectId, query: Annotated[LayerQuery, Query()]
) -> LayerPage:
    """The model's layers matching ``q``, sorted and paged; with ``run``, each row has the run's
    min/max and the scale each calibration method suggests."""
    with service.db.read() as session:
        own_model(session, owner, model_id)
        run = None if query.run is None else done_run(session, owner, query.run)
    if run is not None and run.model_id != model_id:
        raise not_found("run", run.id)
    return layer_page(service.db, model_id, run, query)


@router.get("/api/runs/{run_id}/tensor", responses=_BAD)
def get_tensor(
    service: ServiceDep, owner: Owner, run_id: ObjectId, query: Annotated[TensorQuery, Query()]
) -> TensorOut:
    """One tensor of a run: its profile entry (histogram, per-channel ranges) and the clipping
    range and scale of every calibration method."""
    with service.db.read() as session:
        run = done_run(session, owner, run_id)
        stat = session.scalar(
            select(TensorStat).where(
                TensorStat.run_id == run_id, TensorStat.profile_id == query.profile_id
            )
        )
    if stat is None:
        raise _missing(query.profile_id, f"run {run_id}")
    entry = tensor_entry(stat)
    return TensorOut(
        run_id=run_id,
        model_id=run.model_id,
        entry=entry,
        qparams={m: qparams_for(entry, calibration(query, m, entry)).to_json() for m in METHODS},
    )


@router.get("/api/models/{model_id}/lineage")
def get_lineage(
    service: ServiceDep,
    owner: Owner,
    model_id: ObjectId,
    profile_id: Annotated[Text, Query(description="An initial profileID of the model.")],
) -> LineageOut:
    """What the layer became after each stage, and what each of those bindings holds."""
    with service.db.read() as session:
        model = own_model(session, owner, model_id)
        known = session.scalar(
            select(Layer.id).where(Layer.model_id == model_id, Layer.profile_id == profile_id)
        )
    if known is None:
        raise _missing(profile_id, f"model {model_id}")
    return layer_lineage(model_id, model.stages, profile_id)
