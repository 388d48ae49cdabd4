"""Per-channel chains of the float graph: linear ops (conv2d, dense) with constant weights and
the per-channel affine steps that follow them — what :mod:`.fold_scale_axis` folds into weights
and :mod:`.equalize` rescales between two linear ops.

A *linear op* is a float ``conv2d`` in NCHW/OIHW (any groups) or a ``matmul`` whose right operand
is a 2-D constant (a dense layer; its channel is the last axis); an *affine step* is an
add/subtract/multiply/divide by a per-channel constant of the op's output."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.ir.spans import ids_of, with_ids

CONV2D = tvm.ir.Op.get("relax.nn.conv2d")
MATMUL = tvm.ir.Op.get("relax.matmul")
ADD = tvm.ir.Op.get("relax.add")
SUBTRACT = tvm.ir.Op.get("relax.subtract")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
DIVIDE = tvm.ir.Op.get("relax.divide")
RELU = tvm.ir.Op.get("relax.nn.relu")

# Dtypes numpy computes and stores exactly as TVM does; folding happens in float64 in between.
FLOAT_DTYPES = ("float16", "float32", "float64")


def tensor_dtype(ty) -> str | None:
    """The dtype of a tensor type of known rank, else None."""
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        return None
    return str(ty.dtype)


def is_op(expr, op: tvm.ir.Op) -> bool:
    return isinstance(expr, tvm.ir.Call) and expr.op.same_as(op)


def union(exprs: Iterable) -> frozenset[str]:
    """The profileIDs carried by any of ``exprs``."""
    return frozenset().union(*(ids_of(e) for e in exprs))


def channel_vector(expr, like, axis: int, channels: int) -> np.ndarray | None:
    """``expr`` as one float64 value per channel of a tensor of type ``like``, if it is a finite
    constant of ``like``'s dtype that, right-aligned to ``like``'s rank, varies along ``axis``
    only (size 1 or ``channels`` there, 1 elsewhere; scalars broadcast)."""
    dtype = tensor_dtype(like)
    if not isinstance(expr, tvm.ir.GenericConst) or tensor_dtype(expr.ty) != dtype:
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
class Linear:
    """A conv2d or matmul call whose weight is a float constant: ``x -> W x`` per position."""

    call: tvm.ir.Call
    weight: np.ndarray

    @staticmethod
    def match(expr) -> Linear | None:
        """The linear op ``expr`` is, if it is one this pass can rewrite."""
        if not (is_op(expr, CONV2D) or is_op(expr, MATMUL)):
            return None
        data, weight = expr.args
        dtype = tensor_dtype(data.ty)
        # Equal output dtype also rules out an out_dtype that differs from the inputs'.
        if (
            dtype not in FLOAT_DTYPES
            or not isinstance(weight, tvm.ir.GenericConst)
            or tensor_dtype(weight.ty) != dtype
            or tensor_dtype(expr.ty) != dtype
        ):
            return None
        if expr.op.same_as(CONV2D):
            attrs = expr.attrs
            layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
            if layouts != ("NCHW", "OIHW", "NCHW"):
                return None
        elif weight.ty.ndim != 2 or data.ty.ndim < 1:
            return None
        return Linear(expr, weight.value.numpy())

    @property
    def is_conv(self) -> bool:
        return self.call.op.same_as(CONV2D)

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

    @property
    def input_index(self) -> np.ndarray:
        """For a conv, the input channel each ``[o, i]`` of the OIHW weight reads: with groups,
        output ``o`` of group ``g = o // (O/G)`` reads inputs ``g*(I/G) + i``, ``i < I/G``."""
        out_ch, in_per_group = self.weight.shape[:2]
        group = np.arange(out_ch) // (out_ch // self.groups)
        return group[:, None] * in_per_group + np.arange(in_per_group)[None, :]

    def scaled_inputs(self, scale: np.ndarray) -> np.ndarray:
        """The float64 weight with input channel ``c`` multiplied by ``scale[c]``."""
        w = self.weight.astype(np.float64)
        if not self.is_conv:
            return w * scale[:, None]
        return w * scale[self.input_index][:, :, None, None]

    def rebuild(self, data, weight: np.ndarray, weight_ids, ids) -> tvm.ir.Call:
        """The same op on ``data`` with ``weight`` (cast back to its dtype), carrying ``ids``."""
        const = with_ids(relax.const(weight, dtype=str(self.weight.dtype)), weight_ids)
        call = self.call
        # Input and weight keep their types, so the output type does too: no re-normalising.
        return with_ids(
            relax.Call(call.op, [data, const], call.attrs, call.ty_args, ret_ty=call.ty), ids
        )


@dataclass(frozen=True)
class Affine:
    """One elementwise step ``y = scale * x + shift`` by a per-channel constant."""

    scale: np.ndarray
    shift: np.ndarray | None  # None for a pure scale (multiply, divide)
    const: tvm.ir.GenericConst

    @property
    def is_nonnegative_scale(self) -> bool:
        return self.shift is None and bool(np.all(self.scale >= 0))


def split_const(call, x=None):
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


def affine_step(expr, x, lin: Linear) -> Affine | None:
    """``expr`` as an affine step on ``x`` (an output of ``lin``), if it is one."""
    ops = (ADD, SUBTRACT, MULTIPLY, DIVIDE)
    if not any(is_op(expr, op) for op in ops) or (split := split_const(expr, x)) is None:
        return None
    _, const, x_first = split
    c = channel_vector(const, lin.call.ty, lin.out_axis, lin.out_channels)
    if c is None:
        return None
    ones = np.ones_like(c)
    if expr.op.same_as(MULTIPLY):
        return Affine(c, None, const)
    if expr.op.same_as(DIVIDE):
        # c / x is not affine, and x / 0 must stay an inf/nan.
        return Affine(1.0 / c, None, const) if x_first and np.all(c != 0) else None
    if expr.op.same_as(ADD):
        return Affine(ones, c, const)
    return Affine(ones, -c, const) if x_first else Affine(-ones, c, const)


class Uses:
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


def tuple_round_trip(binding: relax.VarBinding, x, uses: Uses) -> relax.VarBinding | None:
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


def follow(
    var, uses: Uses, step_of: Callable[[tvm.ir.Expr, tvm.ir.Expr], Affine | None]
) -> tuple[list[relax.VarBinding], list[Affine]]:
    """The bindings after ``var``, each the sole reader of the one before, while ``step_of``
    accepts them as affine steps or they build and unpack a tuple; and those steps."""
    bindings, steps = [], []
    while (reader := uses.sole_reader(var)) is not None:
        if (step := step_of(reader.value, var)) is not None:
            bindings.append(reader)
            steps.append(step)
        elif (getter := tuple_round_trip(reader, var, uses)) is not None:
            bindings += [reader, getter]
        else:
            break
        var = bindings[-1].var
    return bindings, steps


@dataclass
class Edits:
    """Binding edits to one function: new bindings in place of some, others dropped."""

    replace: dict[relax.Var, list[relax.VarBinding]] = field(default_factory=dict)
    drop: set[relax.Var] = field(default_factory=set)

    def apply(self, func: relax.Function) -> relax.Function:
        return EditApplier(self).visit_expr(func) if self.replace or self.drop else func


@relax.expr_functor.mutator
class EditApplier(relax.PyExprMutator):
    """Applies :class:`Edits`; new bindings are emitted as built, so their spans survive."""

    def __init__(self, edits: Edits):
        super().__init__()
        self.edits = edits

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.edits.replace:
            for new in self.edits.replace[binding.var]:
                self.builder_.emit_normalized(new)
        elif binding.var not in self.edits.drop:
            super().visit_var_binding_(binding)
