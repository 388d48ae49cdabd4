"""Pattern tables: the FP32 subgraphs a plugin offloads, with their constraint checks.

A region is ``conv2d`` (dense, depthwise or grouped; NCHW / OIHW) or ``matmul`` with a constant
float32 weight, then optionally a constant per-output-channel bias add, then optionally a ReLU or a
``Clip`` (``maximum(·, lo)`` followed by ``minimum(·, hi)``, as ReLU6 is after
``rangeprof.profiler.ir.passes.canonicalize``); or, for targets that take it, a ``batch_matmul``:
a ``matmul`` of two activations (attention's scores ``Q·Kᵀ`` and context ``P·V``), no epilogue.
Patterns are listed longest first, constant-weight kinds before ``batch_matmul``:
``FuseOpsByPattern`` takes the first that matches. :func:`read_region` reads a matched composite
function back into a :class:`FloatRegion`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.backend.utils import has_leaking_intermediate_variables
from tvm.relax.dpl import is_const, is_op, wildcard

from rangeprof.profiler.ir.spans import ids_of

CONV2D = "conv2d"
MATMUL = "matmul"
BATCH_MATMUL = "batch_matmul"  # a matmul of two activations
WEIGHTED = (CONV2D, MATMUL)
_OPS = {CONV2D: "relax.nn.conv2d", MATMUL: "relax.matmul", BATCH_MATMUL: "relax.matmul"}
_EPILOGUES = ("bias_clip", "bias_relu", "bias", "clip", "relu", "")


@dataclass(frozen=True)
class FloatRegion:
    """What a composite function computes, as its quantized form needs it."""

    kind: str  # CONV2D | MATMUL | BATCH_MATMUL
    weight: np.ndarray | None  # OIHW for conv2d, [K, N] for matmul; None for batch_matmul
    bias: np.ndarray | None  # one value per output channel
    clamp: tuple[float, float] | None  # (lo, hi) of a ReLU / Clip epilogue (hi may be inf)
    attrs: dict  # conv2d: strides, padding, dilation, groups
    weight_id: str | None  # profileID of the weight constant, when it is still an initial one

    @property
    def channel_axis(self) -> int:
        """Axis of the weight that holds the output channels."""
        return 0 if self.kind == CONV2D else 1


def _constant(expr) -> np.ndarray | None:
    if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.ty, relax.TensorType):
        return expr.value.numpy()
    return None


def _float32(expr) -> bool:
    return isinstance(expr.ty, relax.TensorType) and str(expr.ty.dtype) == "float32"


def _per_channel(shape: tuple[int, ...], out_shape: tuple[int, ...], axis: int) -> bool:
    """A constant that varies along ``axis`` of the output only (or not at all)."""
    if len(shape) > len(out_shape):
        return False
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    return all(d == 1 or (i == axis and d == out_shape[i]) for i, d in enumerate(padded))


def _scalar(expr) -> float | None:
    value = _constant(expr)
    if value is None or value.size != 1:
        return None
    return float(value.reshape(()))


def _check(kind: str):
    def check(context: relax.transform.PatternCheckContext) -> bool:
        found = context.annotated_expr
        op = found["op"]
        data, weight = op.args
        if not (_float32(data) and _float32(weight) and _float32(op)):
            return False
        # An epilogue whose input is read elsewhere too (HardSwish's ``x * clip(x + 3)``
        # reads the conv's output twice) cannot move into the region: the region would
        # hide the value the other reader needs.
        if has_leaking_intermediate_variables(context):
            return False
        if kind == CONV2D:
            attrs = op.attrs
            layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
            if layouts != ("NCHW", "OIHW", "NCHW"):
                return False
            axis = 1
        else:
            if weight.ty.ndim != 2:
                return False
            axis = op.ty.ndim - 1
        out_shape = tuple(int(d) for d in op.ty.shape.values)
        if "bias" in found:
            bias = _constant(found["bias"])
            if bias is None or not _per_channel(bias.shape, out_shape, axis):
                return False
        if "lo" in found:
            lo, hi = _scalar(found["lo"]), _scalar(found["hi"])
            if lo is None or hi is None or lo > 0 or hi <= 0:
                return False
        return True

    return check


def _check_batch_matmul(context: relax.transform.PatternCheckContext) -> bool:
    """Two float32 activations (a constant operand is a weight: the other patterns' business)
    of static shapes, the quantized kernels being sized at build time."""
    op = context.annotated_expr["op"]
    operands = (*op.args, op)
    return all(
        _float32(e) and _constant(e) is None and e.ty.shape is not None for e in operands
    ) and all(isinstance(d, tvm.tirx.IntImm) for e in operands for d in e.ty.shape.values)


def _batch_matmul_pattern(prefix: str) -> relax.transform.FusionPattern:
    op = is_op(_OPS[BATCH_MATMUL])(wildcard(), wildcard())
    return relax.transform.FusionPattern(
        f"{prefix}.{BATCH_MATMUL}", op, {"op": op}, _check_batch_matmul
    )


def pattern_table(prefix: str, kinds=WEIGHTED) -> list[relax.transform.FusionPattern]:
    """``<prefix>.<kind>[_<epilogue>]`` patterns for the given op kinds, longest first
    (``batch_matmul``, having neither weight nor epilogue, last)."""
    table = []
    for kind in (k for k in kinds if k in WEIGHTED):
        for epilogue in _EPILOGUES:
            op = is_op(_OPS[kind])(wildcard(), is_const())
            found = {"op": op}
            top = op
            if epilogue.startswith("bias"):
                found["bias"] = is_const()
                top = is_op("relax.add")(top, found["bias"])
            if epilogue.endswith("relu"):
                top = is_op("relax.nn.relu")(top)
            elif epilogue.endswith("clip"):
                found["lo"], found["hi"] = is_const(), is_const()
                top = is_op("relax.minimum")(is_op("relax.maximum")(top, found["lo"]), found["hi"])
            name = f"{prefix}.{kind}" + (f"_{epilogue}" if epilogue else "")
            table.append(relax.transform.FusionPattern(name, top, found, _check(kind)))
    if BATCH_MATMUL in kinds:
        table.append(_batch_matmul_pattern(prefix))
    return table


def read_region(func: relax.Function) -> FloatRegion:
    """The :class:`FloatRegion` of a composite function made from :func:`pattern_table`."""
    calls = [b.value for block in func.body.blocks for b in block.bindings]
    op, *epilogue = calls
    if str(func.attrs["Composite"]).endswith(f".{BATCH_MATMUL}"):
        return FloatRegion(BATCH_MATMUL, None, None, None, {}, None)
    kind = CONV2D if op.op.same_as(tvm.ir.Op.get(_OPS[CONV2D])) else MATMUL
    weight_expr = op.args[1]
    channels = int(weight_expr.ty.shape.values[0 if kind == CONV2D else 1])
    bias = None
    lo, hi = -math.inf, math.inf
    for call in epilogue:
        name = str(call.op.name)
        if name == "relax.add":
            # add commutes, and the pattern matches it so: the bias is on either side (ONNX
            # exporters write Add(B, X) as often as Add(X, B)).
            # A scalar (or [1]) constant is a bias equal on every channel.
            value = next(v for v in map(_constant, call.args) if v is not None)
            bias = np.broadcast_to(value.reshape(-1), (channels,)).astype(np.float32)
        elif name == "relax.nn.relu":
            lo = 0.0
        elif name == "relax.maximum":
            lo = _scalar(call.args[1])
        elif name == "relax.minimum":
            hi = _scalar(call.args[1])
    attrs = {}
    if kind == CONV2D:
        a = op.attrs
        attrs = {
            "strides": [int(v) for v in a.strides],
            "padding": [int(v) for v in a.padding],
            "dilation": [int(v) for v in a.dilation],
            "groups": int(a.groups),
        }
    weight_ids = sorted(ids_of(weight_expr))
    return FloatRegion(
        kind=kind,
        weight=_constant(weight_expr),
        bias=bias,
        clamp=None if (lo, hi) == (-math.inf, math.inf) else (lo, hi),
        attrs=attrs,
        weight_id=weight_ids[0] if len(weight_ids) == 1 else None,
    )
