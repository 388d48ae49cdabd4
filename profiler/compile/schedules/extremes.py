"""``max``, ``min``, ``argmax`` and ``argmin`` of floats that see infinities.

TOPI reduces a float ``max`` from the lowest *finite* value (``min_value``), so a row of
``-inf`` (an attention row whose every key is masked) comes out as ``-3.4e38``: the masked-row
test ``ReduceMax(bias) == -inf`` of ONNX's Attention body fails and the row keeps a NaN softmax.
Its ``argmax`` starts from index -1 with the same value and, compared strictly, answers -1 for
such a row. Legalized instead from ``∓inf``, with the first index of the extreme (ONNX's and
numpy's ``select_last_index=0``); an empty reduction is then ``∓inf`` as ONNX defines it.
Integer types keep TVM's.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx


def _axes(x: te.Tensor, axis) -> list[int]:
    ndim = len(x.shape)
    return list(range(ndim)) if axis is None else sorted({int(a) % ndim for a in axis})


def _reduce(x: te.Tensor, axis, keepdims: bool, reducer, name: str):
    """``x`` reduced over ``axis`` by ``reducer`` (applied to the tuple of ``x`` and the flat
    index over the reduced axes, or to ``x`` alone)."""
    axes = _axes(x, axis)
    ranges = {a: te.reduce_axis((0, x.shape[a]), name=f"k{a}") for a in axes}
    # keepdims: every axis indexes the output (a reduced one at 0); else only the kept ones
    outer_axes = (
        list(range(len(x.shape)))
        if keepdims
        else [a for a in range(len(x.shape)) if a not in ranges]
    )
    shape = [1 if a in ranges else x.shape[a] for a in outer_axes]

    def compute(*index):
        outer = dict(zip(outer_axes, index, strict=True))
        full = [ranges[a].var if a in ranges else outer[a] for a in range(len(x.shape))]
        flat = tirx.const(0, "int64")
        for a in axes:
            flat = flat * tirx.Cast("int64", x.shape[a]) + tirx.Cast("int64", ranges[a].var)
        return reducer(x[tuple(full)], flat, [ranges[a] for a in axes])

    return te.compute(shape, compute, name=name)


def _extreme(larger: bool):
    def combine(a, b):
        return tirx.max(a, b) if larger else tirx.min(a, b)

    def identity(dtype):
        return tirx.const(float("-inf") if larger else float("inf"), dtype)

    reducer = te.comm_reducer(combine, identity, name="max" if larger else "min")
    return lambda value, _flat, axes: reducer(value, axis=axes)


def _arg_extreme(larger: bool):
    def combine(a, b):
        better = a[1] > b[1] if larger else a[1] < b[1]
        # On a tie the lower index; a starting index of -1 never wins one.
        take_a = tirx.Or(better, tirx.And(a[1] == b[1], tirx.Or(a[0] < b[0], b[0] < 0)))
        take_a = tirx.And(take_a, a[0] >= 0)
        return tirx.Select(take_a, a[0], b[0]), tirx.Select(take_a, a[1], b[1])

    def identity(index_dtype, value_dtype):
        edge = float("-inf") if larger else float("inf")
        return tirx.const(-1, index_dtype), tirx.const(edge, value_dtype)

    reducer = te.comm_reducer(combine, identity, name="argmax" if larger else "argmin")
    return lambda value, flat, axes: reducer((flat, value), axis=axes)


def _legalize(op: str, larger: bool, arg: bool):
    default = tvm.ir.Op.get(op).get_attr("FLegalize")

    def legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
        data = call.args[0]
        if "float" not in str(data.ty.dtype):
            return default(bb, call)
        reducer = (_arg_extreme if arg else _extreme)(larger)
        name = op.split(".")[-1]
        axis = call.attrs.axis
        if arg:
            axis = None if axis is None else [axis]

        def te_func(x):
            out = _reduce(x, axis, bool(call.attrs.keepdims), reducer, name)
            return out[0] if arg else out

        return bb.call_te(te_func, data, primfunc_name_hint=name)

    return legalize


LEGALIZE = {
    "relax.max": _legalize("relax.max", larger=True, arg=False),
    "relax.min": _legalize("relax.min", larger=False, arg=False),
    "relax.argmax": _legalize("relax.argmax", larger=True, arg=True),
    "relax.argmin": _legalize("relax.argmin", larger=False, arg=True),
}
