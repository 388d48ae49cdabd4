"""TVM's converters behind checks: node forms its converters or kernels get wrong without a
word (or crash on) are refused in one line, naming what is not supported; forms a cast or a
slice makes right are converted."""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from rangeprof.profiler.errors import ConversionError
from rangeprof.profiler.ir.converters.common import constant_input, static_dims, stock


def _text(attr: dict, name: str, default: str) -> str:
    value = attr.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


class _Checked(OnnxOpConverter):
    """TVM's converter of ``op_type``, after :meth:`check` (which raises where TVM's result
    would not be ONNX's)."""

    op_type: str

    @classmethod
    def check(cls, inputs, attr) -> None:
        raise NotImplementedError

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock(cls.op_type, opset)

        def convert(bb, inputs, attr, params):
            cls.check(inputs, attr)
            return tvm_convert(bb, inputs, attr, params)

        return convert


class Resize(OnnxOpConverter):
    """TVM's resize, given roi, scales and sizes over every axis (ONNX lets them cover some
    ``axes`` only, and sizes keep the aspect ratio by ``keep_aspect_ratio_policy``); refused where
    it would compute something else than ONNX's."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("Resize", opset)

        def convert(bb, inputs, attr, params):
            inputs, attr = _every_axis(inputs, attr)
            cls.check(inputs, attr)
            return tvm_convert(bb, inputs, attr, params)

        return convert

    @classmethod
    def check(cls, inputs, attr) -> None:
        if attr.get("antialias", 0):
            raise ConversionError("antialias=1 is not supported (TVM's resize has no antialias)")
        mode = _text(attr, "coordinate_transformation_mode", "half_pixel")
        if mode == "half_pixel_symmetric":
            raise ConversionError(f"coordinate_transformation_mode {mode} is not supported")
        dims = static_dims(inputs[0])
        if dims is None:
            return  # TVM's own checks apply
        scales = constant_input(inputs, 2)
        if scales is not None and scales.size == len(dims):
            for dim, scale in zip(dims, scales.tolist(), strict=True):
                _check_whole(dim, scale)
        if _output_dims(dims, inputs)[:2] != dims[:2]:
            raise ConversionError(
                "resizing the first two axes (batch, channels) is not supported: TVM resizes "
                "the axes after them"
            )
        if mode == "align_corners" and 1 in _output_dims(dims, inputs)[2:]:
            raise ConversionError("align_corners with an output dim of 1 is not supported")


def _check_whole(dim: int, scale: float) -> None:
    if not math.isclose(dim * scale, round(dim * scale), abs_tol=1e-6):
        raise ConversionError(
            f"scale {scale:g} on a dim of {dim} gives the fractional size "
            f"{dim * scale:g}: TVM resizes by the size ratio, ONNX by the scale"
        )


def _every_axis(inputs, attr: dict) -> tuple[list, dict]:
    """Resize's roi, scales and sizes over every axis: those ``axes`` leaves out keep their
    size (roi 0 to 1, scale 1); sizes kept in aspect (``not_larger`` / ``not_smaller``) become
    the sizes of one scale over the axes, which must give whole sizes."""
    policy = _text(attr, "keep_aspect_ratio_policy", "stretch")
    dims = static_dims(inputs[0])
    if dims is None or ("axes" not in attr and policy == "stretch"):
        return list(inputs), attr
    rank = len(dims)
    axes = [a % rank for a in attr.get("axes", range(rank))]
    roi, scales, sizes = (_given(inputs, k, name) for k, name in enumerate(_RESIZE_INPUTS, 1))
    full = [inputs[0], None, None, None]  # empty inputs omitted
    if roi is not None:
        whole = np.array([0.0] * rank + [1.0] * rank, roi.dtype)
        whole[axes] = roi[: len(axes)]
        whole[[rank + a for a in axes]] = roi[len(axes) :]
        full[1] = relax.const(whole)
    if scales is not None:
        whole = np.ones(rank, scales.dtype)
        whole[axes] = scales
        full[2] = relax.const(whole)
    if sizes is not None:
        whole = np.array(dims, "int64")
        whole[axes] = sizes
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            scale = pick(size / dims[a] for size, a in zip(sizes.tolist(), axes, strict=True))
            for a in axes:
                _check_whole(dims[a], scale)
                whole[a] = math.floor(dims[a] * scale + 0.5)  # ONNX rounds half up
        full[3] = relax.const(whole)
    rest = {k: v for k, v in attr.items() if k not in ("axes", "keep_aspect_ratio_policy")}
    return full, rest


_RESIZE_INPUTS = ("roi", "scales", "sizes")


def _given(inputs, k: int, name: str) -> np.ndarray | None:
    """Resize's input ``k`` when given (not omitted, not empty); it must be constant."""
    if len(inputs) <= k or inputs[k] is None:
        return None
    value = constant_input(inputs, k)
    if value is None:
        raise ConversionError(f"{name} computed at run time are not supported with axes")
    return value if value.size else None


def _output_dims(dims: list[int], inputs) -> list[int]:
    sizes = constant_input(inputs, 3)
    if sizes is not None and sizes.size == len(dims):
        return [int(s) for s in sizes]
    scales = constant_input(inputs, 2)
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
        tvm_convert = stock("Split", opset)

        def convert(bb, inputs, attr, params):
            given = constant_input(inputs, 1)
            sizes = given.tolist() if given is not None else list(attr.get("split", []))
            if 0 not in sizes:
                return tvm_convert(bb, inputs, attr, params)
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
            tvm_convert = stock(op_type, opset)

            def convert(bb, inputs, attr, params):
                data = inputs[0]
                dtype = str(data.ty.dtype)
                if dtype == "bool":
                    data = bb.normalize(relax.op.astype(data, "uint8"))
                out = bb.normalize(tvm_convert(bb, [data, *inputs[1:]], attr, params))
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
