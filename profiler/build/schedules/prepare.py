"""Graph clean-ups that let the layout rewrite and the operator rules see plain operators.

* **Constant folding in numpy** (:mod:`rangeprof.profiler.ir.passes.fold_constant`): what is left unfolded
  runs at inference time (none of it is hot).
* **Full-rank constants.** A per-channel constant of rank 3 added to an NCHW tensor (what
  :class:`~rangeprof.profiler.ir.passes.fold_scale_axis.FoldScaleAxis` emits) stops ``ConvertLayout`` at that
  add, so constants of a binary op get leading unit axes up to the rank of the other operand.
* **Batch norms in training mode** legalized first (:data:`legalize_training_batch_norm`).
* **Stack as a concat** of ``expand_dims``, **dropout as its inference value** (the input and
  a mask of ones), **squeeze axes counted from the front**: TVM's layout inference for these
  is broken. ``cosh`` and ``sinh`` through
  ``exp``, which LLVM lowers.
* **Clip as operators.** The ONNX importer lowers ``Clip`` to ``call_tir`` of a ``maximum`` /
  ``minimum`` PrimFunc with a scalar bound; ``ConvertLayout`` cannot see through ``call_tir`` and
  would transpose back to NCHW around every ReLU6. Such calls become ``R.maximum`` /
  ``R.minimum`` again.
* **Per-tensor quantize / dequantize out of their transposes** (:data:`untranspose_quantize`,
  after ``ConvertLayout``, which has no layout rule for them and wraps each in a round trip to
  NCHW): elementwise again, FuseOps can fuse them into the kernel that produces their input
  (ResNet-18 INT8 1.5 % faster).
* **Input channels of unpadded int8 convs to a multiple of 4** (:data:`pad_int8_channels`,
  after the layout rewrite): a 3-channel image would otherwise be copied into a 4-channel stage
  inside the conv kernel, element by element (the dot instructions multiply groups of 4); as a
  ``pad`` of the graph FuseOps fuses it into the kernel producing the image, and the zero
  weights of the new channel keep the sums exact.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from rangeprof.profiler.ir.passes.fold_constant import ConstantFolder, constant_value
from rangeprof.profiler.ir.spans import ids_of, with_ids

from rangeprof.profiler.build.schedules.conv2d_int8 import is_int8

# The depth of the widest dot instructions (vpdpbusd, vpmaddubsw, sdot): 4 products per lane.
CHANNEL_GROUP = 4

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
class _Prepare(ConstantFolder):
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
        if call.op.name == "relax.squeeze" and call.attrs.axis is not None:
            return _squeeze_positive(call)
        if call.op.name == "relax.nn.dropout":  # inference: the input, and a mask of ones
            data = call.args[0]
            return relax.Tuple([data, with_ids(relax.op.ones_like(data), ids_of(call))])
        # Constants inline into operator calls (only: the instrumented program's outputs stay
        # variables), as later passes (FoldScaleAxis, ConvertLayout) look for them there.
        args = [self.inlined(a) for a in call.args]
        if call.op.name in _BINARY:
            args = self._full_rank(args)
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)

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


def _squeeze_positive(call: relax.Call) -> relax.Call:
    """``squeeze`` with its axes counted from the front: TVM's layout inference for a negative
    squeeze axis runs out of memory (``std::bad_alloc``)."""
    ndim = call.args[0].ty.ndim
    axes = [int(a) % ndim for a in call.attrs.axis]
    return _spanned(relax.op.squeeze(call.args[0], axes), call.span)


@tvm.transform.module_pass(opt_level=0, name="PrepareForSchedules")
def prepare(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Numpy constant folding, full-rank binary constants, ``Clip`` as operators, and the
    rewrites of operators TVM cannot lay out or lower (stack, dropout, squeeze, cosh, sinh)."""
    mod = mod.clone()  # the caller's module stays as it was
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _Prepare(mod).visit_expr(func)
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
def legalize_training_batch_norm(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Batch norms in training mode (ONNX ``training_mode=1``: batch statistics, updated running
    statistics) as TVM's own legalization computes them, before ``DecomposeOpsForInference``
    rewrites every batch norm as an inference one."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mutator = _TrainingBatchNorm(mod)
            visited = mutator.visit_expr(func)
            mod = mutator.builder_.get()  # with the legalized PrimFuncs
            mod[gvar] = visited
    return mod


def _inverse(first: relax.Call, second: relax.Call) -> bool:
    """Whether permuting by ``first`` then by ``second`` gives the original axes."""
    p, q = ([int(a) for a in c.attrs.axes] for c in (first, second))
    return [p[i] for i in q] == list(range(len(p)))


def _untranspose(func: relax.Function) -> relax.Function:
    data = wildcard()
    inner = is_op("relax.permute_dims")(data)
    quantize = is_op("relax.quantize")(inner, wildcard(), wildcard()) | is_op("relax.dequantize")(
        inner, wildcard(), wildcard()
    )
    outer = is_op("relax.permute_dims")(quantize)

    def rewrite(expr, matches):
        call = matches[quantize]
        if not _inverse(matches[inner], expr) or any(a.ty.ndim != 0 for a in call.args[1:]):
            return expr
        args = [matches[data], *call.args[1:]]
        return relax.Call(call.op, args, call.attrs, call.ty_args, call.span)

    return rewrite_call(outer, rewrite, func)


@tvm.transform.module_pass(opt_level=0, name="UntransposeQuantize")
def untranspose_quantize(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """``permute_dims(q(permute_dims(x, p)), p⁻¹)`` → ``q(x)`` for a per-tensor (scalar scale
    and zero point) ``quantize`` / ``dequantize`` ``q``."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _untranspose(func)
    return relax.transform.DeadCodeElimination()(mod)


def _pad_channels(func: relax.Function) -> relax.Function:
    data, weight = wildcard(), is_const()
    conv = is_op("relax.nn.conv2d")(data, weight)

    def rewrite(expr, matches):
        call = matches[conv]
        attrs = call.attrs
        layouts = (attrs.data_layout, attrs.kernel_layout)
        if layouts != ("NHWC", "OHWI") or attrs.groups != 1 or not is_int8(call):
            return expr
        channels = int(matches[data].ty.shape[3])
        extra = -channels % CHANNEL_GROUP
        # A conv with padding has a stage of its own (the padding), which pads channels too.
        if extra == 0 or any(int(p) for p in attrs.padding):
            return expr
        # The pad derives from the conv: it carries the conv's profileIDs.
        x = with_ids(relax.op.nn.pad(matches[data], [0, 0, 0, 0, 0, 0, 0, extra]), ids_of(call))
        w = matches[weight].value.numpy()
        w = relax.const(np.pad(w, [(0, 0)] * 3 + [(0, extra)]), "int8")
        return relax.Call(call.op, [x, w], attrs, call.ty_args, call.span)

    return rewrite_call(conv, rewrite, func)


@tvm.transform.module_pass(opt_level=0, name="PadInt8Channels")
def pad_int8_channels(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """An NHWC 8-bit conv with constant int8 weights, no padding and input channels that are no
    multiple of 4 convolves a zero-padded input with zero-padded weights instead."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _pad_channels(func)
    return mod
