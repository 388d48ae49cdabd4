"""Dense, matmul and batch matmul: prepacked-weight legalization and a register-tiled schedule.

Legalization: ``matmul(x, W)`` with a constant 2-D float32 ``W[K, N]`` (an ONNX Gemm / MatMul
with weights, after ``Canonicalize`` folded its transpose) becomes ``dense_packed`` with ``W``
repacked at build time to ``[N/nb, K, nb]``: each reduction step reads ``nb`` contiguous output
columns (``nb`` = two, one or half a vector register of the target, dividing ``N``; where none
divides it, ``W`` is padded with zero columns to whole vectors and a copy drops the padding
columns of the output). Other matmuls (two activations, as in attention) keep TVM's
legalization, whose block is named ``matmul``.

Schedule (both kinds, loops ``batch…, m, n, k``):

* The epilogue (bias, GELU, residual add) is inlined into one output block computed per tile.
* Register tile ``Tm × nb``: ``m`` split by ``Tm`` (unrolled), ``n`` by ``nb`` (vectorised), the
  reduction ``k`` outside both, so ``Tm × nb/lanes`` accumulators stay in registers while
  each ``k`` step broadcasts ``Tm`` values of ``x`` against one row of weights.
* ``parallel`` over the fused ``batch…, m/Tm, n/nb`` tiles.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir, te

from rangeprof.profiler.compile.schedules.elementwise import (
    extent,
    inline_epilogue,
    largest_divisor,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.isa import VectorUnit, vector_unit

DENSE = "dense_packed"
MATMUL = "matmul"  # the block name of TVM's own matmul legalization
COLUMNS = "dense_columns"


def _column_block(n: int, unit: VectorUnit) -> int:
    """Output columns per packed weight block: two vectors, one, half, else a divisor."""
    for nb in (2 * unit.lanes, unit.lanes, unit.lanes // 2):
        if n % nb == 0:
            return nb
    return largest_divisor(n, 2 * unit.lanes)


def _vectorised(nb: int, unit: VectorUnit) -> bool:
    """Whether a block of ``nb`` columns fills whole vectors (of at least 4 lanes)."""
    return nb % max(4, unit.lanes // 2) == 0


def _padded_column_block(n: int, unit: VectorUnit) -> int:
    """The packed block of ``n`` columns: :func:`_column_block` where a vector fits, else
    two vectors (one for fewer columns), the last block padded with zero weights — a
    recognizer's 6625 classes would otherwise be packed 5 wide and never vectorised."""
    nb = _column_block(n, unit)
    if _vectorised(nb, unit):
        return nb
    return 2 * unit.lanes if n > 2 * unit.lanes else unit.lanes


def dense_packed(data, weight, columns: int):
    """``out[…, m, n] = Σ_k x[…, m, k] · w[n / nb, k, n % nb]`` for ``n < columns``; a packed
    weight padded past ``columns`` is computed in full and its padding columns dropped."""
    blocks, k_dim, nb = (int(d) for d in weight.shape)
    k = te.reduce_axis((0, k_dim), "k")
    out = te.compute(
        (*data.shape[:-1], blocks * nb),
        lambda *idx: te.sum(data[(*idx[:-1], k)] * weight[idx[-1] // nb, k, idx[-1] % nb], axis=k),
        name=DENSE,
    )
    return out if blocks * nb == columns else first_columns(out, columns)


def first_columns(out, columns: int):
    """``out[…, :columns]``: a dense computed on padded columns, the padding dropped (a copy
    that the schedules inline into the epilogue's output block)."""
    return te.compute((*out.shape[:-1], columns), lambda *idx: out[idx], name=COLUMNS)


def legalize_matmul(bb: relax.BlockBuilder, call: relax.Call):
    """``matmul`` with a constant float32 ``[K, N]`` right operand → ``dense_packed``."""
    data, weight = call.args
    constant = isinstance(weight, tvm.ir.expr.GenericConst)
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype), str(call.ty.dtype)}
    if not constant or weight.ty.ndim != 2 or data.ty.ndim < 2 or dtypes != {"float32"}:
        return tvm.ir.Op.get("relax.matmul").get_attr("FLegalize")(bb, call)
    w = weight.value.numpy()
    k_dim, n = w.shape
    nb = _padded_column_block(n, vector_unit())
    w = np.pad(w, ((0, 0), (0, -n % nb)))
    packed = np.ascontiguousarray(w.reshape(k_dim, -1, nb).transpose(1, 0, 2))
    packed_weight = relax.const(packed, "float32")
    return bb.call_te(dense_packed, data, packed_weight, n, primfunc_name_hint=DENSE)


def _find_matmul(sch: s_tir.Schedule):
    for name in (DENSE, MATMUL):
        try:
            return sch.get_sblock(name)
        except Exception:  # FuseTIR keeps block names: absent when this is no matmul
            continue
    return None


def schedule_dense(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding a (packed or plain) matmul; False when there is none."""
    block = _find_matmul(sch)
    if block is None:
        return False
    *batch, m, n, k = sch.get_loops(block)
    unit = vector_unit()
    nb = _column_block(extent(sch, n), unit)
    if not _vectorised(nb, unit):
        return False  # no vector width fits the columns: the generic schedule does as well
    if sch.get(block).name_hint == DENSE and batch:
        # The weights are shared by every row: all leading axes form one M (a [128, 1, K]
        # activation is 128 rows, not 128 batches of one).
        m, batch = sch.fuse(*batch, m), []
    rows = unit.tile(extent(sch, m), nb)

    out = inline_epilogue(sch, block)
    mo, mi = sch.split(m, [None, rows])
    no, ni = sch.split(n, [None, nb])
    sch.reorder(*batch, mo, no, k, mi, ni)
    outer = sch.fuse(*batch, mo, no)
    sch.parallel(outer)
    sch.reverse_compute_at(out, outer)
    sch.set_scope(block, 0, "local")
    sch.unroll(mi)
    sch.vectorize(ni)
    init = sch.decompose_reduction(block, k)
    unroll_vectorize_tile(sch, init, out)
    return True
