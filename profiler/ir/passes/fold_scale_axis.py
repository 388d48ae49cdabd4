"""FoldScaleAxis for Relax: fold per-channel affine constants into conv2d / dense weights.

TVM 0.27 has no Relax FoldScaleAxis. These passes run after ``DecomposeOpsForInference`` and
``FoldConstant``, where an inference BatchNormalization has become ``subtract``/``divide``/
``multiply``/``add`` by per-channel constants, so folding such chains folds batch norms too.

A *linear op* is a float ``conv2d`` in NCHW/OIHW (any groups) or a ``matmul`` whose right operand
is a 2-D constant (a dense layer; its channel is the last axis). Directions follow our issue:

* **forward**: ``a * L(x) + b`` (any chain of add/subtract/multiply/divide by per-channel
  constants after ``L``) becomes ``L'(x) + b'``, the weight scaled along the output channels. A
  ``relu`` right after may let further scales through, as ``s * relu(z) == relu(s * z)`` holds
  for ``s >= 0`` only; shifts never move through it. Values inside the chain must have one
  reader each, so nothing else sees the values that disappear.
* **backward**: ``L(x * s)`` becomes ``L'(x)``, the weight scaled along the input channels. Any
  sign is fine, ``L`` being linear with zero padding. Done only when every reader of ``x * s`` is
  such an ``L``, as the scaled tensor disappears.

Identity (see :mod:`rangeprof.profiler.ir.spans`): the folded linear op and its new bias add carry
the profileIDs of every binding folded into them, a surviving relu also those of the scales moved
through it, a backward-folded linear op those of the scale it absorbed, and new weight/bias
constants those of the constants they were computed from. Folded bindings are rebound to the
variables they had (the chain's last variable holds the new final value), so readers need no
remapping."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from rangeprof.profiler.ir.spans import ids_of, with_ids

_CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_ADD = tvm.ir.Op.get("relax.add")
_SUBTRACT = tvm.ir.Op.get("relax.subtract")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_DIVIDE = tvm.ir.Op.get("relax.divide")
_RELU = tvm.ir.Op.get("relax.nn.relu")

# Dtypes numpy computes and stores exactly as TVM does; folding happens in float64 in between.
_FLOAT_DTYPES = ("float16", "float32", "float64")


def _tensor_dtype(ty) -> str | None:
    """The dtype of a tensor type of known rank, else None."""
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        return None
    return str(ty.dtype)


def _is_op(expr, op: tvm.ir.Op) -> bool:
    return isinstance(expr, tvm.ir.Call) and expr.op.same_as(op)


def _union(exprs: Iterable) -> frozenset[str]:
    """The profileIDs carried by any of ``exprs``."""
    return frozenset().union(*(ids_of(e) for e in exprs))


def _channel_vector(expr, like, axis: int, channels: int) -> np.ndarray | None:
    """``expr`` as one float64 value per channel of a tensor of type ``like``, if it is a finite
    constant of ``like``'s dtype that, right-aligned to ``like``'s rank, varies along ``axis``
    only (size 1 or ``channels`` there, 1 elsewhere; scalars broadcast)."""
    dtype = _tensor_dtype(like)
    if not isinstance(expr, tvm.ir.GenericConst) or _tensor_dtype(expr.ty) != dtype:
        return None
    value = expr.value.numpy()
    rank = like.ndim
    if value.ndim > rank or not np.all(np.isfinite(value)):
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    if any(d != 1 for i, d in enumerate(shape) if i != axis) or shape[axis] not in (1, channels):
        return None
    return np.broadcast_to(value.astype(np.float64).reshape(-1), (channels,)).copy()


@dataclass(frozen=True)
class _Linear:
    """A conv2d or matmul call whose weight is a float constant: ``x -> W x`` per position."""

    call: tvm.ir.Call
    weight: np.ndarray

    @staticmethod
    def match(expr) -> _Linear | None:
        """The linear op ``expr`` is, if it is one this pass can rewrite."""
        if not (_is_op(expr, _CONV2D) or _is_op(expr, _MATMUL)):
            return None
        data, weight = expr.args
        dtype = _tensor_dtype(data.ty)
        # Equal output dtype also rules out an out_dtype that differs from the inputs'.
        if (
            dtype not in _FLOAT_DTYPES
            or not isinstance(weight, tvm.ir.GenericConst)
            or _tensor_dtype(weight.ty) != dtype
            or _tensor_dtype(expr.ty) != dtype
        ):
            return None
        if expr.op.same_as(_CONV2D):
            attrs = expr.attrs
            layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
            if layouts != ("NCHW", "OIHW", "NCHW"):
                return None
        elif weight.ty.ndim != 2 or data.ty.ndim < 1:
            return None
        return _Linear(expr, weight.value.numpy())

    @property
    def is_conv(self) -> bool:
        return self.call.op.same_as(_CONV2D)

    @property
    def groups(self) -> int:
        return int(self.call.attrs.groups) if self.is_conv else 1

    @property
    def out_axis(self) -> int:
        return 1 if self.is_conv else self.call.ty.ndim - 1

    @property
    def out_channels(self) -> int:
        return self.weight.shape[0] if self.is_conv else self.weight.shape[1]

    @property
    def in_axis(self) -> int:
        return 1 if self.is_conv else self.call.args[0].ty.ndim - 1

    @property
    def in_channels(self) -> int:
        return self.weight.shape[1] * self.groups if self.is_conv else self.weight.shape[0]

    def scaled_outputs(self, scale: np.ndarray) -> np.ndarray:
        """The float64 weight with output channel ``o`` multiplied by ``scale[o]``."""
        w = self.weight.astype(np.float64)
        return w * scale[:, None, None, None] if self.is_conv else w * scale[None, :]

    def scaled_inputs(self, scale: np.ndarray) -> np.ndarray:
        """The float64 weight with input channel ``c`` multiplied by ``scale[c]``."""
        w = self.weight.astype(np.float64)
        if not self.is_conv:
            return w * scale[:, None]
        # OIHW with groups: output o of group g = o // (O/G) reads inputs g*(I/G) + i, i < I/G.
        out_ch, in_per_group = w.shape[:2]
        group = np.arange(out_ch) // (out_ch // self.groups)
        index = group[:, None] * in_per_group + np.arange(in_per_group)[None, :]
        return w * scale[index][:, :, None, None]

    def rebuild(self, data, weight: np.ndarray, weight_ids, ids) -> tvm.ir.Call:
        """The same op on ``data`` with ``weight`` (cast back to its dtype), carrying ``ids``."""
        const = with_ids(relax.const(weight, dtype=str(self.weight.dtype)), weight_ids)
        call = self.call
        # Input and weight keep their types, so the output type does too: no re-normalising.
        return with_ids(
            relax.Call(call.op, [data, const], call.attrs, call.ty_args, ret_ty=call.ty), ids
        )


@dataclass(frozen=True)
class _Affine:
    """One elementwise step ``y = scale * x + shift`` by a per-channel constant."""

    scale: np.ndarray
    shift: np.ndarray | None  # None for a pure scale (multiply, divide)
    const: tvm.ir.GenericConst

    @property
    def is_nonnegative_scale(self) -> bool:
        return self.shift is None and bool(np.all(self.scale >= 0))


def _split_const(call, x=None):
    """``(operand, constant, operand_first)`` of a binary call with one constant operand (and,
    if ``x`` is given, the other operand ``x``), else None."""
    lhs, rhs = call.args
    for operand, const, first in ((lhs, rhs, True), (rhs, lhs, False)):
        if (
            isinstance(const, tvm.ir.GenericConst)
            and not isinstance(operand, tvm.ir.GenericConst)
            and (x is None or operand.same_as(x))
        ):
            return operand, const, first
    return None


def _affine_step(expr, x, lin: _Linear) -> _Affine | None:
    """``expr`` as an affine step on ``x`` (an output of ``lin``), if it is one."""
    ops = (_ADD, _SUBTRACT, _MULTIPLY, _DIVIDE)
    if not any(_is_op(expr, op) for op in ops) or (split := _split_const(expr, x)) is None:
        return None
    _, const, x_first = split
    c = _channel_vector(const, lin.call.ty, lin.out_axis, lin.out_channels)
    if c is None:
        return None
    ones = np.ones_like(c)
    if expr.op.same_as(_MULTIPLY):
        return _Affine(c, None, const)
    if expr.op.same_as(_DIVIDE):
        # c / x is not affine, and x / 0 must stay an inf/nan.
        return _Affine(1.0 / c, None, const) if x_first and np.all(c != 0) else None
    if expr.op.same_as(_ADD):
        return _Affine(ones, c, const)
    return _Affine(ones, -c, const) if x_first else _Affine(-ones, c, const)


class _Uses:
    """Who reads each variable of a function's top-level blocks."""

    def __init__(self, func: relax.Function):
        self.readers: dict[relax.Var, list[relax.Binding]] = defaultdict(list)
        self.block_of: dict[relax.Var, int] = {}
        for index, block in enumerate(func.body.blocks):
            for binding in block.bindings:
                self.block_of[binding.var] = index
                for var in relax.analysis.free_vars(binding.value):
                    self.readers[var].append(binding)
        self.returned = set(relax.analysis.free_vars(func.body.body))

    def local_readers(self, var) -> list[relax.VarBinding] | None:
        """The bindings reading ``var``, if there are some, all plain bindings in its block, and
        the function's result does not read it; else None."""
        readers = self.readers.get(var, [])
        if not readers or var in self.returned:
            return None
        block = self.block_of.get(var)
        if any(
            not isinstance(r, relax.VarBinding) or self.block_of[r.var] != block for r in readers
        ):
            return None
        return readers

    def sole_reader(self, var) -> relax.VarBinding | None:
        """The only binding reading ``var`` (see :meth:`local_readers`), else None."""
        readers = self.local_readers(var)
        return readers[0] if readers is not None and len(readers) == 1 else None


def _tuple_round_trip(binding: relax.VarBinding, x, uses: _Uses) -> relax.VarBinding | None:
    """The binding reading ``x`` back out of the tuple ``binding`` builds around it (the shape
    ``DecomposeOpsForInference`` leaves a batch norm in), if that is the tuple's only use."""
    if not isinstance(binding.value, relax.Tuple):
        return None
    slots = [i for i, f in enumerate(binding.value.fields) if f.same_as(x)]
    getter = uses.sole_reader(binding.var)
    if len(slots) != 1 or getter is None:
        return None
    value = getter.value
    if not isinstance(value, relax.TupleGetItem) or value.index != slots[0]:
        return None
    return getter


def _follow(
    var, uses: _Uses, step_of: Callable[[tvm.ir.Expr, tvm.ir.Expr], _Affine | None]
) -> tuple[list[relax.VarBinding], list[_Affine]]:
    """The bindings after ``var``, each the sole reader of the one before, while ``step_of``
    accepts them as affine steps or they build and unpack a tuple; and those steps."""
    bindings, steps = [], []
    while (reader := uses.sole_reader(var)) is not None:
        if (step := step_of(reader.value, var)) is not None:
            bindings.append(reader)
            steps.append(step)
        elif (getter := _tuple_round_trip(reader, var, uses)) is not None:
            bindings += [reader, getter]
        else:
            break
        var = bindings[-1].var
    return bindings, steps


@dataclass
class _Edits:
    """Binding edits to one function: new bindings in place of some, others dropped."""

    replace: dict[relax.Var, list[relax.VarBinding]] = field(default_factory=dict)
    drop: set[relax.Var] = field(default_factory=set)

    def apply(self, func: relax.Function) -> relax.Function:
        return _EditApplier(self).visit_expr(func) if self.replace or self.drop else func


@relax.expr_functor.mutator
class _EditApplier(relax.PyExprMutator):
    """Applies :class:`_Edits`; new bindings are emitted as built, so their spans survive."""

    def __init__(self, edits: _Edits):
        super().__init__()
        self.edits = edits

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.edits.replace:
            for new in self.edits.replace[binding.var]:
                self.builder_.emit_normalized(new)
        elif binding.var not in self.edits.drop:
            super().visit_var_binding_(binding)


def _typed_add(lhs, rhs, ids) -> tvm.ir.Call:
    """``lhs + rhs`` with its type inferred, carrying ``ids``."""
    call = relax.BlockBuilder().normalize(relax.op.add(lhs, rhs))
    return with_ids(call, ids)


@dataclass(frozen=True)
class _ForwardChain:
    """A linear op and the bindings after it whose per-channel steps fold into its weight."""

    binding: relax.VarBinding
    linear: _Linear
    pre: list[relax.VarBinding]  # steps (and tuple round trips) before any relu
    relu: relax.VarBinding | None  # kept only with non-negative scales after it
    post: list[relax.VarBinding]
    steps: list[_Affine]

    @staticmethod
    def find(binding: relax.VarBinding, uses: _Uses) -> _ForwardChain | None:
        """The chain after ``binding``, if folding it removes at least one op."""
        lin = _Linear.match(binding.value)
        if lin is None:
            return None

        def any_step(expr, x):
            return _affine_step(expr, x, lin)

        def nonnegative_scale(expr, x):
            step = _affine_step(expr, x, lin)
            return step if step is not None and step.is_nonnegative_scale else None

        pre, steps = _follow(binding.var, uses, any_step)
        relu = uses.sole_reader(pre[-1].var if pre else binding.var)
        post, post_steps = [], []
        if relu is not None and _is_op(relu.value, _RELU):
            post, post_steps = _follow(relu.var, uses, nonnegative_scale)
        if not post_steps:
            relu, post = None, []
        steps = steps + post_steps
        # A lone shift is already "L + b": rewriting it would gain nothing.
        if len(steps) < 2 and all(s.shift is not None for s in steps):
            return None
        return _ForwardChain(binding, lin, pre, relu, post, steps)

    def emit(self, edits: _Edits) -> None:
        """Record the rewrite: the chain's last variable gets the new final value."""
        lin = self.linear
        scale = np.ones(lin.out_channels)
        shift = None
        weight_ids = set(ids_of(lin.call.args[1]))
        bias_ids: set[str] = set()
        for step in self.steps:
            const_ids = ids_of(step.const)
            scale = step.scale * scale
            if step.shift is None:
                weight_ids |= const_ids
            if shift is not None or step.shift is not None:
                shift = step.scale * (0.0 if shift is None else shift)
                shift = shift + (0.0 if step.shift is None else step.shift)
                bias_ids |= const_ids

        absorbed = [self.binding, *self.pre, *self.post]
        ids = _union(b.value for b in absorbed)
        value = lin.rebuild(lin.call.args[0], lin.scaled_outputs(scale), weight_ids, ids)
        conv_var = self.binding.var
        pre_out = self.pre[-1].var if self.pre else conv_var
        new = []
        if shift is not None:
            # Shaped (C, 1, ...) so it broadcasts along the channel axis of the output.
            rank = lin.call.ty.ndim
            bias = shift.reshape((-1,) + (1,) * (rank - 1 - lin.out_axis))
            bias_const = with_ids(relax.const(bias, dtype=str(lin.weight.dtype)), bias_ids)
            new.append(relax.VarBinding(conv_var, value))
            value = _typed_add(conv_var, bias_const, ids)
        if self.relu is not None:
            new.append(relax.VarBinding(pre_out, value))
            relu = self.relu.value
            value = with_ids(
                relax.Call(relu.op, [pre_out], relu.attrs, relu.ty_args, ret_ty=relu.ty),
                ids_of(relu) | _union(b.value for b in self.post),
            )
        final = (self.post or self.pre)[-1].var
        new.append(relax.VarBinding(final, value))

        edits.replace[final] = new
        edits.drop.update(b.var for b in [*absorbed, *([self.relu] if self.relu else [])])


def _fold_forward(func: relax.Function) -> relax.Function:
    """``func`` with every forward chain folded (chains are disjoint, so one sweep does all)."""
    uses = _Uses(func)
    edits = _Edits()
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding):
                chain = _ForwardChain.find(binding, uses)
                if chain is not None:
                    chain.emit(edits)
    return edits.apply(func)


def _backward_fold(binding: relax.Binding, uses: _Uses, edits: _Edits) -> None:
    """Record folding ``binding``, if it is ``x * s`` or ``x / s`` read only by linear ops."""
    value = binding.value
    if not isinstance(binding, relax.VarBinding) or not (
        _is_op(value, _MULTIPLY) or _is_op(value, _DIVIDE)
    ):
        return
    split = _split_const(value)
    readers = uses.local_readers(binding.var)
    if split is None or readers is None:
        return
    data, const, data_first = split
    divide = value.op.same_as(_DIVIDE)
    # x must have the product's shape: a broadcast that grows x changes its channel count.
    if (divide and not data_first) or not tvm_ffi.structural_equal(data.ty, value.ty):
        return
    folds = []
    for reader in readers:
        lin = _Linear.match(reader.value)
        if lin is None or not lin.call.args[0].same_as(binding.var):
            return
        scale = _channel_vector(const, value.ty, lin.in_axis, lin.in_channels)
        if scale is None or (divide and not np.all(scale != 0)):
            return
        folds.append((reader, lin, 1.0 / scale if divide else scale))

    weight_ids = ids_of(const)
    for reader, lin, scale in folds:
        new = lin.rebuild(
            data,
            lin.scaled_inputs(scale),
            ids_of(lin.call.args[1]) | weight_ids,
            ids_of(reader.value) | ids_of(value),
        )
        edits.replace[reader.var] = [relax.VarBinding(reader.var, new)]
    edits.drop.add(binding.var)


def _fold_backward(func: relax.Function) -> relax.Function:
    """``func`` with every backward scale folded; repeated so that a chain of scales in front of
    a linear op folds one scale per sweep (in one sweep the inner scales still have a reader
    that is no linear op)."""
    while True:
        uses = _Uses(func)
        edits = _Edits()
        for block in func.body.blocks:
            for binding in block.bindings:
                _backward_fold(binding, uses, edits)
        if not edits.drop:
            return func
        func = edits.apply(func)


def _rewritable(func) -> bool:
    """Whether ``func`` is an ordinary Relax function (not a kernel-like Primitive/Composite)."""
    if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
        return False
    attrs = func.attrs
    if attrs is None:
        return True
    keys = set(attrs.keys())
    return "Composite" not in keys and not ("Primitive" in keys and int(attrs["Primitive"]) != 0)


@relax.transform.function_pass(opt_level=0, name="ForwardFoldScaleAxis")
class ForwardFoldScaleAxis:
    """Fold per-channel affine ops after conv2d/dense into its weight and a single bias add."""

    def transform_function(self, func, mod, ctx):
        return _fold_forward(func) if _rewritable(func) else func


@relax.transform.function_pass(opt_level=0, name="BackwardFoldScaleAxis")
class BackwardFoldScaleAxis:
    """Fold per-channel scales before conv2d/dense into its weight's input channels."""

    def transform_function(self, func, mod, ctx):
        return _fold_backward(func) if _rewritable(func) else func


@relax.transform.function_pass(opt_level=0, name="FoldScaleAxis")
class FoldScaleAxis:
    """Forward then backward folding.

    Forward goes first: it keeps a batch norm or scale with the op that produced it and also
    folds scales whose tensor has readers other than linear ops, which backward must leave.
    Backward then takes what forward could not (a negative scale behind a relu, a scale on a
    function input or on a tensor with several readers). Neither order needs a second round:
    backward only removes scales and points linear ops at their inputs, which gives no forward
    chain a new step, and forward creates no scales.
    """

    def transform_function(self, func, mod, ctx):
        return _fold_backward(_fold_forward(func)) if _rewritable(func) else func
