"""TVM's converters behind checks: node forms its converters or kernels get wrong without a
word (or crash on) are refused in one line, naming what is not supported; forms a cast or a
slice makes right are converted."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from rangeprof.profiler.errors import ConversionError


def _stock(op_type: str, opset: int):
    return onnx_frontend._get_convert_map()[op_type].get_converter(opset)


def _text(attr: dict, name: str, default: str) -> str:
    value = attr.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


def _constant(inputs, k: int) -> np.ndarray | None:
    """The value of input ``k`` when it is given and constant."""
    expr = inputs[k] if len(inputs) > k else None
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    return None


class _Checked(OnnxOpConverter):
    """TVM's converter of ``op_type``, after :meth:`check` (which raises where TVM's result
    would not be ONNX's)."""

    op_type: str

    @classmethod
    def check(cls, inputs, attr) -> None:
        raise NotImplementedError

    @classmethod
    def get_converter(cls, opset):
        stock = _stock(cls.op_type, opset)

        def convert(bb, inputs, attr, params):
            cls.check(inputs, attr)
            return stock(bb, inputs, attr, params)

        return convert


class Resize(_Checked):
    """TVM's resize: refused where it would compute something else than ONNX's."""

    op_type = "Resize"

    @classmethod
    def check(cls, inputs, attr) -> None:
        if attr.get("antialias", 0):
            raise ConversionError("antialias=1 is not supported (TVM's resize has no antialias)")
        mode = _text(attr, "coordinate_transformation_mode", "half_pixel")
        if mode == "half_pixel_symmetric":
            raise ConversionError(f"coordinate_transformation_mode {mode} is not supported")
        x = inputs[0]
        if not all(isinstance(d, tvm.tirx.IntImm) for d in x.ty.shape.values):
            return  # TVM's own checks apply
        dims = [int(d) for d in x.ty.shape.values]
        scales = _constant(inputs, 2)
        if scales is not None and scales.size == len(dims):
            for dim, scale in zip(dims, scales.tolist(), strict=True):
                if not math.isclose(dim * scale, round(dim * scale), abs_tol=1e-6):
                    raise ConversionError(
                        f"scale {scale:g} on a dim of {dim} gives the fractional size "
                        f"{dim * scale:g}: TVM resizes by the size ratio, ONNX by the scale"
                    )
        if mode == "align_corners" and 1 in _output_dims(dims, inputs)[2:]:
            raise ConversionError("align_corners with an output dim of 1 is not supported")


def _output_dims(dims: list[int], inputs) -> list[int]:
    sizes = _constant(inputs, 3)
    if sizes is not None and sizes.size == len(dims):
        return [int(s) for s in sizes]
    scales = _constant(inputs, 2)
    if scales is not None and scales.size == len(dims):
        return [int(d * s) for d, s in zip(dims, scales.tolist(), strict=True)]
    return dims


class TopK(_Checked):
    """TVM's sort kernels take float, int8/32/64 and uint8 tensors."""

    op_type = "TopK"
    _SORTABLE = frozenset({"float16", "float32", "float64", "int8", "int32", "int64", "uint8"})

    @classmethod
    def check(cls, inputs, attr) -> None:
        dtype = str(inputs[0].ty.dtype)
        if dtype not in cls._SORTABLE:
            raise ConversionError(f"TopK of {dtype} is not supported (TVM sorts no {dtype})")


class Split(OnnxOpConverter):
    """Parts of size 0 as slices: TVM's split takes strictly increasing split points."""

    @classmethod
    def get_converter(cls, opset):
        stock = _stock("Split", opset)

        def convert(bb, inputs, attr, params):
            given = _constant(inputs, 1)
            sizes = given.tolist() if given is not None else list(attr.get("split", []))
            if 0 not in sizes:
                return stock(bb, inputs, attr, params)
            x = inputs[0]
            axis = attr.get("axis", 0) % x.ty.ndim
            ends = np.cumsum(sizes).tolist()
            parts = [
                relax.op.strided_slice(x, axes=[axis], begin=[end - size], end=[end])
                for size, end in zip(sizes, ends, strict=True)
            ]
            return relax.Tuple(parts)

        return convert


def _extreme_reduction(op_type: str, largest: bool):
    """ReduceMax (``largest``) or ReduceMin: of booleans as of uint8 (TVM's reductions have no
    bool identity), and over an empty set the identity ONNX defines (∓inf, the integer type's
    end) where TVM gives the float type's finite end."""

    class Reduction(OnnxOpConverter):
        @classmethod
        def get_converter(cls, opset):
            stock = _stock(op_type, opset)

            def convert(bb, inputs, attr, params):
                data = inputs[0]
                dtype = str(data.ty.dtype)
                if dtype == "bool":
                    data = bb.normalize(relax.op.astype(data, "uint8"))
                out = bb.normalize(stock(bb, [data, *inputs[1:]], attr, params))
                if _size(data) == 0 and _size(out) != 0:
                    shape = [int(d) for d in out.ty.shape.values]
                    out = relax.const(np.full(shape, _identity(dtype, largest)))
                elif dtype == "bool":
                    out = relax.op.astype(out, "bool")
                return out

            return convert

    Reduction.__name__ = op_type
    Reduction.__doc__ = _extreme_reduction.__doc__
    return Reduction


def _size(expr) -> int | None:
    dims = expr.ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return math.prod(int(d) for d in dims)


def _identity(dtype: str, largest: bool):
    """The value a max (``largest``) or min over nothing is, in ONNX."""
    if dtype == "bool":
        return np.bool_(not largest)
    if np.dtype(dtype).kind == "f":
        return np.array(-np.inf if largest else np.inf, dtype)
    info = np.iinfo(dtype)
    return np.array(info.min if largest else info.max, dtype)


ReduceMax = _extreme_reduction("ReduceMax", largest=True)
ReduceMin = _extreme_reduction("ReduceMin", largest=False)
