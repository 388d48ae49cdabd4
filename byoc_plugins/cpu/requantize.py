"""Fixed-point requantization in 32-bit vector instructions, exactly.

The quantized graph requantizes each int32 accumulator with int64 arithmetic,
``(int64(acc) · M + 2^(S-1)) >> S`` per output channel (``M`` and ``S`` constants), fused as the
epilogue of the conv / dense kernel. AVX2 has neither a 64-bit multiply nor a 64-bit arithmetic
shift: LLVM emulates both (~7 and ~4 instructions per 4 lanes), and the epilogue cost as much as
the int8 conv itself. Two legalizations give LLVM operands it can map onto 32-bit instructions,
with the same results for every input:

* ``multiply(x, M)`` with a constant int64 ``M`` whose values fit in int32 (the multiplier is
  below 2^31) → ``x · int64(M32)``: with ``x`` itself an extended int32 (``astype`` of the
  accumulator), LLVM emits ``vpmuldq`` (32 × 32 → 64 bits).
* ``right_shift(x, S)`` with a constant int64 ``S`` in [32, 63] (scales below 1 give such shifts)
  → ``int64(int32(x >> 32) >> (S - 32))``: the high half of ``x`` (a shuffle) then a 32-bit
  arithmetic shift (``vpsravd``); ``⌊⌊x / 2^32⌋ / 2^(S-32)⌋ = ⌊x / 2^S⌋``.

Other calls keep TVM's legalization.

Before legalization, :data:`fold_bias` moves the int32 bias behind the multiply,
``int64(acc + B) · M + R`` → ``int64(acc) · M + (B · M + R)`` (``B · M + R`` folded at build
time): LLVM widens ``int64(acc + B)`` into a 64-bit add, whose sum it can no longer prove fits
in 32 bits, and falls back to the emulated 64-bit multiply. Equal results, the sum ``acc + B``
being an int32 in the graph.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, topi
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

_INT32 = np.iinfo(np.int32)


def _int64_constant(call: relax.Call) -> np.ndarray | None:
    """The second operand's value when the call is int64 with a constant second operand."""
    _, const = call.args
    if str(call.ty.dtype) != "int64" or not isinstance(const, tvm.ir.expr.GenericConst):
        return None
    return const.value.numpy()


def _default(bb: relax.BlockBuilder, call: relax.Call):
    return call.op.get_attr("FLegalize")(bb, call)


def legalize_multiply(bb: relax.BlockBuilder, call: relax.Call):
    """``x · M`` with the int64 constant ``M`` read as int32 when every value fits."""
    m = _int64_constant(call)
    if m is None or m.min() < _INT32.min or m.max() > _INT32.max:
        return _default(bb, call)
    narrow = relax.const(m.astype("int32"), "int32")
    return bb.call_te(
        lambda x, c: topi.multiply(x, topi.cast(c, "int64")),
        call.args[0],
        narrow,
        primfunc_name_hint="multiply",
    )


def legalize_right_shift(bb: relax.BlockBuilder, call: relax.Call):
    """``x >> S`` as a 32-bit shift of the high half when every ``S`` is in [32, 63]."""
    s = _int64_constant(call)
    if s is None or s.min() < 32 or s.max() > 63:
        return _default(bb, call)
    rest = relax.const((s - 32).astype("int32"), "int32")

    def shift(x, r):
        high = topi.cast(topi.right_shift(x, tvm.tirx.const(32, "int64")), "int32")
        return topi.cast(topi.right_shift(high, r), "int64")

    return bb.call_te(shift, call.args[0], rest, primfunc_name_hint="right_shift")


def _bias_patterns():
    """``int64(acc + B) · M`` with and without a constant ``+ R`` after it."""
    acc, bias, mult, rounding = wildcard(), is_const(), is_const(), is_const()
    product = is_op("relax.multiply")(is_op("relax.astype")(is_op("relax.add")(acc, bias)), mult)
    return acc, bias, mult, rounding, product, is_op("relax.add")(product, rounding)


def _fold_bias(func: relax.Function) -> relax.Function:
    acc, bias, mult, rounding, product, rounded = _bias_patterns()

    def rewrite(expr, matches, with_rounding: bool):
        b, m = matches[bias].value.numpy(), matches[mult].value.numpy()
        dtypes = (str(matches[acc].ty.dtype), str(b.dtype), str(m.dtype), str(expr.ty.dtype))
        if dtypes != ("int32", "int32", "int64", "int64"):
            return expr
        folded = b.astype(np.int64) * m
        if with_rounding:
            folded = folded + matches[rounding].value.numpy()
        wide = relax.op.astype(matches[acc], "int64")
        return relax.op.add(relax.op.multiply(wide, matches[mult]), relax.const(folded, "int64"))

    func = rewrite_call(rounded, lambda e, m: rewrite(e, m, True), func)
    return rewrite_call(product, lambda e, m: rewrite(e, m, False), func)


@tvm.transform.module_pass(opt_level=0, name="FoldRequantizeBias")
def fold_bias(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """``int64(acc + B) · M (+ R)`` → ``int64(acc) · M + (B · M (+ R))`` in every function."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _fold_bias(func)
    return relax.transform.DeadCodeElimination()(mod)
