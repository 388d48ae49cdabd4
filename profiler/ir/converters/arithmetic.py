"""Arithmetic where TVM's converters miss ONNX's types or fuse badly, and CumProd, which TVM
lacks.

``Pow`` with the exponent of another type than the base (ONNX allows any pair; Relax's
``power`` wants one float type): the result has the base's type, as ONNX defines it. A float
base takes the exponent cast to its type. An integer base is raised in float64 (exact while the
result stays below 2**53) and converted back: rounded for an integer exponent (the exact
integer power), truncated for a float one (as the reference's cast of the float power).

``Max``, ``Min``, ``Sum`` and ``Mean`` of tensors fold their inputs pairwise (``maximum``,
``minimum``, ``add``), in order. TVM's converters broadcast every input, stack them and reduce
over the new axis: the same values, but a stacked copy and a reduction kernel that no
elementwise chain fuses with, where ``Max(LeakyRelu(conv), c)`` pairwise is one more step of the
conv's epilogue.
"""

import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from rangeprof.profiler.errors import ConversionError
from rangeprof.profiler.ir.converters.common import constant_input


def _integer(dtype: str) -> bool:
    return dtype.startswith(("int", "uint"))


class Pow(onnx_frontend.Pow):
    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        base, exponent = inputs[0], inputs[1]
        dtype, exponent_dtype = (str(x.ty.dtype) for x in (base, exponent))
        if not _integer(dtype):
            if exponent_dtype != dtype:
                exponent = relax.op.astype(exponent, dtype)
            return super()._impl_v7(bb, [base, exponent], attr, params)
        power = relax.op.power(*(relax.op.astype(x, "float64") for x in (base, exponent)))
        if _integer(exponent_dtype):
            power = relax.op.round(power)
        return relax.op.astype(power, dtype)


class CumProd(onnx_frontend.OnnxOpConverter):
    """The running product along ``axis`` (``exclusive``: of the elements before; ``reverse``:
    from the end), as CumSum's converter computes the running sum."""

    @classmethod
    def _impl_v26(cls, bb, inputs, attr, params):
        axis = constant_input(inputs, 1)
        if axis is None:
            raise ConversionError("an axis computed at run time is not supported")
        axis = int(axis.reshape(-1)[0])
        data = inputs[0]
        reverse = attr.get("reverse", 0)
        if reverse:
            data = relax.op.flip(data, axis)
        product = relax.op.cumprod(data, axis, exclusive=bool(attr.get("exclusive", 0)))
        return relax.op.flip(product, axis) if reverse else product


class _Pairwise:
    """Inputs folded pairwise unless all are constants (TVM's converter folds those in numpy)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        if all(isinstance(x, tvm.ir.GenericConst) for x in inputs):
            return super()._impl_v1(bb, inputs, attr, params)
        return cls._impl_dynamic(bb, inputs)


class Max(_Pairwise, onnx_frontend.Max):
    pass


class Min(_Pairwise, onnx_frontend.Min):
    pass


class Sum(_Pairwise, onnx_frontend.Sum):
    pass


class Mean(_Pairwise, onnx_frontend.Mean):
    pass
