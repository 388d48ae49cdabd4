"""Graph clean-ups that let the layout rewrite and the operator rules see plain operators.

* **Constant folding in numpy.** ``relax.transform.FoldConstant`` compiles every constant
  subexpression with LLVM (13 s on MobileNetV2, whose batch norms and ``Clip`` bounds decompose
  into ~400 small constant ops). The handful of ops those chains use are folded here in numpy,
  in milliseconds; anything else is left to run at inference time (none of it is hot).
* **Full-rank constants.** A per-channel constant of rank 3 added to an NCHW tensor (what
  :class:`~profiler.passes.fold_scale_axis.FoldScaleAxis` emits) stops ``ConvertLayout`` at that
  add, so constants of a binary op get leading unit axes up to the rank of the other operand.
* **Clip as operators.** The ONNX importer lowers ``Clip`` to ``call_tir`` of a ``maximum`` /
  ``minimum`` PrimFunc with a scalar bound; ``ConvertLayout`` cannot see through ``call_tir`` and
  would transpose back to NCHW around every ReLU6. Such calls become ``R.maximum`` /
  ``R.minimum`` again.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir, tirx

_ELEMENTWISE = {
    "relax.add": np.add,
    "relax.subtract": np.subtract,
    "relax.multiply": np.multiply,
    "relax.divide": np.divide,
    "relax.maximum": np.maximum,
    "relax.minimum": np.minimum,
    "relax.power": np.power,
    "relax.sqrt": np.sqrt,
    "relax.rsqrt": lambda x: 1 / np.sqrt(x),
    "relax.exp": np.exp,
    "relax.negative": np.negative,
    "relax.isnan": np.isnan,
    "relax.where": np.where,
}
_BINARY = frozenset(
    (
        "relax.add",
        "relax.subtract",
        "relax.multiply",
        "relax.divide",
        "relax.maximum",
        "relax.minimum",
    )
)
_CLIP_OPS = {tirx.Max: relax.op.maximum, tirx.Min: relax.op.minimum}


def _constant(expr) -> np.ndarray | None:
    if isinstance(expr, tvm.ir.expr.GenericConst) and isinstance(expr.ty, relax.TensorType):
        return expr.value.numpy()
    return None


def _static_shape(ty) -> tuple[int, ...] | None:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def _evaluate(call: relax.Call, args: list[np.ndarray]) -> np.ndarray | None:
    """The numpy value of ``call`` on constant ``args``, or None for ops we do not fold."""
    name = call.op.name
    if name in _ELEMENTWISE:
        with np.errstate(all="ignore"):
            return _ELEMENTWISE[name](*args)
    if name == "relax.expand_dims":
        return np.expand_dims(args[0], tuple(int(a) for a in call.attrs.axis))
    if name == "relax.permute_dims":
        axes = call.attrs.axes
        return np.transpose(args[0], None if axes is None else [int(a) for a in axes])
    if name in ("relax.reshape", "relax.squeeze", "relax.astype"):
        return args[0]  # the result is reshaped / cast to the call's own type below
    return None


def _clip_op(func) -> tvm.ir.Op | None:
    """``maximum`` or ``minimum`` when ``func`` is ``out = max|min(a[i...], b[()])``, else None."""
    if not isinstance(func, tirx.PrimFunc) or len(func.params) != 3:
        return None
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    if len(blocks) != 1:
        return None
    store = sch.get(blocks[0]).body
    if not isinstance(store, tirx.BufferStore) or type(store.value) not in _CLIP_OPS:
        return None
    loads = (store.value.a, store.value.b)
    if not all(isinstance(load, tvm.ir.expr.TensorLoad) for load in loads):
        return None
    names = [load.source.name for load in loads]
    ranks = [len(load.indices) for load in loads]
    if names != [p.name for p in func.params[:2]] or ranks != [len(store.indices), 0]:
        return None
    return _CLIP_OPS[type(store.value)]


@relax.expr_functor.mutator
class _Prepare(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod

    def _value(self, arg) -> np.ndarray | None:
        if isinstance(arg, relax.Var):
            arg = self.lookup_binding(arg)
        return _constant(arg)

    def _inline(self, arg):
        value = self.lookup_binding(arg) if isinstance(arg, relax.Var) else None
        return value if _constant(value) is not None else arg

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        if call.op.name == "relax.call_tir":
            return self._clip(call)
        shape = _static_shape(call.ty)
        values = [self._value(a) for a in call.args if not isinstance(a, relax.ShapeExpr)]
        if shape is not None and values and all(v is not None for v in values):
            folded = _evaluate(call, values)
            if folded is not None:
                dtype = str(call.ty.dtype)
                return relax.const(np.asarray(folded).astype(dtype).reshape(shape), dtype)
        # Constants inline, as later passes (FoldScaleAxis, ConvertLayout) look for them there.
        args = [self._inline(a) for a in call.args]
        if call.op.name in _BINARY:
            args = self._full_rank(args)
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)

    def _full_rank(self, args: list) -> list:
        """Constant operands reshaped with leading unit axes to the other operand's rank."""
        ranks = [a.ty.ndim if isinstance(a.ty, relax.TensorType) else -1 for a in args]
        full = []
        for arg, rank in zip(args, ranks, strict=True):
            value = _constant(arg)
            if value is not None and 0 < rank < max(ranks):
                value = value.reshape((1,) * (max(ranks) - rank) + value.shape)
                arg = relax.const(value, str(arg.ty.dtype))
            full.append(arg)
        return full

    def _clip(self, call):
        func = self.mod_[call.args[0]] if call.args[0] in self.mod_.get_global_vars() else None
        op = _clip_op(func)
        if op is None:
            return call
        data, bound = call.args[1].fields
        bound_value = self._value(bound)
        if bound_value is None:
            return call
        # The operator keeps the call's span: the Clip's profileIDs stay on its binding.
        new = op(data, relax.const(bound_value, str(bound.ty.dtype)))
        return relax.Call(new.op, new.args, new.attrs, new.ty_args, call.span)


@tvm.transform.module_pass(opt_level=0, name="PrepareForSchedules")
def prepare(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Numpy constant folding, full-rank binary constants and ``Clip`` as operators."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _Prepare(mod).visit_expr(func)
    return relax.transform.DeadCodeElimination()(mod)
