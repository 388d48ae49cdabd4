"""Activations: the ones whose libm call LLVM cannot vectorise (``erf``, ``exp``, ``tanh``,
``sigmoid``), and the clips of HardSwish / HardSigmoid and LeakyReLU, which the layout rewrite
cannot see through.

LLVM lowers a float32 ``T.exp`` to one ``expf`` call per element, even in a vectorised loop;
TVM writes ``T.tanh`` as two ``exp`` and ``T.sigmoid`` as one, so a SiLU, a GELU (tanh form) or
an LSTM gate costs a libm call per element (a ``tanh`` epilogue ran at 10 ns an element, longer
than the dense layer under it). They are replaced by plain arithmetic, which vectorises and
fuses like any epilogue:

* ``erf`` (GELU) is legalized as TOPI's ``fast_erf`` (a rational approximation on ``[-4, 4]``,
  within 4.2e-7 of ``erf`` over ``[-6, 6]``).
* ``power`` by a constant 2 or 3 (the tanh GELU's ``x³``, older exports' LayerNorm
  ``(x - mean)²``) is legalized as products, as onnxruntime's Pow computes them: no ``powf``
  call per element, and none of TVM's warnings of ``pow(x, 3)`` at every compile.
* :data:`lower_vector_math`, run on every kernel after the schedules, rewrites float32 ``exp``
  as Cephes' ``expf`` (range reduction by ln 2, a degree-7 polynomial, the power of two built in
  the exponent bits: within 2 ulp of libm; below ``log(FLT_MIN)`` it gives 0, as libm's flushed
  result does in a softmax), ``sigmoid`` as ``1 / (1 + exp(-x))`` with that ``exp``, and
  ``tanh`` as Eigen's rational approximation on ``[-9, 9]`` (within 7 ulp; ±1 beyond, where
  float32 ``tanh`` is ±1). NaN stays NaN.

Every kernel of every build is rewritten the same way, whatever it fused, so the profiling build
stays bitwise equal to the build it observes.

The ONNX importer writes HardSwish and HardSigmoid with ``R.clip``, and LeakyReLU with
``R.nn.leakyrelu``, which have no layout inference: ``ConvertLayout`` transposed back to NCHW
around each one, and the transposes kept the activation out of the conv before it (PP-LCNet,
MobileNetV3; a speech CNN's 19 conv + LeakyReLU blocks ran 12 transposes). :data:`as_extrema`,
run before the layout rewrite, writes a clip with constant bounds as ``minimum(maximum(x, lo),
hi)`` (what ``Canonicalize`` makes of the importer's ``Clip``) and ``leakyrelu(x, a)`` as
``maximum(x, x · a)`` (``minimum`` for ``a > 1``): the same values bit for bit, NaN and signed
zeros included, as TOPI computes ``x · a`` where ``x ≤ 0``. The last operator keeps the
activation's span (its profileIDs).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx, topi

_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 in two parts: r = x - n·ln 2 exactly
_EXP_POLY = (
    1.9875691500e-4,
    1.3981999507e-3,
    8.3334519073e-3,
    4.1665795894e-2,
    1.6666665459e-1,
    5.0000001201e-1,
)
_EXP_MIN, _EXP_MAX = -87.3365478515625, 88.72283905206835  # log(FLT_MIN), log(FLT_MAX)
# Eigen's float tanh: odd numerator (x¹ … x¹³), even denominator (x⁰ … x⁶), highest first.
_TANH_P = (
    -2.76076847742355e-16,
    2.00018790482477e-13,
    -8.60467152213735e-11,
    5.12229709037114e-08,
    1.48572235717979e-05,
    6.37261928875436e-04,
    4.89352455891786e-03,
)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
_TANH_CLAMP = 9.0  # float32 tanh is ±1 beyond


_CLIP, _MINIMUM = tvm.ir.Op.get("relax.clip"), tvm.ir.Op.get("relax.minimum")
_LEAKY_RELU, _MAXIMUM = tvm.ir.Op.get("relax.nn.leakyrelu"), tvm.ir.Op.get("relax.maximum")


@relax.expr_functor.mutator
class _AsExtrema(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op.same_as(_LEAKY_RELU):
            data = call.args[0]
            alpha = float(call.attrs.alpha)
            scaled = self.builder_.emit(relax.op.multiply(data, relax.const(alpha, data.ty.dtype)))
            return relax.Call(_MAXIMUM if alpha <= 1 else _MINIMUM, [data, scaled], span=call.span)
        if not call.op.same_as(_CLIP):
            return call
        data, low, high = call.args
        if not all(isinstance(b, tirx.IntImm | tirx.FloatImm) for b in (low, high)):
            return call
        dtype = str(data.ty.dtype)
        lowered = self.builder_.emit(relax.op.maximum(data, relax.const(low.value, dtype)))
        upper = relax.const(high.value, dtype)
        return relax.Call(_MINIMUM, [lowered, upper], span=call.span)


@tvm.transform.module_pass(opt_level=0, name="AsExtrema")
def as_extrema(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every ``R.clip`` with constant bounds → ``minimum(maximum(x, lo), hi)``, every
    ``R.nn.leakyrelu`` → ``maximum(x, x · a)`` (``minimum`` for ``a > 1``)."""
    mod = mod.clone()  # the caller's module stays as it was
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _AsExtrema(mod).visit_expr(func)
    return mod


def legalize_erf(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``erf`` as ``fast_erf`` for float32, TOPI's ``erf`` for other types."""
    x = call.args[0]
    return bb.call_te(topi.fast_erf if str(x.ty.dtype) == "float32" else topi.erf, x)


def legalize_power(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """A float ``x ** 2`` or ``x ** 3`` (a scalar constant exponent) as ``x · x (· x)``; any
    other power as TVM legalizes it."""
    x, y = call.args
    value = y.value.numpy() if isinstance(y, tvm.ir.GenericConst) else np.empty(0)
    exponent = float(value.item()) if value.size == 1 else None
    if "float" not in str(x.ty.dtype) or exponent not in (2.0, 3.0):
        return tvm.ir.Op.get("relax.power").get_attr("FLegalize")(bb, call)

    def product(x):
        square = topi.multiply(x, x)
        return square if exponent == 2.0 else topi.multiply(square, x)

    return bb.call_te(product, x, primfunc_name_hint="power")


def _f32(value: float) -> tirx.PrimExpr:
    return tirx.const(value, "float32")


def _horner(x: tirx.PrimExpr, coefficients) -> tirx.PrimExpr:
    poly = _f32(coefficients[0])
    for c in coefficients[1:]:
        poly = poly * x + _f32(c)
    return poly


def _is_nan(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """Whether float32 ``x`` is NaN, tested on its bits: TVM's vectoriser does not know
    ``T.isnan``, and left a loop holding one scalar (LLVM then vectorised it 8 wide, softmax's
    exp 1.6× slower)."""
    bits = tirx.reinterpret("int32", x) & tirx.const(0x7FFFFFFF, "int32")
    return bits > tirx.const(0x7F800000, "int32")


def _keep_nan(x: tirx.PrimExpr, value: tirx.PrimExpr) -> tirx.PrimExpr:
    """``value``, or ``x`` where ``x`` is NaN (a clamp by min / max would make NaN a number)."""
    return tirx.Select(_is_nan(x), x, value)


def _scale(value: tirx.PrimExpr, n: tirx.PrimExpr) -> tirx.PrimExpr:
    """``value · 2ⁿ`` for an integral float32 ``n`` in ``[-126, 128]``, the power built in the
    exponent bits in two halves: ``exp`` up to ``log(FLT_MAX)`` needs ``2¹²⁸``, no float32."""
    whole = tirx.Cast("int32", n)
    half = whole >> 1
    return value * _exponent(half) * _exponent(whole - half)


def _exponent(n: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.reinterpret("float32", (n + 127) << 23)


def vector_exp(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``exp(x)`` for float32 ``x`` in arithmetic LLVM vectorises (Cephes' ``expf``). Below
    ``log(FLT_MIN)`` the polynomial runs on 0, not on that bound: there it would end in a
    subnormal, and each instruction that makes one costs a microcode assist on Intel cores (a
    causal mask's ``-inf`` half of the scores made softmax 4× slower)."""
    clamped = tirx.Select(x < _f32(_EXP_MIN), _f32(0.0), tirx.min(x, _f32(_EXP_MAX)))
    n = tirx.floor(clamped * _f32(_LOG2E) + _f32(0.5))
    r = clamped - n * _f32(_LN2_HI) - n * _f32(_LN2_LO)
    value = _scale(_horner(r, _EXP_POLY) * r * r + r + _f32(1.0), n)
    value = tirx.Select(x > _f32(_EXP_MAX), _f32(math.inf), value)
    return _keep_nan(x, tirx.Select(x < _f32(_EXP_MIN), _f32(0.0), value))


def vector_tanh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``tanh(x)`` for float32 ``x``: Eigen's rational approximation."""
    clamped = tirx.min(tirx.max(x, _f32(-_TANH_CLAMP)), _f32(_TANH_CLAMP))
    square = clamped * clamped
    return _keep_nan(x, clamped * _horner(square, _TANH_P) / _horner(square, _TANH_Q))


def vector_sigmoid(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """``1 / (1 + exp(-x))`` with :func:`vector_exp`."""
    return _f32(1.0) / (_f32(1.0) + vector_exp(-x))


_VECTOR_MATH = {"tirx.exp": vector_exp, "tirx.tanh": vector_tanh, "tirx.sigmoid": vector_sigmoid}


def _lower_call(call: tvm.ir.Call, mutator) -> tirx.PrimExpr:
    call = mutator.default_mutate(call)
    lower = _VECTOR_MATH.get(getattr(call.op, "name", None))
    if lower is None or str(call.ty) != "float32":
        return call
    # The argument is bound once: the approximations read it a dozen times, and an inlined
    # epilogue (a GELU's cubic) would be copied into each read.
    x = tirx.Var("x", "float32")
    return tirx.Let(x, call.args[0], lower(x))


@tvm.transform.module_pass(opt_level=0, name="LowerVectorMath")
def lower_vector_math(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every kernel's float32 ``exp``, ``tanh`` and ``sigmoid`` → vectorisable arithmetic."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = tvm_ffi.structural_mutate(func, (tvm.ir.Call, _lower_call))
    return mod
