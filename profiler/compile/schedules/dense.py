"""Dense, matmul and batch matmul: prepacked-weight legalization and a register-tiled schedule.

Legalization: ``matmul(x, W)`` with a constant float32 ``W[K, N]`` (an ONNX Gemm / MatMul
with weights, after ``Canonicalize`` folded its transpose; or ``[1, K, N]``, an LSTM's recurrent
weights of one direction) becomes ``dense_packed`` with ``W`` repacked at build time to
``[N/nb, K, nb]``: each reduction step reads ``nb`` contiguous output columns (``nb`` = two, one
or half a vector register of the target, dividing ``N``; four vectors for a matrix-vector
product (at most :data:`GEMV_ROWS` rows), whose tile has no rows to multiply its accumulators
by). Where no vector width divides ``N``, ``W`` is padded with zero columns to whole vectors and
a copy drops the padding columns of the output. Other matmuls (two activations, as in
attention) keep TVM's legalization, whose block is named ``matmul``.

Schedule (both kinds, loops ``batch…, m, n, k``):

* The epilogue (bias, GELU, residual add) is inlined into one output block computed per tile.
* Register tile ``Tm × nb``: ``m`` split by ``Tm`` (unrolled), ``n`` by ``nb`` (vectorised), the
  reduction ``k`` outside both, so ``Tm × nb/lanes`` accumulators stay in registers while
  each ``k`` step broadcasts ``Tm`` values of ``x`` against one row of weights.
* ``parallel`` over the fused ``batch…, m/Tm, n/nb`` tiles, unless the whole product is too
  small to pay for waking the thread pool (an LSTM step's ``h · Rᵀ``).
"""

from __future__ import annotations

import math

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
GEMV_ROWS = 4  # up to this many rows, a matmul is packed and tiled as matrix-vector products
# Below this many multiply-adds (a few µs on one core) a matmul runs on one core: waking the
# thread pool would cost more than it saves.
PARALLEL_MACS = 1 << 17
MATMUL = "matmul"  # the block name of TVM's own matmul legalization
COLUMNS = "dense_columns"


def _column_block(n: int, unit: VectorUnit, gemv: bool = False) -> int:
    """Output columns per packed weight block: (four vectors for a matrix-vector product,)
    two vectors, one, half, else a divisor."""
    widths = (2 * unit.lanes, unit.lanes, unit.lanes // 2)
    for nb in (4 * unit.lanes, *widths) if gemv else widths:
        if n % nb == 0:
            return nb
    return largest_divisor(n, 2 * unit.lanes)


def _vectorised(nb: int, unit: VectorUnit) -> bool:
    """Whether a block of ``nb`` columns fills whole vectors (of at least 4 lanes)."""
    return nb % max(4, unit.lanes // 2) == 0


def _padded_column_block(n: int, unit: VectorUnit, gemv: bool) -> int:
    """The packed block of ``n`` columns: :func:`_column_block` where a vector fits (a whole one
    for a matrix-vector product), else the widest block of :func:`_column_block` not wider than
    ``n`` (one vector for fewer columns), the last block padded with zero weights — a
    recognizer's 6625 classes would otherwise be packed 5 wide and never vectorised, and a
    classifier's 1000 on one register of 8 lanes would wait on the latency of each FMA."""
    nb = _column_block(n, unit, gemv)
    if nb % unit.lanes == 0 or (_vectorised(nb, unit) and not gemv):
        return nb
    widths = (4 * unit.lanes, 2 * unit.lanes) if gemv else (2 * unit.lanes,)
    return next((w for w in widths if n > w), unit.lanes)


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


_MATMUL, _SLICE = tvm.ir.Op.get("relax.matmul"), tvm.ir.Op.get("relax.strided_slice")


def _sliced_constant(call) -> np.ndarray | None:
    """The value of ``strided_slice`` of a constant with constant bounds (forward strides)."""
    if not (isinstance(call, relax.Call) and call.op.same_as(_SLICE)):
        return None
    data, *bounds = call.args
    if not isinstance(data, tvm.ir.expr.GenericConst):
        return None
    if not all(isinstance(b, tvm.tirx.IntImm) for bound in bounds for b in bound.fields):
        return None  # a bound known at run time only
    bounds = [[b.value for b in bound.fields] for bound in bounds]
    axes, begin, end, strides = (*bounds, [1] * len(bounds[0]))[:4]
    if any(s <= 0 for s in strides):
        return None
    index = [slice(None)] * data.ty.ndim
    for axis, b, e, step in zip(axes, begin, end, strides, strict=True):
        index[axis] = slice(b, e, step)
    return data.value.numpy()[tuple(index)]


@relax.expr_functor.mutator
class _SlicedWeights(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.constants: list[tuple[relax.Var, relax.Expr]] = []

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (call.op.same_as(_MATMUL) and isinstance(call.args[1], relax.Var)):
            return call
        weight = self._constant(call.args[1])
        if weight is None:
            return call
        return relax.Call(call.op, [call.args[0], weight], call.attrs, call.ty_args, call.span)

    def _constant(self, var: relax.Var) -> relax.Expr | None:
        """One constant per sliced variable: its steps share one packed copy."""
        known = next((c for v, c in self.constants if v.same_as(var)), None)
        if known is not None:
            return known
        value = _sliced_constant(self.lookup_binding(var))
        if value is None:
            return None
        self.constants.append((var, relax.const(value, str(var.ty.dtype))))
        return self.constants[-1][1]


@tvm.transform.module_pass(opt_level=0, name="SlicedWeights")
def sliced_weights(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """A matmul's right operand sliced from a constant (an LSTM's or GRU's recurrent weights
    of one direction, or of some of its gates: the converter slices them with Relax ops, which
    the canonical stages do not fold) → the constant slice, which the legalization packs."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _SlicedWeights(mod).visit_expr(func)
    return relax.transform.DeadCodeElimination()(mod)


def _matrix(weight: relax.Expr, data: relax.Expr) -> np.ndarray | None:
    """A constant float32 weight as a ``[K, N]`` matrix (leading unit axes dropped, where the
    activation has as many axes as the weight: they broadcast to nothing); None otherwise."""
    if not isinstance(weight, tvm.ir.expr.GenericConst) or data.ty.ndim < weight.ty.ndim:
        return None
    w = weight.value.numpy()
    if w.ndim < 2 or any(d != 1 for d in w.shape[:-2]):
        return None
    return w.reshape(w.shape[-2:])


def legalize_matmul(bb: relax.BlockBuilder, call: relax.Call, packed: dict | None = None):
    """``matmul`` with a constant float32 ``[K, N]`` right operand → ``dense_packed``.

    ``packed``: the weights this build has packed so far, to pack each constant once (an LSTM's
    recurrent weights serve every step: one copy, not one per step)."""
    data, weight = call.args
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype), str(call.ty.dtype)}
    w = _matrix(weight, data)
    if w is None or data.ty.ndim < 2 or dtypes != {"float32"}:
        return tvm.ir.Op.get("relax.matmul").get_attr("FLegalize")(bb, call)
    k_dim, n = w.shape
    rows = [] if data.ty.shape is None else list(data.ty.shape)[:-1]
    static = rows and all(isinstance(d, tvm.tirx.IntImm) for d in rows)
    gemv = bool(static) and math.prod(int(d) for d in rows) <= GEMV_ROWS
    nb = _padded_column_block(n, vector_unit(), gemv)
    # Keyed by the constant's handle; the constant is kept with its packing, so that no other
    # constant can take its address while the cache lives.
    key = (hash(weight), nb)
    source, packed_weight = (packed or {}).get(key, (None, None))
    if source is None or not source.same_as(weight):
        w = np.pad(w, ((0, 0), (0, -n % nb)))
        layout = np.ascontiguousarray(w.reshape(k_dim, -1, nb).transpose(1, 0, 2))
        packed_weight = relax.const(layout, "float32")
        if packed is not None:
            packed[key] = (weight, packed_weight)
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
    packed = sch.get(block).name_hint == DENSE
    if packed and batch:
        # The weights are shared by every row: all leading axes form one M (a [128, 1, K]
        # activation is 128 rows, not 128 batches of one).
        m, batch = sch.fuse(*batch, m), []
    if packed:
        nb = int(sch.get(block).reads[1].source.ty.shape[-1])  # the packed weight's block
    else:
        nb = _column_block(extent(sch, n), unit, extent(sch, m) <= GEMV_ROWS)
    if not _vectorised(nb, unit):
        return False  # no vector width fits the columns: the generic schedule does as well
    rows = unit.tile(extent(sch, m), nb)
    work = math.prod(extent(sch, loop) for loop in (*batch, m, n, k))

    out = inline_epilogue(sch, block)
    mo, mi = sch.split(m, [None, rows])
    no, ni = sch.split(n, [None, nb])
    sch.reorder(*batch, mo, no, k, mi, ni)
    outer = sch.fuse(*batch, mo, no)
    if work >= PARALLEL_MACS:
        sch.parallel(outer)
    sch.reverse_compute_at(out, outer)
    sch.set_scope(block, 0, "local")
    sch.unroll(mi)
    sch.vectorize(ni)
    init = sch.decompose_reduction(block, k)
    unroll_vectorize_tile(sch, init, out)
    return True
