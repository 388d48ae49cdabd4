"""The debug handle: profileIDs carried on the spans of Relax expressions.

Identity lives in the IR itself, so any pass that keeps an expression keeps its identity. A
binding's value carries a span whose source name is a profileID, or a ``SequentialSpan`` of such
spans when the value derives from several initial-IR nodes (a conv that absorbed a batch norm).
Weights carry their profileID on their ``Constant`` the same way.

Only this module knows the encoding; everything else calls :func:`ids_of` and :func:`with_ids`.
"""

from __future__ import annotations

from collections.abc import Iterable

import tvm
from tvm import relax

_NO_IDS: frozenset[str] = frozenset()


def _span(profile_id: str) -> tvm.ir.Span:
    return tvm.ir.Span(tvm.ir.SourceName(profile_id), 0, 0, 0, 0)


def make_span(ids: Iterable[str]) -> tvm.ir.Span | tvm.ir.SequentialSpan | None:
    """The span that encodes ``ids`` (sorted, so equal sets give equal spans)."""
    ordered = sorted(set(ids))
    if not ordered:
        return None
    if len(ordered) == 1:
        return _span(ordered[0])
    return tvm.ir.SequentialSpan([_span(i) for i in ordered])


def span_ids(span) -> frozenset[str]:
    """The profileIDs encoded in a span (empty for ``None`` or a span that is not ours)."""
    if span is None:
        return _NO_IDS
    if isinstance(span, tvm.ir.SequentialSpan):
        return frozenset(str(s.source_name.name) for s in span.spans)
    return frozenset([str(span.source_name.name)])


def ids_of(expr) -> frozenset[str]:
    """The profileIDs carried by an expression."""
    return span_ids(getattr(expr, "span", None))


def with_ids(expr: relax.Expr, ids: Iterable[str]) -> relax.Expr:
    """A copy of ``expr`` carrying exactly ``ids``; leaves that carry no identity are returned.

    Calls keep their inferred type (``ret_ty``) so the copy needs no re-normalisation, which
    would otherwise rebuild the call and drop the span.
    """
    span = make_span(ids)
    if isinstance(expr, tvm.ir.Call):
        return relax.Call(expr.op, expr.args, expr.attrs, expr.ty_args, span=span, ret_ty=expr.ty)
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(expr.tuple_value, expr.index, span=span)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple(expr.fields, span=span)
    if isinstance(expr, tvm.ir.GenericConst):
        return tvm.ir.GenericConst(expr.value, expr.ty, span=span)
    return expr
