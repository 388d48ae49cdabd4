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

from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from rangeprof.profiler.ir.passes.channel_chains import (
    DIVIDE,
    MULTIPLY,
    RELU,
    Affine,
    Edits,
    Linear,
    Uses,
    affine_step,
    channel_vector,
    follow,
    is_op,
    split_const,
    union,
)
from rangeprof.profiler.ir.spans import ids_of, with_ids


def _typed_add(lhs, rhs, ids) -> tvm.ir.Call:
    """``lhs + rhs`` with its type inferred, carrying ``ids``."""
    call = relax.BlockBuilder().normalize(relax.op.add(lhs, rhs))
    return with_ids(call, ids)


@dataclass(frozen=True)
class _ForwardChain:
    """A linear op and the bindings after it whose per-channel steps fold into its weight."""

    binding: relax.VarBinding
    linear: Linear
    pre: list[relax.VarBinding]  # steps (and tuple round trips) before any relu
    relu: relax.VarBinding | None  # kept only with non-negative scales after it
    post: list[relax.VarBinding]
    steps: list[Affine]

    @staticmethod
    def find(binding: relax.VarBinding, uses: Uses) -> _ForwardChain | None:
        """The chain after ``binding``, if folding it removes at least one op."""
        lin = Linear.match(binding.value)
        if lin is None:
            return None

        def any_step(expr, x):
            return affine_step(expr, x, lin)

        def nonnegative_scale(expr, x):
            step = affine_step(expr, x, lin)
            return step if step is not None and step.is_nonnegative_scale else None

        pre, steps = follow(binding.var, uses, any_step)
        relu = uses.sole_reader(pre[-1].var if pre else binding.var)
        post, post_steps = [], []
        if relu is not None and is_op(relu.value, RELU):
            post, post_steps = follow(relu.var, uses, nonnegative_scale)
        if not post_steps:
            relu, post = None, []
        steps = steps + post_steps
        # A lone shift is already "L + b": rewriting it would gain nothing.
        if len(steps) < 2 and all(s.shift is not None for s in steps):
            return None
        return _ForwardChain(binding, lin, pre, relu, post, steps)

    def emit(self, edits: Edits) -> None:
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
        ids = union(b.value for b in absorbed)
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
                ids_of(relu) | union(b.value for b in self.post),
            )
        final = (self.post or self.pre)[-1].var
        new.append(relax.VarBinding(final, value))

        edits.replace[final] = new
        edits.drop.update(b.var for b in [*absorbed, *([self.relu] if self.relu else [])])


def _fold_forward(func: relax.Function) -> relax.Function:
    """``func`` with every forward chain folded (chains are disjoint, so one sweep does all)."""
    uses = Uses(func)
    edits = Edits()
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding):
                chain = _ForwardChain.find(binding, uses)
                if chain is not None:
                    chain.emit(edits)
    return edits.apply(func)


def _backward_fold(binding: relax.Binding, uses: Uses, edits: Edits) -> None:
    """Record folding ``binding``, if it is ``x * s`` or ``x / s`` read only by linear ops."""
    value = binding.value
    if not isinstance(binding, relax.VarBinding) or not (
        is_op(value, MULTIPLY) or is_op(value, DIVIDE)
    ):
        return
    split = split_const(value)
    readers = uses.local_readers(binding.var)
    if split is None or readers is None:
        return
    data, const, data_first = split
    divide = value.op.same_as(DIVIDE)
    # x must have the product's shape: a broadcast that grows x changes its channel count.
    if (divide and not data_first) or not tvm_ffi.structural_equal(data.ty, value.ty):
        return
    folds = []
    for reader in readers:
        lin = Linear.match(reader.value)
        if lin is None or not lin.call.args[0].same_as(binding.var):
            return
        scale = channel_vector(const, value.ty, lin.in_axis, lin.in_channels)
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
        uses = Uses(func)
        edits = Edits()
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
