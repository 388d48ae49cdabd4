"""conv2d_transpose (ONNX ConvTranspose) in NHWC with prepacked weights: legalization, schedule.

TVM legalizes a transposed conv (in NCHW only) as a dense conv over the input dilated by the
stride: ``s²`` multiplies by zero per useful one, no schedule (PP-OCRv4 det's two upsampling
layers: 237 of 313 ms). Here it is the sub-pixel form of the same sum:

* Output row ``zy = qy·s + py`` (phase ``py < s``) reads input rows ``qy − jy`` through kernel
  rows ``ky = py + s·jy``, ``jy < J = ⌈KH/s⌉``: per phase, a stride-1 conv with a ``J × J``
  kernel, every multiply useful (the kernel is ``KH × KW``, dilation folded in as zero taps).
* In NHWC the ``s · O`` outputs of the ``s`` column phases of one input column are contiguous,
  so weights are packed at build time to ``[s_h, J_h, J_w, I, s_w · O]``: a vector of those
  outputs reads a contiguous vector of weights against one broadcast input value.
* The kernel computes the output before padding is cropped (``Z``, rows and columns whole
  multiples of the stride, the input zero-padded by ``J − 1`` where the sum reaches past it);
  the crop, when there is padding, is a shifted copy the epilogue's output block absorbs.

Constant float32 weights and ``groups == 1`` only; anything else runs TVM's NCHW kernel between
two transposes: correct, only slow.

Schedule: ``n, qy | py | (px·o)/ob, qx/T | jy, jx, i, T, ob``: one parallel task per input row,
``T × ob`` accumulators in registers (``ob`` vectorised, ``T`` unrolled), and the epilogue
computed per output row, while its ``s_w · O`` wide row is in cache.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, s_tir, te, topi

from rangeprof.profiler.compile.schedules.conv2d import find_block
from rangeprof.profiler.compile.schedules.elementwise import (
    VECTOR,
    extent,
    inline_epilogue,
    largest_divisor,
    schedule_spatial,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.isa import vector_unit

CONV_TRANSPOSE = "conv2d_transpose_nhwc_packed"
PAD = "conv_transpose_pad"
CROP = "conv_transpose_crop"


def pack_weights(w: np.ndarray, strides, dilation) -> np.ndarray:
    """IOHW ``[I, O, KH, KW]`` → ``[s_h, J_h, J_w, I, s_w · O]`` (see the module doc)."""
    (sh, sw), (dh, dw) = strides, dilation
    channels, out_ch, kh, kw = w.shape
    dilated = np.zeros((channels, out_ch, (kh - 1) * dh + 1, (kw - 1) * dw + 1), w.dtype)
    dilated[:, :, ::dh, ::dw] = w
    jh, jw = -(-dilated.shape[2] // sh), -(-dilated.shape[3] // sw)
    taps = np.zeros((channels, out_ch, jh * sh, jw * sw), w.dtype)
    taps[:, :, : dilated.shape[2], : dilated.shape[3]] = dilated
    # [I, O, jy, py, jx, px] → [py, jy, jx, I, px, O]
    taps = taps.reshape(channels, out_ch, jh, sh, jw, sw).transpose(3, 2, 4, 0, 5, 1)
    return np.ascontiguousarray(taps.reshape(sh, jh, jw, channels, sw * out_ch))


def conv2d_transpose_nhwc_packed(data, weight, strides, padding, out_hw):
    """``Z[n, zy, zx, o] = Σ pad[n, zy/s − jy + J − 1, zx/s − jx + J − 1, i] · w[zy % s, jy, jx,
    i, (zx % s)·O + o]``, cropped to ``out[n, y, x, o] = Z[n, y + top, x + left, o]``."""
    n, h, w, _ = (int(d) for d in data.shape)
    sh, jh, jw, channels, wide = (int(d) for d in weight.shape)
    sw = strides[1]
    out_ch = wide // sw
    top, left = padding[0], padding[1]
    oh, ow = out_hw
    qh, qw = -(-(oh + top) // sh), -(-(ow + left) // sw)
    before, after = [0, jh - 1, jw - 1, 0], [0, max(0, qh - h), max(0, qw - w), 0]
    padded = topi.nn.pad(data, before, after, name=PAD) if any(before + after) else data
    ry, rx = te.reduce_axis((0, jh), "ry"), te.reduce_axis((0, jw), "rx")
    rc = te.reduce_axis((0, channels), "rc")
    full = te.compute(
        (n, qh * sh, qw * sw, out_ch),
        lambda b, y, x, o: te.sum(
            padded[b, y // sh - ry + jh - 1, x // sw - rx + jw - 1, rc]
            * weight[y % sh, ry, rx, rc, x % sw * out_ch + o],
            axis=[ry, rx, rc],
        ),
        name=CONV_TRANSPOSE,
    )
    if (qh * sh, qw * sw) == (oh, ow) and top == left == 0:
        return full
    return te.compute(
        (n, oh, ow, out_ch), lambda b, y, x, o: full[b, y + top, x + left, o], name=CROP
    )


def _nchw_fallback(bb: relax.BlockBuilder, call: relax.Call):
    """TVM's NCHW kernel between transposes (what the packed kernel does not cover)."""
    attrs = call.attrs
    strides, padding = [int(v) for v in attrs.strides], [int(v) for v in attrs.padding]
    output_padding = [int(v) for v in attrs.output_padding]
    dilation = [int(v) for v in attrs.dilation]

    def compute(data, kernel):
        if any(d != 1 for d in dilation):
            kernel = topi.nn.dilate(kernel, [1, 1, *dilation], name="kernel_dilate")
        out = topi.nn.group_conv2d_transpose_nchw(
            topi.transpose(data, [0, 3, 1, 2]),
            kernel,
            strides,
            padding,
            call.ty.dtype,
            output_padding,
            int(attrs.groups),
        )
        return topi.transpose(out, [0, 2, 3, 1])

    return bb.call_te(compute, *call.args, primfunc_name_hint="conv2d_transpose")


def legalize_conv2d_transpose(bb: relax.BlockBuilder, call: relax.Call):
    """NHWC/IOHW conv2d_transpose → the packed sub-pixel kernel (constant float32 weights,
    ``groups == 1``) or else :func:`_nchw_fallback`; any other layout → TVM's legalization."""
    attrs = call.attrs
    data, weight = call.args
    if (attrs.data_layout, attrs.kernel_layout, attrs.out_layout) != ("NHWC", "IOHW", "NHWC"):
        return tvm.ir.Op.get("relax.nn.conv2d_transpose").get_attr("FLegalize")(bb, call)
    constant = isinstance(weight, tvm.ir.expr.GenericConst)
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype), str(call.ty.dtype)}
    if not constant or dtypes != {"float32"} or int(attrs.groups) != 1:
        return _nchw_fallback(bb, call)
    strides, dilation = [int(v) for v in attrs.strides], [int(v) for v in attrs.dilation]
    packed = pack_weights(weight.value.numpy(), strides, dilation)
    return bb.call_te(
        conv2d_transpose_nhwc_packed,
        data,
        relax.const(packed, "float32"),
        strides=strides,
        padding=[int(v) for v in attrs.padding],
        out_hw=[int(call.ty.shape[1]), int(call.ty.shape[2])],
        primfunc_name_hint=CONV_TRANSPOSE,
    )


def _vector_block(wide: int, lanes: int) -> int:
    """Outputs per register-tile row: two, one or half a vector dividing ``wide``, else the
    largest divisor up to a vector (``s_w · O`` = 2 for a one-channel output)."""
    for ob in (2 * lanes, lanes, lanes // 2):
        if wide % ob == 0:
            return ob
    return largest_divisor(wide, lanes)


def schedule_conv2d_transpose(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding the packed conv2d_transpose; False when there is none."""
    conv = find_block(sch, CONV_TRANSPOSE)
    if conv is None:
        return False
    n, y, x, o, ry, rx, rc = sch.get_loops(conv)
    weight = sch.get(conv).reads[-1].source
    sh, wide = int(weight.shape[0]), int(weight.shape[-1])
    sw = wide // extent(sch, o)
    unit = vector_unit()
    ob = _vector_block(wide, unit.lanes)
    tile = unit.tile(extent(sch, x) // sw, ob)

    out = inline_epilogue(sch, conv, keep=(PAD,))
    qy, py = sch.split(y, [None, sh])
    qx, px = sch.split(x, [None, sw])
    qxo, qxi = sch.split(qx, [None, tile])
    co, ci = sch.split(sch.fuse(px, o), [None, ob])
    sch.reorder(n, qy, py, co, qxo, ry, rx, rc, qxi, ci)
    sch.parallel(sch.fuse(n, qy))
    sch.reverse_compute_at(out, py)
    sch.set_scope(conv, 0, "local")
    sch.unroll(qxi)
    sch.vectorize(ci)
    init = sch.decompose_reduction(conv, ry)
    unroll_vectorize_tile(sch, init)
    _schedule_row(sch, out, 2)
    pad = find_block(sch, PAD)
    if pad is not None:
        schedule_spatial(sch, pad)
    return True


def _schedule_row(sch: s_tir.Schedule, out, depth: int) -> None:
    """The epilogue of one output row (its loops below the first ``depth``): columns and
    channels fused, vectorised in vectors that do not straddle a pixel's channels (a bias
    vector then is one contiguous load, not a gather)."""
    loops = sch.get_loops(out)[depth:]
    channels = extent(sch, loops[-1])
    row = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    width = math.gcd(extent(sch, row), VECTOR if channels == 1 else math.gcd(channels, VECTOR))
    if width > 1:
        _, inner = sch.split(row, [None, width])
        sch.vectorize(inner)
