"""``floor_mod`` of floats with numpy's (and ONNX ``Mod(fmod=0)``'s) semantics.

TVM computes a float ``floormod(x, y)`` as ``x - floor(x / y) · y``: NaN for an infinite
divisor (``3 mod inf`` is ``3 - 0 · inf``) and a zero whose sign need not be the divisor's.
Legalized instead from the truncated remainder (``fmod``, exact), moved toward the divisor's
sign: ``r + y`` where ``r`` is non-zero and of the other sign than ``y``, and a zero signed as
``y``. Integer ``floor_mod`` keeps TVM's.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx, topi


def _floor_mod(x, y):
    r = topi.mod(x, y)  # truncated: fmod
    zero = tirx.const(0.0, x.dtype)
    other_sign = topi.logical_and(
        topi.not_equal(r, zero), topi.logical_xor(topi.less(r, zero), topi.less(y, zero))
    )
    r = topi.where(other_sign, topi.add(r, y), r)
    # A zero signed as the divisor, from the zero itself: a -0.0 constant would not do (TIR's
    # simplifier takes it for 0.0), nor copysign (LLVM codegen has none for float16).
    magnitude = topi.abs(r)
    signed = topi.where(topi.less(y, zero), topi.negative(magnitude), magnitude)
    return topi.where(topi.equal(r, zero), signed, r)


def legalize_floor_mod(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """Float ``floor_mod`` as :func:`_floor_mod`; other types as TVM legalizes them."""
    x, y = call.args
    if "float" not in str(call.ty.dtype):
        return tvm.ir.Op.get("relax.floor_mod").get_attr("FLegalize")(bb, call)
    return bb.call_te(_floor_mod, x, y, primfunc_name_hint="floor_mod")
