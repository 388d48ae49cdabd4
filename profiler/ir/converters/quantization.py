"""QuantizeLinear and DequantizeLinear with ``block_size`` (opset 21): one scale and zero point
per block of ``block_size`` elements along ``axis``, which TVM's converters refuse. Each scale and
zero point is repeated over its block (the last block may be short) and the node computed
elementwise as ONNX defines it: ``(x - zero_point) * scale`` and
``saturate(round(x / scale) + zero_point)``, rounding half to even. Unblocked nodes stay TVM's.
"""

from __future__ import annotations

import numpy as np
import onnx
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from rangeprof.profiler.errors import ConversionError
from rangeprof.profiler.ir.converters.common import static_dims, stock


def _blocked(op_type: str, compute):
    """A converter of ``op_type`` that takes blocked nodes to ``compute(x, scale, zero_point,
    attr)`` (scale and zero point over the whole of x) and leaves the others to TVM's."""

    class Converter(OnnxOpConverter):
        @classmethod
        def get_converter(cls, opset):
            tvm_convert = stock(op_type, opset)

            def convert(bb, inputs, attr, params):
                block = attr.get("block_size", 0)
                if not block:
                    return tvm_convert(bb, inputs, attr, params)
                x, scale = inputs[0], inputs[1]
                zero_point = inputs[2] if len(inputs) > 2 else None
                dims = static_dims(x)
                if dims is None:
                    raise ConversionError("blocked quantization of a tensor of unknown shape")
                axis = attr.get("axis", 1) % len(dims)
                whole = [_over_blocks(bb, v, axis, block, dims[axis]) for v in (scale, zero_point)]
                return compute(x, *whole, attr)

            return convert

    Converter.__name__ = op_type
    return Converter


def _over_blocks(bb, value, axis: int, block: int, size: int):
    """A per-block value repeated over each block's elements, cut to the axis' ``size``."""
    if value is None:
        return None
    repeated = relax.op.repeat(value, block, axis)
    return bb.normalize(relax.op.strided_slice(repeated, [axis], [0], [size]))


def _dequantize(x, scale, zero_point, attr):
    dtype = str(scale.ty.dtype)
    if attr.get("output_dtype", 0):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(attr["output_dtype"]).name
    # float32 holds 8- and 16-bit integers and their differences exactly
    shifted = relax.op.astype(x, "float32")
    if zero_point is not None:
        shifted = relax.op.subtract(shifted, relax.op.astype(zero_point, "float32"))
    return relax.op.astype(relax.op.multiply(shifted, relax.op.astype(scale, "float32")), dtype)


def _quantize(x, scale, zero_point, attr):
    dtype = "uint8" if zero_point is None else str(zero_point.ty.dtype)
    if attr.get("output_dtype", 0):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(attr["output_dtype"]).name
    info = np.iinfo(dtype)
    levels = relax.op.round(relax.op.divide(x, scale))
    if zero_point is not None:
        levels = relax.op.add(levels, relax.op.astype(zero_point, str(x.ty.dtype)))
    return relax.op.astype(relax.op.clip(levels, int(info.min), int(info.max)), dtype)


DequantizeLinear = _blocked("DequantizeLinear", _dequantize)
QuantizeLinear = _blocked("QuantizeLinear", _quantize)
