"""One-hot matmuls as row gathers.

Models exported from JAX or TensorFlow embed integer tokens as ``one_hot(x, N) @ W``:
``equal(x[..., None], arange(N))`` cast to float32, then a matmul with a constant ``W[N, K]``
(Magika's bytes, 2048 × 257 → 64). The one-hot tensor costs a pass over ``rows × N`` floats and
the matmul ``rows × N × K`` multiply-adds, where the product is the row ``W[x]`` (zeros for an
``x`` outside ``[0, N)``): every other term is ``0 · w``.

:data:`one_hot_gathers`, run before the legalization, rewrites such a matmul as ``take`` from
``W`` with a zero row appended, indexed by ``x`` (out-of-range indices pointing at the zero
row). The sum of one ``w`` and zeros is ``w`` exactly, so the result is the matmul's, bit for
bit, for finite weights. The one-hot tensor is left to dead-code elimination (the profiling
build, which observes it, keeps it).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

_EQUAL, _CAST = tvm.ir.Op.get("relax.equal"), tvm.ir.Op.get("relax.astype")
_MATMUL = tvm.ir.Op.get("relax.matmul")


def _iota_length(expr) -> int | None:
    """``N`` when ``expr`` is the constant ``arange(N)`` along its last axis (leading axes of
    one), else None."""
    if not isinstance(expr, tvm.ir.expr.GenericConst) or "int" not in str(expr.ty.dtype):
        return None
    value = expr.value.numpy()
    if value.ndim == 0 or any(d != 1 for d in value.shape[:-1]):
        return None
    n = value.shape[-1]
    return n if np.array_equal(value.ravel(), np.arange(n)) else None


@relax.expr_functor.mutator
class _OneHotGathers(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not call.op.same_as(_MATMUL) or str(call.ty.dtype) != "float32":
            return call
        weight = call.args[1]
        index = self._one_hot_index(call.args[0])
        if index is None or not isinstance(weight, tvm.ir.expr.GenericConst):
            return call
        table = weight.value.numpy()
        if table.ndim != 2:
            return call
        rows = table.shape[0]
        zero_row = np.concatenate([table, np.zeros((1, table.shape[1]), table.dtype)])
        flat = self.builder_.emit(relax.op.squeeze(index, [index.ty.ndim - 1]))
        dtype = str(flat.ty.dtype)
        inside = relax.op.logical_and(
            relax.op.greater_equal(flat, relax.const(0, dtype)),
            relax.op.less(flat, relax.const(rows, dtype)),
        )
        safe = self.builder_.emit(relax.op.where(inside, flat, relax.const(rows, dtype)))
        return relax.op.take(relax.const(zero_row, "float32"), safe, axis=0, mode="clip")

    def _one_hot_index(self, var) -> relax.Expr | None:
        """``x`` (last axis of one) when ``var`` is ``astype(equal(x, arange(N)), float32)``."""
        cast = self.lookup_binding(var) if isinstance(var, relax.Var) else None
        if not (isinstance(cast, relax.Call) and cast.op.same_as(_CAST)):
            return None
        equal = self.lookup_binding(cast.args[0]) if isinstance(cast.args[0], relax.Var) else None
        if not (isinstance(equal, relax.Call) and equal.op.same_as(_EQUAL)):
            return None
        for index, iota in (equal.args, equal.args[::-1]):
            length = _iota_length(iota)
            last = None if index.ty.shape is None else index.ty.shape[-1]
            if length is not None and isinstance(last, tvm.tirx.IntImm) and int(last) == 1:
                return index
        return None


@tvm.transform.module_pass(opt_level=0, name="OneHotGathers")
def one_hot_gathers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every ``one_hot(x) @ W`` (constant ``W``) → ``take`` of ``W``'s rows."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _OneHotGathers(mod).visit_expr(func)
    return relax.transform.DeadCodeElimination()(mod)
