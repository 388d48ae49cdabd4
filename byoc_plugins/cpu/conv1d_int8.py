"""Integer row convs: conv1d (which ``Canonicalize`` writes as a conv2d of height one) on the
dense dot-product kernel of :mod:`.conv2d_int8`, reshaped and padded to fit it.

That kernel takes output channels in whole vectors of the instruction (an STFT's 257 frequency
bins fit none: TVM's own integer conv ran a log-mel front end's two convs in 20 ms on Zen 4, 27×
onnxruntime FP32), input channels in groups of the instruction's depth (one audio channel padded
to the four of ``vpdpbusd`` wastes three products in four) and tiles the frames by divisors (101
frames, a prime: a tile of one). So for a row conv (``H = KH = 1``, ``groups == 1``, constant int8
weights):

* consecutive taps fold into channels where the stride and the left padding allow it
  (:data:`fold_row_conv_taps`, a layout pass): ``g`` taps of ``C`` channels become ``g·C``
  channels (``g`` the smallest making them a multiple of 4), the input viewed as
  ``[W/g, g·C]`` (the same bytes), the stride divided by ``g``;
* output channels are padded with zero weights to whole vectors of every instruction (16);
* frames are padded until the register tile holds at least half the accumulators;
* a copy crops both paddings (FuseOps puts it in the kernel's epilogue, which
  :func:`~.conv2d_int8.schedule_conv2d_int8` computes with the rest of it).

Anything else goes to :func:`~.conv2d_int8.legalize_conv2d_int8`.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from rangeprof.profiler.ir.spans import ids_of, with_ids

from .conv2d_int8 import (
    CONV,
    conv2d_int8_nhwc,
    correction,
    dot_layout,
    is_integer,
    legalize_conv2d_int8,
    output_block,
    pack_weights,
)
from .isa import DotInstruction, Isa
from .prepare import CHANNEL_GROUP

CROP = "int8_row_conv_crop"
CHANNEL_BLOCK = 16  # every dot instruction's lanes divide it


def _row_conv(call: relax.Call) -> bool:
    """An NHWC integer conv2d of one row (a conv1d), dense, constant weights, no row padding."""
    attrs = call.attrs
    data, weight = call.args
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    return (
        layouts == ("NHWC", "OHWI", "NHWC")
        and is_integer(call)
        and int(attrs.groups) == 1
        and int(data.ty.shape[1]) == 1
        and int(weight.ty.shape[1]) == 1
        and not any(int(p) for p in (attrs.padding[0], attrs.padding[2]))
    )


def fold_taps(w: np.ndarray, fold: int) -> np.ndarray:
    """``[O, 1, KW, C]`` → ``[O, 1, ⌈KW/g⌉, g·C]``, the missing last taps zero."""
    out_ch, _, kw, channels = w.shape
    taps = -(-kw // fold)
    w = np.pad(w, [(0, 0), (0, 0), (0, taps * fold - kw), (0, 0)])
    return w.reshape(out_ch, 1, taps, fold * channels)


def _folded(call: relax.Call, data: relax.Expr, w: np.ndarray) -> relax.Expr | None:
    """The row conv with ``g`` taps folded into its channels, or None where it cannot fold."""
    attrs = call.attrs
    channels = int(data.ty.shape[3])
    fold = CHANNEL_GROUP // math.gcd(channels, CHANNEL_GROUP)
    stride, left = int(attrs.strides[1]), int(attrs.padding[1])
    if fold == 1 or stride % fold or left % fold or int(attrs.dilation[1]) != 1:
        return None
    w = fold_taps(w, fold)
    ids = ids_of(call)
    # The folded columns the frames read right of the left padding: the input padded with
    # zeros (read only by zero taps) or cut to exactly as many samples, then viewed folded.
    columns = (int(call.ty.shape[2]) - 1) * (stride // fold) + w.shape[2] - left // fold
    batch, _, width, _ = (int(d) for d in data.ty.shape)
    if columns * fold > width:
        data = relax.op.nn.pad(data, [0, 0, 0, 0, 0, columns * fold - width, 0, 0])
    elif columns * fold < width:
        data = relax.op.strided_slice(data, [2], [0], [columns * fold])
    view = relax.op.reshape(with_ids(data, ids), [batch, 1, columns, fold * channels])
    return relax.op.nn.conv2d(
        with_ids(view, ids),
        relax.const(w, "int8"),
        strides=[1, stride // fold],
        padding=[0, left // fold, 0, 0],
        data_layout="NHWC",
        kernel_layout="OHWI",
        out_dtype="int32",
    )


def _fold_row_convs(func: relax.Function) -> relax.Function:
    data, weight = wildcard(), is_const()
    conv = is_op("relax.nn.conv2d")(data, weight)

    def rewrite(expr, matches):
        call = matches[conv]
        if not _row_conv(call):
            return expr
        folded = _folded(call, matches[data], matches[weight].value.numpy())
        return expr if folded is None else with_ids(folded, ids_of(call))

    return rewrite_call(conv, rewrite, func)


@tvm.transform.module_pass(opt_level=0, name="FoldRowConvTaps")
def fold_row_conv_taps(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """An integer row conv of fewer input channels than a dot instruction's depth (one audio
    channel) takes ``g`` consecutive taps as ``g·C`` channels: the input viewed ``[W/g, g·C]``
    (the same bytes), the stride and the left padding divided by ``g``. Run before
    :data:`~.prepare.pad_int8_channels`, which would pad the channels with zeros instead."""
    mod = mod.clone()
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _fold_row_convs(func)
    return mod


def row_conv_int8(data, weight, *offset_fix, left: int, wide: int, **args):
    """:func:`~.conv2d_int8.conv2d_int8_nhwc` over ``wide`` frames, the input zero-padded on
    the right as far as they read."""
    stride = args["strides"][1]
    reach = (wide - 1) * stride + int(weight.shape[2])
    right = max(0, reach - int(data.shape[2]) - left)
    return conv2d_int8_nhwc(data, weight, *offset_fix, padding=[0, left, 0, right], **args)


def crop(data, width: int, channels: int):
    """The first ``width`` frames and ``channels`` channels of an NHWC row."""
    shape = (int(data.shape[0]), 1, width, channels)
    return te.compute(shape, lambda n, y, x, o: data[n, y, x, o], name=CROP)


def _padded_frames(width: int, channels: int, instruction: DotInstruction) -> tuple[int, int]:
    """``(frames, ob)``: frames grown until the register tile (``ob`` as
    :func:`~.conv2d_int8.output_block` picks it) holds half the accumulators or more."""
    half = instruction.registers * 3 // 4 // 2
    wide = width
    while True:
        ob = output_block(wide, channels, instruction)
        if instruction.tile(wide, ob) * (ob // instruction.lanes) >= half:
            return wide, ob
        wide += 1


def legalize_conv_int8(bb: relax.BlockBuilder, call: relax.Call, isa: Isa):
    """A row conv (:func:`_row_conv`) → the dot-product kernel on channels and frames padded
    to fit it; any other integer conv2d, or a row conv that fits as it is →
    :func:`~.conv2d_int8.legalize_conv2d_int8`."""
    if not _row_conv(call):
        return legalize_conv2d_int8(bb, call, isa)
    attrs = call.attrs
    data = call.args[0]
    w = call.args[1].value.numpy()  # [O, 1, KW, C]
    out_ch = w.shape[0]
    width = int(call.ty.shape[2])
    padded = -(-out_ch // CHANNEL_BLOCK) * CHANNEL_BLOCK
    dtype = str(data.ty.dtype)
    layout = dot_layout(isa, padded, int(np.abs(w.astype(np.int32)).max()), dtype, width)
    if layout is None:
        return legalize_conv2d_int8(bb, call, isa)
    instruction = layout[0]
    wide, ob = _padded_frames(width, padded, instruction)
    if (padded, wide) == (out_ch, width):
        return legalize_conv2d_int8(bb, call, isa)
    w = np.pad(w, [(0, padded - out_ch), (0, 0), (0, 0), (0, 0)])
    offset = instruction.data_offset(dtype)
    fix = correction(w, offset)
    conv = bb.emit(
        bb.call_te(
            row_conv_int8,
            data,
            relax.const(pack_weights(w, ob, instruction)),
            *([] if fix is None else [fix]),
            left=int(attrs.padding[1]),
            wide=wide,
            strides=[int(v) for v in attrs.strides],
            dilation=[int(v) for v in attrs.dilation],
            instruction=instruction.intrinsic,
            offset=offset,
            primfunc_name_hint=CONV,
        )
    )
    return bb.call_te(crop, conv, width, out_ch, primfunc_name_hint=CROP)
