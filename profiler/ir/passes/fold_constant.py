"""Constant folding in numpy, for the ops that folding batch norms and ``Clip`` bounds needs, and
the shape arithmetic exported models do on static shapes (``Shape`` → ``Gather`` → ``Concat`` →
``Reshape``; the frontend's normalisation of a constant index against a tensor's shape), which
would otherwise run as a handful of VM calls per inference.

``relax.transform.FoldConstant`` compiles every constant subexpression with LLVM, one op at a
time: 13 s on PP-OCR and 19 s on MobileNetV2, whose batch norms and ``Clip`` bounds decompose
into hundreds of small constant ops. The handful of ops those chains use are folded here in
numpy, in milliseconds. Anything else is left alone: run ``FoldConstant`` after this pass for the
few calls that remain (the tracked ``fold_constant`` stage does), or leave them to run at
inference time (the build pipeline does; none of them is hot).

As with ``FoldConstant``, constants are inlined into their readers, the bindings left dead are
removed and a folded constant carries no profileID: the IDs of what was folded (calls and weights)
go to the readers that absorbed it (``folded_into``, see :mod:`rangeprof.profiler.ir.lineage`)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

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
    "relax.less": np.less,
    "relax.less_equal": np.less_equal,
    "relax.greater": np.greater,
    "relax.greater_equal": np.greater_equal,
    "relax.equal": np.equal,
    "relax.not_equal": np.not_equal,
}
_TAKE_MODES = {"wrap": "wrap", "clip": "clip", "fast": "raise"}  # fast: no index is out of range


def constant_value(expr) -> np.ndarray | None:
    """The value of a constant tensor, else None."""
    if isinstance(expr, tvm.ir.expr.GenericConst) and isinstance(expr.ty, relax.TensorType):
        return expr.value.numpy()
    return None


def _static_dims(shape) -> tuple[int, ...] | None:
    """The dimensions of a shape (``R.shape([...])`` or a tensor type's), when all are known."""
    if not isinstance(shape, relax.ShapeExpr):
        return None
    if not all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
        return None
    return tuple(int(d) for d in shape.values)


def _static_shape(ty) -> tuple[int, ...] | None:
    return _static_dims(ty.shape) if isinstance(ty, relax.TensorType) else None


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
    if name == "relax.take":
        axis = call.attrs.axis
        try:
            return np.take(
                args[0],
                args[1],
                None if axis is None else int(axis),
                mode=_TAKE_MODES[call.attrs.mode],
            )
        except IndexError:
            return None  # left to fail at run time, where TVM checks it
    return None


class ConstantFolder(relax.PyExprMutator):
    """Replaces calls of known ops on constant arguments (directly or through bindings) by
    their numpy value; subclasses say where constants inline and rewrite the calls left
    (:meth:`rewrite`). Not decorated, so that it can be subclassed: decorate the class you
    instantiate with ``relax.expr_functor.mutator``."""

    def _bound(self, arg):
        return self.lookup_binding(arg) if isinstance(arg, relax.Var) else arg

    def _value(self, arg) -> np.ndarray | None:
        return constant_value(self._bound(arg))

    def inlined(self, arg):
        """The constant ``arg`` is bound to, else ``arg`` itself."""
        value = self._bound(arg)
        return value if constant_value(value) is not None else arg

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op):
            return call
        shape_call = self._fold_shape(call)
        if shape_call is not None:
            return shape_call
        shape = _static_shape(call.ty)
        values = [self._value(a) for a in call.args if not isinstance(a, relax.ShapeExpr)]
        if shape is not None and values and all(v is not None for v in values):
            folded = _evaluate(call, values)
            if folded is not None:
                dtype = str(call.ty.dtype)
                return relax.const(np.asarray(folded).astype(dtype).reshape(shape), dtype)
        return self.rewrite(call)

    def _fold_shape(self, call: relax.Call) -> relax.Expr | None:
        """Shape computations on static shapes (the ONNX frontend's ``Shape`` and index
        normalisation): ``shape_of`` a tensor of static shape, ``shape_to_tensor`` of a static
        shape, ``tensor_to_shape`` of a constant."""
        name = call.op.name
        if name == "relax.shape_of":
            dims = _static_shape(call.args[0].ty)
            return None if dims is None else relax.ShapeExpr(list(dims))
        if name == "relax.shape_to_tensor":
            dims = _static_dims(self._bound(call.args[0]))
            return None if dims is None else relax.const(np.array(dims, "int64"), "int64")
        if name == "relax.tensor_to_shape":
            value = self._value(call.args[0])
            return None if value is None else relax.ShapeExpr([int(d) for d in value.reshape(-1)])
        return None

    def rewrite(self, call: relax.Call) -> relax.Expr:
        """A call on an operator that did not fold."""
        return call


@relax.expr_functor.mutator
class _FoldConstant(ConstantFolder):
    def visit_var_(self, var):
        return self.inlined(var)  # wherever they are read, as FoldConstant leaves them

    visit_dataflow_var_ = visit_var_


@tvm.transform.module_pass(opt_level=0, name="FoldConstantNumpy")
class FoldConstantNumpy:
    """Folds constant calls of the ops numpy computes as TVM does (see the module's doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was (stage reports compare the two)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gvar] = _FoldConstant(mod).visit_expr(func)
        return relax.transform.DeadCodeElimination()(mod)
