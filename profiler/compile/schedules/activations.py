"""Activations whose libm call LLVM cannot vectorise: ``erf`` (GELU).

LLVM lowers ``T.erf`` to one ``erff`` call per element, inside the GELU epilogue of a
transformer's feed-forward dense kernel. Float32 ``erf`` is legalized as TOPI's ``fast_erf``
instead (a rational approximation on ``[-4, 4]``, within 4.2e-7 of ``erf`` over ``[-6, 6]``):
plain arithmetic, which vectorises and fuses like any epilogue. Every build of a model uses the
same legalization, so the profiling build stays bitwise equal to the one it observes.
"""

from __future__ import annotations

from tvm import relax, topi


def legalize_erf(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``erf`` as ``fast_erf`` for float32, TOPI's ``erf`` for other types."""
    x = call.args[0]
    return bb.call_te(topi.fast_erf if str(x.ty.dtype) == "float32" else topi.erf, x)
