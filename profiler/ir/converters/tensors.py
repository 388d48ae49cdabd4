"""Tensor-building and shaping operators in forms TVM's converters refuse or get wrong: OneHot with
values given at run time, EyeLike of another type than its input, Trilu of an empty tensor,
Reshape to a shape holding 0 under ``allowzero``, Slice before opset 10 (attributes, not
inputs), Upsample (its scales an input from opset 9), SequenceLength of a bound sequence,
SequenceInsert at a negative position,
OptionalHasElement without an input, and ReverseSequence, which TVM's frontend lacks; and the
gathers (Gather, GatherElements, GatherND), which must never read outside their data."""

from __future__ import annotations

import math

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from rangeprof.profiler.errors import ConversionError
from rangeprof.profiler.ir.converters.checked import Resize
from rangeprof.profiler.ir.converters.common import constant_input, static_dims, stock

_TAKE = tvm.ir.Op.get("relax.take")
_GATHERS = (tvm.ir.Op.get("relax.gather_elements"), tvm.ir.Op.get("relax.gather_nd"))


class OneHot(OnnxOpConverter):
    """``values[1]`` where an index (a negative one counted back from ``depth``) equals its
    position along ``axis``, ``values[0]`` elsewhere: any ``values``, TVM takes constant ones
    only. Indices out of range give a row of ``values[0]``."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        indices, values = inputs[0], inputs[2]
        depth = constant_input(inputs, 1)
        if depth is None:
            raise ConversionError("a depth computed at run time is not supported")
        depth = int(depth.reshape(-1)[0])
        rank = indices.ty.ndim
        axis = attr.get("axis", -1) % (rank + 1)
        index = relax.op.astype(indices, "int64")  # ONNX allows float indices, cast as here
        negative = relax.op.less(index, relax.const(0, "int64"))
        index = relax.op.where(negative, relax.op.add(index, relax.const(depth, "int64")), index)
        # positions along the new axis, broadcast against the indices with that axis inserted
        positions = relax.op.reshape(
            relax.op.arange(depth, dtype="int64"), [depth] + [1] * (rank - axis)
        )
        hot = relax.op.equal(relax.op.expand_dims(index, axis), positions)
        off, on = (relax.op.take(values, relax.const(k, "int64"), axis=0) for k in (0, 1))
        return relax.op.where(hot, on, off)


class EyeLike(OnnxOpConverter):
    """Ones on diagonal ``k`` in the type ``dtype`` names (the input's by default); TVM's
    converter takes no other type than the input's."""

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        x = inputs[0]
        dims = static_dims(x)
        if dims is None:
            raise ConversionError("an input of unknown shape is not supported")
        dtype = str(x.ty.dtype)
        if "dtype" in attr:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(attr["dtype"]).name
        return relax.op.eye(dims[0], dims[1], attr.get("k", 0), dtype)


class Gather(OnnxOpConverter):
    """A Gather never reads outside its data. ONNX makes an index past the axis an error; TVM's
    converter takes in ``fast`` mode, which reads past the table (a token id past a vocabulary
    crashed the process). Here the take clips: a wrong value, never a crash. Indices that a
    model input feeds are checked before any work (:mod:`rangeprof.profiler.ir.index_inputs`);
    the converter has made negative ones positive."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("Gather", opset)

        def clipped(bb, inputs, attr, params):
            taken = tvm_convert(bb, inputs, attr, params)
            if not isinstance(taken, relax.Call) or taken.op != _TAKE:
                return taken  # folded: a constant, or a dimension of a shape
            data, indices = taken.args
            return relax.op.take(data, indices, taken.attrs.axis, mode="clip")

        return clipped


class ClippedGather(OnnxOpConverter):
    """GatherElements and GatherND clip their indices into the data, as :class:`Gather` does:
    TOPI's gathers read wherever an index points. The stock converter has made negative indices
    positive; the upper bound per indexed axis is the data's static extent less one (a data of
    unknown shape keeps the stock gather)."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock(cls.__name__, opset)  # a subclass named as its operator

        def clipped(bb, inputs, attr, params):
            gathered = tvm_convert(bb, inputs, attr, params)
            if not isinstance(gathered, relax.Call) or gathered.op not in _GATHERS:
                return gathered
            data, indices = gathered.args
            data_dims, index_dims = static_dims(data), static_dims(indices)
            if data_dims is None or index_dims is None:
                return gathered
            bounds = _gather_bounds(gathered, data_dims, index_dims)
            dtype = str(indices.ty.dtype)
            high = relax.const(np.asarray(bounds, dtype), dtype)
            inside = relax.op.minimum(relax.op.maximum(indices, relax.const(0, dtype)), high)
            return relax.Call(gathered.op, [data, bb.normalize(inside)], gathered.attrs)

        return clipped


def _gather_bounds(gathered: relax.Call, data: list[int], indices: list[int]):
    """The largest index each element of a gather's indices may hold, broadcastable against
    them: the extent of the gathered axis less one (GatherElements), or of each coordinate's
    axis (along GatherND's last dimension)."""
    if gathered.op == _GATHERS[0]:
        return data[int(gathered.attrs.axis) % len(data)] - 1
    start = int(gathered.attrs.batch_dims)
    return [extent - 1 for extent in data[start : start + indices[-1]]]


class GatherElements(ClippedGather):
    """GatherElements, clipped (:class:`ClippedGather`)."""


class GatherND(ClippedGather):
    """GatherND, clipped (:class:`ClippedGather`)."""


class Trilu(OnnxOpConverter):
    """An empty tensor is its own triangle: TVM's converter fails on one when ``k`` is an
    input."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("Trilu", opset)

        def empty_aware(bb, inputs, attr, params):
            x = inputs[0]
            dims = static_dims(x)
            if dims is not None and math.prod(dims) == 0:
                return relax.op.tril(x, 0)
            return tvm_convert(bb, inputs, attr, params)

        return empty_aware


class Reshape(OnnxOpConverter):
    """Under ``allowzero`` a 0 in the target is a dim of size 0 (the tensor is empty), where
    TVM's converter leaves the shape symbolic and Relax's reshape reads 0 as "copy this dim":
    the empty result is built at its shape."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("Reshape", opset)

        def allowing_zero(bb, inputs, attr, params):
            data, target = inputs[0], constant_input(inputs, 1)
            dims = static_dims(data) if isinstance(data.ty, relax.TensorType) else None
            zero_dims = target is not None and 0 in target.tolist()
            if not (attr.get("allowzero", 0) and zero_dims and dims is not None):
                return tvm_convert(bb, inputs, attr, params)
            try:
                shape = np.empty(dims, dtype=bool).reshape(target.tolist()).shape
            except ValueError as err:
                raise ConversionError(
                    f"cannot reshape a tensor of shape {dims} to {target.tolist()}"
                ) from err
            return relax.op.zeros(shape, str(data.ty.dtype))

        return allowing_zero


class Slice(OnnxOpConverter):
    """Before opset 10 ``starts``, ``ends`` and ``axes`` are attributes: given to TVM's converter
    (which reads inputs at every opset) as constant inputs."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("Slice", opset)
        if opset >= 10:
            return tvm_convert

        def from_attributes(bb, inputs, attr, params):
            given = [attr.get(name) for name in ("starts", "ends", "axes")]
            constants = [None if v is None else relax.const(np.array(v, "int64")) for v in given]
            return tvm_convert(bb, [inputs[0], *constants, None], attr, params)

        return from_attributes


class Upsample(OnnxOpConverter):
    """A Resize with the scales of the attribute (opset 7) or input (opset 9): ``nearest`` picks
    ``floor(i / scale)`` (asymmetric coordinates, rounding down), ``linear`` interpolates on
    asymmetric coordinates, as onnxruntime does; the Resize's checks apply."""

    @classmethod
    def get_converter(cls, opset):
        resize = Resize.get_converter(18)

        def convert(bb, inputs, attr, params):
            scales = constant_input(inputs, 1) if opset >= 9 else attr.get("scales")
            if scales is None:
                raise ConversionError("scales computed at run time are not supported")
            scales = np.asarray(scales, "float32")
            mode = attr.get("mode", b"nearest")
            if mode == b"nearest" and (scales < 1).any():
                raise ConversionError("nearest Upsample by a scale below 1 is not supported")
            settings = {
                "mode": mode,
                "coordinate_transformation_mode": b"asymmetric",
                "nearest_mode": b"floor",
            }
            return resize(bb, [inputs[0], None, relax.const(scales)], settings, params)

        return convert


def _sequence_fields(sequence) -> list:
    """The tensors of a sequence: a tuple expression's fields, or items of a bound tuple (TVM's
    converters read the fields of a tuple expression only)."""
    if isinstance(sequence, relax.Tuple):
        return list(sequence.fields)
    return [relax.TupleGetItem(sequence, i) for i in range(len(sequence.ty.fields))]


class SequenceLength(OnnxOpConverter):
    """The number of tensors in a sequence, also when it is bound to a variable (TVM's converter
    counts the fields of a tuple expression only)."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        return relax.const(len(_sequence_fields(inputs[0])), "int64")


class SequenceInsert(OnnxOpConverter):
    """A tensor inserted before ``position``, counted from the back when negative (ONNX: ``-1``
    inserts before the last tensor), appended without one. TVM's converter appends for any
    ``-1``, taking it for the default."""

    @classmethod
    def _impl_v11(cls, bb, inputs, attr, params):
        fields = _sequence_fields(inputs[0])
        position = len(fields)
        if len(inputs) > 2 and inputs[2] is not None:
            given = constant_input(inputs, 2)
            if given is None:
                raise ConversionError("a position computed at run time is not supported")
            position = int(given) + len(fields) if given < 0 else int(given)
            if not 0 <= position <= len(fields):
                raise ConversionError(
                    f"position {int(given)} is outside [-n, n] for n={len(fields)}"
                )
        fields.insert(position, inputs[1])
        return relax.Tuple(fields)


class OptionalHasElement(OnnxOpConverter):
    """False without an input (an empty optional, which ONNX lets a node omit); TVM's converter
    otherwise."""

    @classmethod
    def get_converter(cls, opset):
        tvm_convert = stock("OptionalHasElement", opset)

        def omitted(bb, inputs, attr, params):
            if not [x for x in inputs if x is not None]:
                return relax.const(False, "bool")
            return tvm_convert(bb, inputs, attr, params)

        return omitted


class ReverseSequence(OnnxOpConverter):
    """The first ``sequence_lens[b]`` steps along ``time_axis`` of each batch entry reversed."""

    @classmethod
    def _impl_v10(cls, bb, inputs, attr, params):
        x, lengths = inputs[0], inputs[1]
        time_axis, batch_axis = attr.get("time_axis", 0), attr.get("batch_axis", 1)
        return relax.op.reverse_sequence(x, lengths, time_axis, batch_axis)
