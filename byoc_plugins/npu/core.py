"""Reading an offloaded integer core back into an NPU operation.

The NPU runs exactly what :func:`rangeprof.byoc.lowering.integer_core` builds — one input, one
layer, fixed-point requantization — and nothing else. The input and output are 8-bit (an int8
region), or both int16 (an int16 region, a layer an accuracy budget found too sensitive for 8
bits: symmetric, so no ``pad``; its levels capped by the lowering so that the int32 accumulator
of int16 × int8 products cannot overflow). :func:`read_core` checks a ``Codegen``-marked Relax
function binding by binding against that canonical form:

    [pad(x, pad_value=z_x)]                       # only on H and W, only before a conv
    conv2d(x, W int8 OIHW, out_dtype=int32)       # NCHW, any stride / dilation / groups
      | matmul(x, W int8 [K, N], out_dtype=int32)
    + bias (int32 per channel) → astype int64 → × M (per channel) → + 2^(S-1) (per channel)
    → >> S (per channel) → astype int32 → + z_y → maximum lo → minimum hi → astype the output type

and returns the constants the hardware takes (:class:`Conv2dOp`, :class:`MatmulOp`). Anything
else — another operator, a non-constant operand, a rounding constant other than ``2^(S-1)``, a
multiplier that is not an int32 — is a :class:`~rangeprof.profiler.errors.RangeprofError` naming the
region and the binding, never a silently different computation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.errors import RangeprofError

EIGHT_BITS = ("uint8", "int8")
# The output types each input type may have: 8 bits in, 8 bits out; int16 in, int16 out.
OUTPUTS = {"uint8": EIGHT_BITS, "int8": EIGHT_BITS, "int16": ("int16",)}
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INT32 = np.iinfo(np.int32)

# The epilogue after the accumulator: (operator, result dtype, name of the constant operand).
_EPILOGUE = (
    ("relax.add", "int32", "bias"),
    ("relax.astype", "int64", None),
    ("relax.multiply", "int64", "multiplier"),
    ("relax.add", "int64", "rounding"),
    ("relax.right_shift", "int64", "shift"),
    ("relax.astype", "int32", None),
    ("relax.add", "int32", "zero_point"),
    ("relax.maximum", "int32", "lo"),
    ("relax.minimum", "int32", "hi"),
)
_PER_CHANNEL = ("bias", "multiplier", "rounding", "shift")


@dataclass(frozen=True)
class Requantize:
    """``y = clamp(((acc + bias) · M + 2^(S−1)) >> S) + z_y, lo, hi)`` per output channel."""

    bias: np.ndarray  # int32 [channels], input zero point folded in
    multiplier: np.ndarray  # int32 [channels]
    shift: np.ndarray  # uint8 [channels], in [1, 63]
    zero_point: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Conv2dOp:
    """An NCHW conv2d of an 8-bit or int16 input by int8 OIHW weights, then requantization."""

    symbol: str
    in_dtype: str
    out_dtype: str
    in_shape: tuple[int, int, int, int]  # N, C, H, W
    out_shape: tuple[int, int, int, int]  # N, K, OH, OW
    weight: np.ndarray  # int8 [K, C / groups, KH, KW]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]  # top, left, bottom, right
    pad_value: int  # what the padding holds: z_x (0 when the conv pads by itself)
    groups: int
    requantize: Requantize


@dataclass(frozen=True)
class MatmulOp:
    """``x [..., K] @ W [K, N]`` of an 8-bit or int16 input by int8 weights, then
    requantization."""

    symbol: str
    in_dtype: str
    out_dtype: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    weight: np.ndarray  # int8 [K, N]
    requantize: Requantize

    @property
    def rows(self) -> int:
        return int(np.prod(self.in_shape[:-1]))


NpuOp = Conv2dOp | MatmulOp


class _Reader:
    """Walks the bindings of one core, failing with the region's name."""

    def __init__(self, func: relax.Function):
        self.symbol = str(func.attrs["global_symbol"])
        self.bindings = [b for block in func.body.blocks for b in block.bindings]
        self.at = 0
        self.func = func

    def fail(self, why: str) -> RangeprofError:
        return RangeprofError(f"npu: region {self.symbol} is not a canonical integer core: {why}")

    def next_op(self) -> str:
        """The operator the next binding calls (a description when it calls none)."""
        if self.at >= len(self.bindings):
            return "(nothing)"
        value = self.bindings[self.at].value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            return str(value.op.name)
        return type(value).__name__

    def take(self, op_name: str, data: relax.Expr) -> relax.Call:
        """The next binding, which must call ``op_name`` on ``data``."""
        if self.at >= len(self.bindings):
            raise self.fail(f"ends before {op_name}")
        binding = self.bindings[self.at]
        call = binding.value
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.Op):
            raise self.fail(f"binding {binding.var.name} is not an operator call (want {op_name})")
        if str(call.op.name) != op_name:
            raise self.fail(f"binding {binding.var.name} calls {call.op.name}, want {op_name}")
        if not call.args or not call.args[0].same_as(data):
            raise self.fail(f"{op_name} at {binding.var.name} does not take the previous value")
        self.at += 1
        return call

    def var(self) -> relax.Var:
        return self.bindings[self.at - 1].var

    def constant(self, call: relax.Call, dtype: str) -> np.ndarray:
        operand = call.args[1]
        if not isinstance(operand, tvm.ir.GenericConst) or str(operand.ty.dtype) != dtype:
            raise self.fail(f"{call.op.name} needs a constant {dtype} operand")
        return operand.value.numpy()

    def dtype(self, expr: relax.Expr) -> str:
        return str(expr.ty.dtype)

    def shape(self, expr: relax.Expr) -> tuple[int, ...]:
        ty = expr.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise self.fail("tensor shapes must be static")
        try:
            return tuple(int(d) for d in ty.shape.values)
        except TypeError as err:
            raise self.fail("tensor shapes must be static") from err


def _channels(reader: _Reader, value: np.ndarray, channels: int, axis: int, what: str):
    """A constant that varies along the output-channel ``axis`` (counted from the end) only,
    as a [channels] vector."""
    if value.size == 1:
        return np.full(channels, value.reshape(()))
    if value.ndim < -axis or value.shape[axis] != channels or value.size != channels:
        raise reader.fail(f"{what} varies along more than the output channels")
    return value.reshape(channels)


def _requantize(
    reader: _Reader, acc: relax.Var, channels: int, axis: int
) -> tuple[Requantize, str]:
    """The epilogue's constants, and the output dtype (checked by :func:`read_core`)."""
    values: dict[str, np.ndarray] = {}
    data = acc
    for op_name, dtype, name in _EPILOGUE:
        call = reader.take(op_name, data)
        if name is None and str(call.attrs.dtype) != dtype:
            raise reader.fail(f"astype to {call.attrs.dtype}, want {dtype}")
        if name is not None:
            values[name] = reader.constant(call, dtype)
        data = reader.var()
    last = reader.take("relax.astype", data)
    out_dtype = str(last.attrs.dtype)
    if reader.at != len(reader.bindings):
        raise reader.fail("the core must end with its astype to the output type")
    if not reader.func.body.body.same_as(reader.var()):
        raise reader.fail("the core must return its last binding")
    vectors = {
        name: _channels(reader, values[name], channels, axis, name).astype(np.int64)
        for name in _PER_CHANNEL
    }
    shift, multiplier = vectors["shift"], vectors["multiplier"]
    if np.any(shift < 1) or np.any(shift > 63):
        raise reader.fail("shifts must lie in [1, 63]")
    if np.any(multiplier < 0) or np.any(multiplier > _INT32.max):
        raise reader.fail("multipliers must be non-negative int32")
    if np.any(vectors["rounding"] != np.left_shift(np.int64(1), shift - 1)):
        raise reader.fail("the rounding constant must be 2^(shift-1)")
    scalars = {}
    for name in ("zero_point", "lo", "hi"):
        if values[name].size != 1:
            raise reader.fail(f"{name} must be one value")
        scalars[name] = int(values[name].reshape(()))
    info = np.iinfo(out_dtype)
    if not info.min <= scalars["lo"] <= scalars["hi"] <= info.max:
        raise reader.fail(f"clamp [{scalars['lo']}, {scalars['hi']}] is outside {out_dtype}")
    requantize = Requantize(
        bias=vectors["bias"].astype(np.int32),
        multiplier=multiplier.astype(np.int32),
        shift=shift.astype(np.uint8),
        **scalars,
    )
    return requantize, out_dtype


def _conv2d(reader: _Reader, call: relax.Call, data, pad_value, pre_padding):
    attrs = call.attrs
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    if layouts != ("NCHW", "OIHW", "NCHW"):
        raise reader.fail(f"conv2d layouts {layouts}, want NCHW / OIHW / NCHW")
    padding = tuple(int(p) for p in attrs.padding)
    if any(padding) and any(pre_padding):
        raise reader.fail("conv2d pads an input that is already padded")
    weight = reader.constant(call, "int8")
    acc = reader.var()
    requantize, out_dtype = _requantize(reader, acc, weight.shape[0], -3)
    n, k, oh, ow = reader.shape(acc)
    return Conv2dOp(
        symbol=reader.symbol,
        in_dtype=reader.dtype(data),
        out_dtype=out_dtype,
        in_shape=reader.shape(data),
        out_shape=(n, k, oh, ow),
        weight=weight,
        strides=tuple(int(s) for s in attrs.strides),
        dilation=tuple(int(d) for d in attrs.dilation),
        padding=pre_padding if any(pre_padding) else padding,
        pad_value=pad_value if any(pre_padding) else 0,  # conv2d's own padding holds zeros
        groups=int(attrs.groups),
        requantize=requantize,
    )


def read_core(func: relax.Function) -> NpuOp:
    """The NPU operation of one integer core (see the module docstring for the form)."""
    reader = _Reader(func)
    if not _SYMBOL.fullmatch(reader.symbol):
        raise reader.fail("its global_symbol is not a C identifier")
    if len(func.params) != 1 or reader.dtype(func.params[0]) not in OUTPUTS:
        raise reader.fail("it must take one uint8 / int8 / int16 tensor")
    in_dtype, out_dtype = reader.dtype(func.params[0]), reader.dtype(func.body.body)
    if out_dtype not in OUTPUTS[in_dtype]:
        raise reader.fail(
            f"it returns {out_dtype}; the NPU requantizes the outputs of {in_dtype} inputs to "
            f"{' / '.join(OUTPUTS[in_dtype])} (integer-only hardware)"
        )
    data = func.params[0]
    pad_value, pre_padding = 0, (0, 0, 0, 0)
    if reader.next_op() == "relax.nn.pad":
        pad = reader.take("relax.nn.pad", data)
        widths = [int(w) for w in pad.attrs.pad_width]
        if len(widths) != 8 or any(widths[:4]) or str(pad.attrs.pad_mode) != "constant":
            raise reader.fail("pad must be a constant pad of H and W only")
        top, bottom, left, right = widths[4:]
        pre_padding = (top, left, bottom, right)
        pad_value = int(pad.attrs.pad_value)
        if pad_value != float(pad.attrs.pad_value):
            raise reader.fail("the pad value must be an integer")
    source = reader.var() if reader.at else data
    name = reader.next_op()
    if name == "relax.nn.conv2d":
        conv = reader.take(name, source)
        if str(conv.attrs.out_dtype) != "int32":
            raise reader.fail("conv2d must accumulate in int32")
        # The hardware reads the unpadded input and pads while it copies (see tiling).
        return _conv2d(reader, conv, data, pad_value, pre_padding)
    if name == "relax.matmul" and not reader.at:
        matmul = reader.take(name, source)
        weight = reader.constant(matmul, "int8")
        if weight.ndim != 2 or str(matmul.attrs.out_dtype) != "int32":
            raise reader.fail("matmul needs an int8 [K, N] weight and int32 accumulation")
        acc = reader.var()
        requantize, out_dtype = _requantize(reader, acc, weight.shape[1], -1)
        return MatmulOp(
            symbol=reader.symbol,
            in_dtype=reader.dtype(data),
            out_dtype=out_dtype,
            in_shape=reader.shape(data),
            out_shape=reader.shape(acc),
            weight=weight,
            requantize=requantize,
        )
    raise reader.fail(f"it computes {name}; the NPU runs conv2d and matmul only")
