"""Lowering regions to integer code: the quantized form every target compiles.

Each INT8 region's composite call in ``main`` becomes

    x_q = quantize(x, s_x, z_x)            # FP32 -> 8 bits, at the region boundary
    y_q = core(x_q)                        # integer only (below)
    y   = dequantize(y_q, s_y, z_y)        # back to FP32 for whatever consumes it

and the **core** (:func:`integer_core`) is, in plain Relax integer operators:
``pad`` with ``z_x`` → ``conv2d`` / ``matmul`` (8-bit × int8 → int32) → ``+ bias`` (int32) →
requantize as the policy says (fixed point: int64 multiply, add the rounding constant,
arithmetic shift; or float: float32 multiply, round) → ``+ z_y`` → clamp → 8 bits (formulas
in :mod:`.policy`). A ``batch_matmul`` region quantizes both operands at its boundary (the
second one symmetric int8) and its core (:func:`batch_matmul_core`) corrects the first one's
zero point at run time: ``Σ_k (a_q − z_a)·b_q = Σ_k a_q·b_q − z_a·Σ_k b_q``, a column sum of
``b_q`` per call. A region whose input is the output of
another INT8 region with the same qparams takes that region's ``y_q`` directly: chains of
regions stay in 8 bits, and dequantize / quantize pairs are left only where an FP32 operator
sits between them.

How the core is compiled is the target's business: inline in ``main`` for the LLVM targets (x86,
aarch64: :mod:`rangeprof.byoc.cpu` gives the integer convolutions their kernels), or
as a function of its own marked ``Codegen`` for an external code generator (npu).

Modes per region: ``int8``; ``int16`` (where the policy has wide activations: the input
quantized to its int16 grid and clamped to the levels :func:`~.policy.wide_input` allows, the
same core on it, the output in FP32 — or requantized to int16 by integer-only targets);
``w4`` (a dense region's weights in 4-bit groups, its activations FP32: the target's
``dense_w4`` kernel, then the bias and the clamp); ``fp32`` (the composite's FP32 body inline:
a fallback, or the FP32 reference); ``shadow``
(FP32 downstream, and the INT8 core computed on the same FP32 input on the side: one build
measures every layer's *isolated* error). With ``expose``, ``main`` returns ``(outputs, *region
outputs)`` — the dequantized output of each int8 / int16 / shadow region, the FP32 output of
each fp32 region — in region order. Inlined bindings carry the region's
profileIDs, so lineage holds through the lowered IR.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.ir.spans import with_ids

from .patterns import BATCH_MATMUL, CONV2D
from .policy import (
    FIXED_POINT,
    FLOAT,
    ActivationQ,
    QuantPolicy,
    fixed_point,
    float_bias,
    float_requantize_fits,
    int32_bias,
    output_clamp,
    quantize_weights,
    wide_input,
)
from .regions import Region

INT8, INT16, FP32, SHADOW, W4 = "int8", "int16", "fp32", "shadow", "w4"
MODES = (INT8, INT16, FP32, SHADOW, W4)
# Emits a 4-bit dense layer: (bb, data, q, scales, zero_points, group_size, bias) -> its value.
DenseW4 = Callable[..., relax.Expr]


def default_mode(region: Region) -> str:
    """A region's mode unless told otherwise: FP32 without qparams, 4-bit where its weights
    are, else INT8."""
    if region.fallback:
        return FP32
    return W4 if region.int4 is not None else INT8


_LOWERED = "main__lowered"


def _const(value, dtype: str) -> relax.Constant:
    return relax.const(np.asarray(value).astype(dtype), dtype)


def integer_core(
    region: Region,
    policy: QuantPolicy,
    in_shape,
    name: str,
    integer_output: bool = True,
    x: ActivationQ | None = None,
    y: ActivationQ | None = None,
) -> relax.Function:
    """The region's integer computation as a function of its quantized input; without
    ``integer_output`` the int32 accumulator is scaled to FP32 (``s_x · s_c · acc``) instead of
    requantized, for a region whose consumers are FP32 operators. ``x`` and ``y`` replace the
    region's own input and output qparams (its int16 ones)."""
    fr = region.float_region
    x, y = x or region.input, y or region.output
    axis = fr.channel_axis
    wq, w_scales = quantize_weights(fr.weight, axis, policy, fr.bias, x.scale)
    offset = float_bias(fr.bias, wq.shape[axis], x, w_scales)
    way = policy.requantize if integer_output else FLOAT
    m = x.scale * w_scales / y.scale if integer_output else None
    if integer_output and way == FLOAT and not float_requantize_fits(wq, offset, axis, x, m):
        way = FIXED_POINT
    # Integer-only requantization adds the bias in int32 accumulator units; a float epilogue
    # adds it unrounded (a batch norm's shift folded into the bias keeps its exact value).
    bias = int32_bias(fr.bias if way == FIXED_POINT else None, wq, axis, x, w_scales)
    offset = None if way == FIXED_POINT else offset
    channels = wq.shape[axis]

    bb = relax.BlockBuilder()
    xq = relax.Var("xq", relax.TensorType(in_shape, x.dtype))
    with bb.function(name, [xq]):
        with bb.dataflow():
            if fr.kind == CONV2D:
                per_channel = (1, channels, 1, 1)
                data, padding = xq, fr.attrs["padding"]
                if any(padding) and x.zero_point != 0:
                    top, left, bottom, right = padding
                    widths = [0, 0, 0, 0, top, bottom, left, right]
                    data = bb.emit(relax.op.nn.pad(xq, widths, pad_value=float(x.zero_point)))
                    padding = [0, 0, 0, 0]
                acc = relax.op.nn.conv2d(
                    data,
                    _const(wq, "int8"),
                    strides=fr.attrs["strides"],
                    padding=padding,
                    dilation=fr.attrs["dilation"],
                    groups=fr.attrs["groups"],
                    out_dtype="int32",
                )
            else:
                per_channel = (channels,)
                acc = relax.op.matmul(xq, _const(wq, "int8"), out_dtype="int32")
            acc = bb.emit(acc)
            acc = bb.emit(relax.op.add(acc, _const(bias.reshape(per_channel), "int32")))
            if integer_output:
                bounds = output_clamp(y, fr.clamp)
                out = requantize(bb, acc, m, per_channel, y, bounds, way, offset)
            else:
                out = _float_output(bb, acc, x.scale * w_scales, per_channel, fr.clamp, offset)
        bb.emit_func_output(out)
    return bb.get()[name]


def batch_matmul_core(
    region: Region, policy: QuantPolicy, shapes, name: str, integer_output: bool = True
) -> relax.Function:
    """A ``batch_matmul`` region's integer computation, a function of both quantized operands:
    ``Σ_k a_q·b_q − z_a·Σ_k b_q`` in int32, then as :func:`integer_core` (one scale for all
    channels, ``s_a · s_b``)."""
    a, b, y = region.input, region.operand, region.output
    bb = relax.BlockBuilder()
    aq = relax.Var("aq", relax.TensorType(shapes[0], a.dtype))
    bq = relax.Var("bq", relax.TensorType(shapes[1], b.dtype))
    depth = int(shapes[1][-2])
    scale = np.array([a.scale * b.scale])
    with bb.function(name, [aq, bq]):
        with bb.dataflow():
            acc = bb.emit(relax.op.matmul(aq, bq, out_dtype="int32"))
            if a.zero_point:
                wide = bb.emit(relax.op.astype(bq, "int32"))
                sums = bb.emit(relax.op.sum(wide, axis=[-2], keepdims=True))
                fix = bb.emit(relax.op.multiply(sums, _const(a.zero_point, "int32")))
                acc = bb.emit(relax.op.subtract(acc, fix))
            if integer_output:
                m = scale / y.scale
                largest = depth * max(a.qmax - a.zero_point, a.zero_point - a.qmin) * b.qmax
                way = policy.requantize
                if way == FLOAT and largest * m[0] >= 2.0**30:
                    way = FIXED_POINT
                out = requantize(bb, acc, m, (1,), y, output_clamp(y, None), way)
            else:
                out = _float_output(bb, acc, scale, (1,), None, None)
        bb.emit_func_output(out)
    return bb.get()[name]


def requantize(
    bb, acc, multiplier: np.ndarray, per_channel, y: ActivationQ, bounds, way: str, offset=None
):
    """The int32 accumulator ``acc`` scaled by ``multiplier`` (float64, one per channel, shaped
    by ``per_channel``) the ``way`` a policy names, ``+ z_y``, clamped to ``bounds``, in ``y``'s
    8-bit type; the float way first adds ``offset`` (a float bias in accumulator units)."""
    if way == FLOAT:
        return _requantize_float(bb, acc, multiplier, per_channel, y, bounds, offset)
    m, shift = fixed_point(multiplier)
    return _requantize_fixed_point(bb, acc, m, shift, per_channel, y, bounds)


def _requantize_fixed_point(bb, acc, multiplier, shift, per_channel, y: ActivationQ, bounds):
    """``((acc · M + 2^(S−1)) >> S) + z_y``, clamped, in ``y``'s 8-bit type."""
    wide = bb.emit(relax.op.astype(acc, "int64"))
    wide = bb.emit(relax.op.multiply(wide, _const(multiplier.reshape(per_channel), "int64")))
    half = (np.int64(1) << (shift - 1)).reshape(per_channel)
    wide = bb.emit(relax.op.add(wide, _const(half, "int64")))
    wide = bb.emit(relax.op.right_shift(wide, _const(shift.reshape(per_channel), "int64")))
    return _finish(bb, bb.emit(relax.op.astype(wide, "int32")), y, bounds)


def _requantize_float(bb, acc, multiplier, per_channel, y: ActivationQ, bounds, offset=None):
    """``round((float32(acc) + β) · m) + z_y`` (round half to even: TVM's ``round``), clamped,
    in ``y``'s 8-bit type; the clamp stays in int32, where the 8-bit packing does it for free.
    ``(a + β) · m`` rather than ``a · m + b``: no target may contract it into a fused
    multiply-add, so every target rounds alike."""
    scaled = _plus(bb, bb.emit(relax.op.astype(acc, "float32")), offset, per_channel)
    scaled = bb.emit(relax.op.multiply(scaled, _const(multiplier.reshape(per_channel), "float32")))
    rounded = bb.emit(relax.op.round(scaled))
    return _finish(bb, bb.emit(relax.op.astype(rounded, "int32")), y, bounds)


def _finish(bb, out, y: ActivationQ, bounds):
    """``out + z_y``, clamped to ``bounds``, in ``y``'s 8-bit type."""
    out = bb.emit(relax.op.add(out, _const(y.zero_point, "int32")))
    out = bb.emit(relax.op.maximum(out, _const(bounds[0], "int32")))
    out = bb.emit(relax.op.minimum(out, _const(bounds[1], "int32")))
    return bb.emit_output(relax.op.astype(out, y.dtype))


def _plus(bb: relax.BlockBuilder, value, offset, per_channel):
    """``value + offset`` (float32, one per channel), or ``value`` without one."""
    if offset is None or not offset.any():
        return value
    return bb.emit(relax.op.add(value, _const(offset.reshape(per_channel), "float32")))


def _float_output(bb: relax.BlockBuilder, acc, scales: np.ndarray, per_channel, clamp, offset):
    """``s_x · s_c · (acc + β)`` in FP32, then the ReLU / Clip epilogue."""
    out = _plus(bb, bb.emit(relax.op.astype(acc, "float32")), offset, per_channel)
    out = relax.op.multiply(out, _const(scales.reshape(per_channel), "float32"))
    if clamp is not None:
        out = relax.op.maximum(bb.emit(out), _const(clamp[0], "float32"))
        if np.isfinite(clamp[1]):
            out = relax.op.minimum(bb.emit(out), _const(clamp[1], "float32"))
    return bb.emit_output(out)


def _inline(bb: relax.BlockBuilder, func: relax.Function, args, ids, result: relax.Var | None):
    """Emits ``func``'s bindings (flat operator calls) with its params bound to ``args``;
    the last value is bound to ``result`` when given. Returns the value's Var."""
    remap = dict(zip(func.params, args, strict=True))
    bindings = [b for block in func.body.blocks for b in block.bindings]
    out = None
    for index, binding in enumerate(bindings):
        call = binding.value
        new_args = [remap.get(a, a) for a in call.args]
        value = relax.Call(call.op, new_args, call.attrs, call.ty_args, ret_ty=call.ty)
        value = with_ids(value, ids)
        if result is not None and index == len(bindings) - 1:
            bb.emit_normalized(relax.VarBinding(result, value))
            out = result
        else:
            out = bb.emit(value)
        remap[binding.var] = out
    return out


def _vars_in(expr) -> list[relax.Var]:
    found: list[relax.Var] = []
    relax.analysis.post_order_visit(
        expr, lambda e: found.append(e) if isinstance(e, relax.Var) else None
    )
    return found


def _boundary(bb: relax.BlockBuilder, op, data, q: ActivationQ, ids, out_dtype: str):
    """A per-tensor ``quantize`` / ``dequantize`` call, typed, carrying ``ids``."""
    scale = _const(q.scale, "float32")
    zero = _const(q.zero_point, "int32")
    return with_ids(bb.normalize(op(data, scale, zero, axis=-1, out_dtype=out_dtype)), ids)


class _Lowerer:
    def __init__(self, mod, regions, modes, policy, external, dense_w4=None):
        self.mod = mod
        self.by_name = {r.name: r for r in regions}
        self.modes = modes
        self.policy = policy
        self.external = external
        self.dense_w4 = dense_w4
        self.bb = relax.BlockBuilder(mod)
        self.quantized: dict[relax.Var, tuple[relax.Expr, ActivationQ]] = {}
        self.exposed: list[tuple[str, relax.Expr]] = []
        self.integer_outputs = self._integer_outputs()

    def _mode(self, region: Region) -> str:
        return self.modes.get(region.name, default_mode(region))

    def _integer_outputs(self) -> set[str]:
        """Regions whose output stays 8-bit: every consumer is a quantized region taking the
        same qparams (or the policy wants integer outputs everywhere)."""
        main = self.mod["main"]
        calls: dict[relax.Var, Region] = {}
        # Who reads a Var: a region's first operand (which may take it in 8 bits), or None.
        consumers: dict[relax.Var, list[Region | None]] = {}
        for block in main.body.blocks:
            for binding in block.bindings:
                value = binding.value
                callee = getattr(value, "op", None)
                region = None
                if isinstance(callee, tvm.ir.GlobalVar):
                    region = self.by_name.get(callee.name_hint)
                if region is not None:
                    calls[binding.var] = region
                first = value.args[0] if region is not None else None
                for var in _vars_in(value):
                    consumers.setdefault(var, []).append(region if var.same_as(first) else None)
        consumers.setdefault(main.body.body, []).append(None)
        keep = set()
        for var, region in calls.items():
            if region.output is None:
                continue  # no qparams: it leaves in FP32
            users = consumers.get(var, [])
            quantized_users = all(
                user is not None
                and self._mode(user) in (INT8, SHADOW)
                and user.int4 is None  # 4-bit layers read FP32
                and user.input == region.output
                for user in users
            )
            if self.policy.integer_outputs or (users and quantized_users):
                keep.add(region.name)
        return keep

    def _core(self, region: Region, operands: list) -> relax.Expr:
        shapes = [[int(d) for d in q.ty.shape.values] for q in operands]
        name = f"{region.name}_int8"
        integer = region.name in self.integer_outputs
        if region.float_region.kind == BATCH_MATMUL:
            core = batch_matmul_core(region, self.policy, shapes, name, integer)
        else:
            policy = self.policy.for_layer(region.weight_bits)
            core = integer_core(region, policy, shapes[0], name, integer)
        return self._emit_core(core, name, operands, region.profile_ids)

    def _emit_core(self, core: relax.Function, name: str, operands: list, ids) -> relax.Expr:
        """``core`` applied to ``operands``: inline, or called for the external codegen."""
        if self.external is None:
            return _inline(self.bb, core, operands, ids, None)
        attrs = {"Codegen": self.external, "global_symbol": name}
        gvar = self.bb.add_func(core.with_attrs(attrs), name)
        call = self.bb.normalize(relax.Call(gvar, operands))
        return self.bb.emit(with_ids(call, ids))

    def _int16(self, region: Region, args, result: relax.Var) -> relax.Expr:
        """The region on int16 activations (see the module doc)."""
        fr, ids = region.float_region, region.profile_ids
        if fr.weight is None or not self.policy.wide_activations:
            raise ValueError(f"{region.name} cannot run on int16 activations")
        policy = self.policy.for_layer(8)  # the most sensitive layers: 8-bit weights
        x, levels = wide_input(region.input, fr.weight, fr.channel_axis, policy)
        xq = self.bb.emit(_boundary(self.bb, relax.op.quantize, args[0], x, ids, x.dtype))
        xq = self.bb.emit(with_ids(relax.op.clip(xq, -levels, levels), ids))  # symmetric
        integer = self.policy.integer_outputs
        y = region.output.symmetric(x.dtype) if integer else None
        shape = [int(d) for d in xq.ty.shape.values]
        name = f"{region.name}_{x.dtype}"
        core = integer_core(region, policy, shape, name, integer, x, y)
        out = self._emit_core(core, name, [xq], ids)
        if integer:
            out = _boundary(self.bb, relax.op.dequantize, out, y, ids, "float32")
        self.bb.emit_normalized(relax.VarBinding(result, out))
        return result

    def _w4(self, region: Region, args, result: relax.Var | None) -> relax.Expr:
        """The dense region on its 4-bit weights, FP32 in and out (see the module doc)."""
        fr, w, ids = region.float_region, region.int4, region.profile_ids
        if w is None or self.dense_w4 is None:
            raise ValueError(f"{region.name} has no 4-bit weights on this target")
        zero_points = None if w.symmetric else w.zero_points
        call = self.dense_w4(self.bb, args[0], w.q, w.scales, zero_points, w.group_size, fr.bias)
        y = with_ids(self.bb.normalize(call), ids)
        if fr.clamp is not None:
            lo, hi = fr.clamp
            y = relax.op.maximum(self.bb.emit(y), _const(lo, "float32"))
            if np.isfinite(hi):
                y = relax.op.minimum(self.bb.emit(with_ids(y, ids)), _const(hi, "float32"))
            y = with_ids(self.bb.normalize(y), ids)
        if result is None:
            return self.bb.emit(y)
        self.bb.emit_normalized(relax.VarBinding(result, y))
        return result

    def _quantized(self, data, q: ActivationQ, ids) -> relax.Expr:
        """``data`` in ``q``'s integers: the 8-bit output of the region that computed it when
        its qparams are ``q``, else a quantize."""
        twin = self.quantized.get(data)
        if twin is not None and twin[1] == q:
            return twin[0]
        return self.bb.emit(_boundary(self.bb, relax.op.quantize, data, q, ids, q.dtype))

    def _int8(self, region: Region, args, result: relax.Var | None) -> relax.Expr:
        ids = region.profile_ids
        operands = [self._quantized(args[0], region.input, ids)]
        if region.operand is not None:
            operands.append(self._quantized(args[1], region.operand, ids))
        yq = self._core(region, operands)
        if region.name not in self.integer_outputs:
            y = yq  # already FP32
        else:
            y = _boundary(self.bb, relax.op.dequantize, yq, region.output, ids, "float32")
        if result is None:
            return y if isinstance(y, relax.Var) else self.bb.emit(y)
        self.bb.emit_normalized(relax.VarBinding(result, y))
        if region.name in self.integer_outputs:
            self.quantized[result] = (yq, region.output)
        return result

    def binding(self, binding: relax.VarBinding) -> None:
        value = binding.value
        region = None
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
            region = self.by_name.get(value.op.name_hint)
        if region is None:
            self.bb.emit_normalized(binding)
            return
        mode = self._mode(region)
        if mode != FP32 and region.fallback:
            raise ValueError(f"{region.name} has no qparams: {region.fallback}")
        func = self.mod[value.op]
        if mode == INT8:
            out = self._int8(region, value.args, binding.var)
        elif mode == INT16:
            out = self._int16(region, value.args, binding.var)
        elif mode == W4:
            out = self._w4(region, value.args, binding.var)
        else:
            out = _inline(self.bb, func, value.args, region.profile_ids, binding.var)
            if mode == SHADOW:  # the region's own quantized form, beside the FP32 one
                side = self._w4 if region.int4 is not None else self._int8
                out = side(region, value.args, None)
        self.exposed.append((region.output_id or region.name, out))

    def lower(self, expose: bool) -> tuple[tvm.IRModule, list[str]]:
        main = self.mod["main"]
        with self.bb.function(_LOWERED, list(main.params), attrs=dict(main.attrs)):
            with self.bb.dataflow():
                for block in main.body.blocks:
                    for binding in block.bindings:
                        self.binding(binding)
                result = main.body.body
                if expose:
                    fields = [result, *(v for _, v in self.exposed)]
                    result = self.bb.emit_output(relax.Tuple(fields))
            self.bb.emit_func_output(result)
        lowered = self.bb.get()
        lowered["main"] = lowered[_LOWERED].with_attr("global_symbol", "main")
        for name in [_LOWERED, *self.by_name]:
            del lowered[name]
        # Inlined regions leave alias bindings (``y = x``): ConvertLayout stops at them and
        # transposes back to NCHW (ResNet-18's max pool and residual adds, ~2 ms).
        lowered = relax.transform.CanonicalizeBindings()(lowered)
        lowered = relax.transform.DeadCodeElimination(["main"])(lowered)
        return lowered, [i for i, _ in self.exposed] if expose else []


def lower(
    mod: tvm.IRModule,
    regions: Sequence[Region],
    policy: QuantPolicy,
    modes: dict[str, str] | None = None,
    expose: bool = False,
    external: str | None = None,
    dense_w4: DenseW4 | None = None,
) -> tuple[tvm.IRModule, list[str]]:
    """``mod`` (partitioned, :func:`~rangeprof.byoc.regions.partition`) with each region lowered
    by its mode (default ``int8``, ``fp32`` for regions without qparams); returns the module and
    the profileIDs of the exposed outputs."""
    for name, mode in (modes or {}).items():
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} for {name}")
    return _Lowerer(mod, regions, modes or {}, policy, external, dense_w4).lower(expose)
