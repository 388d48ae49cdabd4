"""conv2d in NHWC with prepacked weights: legalization and schedule.

Legalization (after ``ConvertLayout`` to NHWC/OHWI, constant float32 weights only; anything
else keeps TVM's own legalization and gets the generic schedule):

* **Dense conv** (``groups == 1``, any kernel, stride, dilation and padding): weights repacked at
  build time to ``[O/ob, KH, KW, I, ob]``, ``ob`` output channels (two, one or half a vector
  register of the target, :func:`register_tile`) contiguous, so the innermost loop reads whole
  vectors of weights per input channel. 1×1 convs use the same kernel: their tile covers a row
  of pixels. When the input channels take more than one pass of the reduction
  (:func:`input_chunk`), weights are ``[O/ob, I/cb, KH, KW, cb, ob]`` and the padded input is
  copied as ``[N, I/cb, H, W, cb]``: each pass reads two contiguous blocks. Strided by the
  whole channel count (a power of two), a pass's taps fell into the same L1 sets and evicted
  each other: 512 channels at 7×7 on a Zen 3 went 15 % faster blocked, 2–4 % elsewhere.
* **Depthwise conv** (``groups == I == O``): weights repacked to ``[KH, KW, C]``.
* Padding is an explicit ``conv_pad`` stage.

Schedule (one per fused PrimFunc holding such a conv):

* The epilogue (bias add, ReLU/ReLU6, residual add) is inlined into one output block, which is
  tiled ``n, h, c/ob, w/T | T, ob`` and runs ``parallel`` over ``n, h, c/ob``: TVM's pool gives
  each thread one contiguous share of that range, so each core computes a band of rows in every
  channel, and the next layer reads its band from the core's own cache. Split by channel blocks
  instead, every core read half of each input from the other's cache: on a 2-vCPU Xeon, two
  threads were 1.3× faster than one where each kernel alone was 1.9× (ResNet-18 20.6 → 14.7 ms,
  MobileNetV2 5.5 → 4.2 ms).
* The conv is computed at that tile into a ``local`` ``T × ob`` accumulator: reduction loops
  ``kh, kw, ci`` outside, ``T`` unrolled, ``ob`` vectorised, so LLVM keeps the
  ``T × ob/lanes`` accumulators in vector registers (``T`` bounds them at three quarters of the
  register file, :mod:`.isa`) and each weight vector load feeds ``T`` FMAs with a broadcast
  input.
* Depthwise: same tiling with ``ob`` = a vector of channels; ``kh, kw`` are unrolled too.
* ``conv_pad`` is computed once per call at root, ``parallel`` and vectorised over channels;
  a depthwise conv on whole vectors of channels, which reads each input element for a few taps
  only, inlines it instead.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, s_tir, te, topi

from rangeprof.profiler.compile.schedules.elementwise import (
    VECTOR,
    extent,
    inline_epilogue,
    largest_divisor,
    schedule_spatial,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.isa import VectorUnit, vector_unit

CONV = "conv2d_nhwc_packed"
DEPTHWISE = "depthwise_conv2d_nhwc"
PAD = "conv_pad"
BLOCKED = "conv_input_blocked"
ACCUMULATOR_BYTES = 16 * 1024  # rows of partial sums kept in L1 across input-channel chunks
WEIGHT_BYTES = 24 * 1024  # weights of one input-channel chunk, reused from L1 by every tile


def register_tile(width: int, out_channels: int, unit: VectorUnit) -> tuple[int, int]:
    """``(ob, tile)``: output channels per packed weight block and pixels per register tile.

    ``tile × ob / lanes`` accumulators must fit the register file, ``tile`` must divide the
    output width (a tail would put predicates in the unrolled tile) and ``ob`` the channels,
    in whole vectors: widths that are not a power of two (24 channels in MobileNetV2) make LLVM
    emit scalar code, 50× slower. Among the blocks of two, one or half a vector, the one whose
    tile holds the most accumulators wins; ties go to the wider block (fewer input passes).
    """
    best = (0, 0, 0)
    for ob in (2 * unit.lanes, unit.lanes, unit.lanes // 2):
        if out_channels % ob:
            continue
        tile = unit.tile(width, ob)
        best = max(best, (tile * math.ceil(ob / unit.lanes), ob, tile))
    if best[1]:
        return best[1], best[2]
    ob = largest_divisor(out_channels, unit.lanes)
    return ob, unit.tile(width, ob)


def pad_nhwc(data: te.Tensor, padding) -> te.Tensor:
    top, left, bottom, right = (int(p) for p in padding)
    if not any((top, left, bottom, right)):
        return data
    return topi.nn.pad(data, [0, top, left, 0], [0, bottom, right, 0], name=PAD)


def out_size(size, kernel: int, stride: int, dilation: int, before: int, after: int):
    return (size + before + after - (kernel - 1) * dilation - 1) // stride + 1


def conv2d_nhwc_packed(
    data, weight, strides, padding, dilation, group_channels: int = 0, channel_block: int = 0
):
    """``out[n, y, x, o] = Σ pad[n, y·s + ky·d, x·s + kx·d, i] · w[o / ob, ky, kx, i, o % ob]``;
    with ``group_channels`` (output channels per group) a grouped conv, whose input channel is
    ``o // group_channels · I/g + i`` (``I/g`` = the weight's input channels). With
    ``channel_block`` the padded input is copied as ``[n, I/cb, H, W, cb]``: the ``cb`` input
    channels one pass of the reduction reads are contiguous per pixel and per image."""
    n, h, w, _ = data.shape
    if channel_block:  # [O/ob, I/cb, KH, KW, cb, ob]: a pass's weights contiguous too
        blocks, chunks, kh, kw, cb, ob = (int(d) for d in weight.shape)
        ci = chunks * cb
    else:
        blocks, kh, kw, ci, ob = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    oh = out_size(h, kh, sh, dh, padding[0], padding[2])
    ow = out_size(w, kw, sw, dw, padding[1], padding[3])
    padded = pad_nhwc(data, padding)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    if channel_block:
        cb = channel_block
        _, ph, pw, _ = padded.shape
        blocked = te.compute(
            (n, ci // cb, ph, pw, cb),
            lambda b, c, y, x, i: padded[b, y, x, c * cb + i],
            name=BLOCKED,
        )
        rco, rci = te.reduce_axis((0, ci // cb), "rco"), te.reduce_axis((0, cb), "rci")
        return te.compute(
            (n, oh, ow, blocks * ob),
            lambda b, y, x, o: te.sum(
                blocked[b, rco, y * sh + ry * dh, x * sw + rx * dw, rci]
                * weight[o // ob, rco, ry, rx, rci, o % ob],
                axis=[ry, rx, rco, rci],
            ),
            name=CONV,
        )
    rc = te.reduce_axis((0, ci), "rc")

    def channel(o):
        return o // group_channels * ci + rc if group_channels else rc

    return te.compute(
        (n, oh, ow, blocks * ob),
        lambda b, y, x, o: te.sum(
            padded[b, y * sh + ry * dh, x * sw + rx * dw, channel(o)]
            * weight[o // ob, ry, rx, rc, o % ob],
            axis=[ry, rx, rc],
        ),
        name=CONV,
    )


def depthwise_conv2d_nhwc(data, weight, strides, padding, dilation):
    """``out[n, y, x, c] = Σ pad[n, y·s + ky·d, x·s + kx·d, c] · w[ky, kx, c]``."""
    n, h, w, c = data.shape
    kh, kw, _ = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    oh = out_size(h, kh, sh, dh, padding[0], padding[2])
    ow = out_size(w, kw, sw, dw, padding[1], padding[3])
    padded = pad_nhwc(data, padding)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    return te.compute(
        (n, oh, ow, c),
        lambda b, y, x, k: te.sum(
            padded[b, y * sh + ry * dh, x * sw + rx * dw, k] * weight[ry, rx, k], axis=[ry, rx]
        ),
        name=DEPTHWISE,
    )


def default_legalize(bb: relax.BlockBuilder, call: relax.Call):
    """TVM's own conv2d legalization (generic schedule) for what the rules do not cover."""
    return tvm.ir.Op.get("relax.nn.conv2d").get_attr("FLegalize")(bb, call)


def legalize_conv2d(bb: relax.BlockBuilder, call: relax.Call):
    """NHWC/OHWI float32 conv2d with a constant weight → a packed-weight kernel."""
    attrs = call.attrs
    data, weight = call.args
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    constant = isinstance(weight, tvm.ir.expr.GenericConst)
    dtypes = {str(data.ty.dtype), str(weight.ty.dtype), str(call.ty.dtype)}
    if layouts != ("NHWC", "OHWI", "NHWC") or not constant or dtypes != {"float32"}:
        return default_legalize(bb, call)
    w = weight.value.numpy()  # [O, KH, KW, I / groups]
    out_ch, kh, kw, in_per_group = w.shape
    args = dict(strides=attrs.strides, padding=attrs.padding, dilation=attrs.dilation)
    args = {k: [int(v) for v in vals] for k, vals in args.items()}
    if attrs.groups == 1:
        _, height, width, _ = (int(d) for d in call.ty.shape)
        ob, _ = register_tile(width if width > 1 else height, out_ch, vector_unit())
        kernel = conv2d_nhwc_packed
        chunk = input_chunk(in_per_group, kh * kw, ob)
        if chunk < in_per_group:
            args["channel_block"] = chunk
            blocked = w.reshape(out_ch // ob, ob, kh, kw, in_per_group // chunk, chunk)
            packed = blocked.transpose(0, 4, 2, 3, 5, 1)
        else:
            packed = w.reshape(out_ch // ob, ob, kh, kw, in_per_group).transpose(0, 2, 3, 4, 1)
    elif in_per_group == 1 and attrs.groups == out_ch:
        packed = w[..., 0].transpose(1, 2, 0)
        kernel = depthwise_conv2d_nhwc
    else:
        return default_legalize(bb, call)
    const = relax.const(np.ascontiguousarray(packed), "float32")
    return bb.call_te(kernel, data, const, primfunc_name_hint=kernel.__name__, **args)


def input_chunk(channels: int, taps: int, ob: int) -> int:
    """Input channels per pass of the reduction: their weights stay in L1 (``WEIGHT_BYTES``)."""
    return largest_divisor(channels, max(1, WEIGHT_BYTES // (taps * ob * 4)))


def find_block(sch: s_tir.Schedule, name: str):
    try:
        return sch.get_sblock(name)
    except Exception:  # FuseTIR keeps the names of the blocks it fuses; absent when not fused
        return None


def _schedule_pad(sch: s_tir.Schedule) -> None:
    pad, blocked = find_block(sch, PAD), find_block(sch, BLOCKED)
    if pad is not None and blocked is not None:
        sch.compute_inline(pad)
        pad = None
    for block in (pad, blocked):
        if block is not None:
            schedule_spatial(sch, block)


def _schedule_dense(sch: s_tir.Schedule, conv) -> None:
    """``n, y/Y, o/ob | ci/R, Y, x/T, ky, kx, R, T, ob``: rows of accumulators, L1 weights."""
    loops = sch.get_loops(conv)
    n, y, x, o, ry, rx = loops[:6]
    if extent(sch, x) == 1:  # a 1-D conv along H (Magika's 5×1): the tile runs down the column
        y, x = x, y
    ob = int(sch.get(conv).reads[1].source.ty.shape[-1])
    width = extent(sch, x)
    tile = vector_unit().tile(width, ob)
    rows = largest_divisor(extent(sch, y), max(1, ACCUMULATOR_BYTES // (width * ob * 4)))

    out = inline_epilogue(sch, conv, keep=(PAD, BLOCKED))
    yo, yi = sch.split(y, [None, rows])
    xo, xi = sch.split(x, [None, tile])
    oo, oi = sch.split(o, [None, ob])
    if len(loops) == 8:  # the input blocked by channels: the passes are the blocks
        rco, rci = loops[6:]
    else:
        chunk = input_chunk(extent(sch, loops[6]), extent(sch, ry) * extent(sch, rx), ob)
        rco, rci = sch.split(loops[6], [None, chunk])
    sch.reorder(n, yo, oo, rco, yi, xo, ry, rx, rci, xi, oi)
    outer = sch.fuse(n, yo, oo)
    sch.parallel(outer)
    sch.reverse_compute_at(out, outer)
    sch.set_scope(conv, 0, "local")
    sch.unroll(xi)
    sch.vectorize(oi)
    init = sch.decompose_reduction(conv, rco)
    unroll_vectorize_tile(sch, init, out)


def schedule_depthwise(sch: s_tir.Schedule, conv, keep=(PAD,)) -> None:
    """``n, y, c/ob, x/T | ky, kx, T, ob`` with the taps unrolled: a ``T × ob`` register tile
    (``keep``: the input stage the epilogue inlining must leave alone)."""
    n, y, x, o, ry, rx = sch.get_loops(conv)
    channels = extent(sch, o)
    ob = VECTOR if channels % VECTOR == 0 else largest_divisor(channels, 2 * VECTOR)
    tile = vector_unit().tile(extent(sch, x), ob)

    out = inline_epilogue(sch, conv, keep=keep)
    xo, xi = sch.split(x, [None, tile])
    oo, oi = sch.split(o, [None, ob])
    sch.reorder(n, y, oo, xo, ry, rx, xi, oi)
    sch.parallel(sch.fuse(n, y, oo))
    sch.reverse_compute_at(out, xo)
    sch.set_scope(conv, 0, "local")
    for loop in (ry, rx, xi):
        sch.unroll(loop)
    sch.vectorize(oi)
    init = sch.decompose_reduction(conv, ry)
    unroll_vectorize_tile(sch, init, out)


def schedule_conv2d(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding a packed NHWC conv; False when there is none."""
    conv = find_block(sch, CONV)
    if conv is not None:
        _schedule_dense(sch, conv)
    elif (conv := find_block(sch, DEPTHWISE)) is not None:
        # Padding inlined where the channels fill whole vectors: a test per tap costs less than
        # a padded copy of the input written and read back (MobileNetV2's largest depthwise
        # conv: 1.0 → 0.34 ms); on odd vectors (88 channels: 22 lanes) the guarded loads ran
        # scalar, 5× slower than the copy.
        pad = find_block(sch, PAD)
        if pad is not None and extent(sch, sch.get_loops(conv)[3]) % VECTOR == 0:
            sch.compute_inline(pad)
        schedule_depthwise(sch, conv)
    else:
        return False
    _schedule_pad(sch)
    return True
