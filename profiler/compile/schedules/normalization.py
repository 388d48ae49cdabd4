"""Row reductions with an elementwise epilogue: layer norm, softmax (and a fused quantize).

TVM legalizes them as whole-tensor passes: layer norm a sum, a mean, a variance sum and the
normalize; softmax a maximum, an exp, an exp sum and the division. The generic schedule runs each
reduction as its own parallel pass over memory, serial over the reduced axis (LLVM keeps a float
sum in program order: one scalar add per element).

Here every block is computed per row of the output, right before that row's epilogue:

* The output block's row loops are fused and ``parallel``; its last axis (the reduced one) is
  vectorised.
* Each reduction is computed at the row, its reduced axis split by 16 and ``rfactor``-ed: 16
  partial sums (or maxima) in registers, vectorised, then summed across lanes once per row.
  This reorders the float sum (within rounding of TVM's default) the same way in every build
  that holds the kernel, whatever its epilogue: the profiling build stays bitwise equal to its
  uninstrumented build. A reduced axis that 4 does not divide stays serial.
* A full-row intermediate that several blocks read (softmax's exp) is kept, computed at the row
  into a row-sized buffer: exp is evaluated once per element, and the row stays in cache between
  the sum and the division. Everything else is inlined.

Softmax's ``exp`` is vectorised arithmetic (:data:`~.activations.lower_vector_math`).
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from rangeprof.profiler.compile.schedules.elementwise import (
    PARALLEL_MIN,
    VECTOR,
    inline_all,
    is_reduction,
    largest_divisor,
    root_blocks,
)


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
    """Names of the non-output spatial blocks shaped like the output (softmax's exp)."""
    shape = [int(iv.dom.extent) for iv in sch.get(out).iter_vars]
    return {
        sch.get(b).name_hint
        for b in root_blocks(sch)
        if not is_reduction(sch, b)
        and not sch.get(b).same_as(sch.get(out))
        and [int(iv.dom.extent) for iv in sch.get(b).iter_vars] == shape
    }


def _vectorize_row(sch: s_tir.Schedule, loop, width: int) -> None:
    lanes = largest_divisor(width, VECTOR)
    if lanes > 1:
        _, inner = sch.split(loop, [None, lanes])
        sch.vectorize(inner)


def _rfactor(sch: s_tir.Schedule, block, width: int):
    """Splits the reduced axis of a root reduction block into 16 (or fewer) lanes of partial
    reductions (a local buffer) and one reduction across them; None when no lanes fit."""
    lanes = largest_divisor(width, VECTOR)
    if lanes < 4:
        return None
    *_, k = sch.get_loops(block)
    _, ki = sch.split(k, [None, lanes])
    partial = sch.rfactor(ki, factor_axis=len(sch.get(block).iter_vars) - 1)
    sch.set_scope(partial, 0, "local")
    return partial


def _vectorize_partial(sch: s_tir.Schedule, partial) -> None:
    """Puts the lanes of the partial reductions innermost, vectorised, their init apart."""
    *_, first, second = sch.get_loops(partial)
    realize = sch.get(second).body
    lane_var = next(
        value
        for iv, value in zip(realize.block.iter_vars, realize.iter_values, strict=True)
        if iv.iter_type == tirx.IterVar.DataPar
        and any(value.same_as(sch.get(lp).loop_var) for lp in (first, second))
    )
    ko, ki = (first, second) if lane_var.same_as(sch.get(second).loop_var) else (second, first)
    sch.reorder(ko, ki)
    sch.vectorize(ki)
    sch.decompose_reduction(partial, ko)


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
    partials = [p for p in (_rfactor(sch, b, width) for b in reductions) if p is not None]
    loops = sch.get_loops(out)
    row = sch.fuse(*loops[:-1]) if len(loops) > 2 else loops[0]
    blocks = [b for b in root_blocks(sch) if not sch.get(b).same_as(sch.get(out))]
    for block in reversed(blocks):
        sch.compute_at(block, row)
    # Before the inits are split off: TIR parallelises and vectorises only whole reductions.
    if math.prod(rows) > 1 and math.prod(rows) * width >= PARALLEL_MIN:
        sch.parallel(row)
    for partial in partials:
        _vectorize_partial(sch, partial)
    for block in blocks:
        if not is_reduction(sch, block):
            _vectorize_row(sch, sch.get_loops(block)[-1], width)
    _vectorize_row(sch, sch.get_loops(out)[-1], width)
    return True
