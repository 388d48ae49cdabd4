"""A model's layer table, searched, sorted and paged in SQL so that a model with thousands of
layers costs one page of rows per request; with a done run, each row carries the run's min/max
and the scale every calibration method suggests.

Scales are computed for the rows of the page only (entropy's threshold search costs ~20 ms per
2048-bin histogram) and memoised: a done run's statistics never change, and the key includes
the run's finish time, so a run id that SQLite reuses after a deletion gets no stale entry.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

from sqlalchemy import and_, func, or_, select

from rangeprof.profiler.calibrate.methods import METHODS, CalibrationOptions, is_static, qparams_for
from rangeprof.workflows.options import CalibrationOptions as Asked
from rangeprof.workflows.profiling import calibration_options

from .db import Database
from .documents import IDENTITY
from .models import Layer, Run, TensorStat
from .schemas import LayerPage, LayerQuery, LayerRow, TensorQuery

_CACHE_ENTRIES = 50_000
_SORT = {
    "position": Layer.position,
    "profile_id": Layer.profile_id,
    "kind": Layer.kind,
    "op": Layer.op,
    "source_node": Layer.source_node,
    "min": TensorStat.min,
    "max": TensorStat.max,
}


class _Scales:
    """A bounded, thread-safe memo of suggested scales."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[tuple, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, entry: dict, query: LayerQuery) -> dict[str, float]:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        scales = {m: qparams_for(entry, calibration(query, m, entry)).scale for m in METHODS}
        with self._lock:
            self._entries[key] = scales
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return scales


_scales = _Scales(_CACHE_ENTRIES)


def calibration(
    query: LayerQuery | TensorQuery, method: str = "max", entry: dict | None = None
) -> CalibrationOptions:
    """Per-tensor options of ``method`` for the tensor ``entry``: the query's scheme, dtype and
    percentile, the target's grid where not given — its weights' for weights and other static
    tensors, its activations' for the rest."""
    asked = Asked(
        target=query.target,
        method=method,
        percentile=query.percentile,
        scheme=query.scheme,
        dtype=query.dtype,
        granularity="per-tensor",
    )
    activations, weights = calibration_options(asked)
    static = entry is not None and is_static(entry)
    grid = weights if static and query.scheme is None and query.dtype is None else activations
    return replace(grid, method=method, percentile=query.percentile, granularity="per-tensor")


def tensor_entry(stat: TensorStat) -> dict:
    """The profile document's entry of a ``tensor_stat`` row."""
    return {**{k: getattr(stat, k) for k in IDENTITY}, **stat.stats}


def layer_page(db: Database, model_id: int, run: Run | None, query: LayerQuery) -> LayerPage:
    run_id = run.id if run else None
    joined = and_(TensorStat.run_id == run_id, TensorStat.profile_id == Layer.profile_id)
    where = [Layer.model_id == model_id]
    if query.q:
        needle = query.q.lower()
        where.append(
            or_(
                *(
                    func.lower(column).contains(needle, autoescape=True)
                    for column in (Layer.profile_id, Layer.op, Layer.source_node)
                )
            )
        )
    column = _SORT[query.sort]
    ordered = column.desc() if query.order == "desc" else column.asc()
    with db.read() as session:
        total = session.scalar(select(func.count()).select_from(Layer).where(*where))
        rows = session.execute(
            select(Layer, TensorStat)
            .outerjoin(TensorStat, joined)
            .where(*where)
            .order_by(ordered.nulls_last(), Layer.position)
            .offset(query.offset)
            .limit(query.limit)
        ).all()
    # Scales outside the transaction: on SQLite it holds the write lock the worker needs.
    return LayerPage(
        model_id=model_id,
        run_id=run_id,
        total=total,
        offset=query.offset,
        limit=query.limit,
        rows=[_row(layer, stat, run, query) for layer, stat in rows],
    )


def _row(layer: Layer, stat: TensorStat | None, run: Run | None, query: LayerQuery) -> LayerRow:
    scales = {}
    if stat is not None:
        options = (query.target, query.scheme, query.dtype, query.percentile)
        key = (run.id, run.finished_at.isoformat(), layer.profile_id, *options)
        scales = _scales.get(key, tensor_entry(stat), query)
    return LayerRow(
        position=layer.position,
        profile_id=layer.profile_id,
        kind=layer.kind,
        op=layer.op,
        source_node=layer.source_node,
        source_op=layer.source_op,
        shape=layer.shape,
        dtype=layer.dtype,
        min=None if stat is None else stat.min,
        max=None if stat is None else stat.max,
        scales=scales,
    )
