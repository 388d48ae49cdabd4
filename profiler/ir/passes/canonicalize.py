"""Canonicalization: the graph clean-ups every consumer of the imported model runs first, so that
later passes (FoldScaleAxis, the BYOC patterns, the layout rewrite, the operator rules) see plain
operators.

* **Constant folding in numpy** (:mod:`rangeprof.profiler.ir.passes.fold_constant`): what is left
  unfolded runs at inference time (none of it is hot).
* **Full-rank constants.** A per-channel constant of rank 3 added to an NCHW tensor (what
  :class:`~rangeprof.profiler.ir.passes.fold_scale_axis.FoldScaleAxis` emits) stops
  ``ConvertLayout`` at that add, so constants of a binary op get leading unit axes up to the rank
  of the other operand.
* **Constants second** in a commutative op (``ConvertLayout`` follows the first operand).
* **Batch norms in training mode** legalized first (:class:`LegalizeTrainingBatchNorm`).
* **A take of one constant index as a slice** (it fuses; a gather does not).
* **Stack as a concat** of ``expand_dims``, **dropout as its inference value** (the input and
  a mask of ones), **squeeze axes counted from the front**: TVM's layout inference for these
  is broken. ``cosh`` and ``sinh`` through ``exp``, which LLVM lowers.
* **A conv1d as a conv2d of height one** (``expand_dims`` → ``conv2d`` → ``squeeze``): the
  BYOC patterns, ``FoldScaleAxis``, the layout rewrite and the CPU kernels know conv2d only (TVM's
  own conv1d kernel ran a log-mel front end 100× slower than onnxruntime). The ``expand_dims``
  carries the profileIDs of the tensor it reshapes, so a region's input is still that tensor.
* **Clip as operators.** The ONNX importer lowers ``Clip`` to ``call_tir`` of a ``maximum`` /
  ``minimum`` PrimFunc with a scalar bound; ``ConvertLayout`` cannot see through ``call_tir`` and
  would transpose back to NCHW around every ReLU6, and no pattern matches it. Such calls become
  ``R.maximum`` / ``R.minimum`` again.
"""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx

from rangeprof.profiler.ir.passes.fold_constant import ConstantFolder, constant_value
from rangeprof.profiler.ir.spans import ids_of, with_ids
from rangeprof.profiler.ir.tagging import INPUT_PREFIX

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
# Their constant operand goes second: ``ConvertLayout`` takes a binary op's layout from its
# first operand, and a constant first (PP-LCNet's ``scale * x``) kept the op in NCHW between
# two transposes.
_COMMUTATIVE = frozenset(("relax.add", "relax.multiply", "relax.maximum", "relax.minimum"))
_CLIP_OPS = {tirx.Max: relax.op.maximum, tirx.Min: relax.op.minimum}


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
class _Canonicalize(ConstantFolder):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod_ = mod

    def rewrite(self, call):
        if call.op.name == "relax.call_tir":
            return self._clip(call)
        if call.op.name == "relax.stack" and isinstance(call.args[0], relax.Tuple):
            return _stack_as_concat(call)
        if call.op.name in _HYPERBOLIC:
            return _hyperbolic(call)
        if call.op.name == "relax.nn.conv1d":
            return _conv1d_as_conv2d(call, self._tensor_ids(call.args[0]), self.inlined)
        if call.op.name == "relax.squeeze" and call.attrs.axis is not None:
            return _squeeze_positive(call)
        if call.op.name == "relax.take":
            index = self._value(call.args[1])
            if index is not None and index.ndim == 0 and call.attrs.axis is not None:
                return _take_as_slice(call, int(index))
        if call.op.name == "relax.nn.dropout":  # inference: the input, and a mask of ones
            data = call.args[0]
            return relax.Tuple([data, with_ids(relax.op.ones_like(data), ids_of(call))])
        # Constants inline into operator calls (only: the instrumented program's outputs stay
        # variables), as later passes (FoldScaleAxis, ConvertLayout) look for them there.
        args = [self.inlined(a) for a in call.args]
        if call.op.name in _BINARY:
            args = self._full_rank(args)
        if call.op.name in _COMMUTATIVE and constant_value(args[0]) is not None:
            args = args[::-1]
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)

    def _tensor_ids(self, var) -> frozenset[str]:
        """The profileIDs of the tensor ``var`` holds: a graph input's, or its binding's."""
        value = self.lookup_binding(var)
        while isinstance(value, relax.Var):
            var, value = value, self.lookup_binding(value)
        return frozenset([INPUT_PREFIX + str(var.name)]) if value is None else ids_of(value)

    def _full_rank(self, args: list) -> list:
        """Constant operands reshaped with leading unit axes to the other operand's rank."""
        ranks = [a.ty.ndim if isinstance(a.ty, relax.TensorType) else -1 for a in args]
        full = []
        for arg, rank in zip(args, ranks, strict=True):
            value = constant_value(arg)
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
        return _spanned(new, call.span)


def _spanned(new: relax.Call, span) -> relax.Call:
    """``new`` with the span (the profileIDs) of the call it replaces."""
    return relax.Call(new.op, new.args, new.attrs, new.ty_args, span)


_HYPERBOLIC = {"relax.cosh": relax.op.add, "relax.sinh": relax.op.subtract}


def _hyperbolic(call: relax.Call) -> relax.Call:
    """``cosh`` / ``sinh`` as ``(exp(x) ± exp(-x)) / 2``: LLVM's code generator in TVM 0.27 has
    no lowering for their intrinsics."""
    x, ids = call.args[0], ids_of(call)
    parts = [with_ids(relax.op.exp(v), ids) for v in (x, with_ids(relax.op.negative(x), ids))]
    half = relax.const(0.5, str(x.ty.dtype))
    total = with_ids(_HYPERBOLIC[call.op.name](*parts), ids)
    return _spanned(relax.op.multiply(total, half), call.span)


def _stack_as_concat(call: relax.Call) -> relax.Call:
    """``stack(xs, axis)`` as ``concat(expand_dims(x, axis) for x in xs, axis)``: TVM's layout
    inference for ``stack`` names an axis its own transposes cannot find ("Invalid SLayout"),
    the concat's works."""
    fields = list(call.args[0].fields)
    axis = int(call.attrs.axis or 0) % (fields[0].ty.ndim + 1)
    ids = ids_of(call)
    parts = [with_ids(relax.op.expand_dims(x, axis), ids) for x in fields]
    return _spanned(relax.op.concat(parts, axis), call.span)


def _conv1d_as_conv2d(call: relax.Call, data_ids, inlined) -> relax.Call:
    """``conv1d(x, w)`` (NCW / OIW) as ``squeeze(conv2d(expand_dims(x, 2), w[:, :, None]), 2)``;
    ``data_ids``: the profileIDs of ``x``."""
    a = call.attrs
    if (a.data_layout, a.kernel_layout, a.out_layout) != ("NCW", "OIW", "NCW"):
        return call
    data, weight = call.args[0], inlined(call.args[1])
    value = constant_value(weight)
    if value is not None:
        weight = with_ids(relax.const(value[:, :, None], str(weight.ty.dtype)), ids_of(weight))
    else:
        weight = with_ids(relax.op.expand_dims(weight, 2), ids_of(call))
    conv = relax.op.nn.conv2d(
        with_ids(relax.op.expand_dims(data, 2), data_ids),
        weight,
        strides=[1, int(a.strides[0])],
        padding=[0, int(a.padding[0]), 0, int(a.padding[1])],
        dilation=[1, int(a.dilation[0])],
        groups=int(a.groups),
        out_dtype=a.out_dtype,
    )
    return _spanned(relax.op.squeeze(with_ids(conv, ids_of(call)), [2]), call.span)


def _squeeze_positive(call: relax.Call) -> relax.Call:
    """``squeeze`` with its axes counted from the front: TVM's layout inference for a negative
    squeeze axis runs out of memory (``std::bad_alloc``)."""
    ndim = call.args[0].ty.ndim
    axes = [int(a) % ndim for a in call.attrs.axis]
    return _spanned(relax.op.squeeze(call.args[0], axes), call.span)


def _take_as_slice(call: relax.Call, index: int) -> relax.Call:
    """``take`` of one constant index (a transformer's q / k / v out of one projection) as a
    ``strided_slice`` and a ``squeeze``: injective, it fuses into what reads it, where the
    gather's data-dependent load made ``take`` a kernel of its own."""
    data, ids = call.args[0], ids_of(call)
    axis = int(call.attrs.axis) % data.ty.ndim
    size = data.ty.shape.values[axis]
    if not isinstance(size, tvm.tirx.IntImm):
        return call
    size = int(size)
    if call.attrs.mode == "wrap":
        index %= size
    elif call.attrs.mode == "clip":
        index = min(max(index, 0), size - 1)
    elif not 0 <= index < size:
        return call  # out of range: left to fail at run time
    piece = with_ids(relax.op.strided_slice(data, [axis], [index], [index + 1]), ids)
    return _spanned(relax.op.squeeze(piece, [axis]), call.span)


@tvm.transform.module_pass(opt_level=0, name="Canonicalize")
class Canonicalize:
    """Numpy constant folding, full-rank binary constants, ``Clip`` as operators, and the
    rewrites of operators TVM cannot lay out or lower (stack, dropout, squeeze, cosh, sinh)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mod[gvar] = _Canonicalize(mod).visit_expr(func)
        return relax.transform.DeadCodeElimination()(mod)


_BATCH_NORM = tvm.ir.Op.get("relax.nn.batch_norm")


@relax.expr_functor.mutator
class _TrainingBatchNorm(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (call.op.same_as(_BATCH_NORM) and call.attrs.training):
            return call
        legalized = _BATCH_NORM.get_attr("FLegalize")(self.builder_, call)
        return with_ids(legalized, ids_of(call))


@tvm.transform.module_pass(opt_level=0, name="LegalizeTrainingBatchNorm")
class LegalizeTrainingBatchNorm:
    """Batch norms in training mode (ONNX ``training_mode=1``: batch statistics, updated running
    statistics) as TVM's own legalization computes them, before ``DecomposeOpsForInference``
    rewrites every batch norm as an inference one."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                mutator = _TrainingBatchNorm(mod)
                visited = mutator.visit_expr(func)
                mod = mutator.builder_.get()  # with the legalized PrimFuncs
                mod[gvar] = visited
        return mod
