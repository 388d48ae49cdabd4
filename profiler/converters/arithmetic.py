"""Arithmetic where TVM's converters miss ONNX's types.

``Pow`` of two integer tensors: Relax's ``power`` takes floats only. The integer power is
computed in float64 (exact while the result stays below 2**53) and rounded back to the base's
type, as ONNX computes it in the base's type.
"""

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend


class Pow(onnx_frontend.Pow):
    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        base, exponent = inputs[0], inputs[1]
        dtypes = [str(x.ty.dtype) for x in (base, exponent)]
        if not all(d.startswith(("int", "uint")) for d in dtypes):
            return super()._impl_v7(bb, inputs, attr, params)
        wide = [relax.op.astype(x, "float64") for x in (base, exponent)]
        return relax.op.astype(relax.op.round(relax.op.power(*wide)), dtypes[0])
