"""MaxPool with its ``Indices`` output, which TVM's converter does not compute, and with
``auto_pad`` SAME_LOWER's output size.

``Y`` stays TVM's max pooling. ``Indices`` holds, for every output, where its maximum is in the
input flattened row-major (over the spatial axes column-major with ``storage_order`` 1), as
onnxruntime computes it: the first maximum of a window, in the window's row-major order. Each
window position is a strided slice of the input padded with -inf (integer inputs in float32);
the argmax over the stacked slices says which position held the maximum.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from rangeprof.profiler.errors import ConversionError
from rangeprof.profiler.ir.converters.common import constant_input, static_dims, stock


class MaxPool(OnnxOpConverter):
    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("MaxPool", opset)

        def convert(bb, inputs, attr, params):
            x = inputs[0]
            dims = static_dims(x)
            if dims is None:
                return tvm_convert(bb, inputs, attr, params)
            attr = _explicit_pads(attr, dims[2:])
            pooled = tvm_convert(bb, inputs, attr, params)
            if attr["tvm_custom"]["num_outputs"] < 2:
                return pooled
            pooled = bb.normalize(pooled)
            return relax.Tuple([pooled, _indices(x, dims, static_dims(pooled)[2:], attr)])

        return convert


def _explicit_pads(attr: dict, spatial: list[int]) -> dict:
    """``auto_pad`` SAME_UPPER / SAME_LOWER as the ``pads`` they stand for: outputs of
    ``ceil(input / stride)``, the odd padding after (UPPER) or before (LOWER); TVM's converter
    gives SAME_LOWER ``floor(input / stride)`` outputs."""
    auto_pad = attr.get("auto_pad", b"NOTSET").decode()
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        return attr
    rank = len(spatial)
    kernel = list(attr["kernel_shape"])
    strides = list(attr.get("strides", [1] * rank))
    dilations = list(attr.get("dilations", [1] * rank))
    before, after = [], []
    for n, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
        total = max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
        small, large = total // 2, total - total // 2
        before.append(small if auto_pad == "SAME_UPPER" else large)
        after.append(total - before[-1])
    return {**attr, "auto_pad": b"NOTSET", "pads": before + after}


def _indices(x, dims: list[int], out: list[int], attr: dict):
    spatial = dims[2:]
    rank = len(spatial)
    kernel = list(attr["kernel_shape"])
    strides = list(attr.get("strides", [1] * rank))
    dilations = list(attr.get("dilations", [1] * rank))
    begin = list(attr.get("pads", [0] * 2 * rank))[:rank]
    if attr.get("auto_pad", b"NOTSET") == b"VALID":
        begin = [0] * rank
    # how far the last window reaches past the input's end (with ceil_mode, past the padding)
    after = [
        max(0, (o - 1) * s + (k - 1) * d + 1 - n - b)
        for o, s, k, d, n, b in zip(out, strides, kernel, dilations, spatial, begin, strict=True)
    ]
    # in a float type padding can be -inf, which no input value loses to (int8 / uint8 exactly)
    dtype = "float32" if np.dtype(str(x.ty.dtype)).kind in "iu" else str(x.ty.dtype)
    widths = [0, 0, 0, 0] + [w for pair in zip(begin, after, strict=True) for w in pair]
    padded = relax.op.nn.pad(relax.op.astype(x, dtype), widths, "constant", float("-inf"))
    axes = list(range(2, 2 + rank))
    windows = [
        relax.op.strided_slice(
            padded,
            axes,
            [p * d for p, d in zip(offset, dilations, strict=True)],
            [
                p * d + (o - 1) * s + 1
                for p, d, o, s in zip(offset, dilations, out, strides, strict=True)
            ],
            strides,
        )
        for offset in itertools.product(*(range(k) for k in kernel))
    ]
    which = relax.op.argmax(relax.op.stack(windows, axis=-1), axis=-1)  # int64, (N, C, *out)
    column_major = attr.get("storage_order", 0) == 1
    flat = relax.op.multiply(
        relax.op.reshape(relax.op.arange(dims[0] * dims[1], dtype="int64"), dims[:2] + [1] * rank),
        relax.const(math.prod(spatial), "int64"),
    )
    for i in range(rank):
        inner = math.prod(kernel[i + 1 :])
        offset = relax.op.mod(
            relax.op.floor_divide(which, relax.const(inner, "int64")),
            relax.const(kernel[i], "int64"),
        )
        start = relax.op.reshape(
            relax.op.arange(-begin[i], out[i] * strides[i] - begin[i], strides[i], "int64"),
            [out[i]] + [1] * (rank - 1 - i),
        )
        position = relax.op.add(
            start, relax.op.multiply(offset, relax.const(dilations[i], "int64"))
        )
        step = math.prod(spatial[:i]) if column_major else math.prod(spatial[i + 1 :])
        flat = relax.op.add(flat, relax.op.multiply(position, relax.const(step, "int64")))
    return flat


class MaxUnpool(OnnxOpConverter):
    """With ``output_shape`` (a constant, or a value input bound to its value), the values
    scattered into zeros of that shape; TVM's converter reads the input as an array it is not."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("MaxUnpool", opset)

        def convert(bb, inputs, attr, params):
            if len(inputs) < 3 or inputs[2] is None:
                return tvm_convert(bb, inputs, attr, params)
            shape = constant_input(inputs, 2)
            if shape is None:
                raise ConversionError("an output_shape computed at run time is not supported")
            data, indices = inputs[0], inputs[1]
            zeros = bb.normalize(relax.op.zeros(shape.tolist(), str(data.ty.dtype)))
            flat = relax.op.scatter_elements(
                relax.op.reshape(zeros, [-1]),
                relax.op.reshape(indices, [-1]),
                relax.op.reshape(data, [-1]),
                axis=0,
            )
            return relax.op.reshape(flat, shape.tolist())

        return convert
