"""Row reductions with an elementwise epilogue: layer norm, softmax (and a fused quantize).

TVM legalizes them as whole-tensor passes: layer norm a sum, a mean, a variance sum and the
normalize; softmax a maximum, an exp, an exp sum and the division. The generic schedule runs each
reduction as its own parallel pass over memory, serial over the reduced axis (LLVM keeps a float
sum in program order: one scalar add per element).

Here every block is computed per row of the output, right before that row's epilogue:

* The output block's row loops are fused, split into groups of 4 rows, and ``parallel`` over
  the groups; its last axis (the reduced one) is vectorised.
* Each reduction is computed at the row, its reduced axis split by 16 and ``rfactor``-ed: 16
  partial sums (or maxima) in a register, vectorised, then summed across lanes once per row.
  This reorders the float sum (within rounding of TVM's default) the same way in every build
  that holds the kernel, whatever its epilogue: the profiling build stays bitwise equal to its
  uninstrumented build. A reduced axis that 4 does not divide stays serial. The rows of a
  group are reduced side by side, each step adding to every row's sums (a row alone is a chain
  of dependent adds the core waits on: layer norm 1.5× slower), each row in its own order.
* A full-row intermediate that several blocks read (softmax's exp) is kept, computed at the row
  into a row-sized buffer: exp is evaluated once per element, and the row stays in cache between
  the sum and the division. Everything else is inlined (the division into a fused quantize).

Softmax's ``exp`` is vectorised arithmetic (:data:`~.activations.lower_vector_math`). Softmax
over the last axis is legalized as TOPI's but for its normalization (:func:`legalize_softmax`):
each ``exp`` times the reciprocal of its row's sum, as onnxruntime's MLAS normalizes: a scalar
division per vector of the row (LLVM broadcasts it) instead of a vector division, which costs
what a dozen multiplies do.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax, s_tir, te, tirx

from rangeprof.profiler.compile.schedules.elementwise import (
    PARALLEL_MIN,
    VECTOR,
    inline_all,
    is_reduction,
    largest_divisor,
    root_blocks,
)


def _softmax(x: te.Tensor) -> te.Tensor:
    """TOPI's softmax over the last axis, its blocks and their names, the division by the row's
    sum a product with its reciprocal (within an ulp of the quotient)."""
    *rows, width = x.shape
    k1, k2 = te.reduce_axis((0, width), "k"), te.reduce_axis((0, width), "k")
    maxelem = te.compute(rows, lambda *r: te.max(x[(*r, k1)], axis=k1), name="T_softmax_maxelem")
    exp = te.compute(x.shape, lambda *i: te.exp(x[i] - maxelem[i[:-1]]), name="T_softmax_exp")
    expsum = te.compute(rows, lambda *r: te.sum(exp[(*r, k2)], axis=k2), name="T_softmax_expsum")
    one = tirx.const(1.0, x.dtype)
    return te.compute(x.shape, lambda *i: exp[i] * (one / expsum[i[:-1]]), name="T_softmax_norm")


def legalize_softmax(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``softmax`` of float32 over its last axis as :func:`_softmax`; others as TVM's."""
    x = call.args[0]
    if str(x.ty.dtype) == "float32" and int(call.attrs.axis) in (-1, x.ty.ndim - 1):
        return bb.call_te(_softmax, x, primfunc_name_hint="softmax")
    return tvm.ir.Op.get("relax.nn.softmax").get_attr("FLegalize")(bb, call)


# Rows whose reductions run side by side: a row's sums are chains of dependent adds (16
# partial sums, then across the lanes), 4-cycle latency each, which one row alone leaves idle.
_INTERLEAVED = 4


def _rows_then_reduce(sch: s_tir.Schedule, block, rows: list[int], width: int) -> bool:
    """Whether a reduction block runs over the output's rows and reduces their last axis."""
    ivs = sch.get(block).iter_vars
    spatial = [int(iv.dom.extent) for iv in ivs[:-1]]
    last = ivs[-1]
    return (
        all(iv.iter_type == tirx.IterVar.DataPar for iv in ivs[:-1])
        and last.iter_type == tirx.IterVar.CommReduce
        and spatial == rows
        and int(last.dom.extent) == width
        and len(sch.get_loops(block)) == len(ivs)
    )


def _full_rows(sch: s_tir.Schedule, out) -> set[str]:
    """Names of the non-output spatial blocks shaped like the output that several blocks read
    (softmax's exp, read by its sum and its division); one read once (the division, before a
    fused quantize) is inlined into its reader."""
    shape = [int(iv.dom.extent) for iv in sch.get(out).iter_vars]
    return {
        sch.get(b).name_hint
        for b in root_blocks(sch)
        if not is_reduction(sch, b)
        and not sch.get(b).same_as(sch.get(out))
        and [int(iv.dom.extent) for iv in sch.get(b).iter_vars] == shape
        and len(sch.get_consumers(b)) > 1
    }


def _vectorize_row(sch: s_tir.Schedule, loop, width: int) -> None:
    lanes = largest_divisor(width, VECTOR)
    if lanes > 1:
        _, inner = sch.split(loop, [None, lanes])
        sch.vectorize(inner)


def _rfactor(sch: s_tir.Schedule, block, width: int):
    """Splits the reduced axis of a root reduction block into 16 (or fewer) lanes of partial
    reductions and one reduction across them, when at least 4 lanes fit. The partials keep the
    global scope: TVM places a small global buffer on the stack, where LLVM keeps it in a
    register, but a ``local`` one in a workspace it allocates per row, where every step of the
    reduction loads and stores it (softmax 1.5× slower)."""
    lanes = largest_divisor(width, VECTOR)
    if lanes >= 4:
        *_, k = sch.get_loops(block)
        _, ki = sch.split(k, [None, lanes])
        sch.rfactor(ki, factor_axis=len(sch.get(block).iter_vars) - 1)


def _roles(sch: s_tir.Schedule, block, row) -> dict[str, object]:
    """The block's loops below ``row`` by what they run over: ``reduce`` (the reduced axis),
    ``rows`` (the rows interleaved under ``row``) and ``lanes`` (a partial reduction's)."""
    loops = sch.get_loops(block)
    below = loops[[sch.get(lp).same_as(sch.get(row)) for lp in loops].index(True) + 1 :]
    realize = sch.get(below[-1]).body
    outer = sch.get(row).loop_var
    roles = {}
    for loop in below:
        var = sch.get(loop).loop_var
        for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True):
            used = tirx.analysis.undefined_vars(value)
            if not any(v.same_as(var) for v in used):
                continue
            if iv.iter_type != tirx.IterVar.DataPar:
                roles["reduce"] = loop
            elif any(v.same_as(outer) for v in used):
                roles["rows"] = loop
            else:
                roles["lanes"] = loop
    return roles


def _interleave(sch: s_tir.Schedule, block, row) -> None:
    """A reduction computed at ``row``: its reduced loop outside the rows, which are unrolled
    (each step then adds to the partial sums of every row, independent chains the core
    overlaps), a partial reduction's lanes innermost and vectorised, the init split off. Each
    row still adds in the same order."""
    roles = _roles(sch, block, row)
    order = [roles[r] for r in ("reduce", "rows", "lanes") if r in roles]
    if len(order) > 1:
        sch.reorder(*order)
    if "rows" in roles:
        sch.unroll(roles["rows"])
    if "lanes" in roles:
        sch.vectorize(roles["lanes"])
    if "reduce" in roles:  # none where the lanes cover the row: no loop
        sch.decompose_reduction(block, roles["reduce"])


def schedule_normalization(sch: s_tir.Schedule) -> bool:
    """Schedules row reductions followed by a per-element epilogue; False when the PrimFunc is
    no such kernel."""
    blocks = root_blocks(sch)
    outputs = sch.get_output_blocks(sch.get_sblock("root"))
    if len(outputs) != 1 or not any(is_reduction(sch, b) for b in blocks):
        return False
    out = outputs[0]
    if is_reduction(sch, out) or len(sch.get(out).iter_vars) < 2:
        return False
    inline_all(sch, keep=_full_rows(sch, out))
    out = sch.get_output_blocks(sch.get_sblock("root"))[0]
    *rows, width = [int(iv.dom.extent) for iv in sch.get(out).iter_vars]
    blocks = [b for b in root_blocks(sch) if not sch.get(b).same_as(sch.get(out))]
    reductions = [b for b in blocks if is_reduction(sch, b)]
    if not all(_rows_then_reduce(sch, b, rows, width) for b in reductions):
        return False
    for block in blocks:
        if not is_reduction(sch, block) and len(sch.get_loops(block)) != len(rows) + 1:
            return False  # a per-row scalar left uninlined: not a shape we schedule
    for block in reductions:
        _rfactor(sch, block, width)
    loops = sch.get_loops(out)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    together = largest_divisor(math.prod(rows), _INTERLEAVED)
    if together > 1:
        row, _ = sch.split(row, [None, together])
    blocks = [b for b in root_blocks(sch) if not sch.get(b).same_as(sch.get(out))]
    for block in reversed(blocks):
        sch.compute_at(block, row)
    # Before the inits are split off: TIR parallelises and vectorises only whole reductions.
    if math.prod(rows) > together and math.prod(rows) * width >= PARALLEL_MIN:
        sch.parallel(row)
    for block in blocks:
        if is_reduction(sch, block):
            _interleave(sch, block, row)
        else:
            _vectorize_row(sch, sch.get_loops(block)[-1], width)
    _vectorize_row(sch, sch.get_loops(out)[-1], width)
    return True
