"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", 2019): per-channel weight
ranges of two consecutive linear ops made equal, so that per-tensor (and, less so, per-channel)
INT8 weights lose less.

For a pair ``L2(f(L1(x)))`` where ``f`` is a chain of per-channel affine steps (bias adds,
inference batch norms, channel scales) and at most positively homogeneous activations (``relu``,
``leaky_relu``: ``f(z / s) = f(z) / s`` for ``s > 0``), output channel ``c`` of ``L1`` is divided
by ``s_c`` — its weights, and the shifts of the steps after it — and input channel ``c`` of ``L2``
multiplied by ``s_c``: the function is unchanged. ``s_c = sqrt(r1_c / r2_c)`` with ``r1_c`` the
range of ``L1``'s effective weights (its weights times the chain's scales) for channel ``c`` and
``r2_c`` that of ``L2``'s weights reading channel ``c`` makes both ``sqrt(r1_c r2_c)``. Chains of
several pairs (``L1 → L2 → L3``) are equalized in rounds until the scales settle.

Covered: conv → conv (any groups, so depthwise separable blocks in both orders), dense → dense,
with the chain in either the initial IR's form (``batch_norm`` and its tuple) or the canonical
one (``multiply`` / ``add`` by per-channel constants). Not covered, left as is: bounded
activations (``Clip``, ReLU6, hardswish: not homogeneous), tensors with other readers.

The pass runs on the tagged initial IR, so the profiling build observes the equalized model's
tensors under their own profileIDs: only constants change, each keeping its profileID, and every
call keeps its span. A profile made with it says so (``model.transforms``), and builds of that
profile run it again: it depends on the weights alone, so it gives the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.passes.channel_chains import (
    Edits,
    Linear,
    Uses,
    affine_step,
    is_op,
)
from rangeprof.profiler.ir.spans import ids_of, with_ids

NAME = "cross_layer_equalization"  # as a profile's ``model.transforms`` lists it
_BATCH_NORM = tvm.ir.Op.get("relax.nn.batch_norm")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_HOMOGENEOUS = (tvm.ir.Op.get("relax.nn.relu"), tvm.ir.Op.get("relax.nn.leakyrelu"))
_ROUNDS = 50
_SETTLED = 1e-4  # largest |log s| of a round at which the scales count as settled


# Where a shift constant sits: a binding and the argument position of the constant in its call.
_Shift = tuple[relax.VarBinding, int]


@dataclass(frozen=True)
class _Step:
    """A binding between the two linear ops: how it scales the channel's magnitude, and the
    constants holding its per-channel shifts (divided by ``s`` when the channel is)."""

    binding: relax.VarBinding
    gain: np.ndarray | None  # |scale| per channel; None for an activation or a tuple read
    shifts: tuple[_Shift, ...] = ()


@dataclass
class _Pair:
    first: relax.VarBinding
    steps: list[_Step]
    second: relax.VarBinding
    scale: np.ndarray  # the accumulated s per channel


def _batch_norm_step(binding, x, lin: Linear, uses: Uses) -> tuple[_Step, relax.VarBinding] | None:
    """An inference batch norm of ``x`` on the channel axis with constant parameters, and the
    binding reading its output 0, if its other outputs (the running statistics) go unread."""
    call = binding.value
    if not is_op(call, _BATCH_NORM) or not call.args[0].same_as(x) or call.attrs.training:
        return None
    if int(call.attrs.axis) % lin.call.ty.ndim != lin.out_axis:
        return None
    params = [_parameter(p, lin.out_channels) for p in call.args[1:]]
    if any(p is None for p in params):
        return None
    gamma, _, _, var = params
    getters = uses.local_readers(binding.var) or []
    output = [g for g in getters if isinstance(g.value, relax.TupleGetItem) and g.value.index == 0]
    others = [g for g in getters if g not in output]
    if len(output) != 1 or any(uses.readers.get(g.var) or g.var in uses.returned for g in others):
        return None
    gain = np.abs(gamma) / np.sqrt(var + float(call.attrs.epsilon))
    # mean and beta scale with the channel: (x - mean) / s and beta / s give y / s.
    return _Step(binding, gain, ((binding, 2), (binding, 3))), output[0]


def _parameter(expr, channels: int) -> np.ndarray | None:
    """A batch norm parameter: a finite float constant of shape ``(channels,)``."""
    if not isinstance(expr, tvm.ir.GenericConst) or "float" not in str(expr.ty.dtype):
        return None
    value = expr.value.numpy()
    if value.shape != (channels,) or not np.all(np.isfinite(value)):
        return None
    return value.astype(np.float64)


def _reshaped_constant(
    var, reader: relax.VarBinding, uses: Uses, defs
) -> tuple[relax.VarBinding, tvm.ir.GenericConst] | None:
    """The binding of ``var`` and the constant it computes, when it reshapes a constant to a
    static shape and only ``reader`` reads it (how the importer adds a conv's bias)."""
    binding = defs.get(var)
    if binding is None or uses.sole_reader(var) is not reader:
        return None
    value, ty = binding.value, var.ty
    if not is_op(value, _RESHAPE) or not isinstance(value.args[0], tvm.ir.GenericConst):
        return None
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    array = value.args[0].value.numpy().reshape([int(d) for d in dims])
    return binding, relax.const(array, str(ty.dtype))


def _affine(reader: relax.VarBinding, x, lin: Linear, uses: Uses, defs) -> _Step | None:
    """``reader`` as an affine step on ``x``: by a constant operand, or by one reshaped from a
    constant holding one value per channel."""
    call = reader.value
    step = affine_step(call, x, lin)
    if step is not None:
        if step.shift is None:
            return _Step(reader, np.abs(step.scale))
        (i,) = [i for i, a in enumerate(call.args) if a.same_as(step.const)]
        return _Step(reader, None, ((reader, i),))
    if not isinstance(call, relax.Call) or len(call.args) != 2:
        return None
    for i, operand in enumerate(call.args):
        found = _reshaped_constant(operand, reader, uses, defs)
        if found is None or found[1].value.numpy().size != lin.out_channels:
            continue
        source, const = found
        args = list(call.args)
        args[i] = const
        step = affine_step(relax.Call(call.op, args, call.attrs), x, lin)
        if step is None:
            return None
        if step.shift is None:
            return _Step(reader, np.abs(step.scale))
        return _Step(reader, None, ((source, 0),))
    return None


def _chain(first: relax.VarBinding, lin: Linear, uses: Uses, defs) -> _Pair | None:
    """The pair starting at the linear op ``first``, if the chain after it reaches another."""
    var, steps = first.var, []
    while (reader := uses.sole_reader(var)) is not None:
        value = reader.value
        if (step := _affine(reader, var, lin, uses, defs)) is not None:
            steps.append(step)
        elif any(is_op(value, op) for op in _HOMOGENEOUS) and value.args[0].same_as(var):
            steps.append(_Step(reader, None))
        elif (found := _batch_norm_step(reader, var, lin, uses)) is not None:
            step, getter = found
            steps += [step, _Step(getter, None)]
            reader = getter
        else:
            second = Linear.match(value)
            if second is None or not value.args[0].same_as(var):
                return None
            if second.in_channels != lin.out_channels or second.is_conv != lin.is_conv:
                return None
            return _Pair(first, steps, reader, np.ones(lin.out_channels))
        var = reader.var
    return None


def _out_ranges(lin: Linear) -> np.ndarray:
    w = np.abs(lin.weight.astype(np.float64))
    return w.reshape(w.shape[0], -1).max(axis=1) if lin.is_conv else w.max(axis=0)


def _in_ranges(lin: Linear) -> np.ndarray:
    w = np.abs(lin.weight.astype(np.float64))
    if not lin.is_conv:
        return w.max(axis=1)
    ranges = np.zeros(lin.in_channels)
    np.maximum.at(ranges, lin.input_index, w.max(axis=(2, 3)))
    return ranges


def _equalize(pairs: list[_Pair], linears: dict[relax.Var, Linear]) -> None:
    """Rounds over the pairs, each rescaling its two ops' weights in ``linears``, until the
    scales settle."""
    for _ in range(_ROUNDS):
        largest = 0.0
        for pair in pairs:
            lin1, lin2 = linears[pair.first.var], linears[pair.second.var]
            gain = np.ones(lin1.out_channels)
            for step in pair.steps:
                if step.gain is not None:
                    gain *= step.gain
            r1, r2 = _out_ranges(lin1) * gain, _in_ranges(lin2)
            live = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
            s = np.where(live, np.sqrt(np.where(live, r1, 1.0) / np.where(live, r2, 1.0)), 1.0)
            linears[pair.first.var] = replace(lin1, weight=lin1.scaled_outputs(1.0 / s))
            linears[pair.second.var] = replace(lin2, weight=lin2.scaled_inputs(s))
            pair.scale *= s
            largest = max(largest, float(np.max(np.abs(np.log(s)))))
        if largest < _SETTLED:
            return


def _divided(const, scale: np.ndarray, lin: Linear):
    """``const`` divided by ``scale`` along ``lin``'s output channels: a constant of one value
    per channel (in channel order whatever its unit axes), or a scalar made one."""
    value = const.value.numpy().astype(np.float64)
    if value.size == scale.size:
        new = (value.reshape(-1) / scale).reshape(value.shape)
    else:  # one value for every channel: per channel now, right-aligned to the output
        rank = lin.call.ty.ndim
        shape = [1] * (rank - lin.out_axis)
        shape[0] = scale.size
        new = (value.reshape(-1)[0] / scale).reshape(shape)
    return with_ids(relax.const(new, dtype=str(const.ty.dtype)), ids_of(const))


def _with_args(call, args) -> tvm.ir.Call:
    # The output type stays (shapes broadcast the same), so the call needs no re-normalising.
    return relax.Call(call.op, args, call.attrs, call.ty_args, span=call.span, ret_ty=call.ty)


def _edits(pairs: list[_Pair], linears: dict[relax.Var, Linear], original) -> Edits:
    edits = Edits()
    for var, lin in linears.items():
        old = original[var]
        weight = lin.weight.astype(old.weight.dtype)
        ids = ids_of(old.call.args[1])
        call = old.rebuild(old.call.args[0], weight, ids, ids_of(old.call))
        edits.replace[var] = [relax.VarBinding(var, call)]
    shifted: dict[relax.Var, tuple[relax.VarBinding, list]] = {}
    for pair in pairs:
        for step in pair.steps:
            for binding, i in step.shifts:
                _, args = shifted.setdefault(binding.var, (binding, list(binding.value.args)))
                args[i] = _divided(args[i], pair.scale, original[pair.first.var])
    for var, (binding, args) in shifted.items():
        edits.replace[var] = [relax.VarBinding(var, _with_args(binding.value, args))]
    return edits


def equalize_function(func: relax.Function) -> relax.Function:
    """``func`` with every pair of linear ops it holds equalized."""
    uses = Uses(func)
    defs = {
        b.var: b
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b, relax.VarBinding)
    }
    pairs, original = [], {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            lin = Linear.match(binding.value)
            if lin is None:
                continue
            original[binding.var] = lin
            pair = _chain(binding, lin, uses, defs)
            if pair is not None:
                pairs.append(pair)
    if not pairs:
        return func
    linears = {}
    for pair in pairs:
        for var in (pair.first.var, pair.second.var):
            linears[var] = original[var]
    _equalize(pairs, linears)
    return _edits(pairs, linears, original).apply(func)


@relax.transform.function_pass(opt_level=0, name="CrossLayerEqualization")
class CrossLayerEqualization:
    """Equalizes every pair of consecutive linear ops of every Relax function (see the module
    docstring); the result computes the same function."""

    def transform_function(self, func, mod, ctx):
        return equalize_function(func) if isinstance(func, relax.Function) else func


def equalized_initializers(mod: tvm.IRModule) -> dict[str, np.ndarray]:
    """The weights that equalizing the tagged initial module ``mod`` changes, by profileID
    (``weight:<initializer>`` for an ONNX initializer), with their new values."""

    def constants(module: tvm.IRModule) -> dict[str, list[np.ndarray]]:
        found: dict[str, list[np.ndarray]] = {}

        def visit(expr):
            if isinstance(expr, tvm.ir.GenericConst):
                for profile_id in ids_of(expr):
                    found.setdefault(profile_id, []).append(expr.value.numpy())

        relax.analysis.post_order_visit(module["main"], visit)
        return found

    before, after = constants(mod), constants(CrossLayerEqualization()(mod))
    changed = {}
    for profile_id, values in after.items():
        moved = [v for v in values if not any(np.array_equal(v, b) for b in before[profile_id])]
        if not moved:
            continue
        if len(values) > 1:  # one use equalized, another not: no single value to write back
            raise RangeprofError(f"{profile_id} is read by several layers and equalized in one")
        changed[profile_id] = moved[0]
    return changed
