"""conv1d: a conv2d of height one in NHWC, padded to whole register tiles.

:class:`~rangeprof.profiler.ir.passes.canonicalize.Canonicalize` writes every conv1d as a conv2d
of height one (the BYOC patterns and the INT8 kernels then take it as they are); the FP32 build
gives it :mod:`.conv2d`'s packed kernel and schedule. Two shapes of 1-D convs defeat that
kernel's tiling, which takes divisors: an STFT written as a conv (``n_fft / 2 + 1`` = 257
frequency bins, a prime) packed one channel wide runs scalar, and its frame count (101 frames of
a second of 16 kHz audio, a prime too) gives a register tile of one frame: two accumulators,
bound by the FMA's latency (together 100× slower than onnxruntime). So a row conv
(``H = KH = 1``, dense, constant float32 weights) is legalized here, before :mod:`.conv2d`:

* its output channels are padded with zero weights to whole vectors (the block of one or two
  vectors that pads least: 257 → 272);
* its output width to the next count whose register tile holds at least half the
  accumulators (:meth:`~.isa.VectorUnit.tile`; 101 → 102 frames, tiles of 17), the input zero
  padded on the right to match;
* a copy crops both paddings (FuseOps puts it in the conv's kernel, with the epilogue).

Schedule (:func:`schedule_row_conv`, before :mod:`.conv2d`'s, which would hold a whole block
of output channels of the row in a local buffer and write it out unrolled frame by frame):
``n, o/ob, x/T | kx, c, T, ob``, the ``T × ob`` accumulators in registers and the epilogue (crop
included) computed right after each register tile.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir, te

from rangeprof.profiler.compile.schedules.conv2d import (
    CONV,
    PAD,
    conv2d_nhwc_packed,
    find_block,
)
from rangeprof.profiler.compile.schedules.elementwise import (
    extent,
    inline_epilogue,
    schedule_spatial,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.isa import VectorUnit, vector_unit

CROP = "conv1d_crop"


def padded_tiling(width: int, channels: int, unit: VectorUnit) -> tuple[int, int, int]:
    """``(ob, padded channels, padded width)``: of the blocks of two vectors and of one, the
    one that computes the fewest padded outputs (ties: the wider), the width grown until its
    register tile holds at least half the accumulators."""
    best = None
    for vectors in (2, 1):
        ob = vectors * unit.lanes
        padded = -(-channels // ob) * ob
        wide = width
        while unit.tile(wide, ob) * vectors < unit.accumulators // 2:
            wide += 1
        if best is None or padded * wide < best[1] * best[2]:
            best = (ob, padded, wide)
    return best


def _row_conv(call: relax.Call) -> bool:
    """A dense NHWC/OHWI float32 conv2d of one row, constant weights: a conv1d."""
    attrs = call.attrs
    data, weight = call.args
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype), str(call.ty.dtype)}
    return (
        layouts == ("NHWC", "OHWI", "NHWC")
        and isinstance(weight, tvm.ir.expr.GenericConst)
        and dtypes == {"float32"}
        and int(attrs.groups) == 1
        and int(data.ty.shape[1]) == 1
        and int(weight.ty.shape[1]) == 1
        and not any(int(p) for p in (attrs.padding[0], attrs.padding[2]))
    )


def conv1d_nhwc_padded(data, weight, stride: int, dilation: int, left: int, wide: int):
    """:func:`~.conv2d.conv2d_nhwc_packed` over ``wide`` outputs, the input zero-padded on the
    right as far as they read."""
    kw = int(weight.shape[2])
    reach = (wide - 1) * stride + (kw - 1) * dilation + 1
    right = max(0, reach - int(data.shape[2]) - left)
    return conv2d_nhwc_packed(data, weight, [1, stride], [0, left, 0, right], [1, dilation])


def crop(data, width: int, channels: int):
    """The first ``width`` columns and ``channels`` channels of an NHWC row."""
    shape = (int(data.shape[0]), 1, width, channels)
    return te.compute(shape, lambda n, y, x, o: data[n, y, x, o], name=CROP)


def legalize_row_conv(bb: relax.BlockBuilder, call: relax.Call):
    """A row conv (:func:`_row_conv`) → the padded packed kernel; None for any other conv2d,
    or one whose tiling needs no padding (:mod:`.conv2d` then)."""
    if not _row_conv(call):
        return None
    attrs = call.attrs
    w = call.args[1].value.numpy()  # [O, 1, KW, I]
    out_ch, _, kw, channels = w.shape
    width = int(call.ty.shape[2])
    ob, padded, wide = padded_tiling(width, out_ch, vector_unit())
    if (padded, wide) == (out_ch, width):
        return None
    w = np.pad(w, [(0, padded - out_ch), (0, 0), (0, 0), (0, 0)])
    packed = w.reshape(padded // ob, ob, 1, kw, channels).transpose(0, 2, 3, 4, 1)
    conv = bb.emit(
        bb.call_te(
            conv1d_nhwc_padded,
            call.args[0],
            relax.const(np.ascontiguousarray(packed), "float32"),
            stride=int(attrs.strides[1]),
            dilation=int(attrs.dilation[1]),
            left=int(attrs.padding[1]),
            wide=wide,
            primfunc_name_hint="conv1d_nhwc_padded",
        )
    )
    return bb.call_te(crop, conv, width, out_ch, primfunc_name_hint=CROP)


def schedule_row_conv(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding a padded row conv (its crop); False when there is none."""
    conv, cropped = find_block(sch, CONV), find_block(sch, CROP)
    if conv is None or cropped is None:
        return False
    n, y, x, o, ry, rx, rc = sch.get_loops(conv)
    ob = int(sch.get(conv).reads[1].source.ty.shape[-1])
    tile = vector_unit().tile(extent(sch, x), ob)

    out = inline_epilogue(sch, conv, keep=(PAD,))
    xo, xi = sch.split(x, [None, tile])
    oo, oi = sch.split(o, [None, ob])
    sch.reorder(n, y, oo, xo, ry, rx, rc, xi, oi)
    sch.parallel(sch.fuse(n, y, oo))
    sch.reverse_compute_at(out, xo)
    sch.set_scope(conv, 0, "local")
    sch.unroll(xi)
    sch.vectorize(oi)
    init = sch.decompose_reduction(conv, ry)
    unroll_vectorize_tile(sch, init, out)
    pad = find_block(sch, PAD)
    if pad is not None:
        schedule_spatial(sch, pad)
    return True
