"""Integer conv2d (8-bit or int16 activations × constant int8 weights → int32) in NHWC:
legalization and schedule on the target's dot-product instruction.

The quantized graph convolves ``uint8`` or ``int8`` activations (``int16``, zero point 0, in
the layers too sensitive for 8 bits) with int8 weights into an exact int32 accumulator, followed
by an integer epilogue (bias, fixed-point requantization, clamp) that FuseOps puts in the same
kernel. After ``ConvertLayout`` to NHWC/OHWI:

* **Dense conv** (``groups == 1``, any kernel, stride, dilation): an ``int8_stage`` brings the
  activations into the instruction's type (:class:`~.isa.DotInstruction`: uint8 for AVX-512
  VNNI ``vpdpbusd`` and for AVX2 ``vpmaddubsw`` (weights within ±64), int16 for AVX2
  ``vpmaddwd`` (any other int8 weights), int8 for NEON ``sdot``), pads them (with
  zero, the conv's own padding) and pads the channels to a multiple of the instruction's
  depth. Flipping int8 ↔ uint8 adds ±128 to every activation; the exact correction
  ``-offset · Σw`` per output channel is computed at build time and added after the
  reduction. int16 activations take the int16 pairs (``vpdpwssd`` on AVX-512 VNNI,
  ``vpmaddwd`` elsewhere on x86) as they are: their stage only pads, if anything. Weights are
  packed at build time to ``[O/ob, KH, KW, C/depth, ob·depth]``: one instruction reads
  ``lanes × depth`` contiguous weights.
* **Depthwise conv** (``groups == C``): no dot product spans the channels. On x86 the taps
  go in pairs (:meth:`~.isa.Isa.pair`: ``vpdpwssd`` on AVX-512 VNNI, else
  ``vpmaddwd``): a stage packs ``pad[x]`` and ``pad[x + d]`` (int16 each, 8-bit and int16
  activations alike) into one int32 word per channel (at the columns the conv reads: every
  other one at stride 2), weights are packed to int16 ``[KH, ⌈KW/2⌉, 2C]``, and one
  instruction does two taps of 16 (AVX-512) or 8 channels (a 3×3 kernel: 6 instructions
  instead of 9 multiplies). On Zen 4, 16-lane ``vpdpwssd`` made the int32 core of
  MobileNetV2's 144-channel layer 1.7× faster than 8-lane ``vpmaddwd`` + ``vpaddd`` (1.4× the
  FP32 kernel, with its requantization). Elsewhere (NEON) weights are widened to int16
  ``[KH, KW, C]`` and the kernel multiplies-adds a vector of channels per tap in int32 (LLVM
  emits ``smlal``).
* Anything else (grouped convs, non-constant weights, output channels no instruction's lanes
  divide, targets without one: int16 dense convs on NEON, whose ``sdot`` is 8-bit only) keeps
  TVM's legalization and the generic schedule: correct, only slow.

Schedule (dense conv), the FP32 rule's structure (:mod:`.conv2d`) with the instruction inside:
``n, y/Y, o/ob | c/chunk, Y, x/T, ky, kx, c, T, ob/lanes | lanes, depth`` (bands of rows per
thread, as :mod:`.conv2d` says why). The ``T × ob``
int32 accumulators stay in registers, each weight vector feeds ``T`` instructions with a
broadcast group of ``depth`` activations, and the innermost ``lanes × depth`` loops become one
instruction call (:mod:`.dot`). The epilogue is computed per tile of ``Y`` rows, or, when one
chunk holds all channels (``c/chunk`` = 1, which then moves inside ``x/T``), right after each
register tile; the stage once per call; both ``parallel`` and vectorised. Depthwise convs keep
the FP32 rule's tiling ``n, y, c/ob, x/T | ky, kx, T, ob``, pairs of taps ``kx`` in one
instruction on x86, where each parallel task of :data:`DEPTHWISE_ROWS` output rows computes
the tap pairs it reads, vectorised over channels only (the padding test then holds for a whole
vector).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from rangeprof.profiler.compile.schedules.conv2d import (
    ACCUMULATOR_BYTES,
    WEIGHT_BYTES,
    default_legalize,
    find_block,
    out_size,
    schedule_depthwise,
)
from rangeprof.profiler.compile.schedules.elementwise import (
    extent,
    inline_epilogue,
    largest_divisor,
    schedule_spatial,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.isa import vector_unit

from .dot import INSTRUCTION, chosen_instruction, mark
from .isa import DOT_INSTRUCTIONS, DotInstruction, Isa

CONV = "conv2d_int8"
DEPTHWISE = "depthwise_conv2d_int8"
DEPTHWISE_PAIRS = "depthwise_conv2d_int8_pairs"
STAGE = "int8_stage"
CORRECTION = "int8_offset_correction"
# Activations the kernels take: 8-bit, or int16 (symmetric: zero point 0, no offset to undo).
DATA_DTYPES = ("uint8", "int8", "int16")
# Output rows per depthwise task: its tap-pair slab ((R - 1)·stride + KH padded rows of its
# channels, ~70 KB for 112-wide rows of 16 channels) stays in cache. A whole-input stage
# first was 10–35 % slower on MobileNetV2's shapes (8 rows as fast as 16 or 28).
DEPTHWISE_ROWS = 8


def is_integer(call: relax.Call, constant: bool = True) -> bool:
    """8-bit or int16 activations × an int8 right operand → int32 (conv2d or matmul), static
    shapes (the kernels are sized at build time); the right operand a constant (weights,
    packed at build time) unless ``constant`` is False (a matmul of two activations)."""
    data, weight = call.args
    shapes = (data.ty.shape, weight.ty.shape, call.ty.shape)
    dims = [d for s in shapes for d in s.values] if all(s is not None for s in shapes) else [None]
    return (
        str(data.ty.dtype) in DATA_DTYPES
        and str(weight.ty.dtype) == "int8"
        and str(call.ty.dtype) == "int32"
        and (isinstance(weight, tvm.ir.expr.GenericConst) or not constant)
        and all(isinstance(d, tirx.IntImm) for d in dims)
    )


def stage(data: te.Tensor, padding, channels: int, dtype: str, offset: int) -> te.Tensor:
    """``dtype(x + offset)``, zero-padded spatially (``padding``: top, left, bottom, right of
    NHWC data; empty for a matmul's rows) and along the last axis to ``channels``; ``data``
    itself when that changes nothing."""
    *lead, last = (int(d) for d in data.shape)
    pads = [int(p) for p in padding]
    if not any(pads) and channels == last and dtype == data.dtype and offset == 0:
        return data
    top, left = (pads[0], pads[1]) if pads else (0, 0)
    shape = list(lead)
    if pads:
        shape[1] += pads[0] + pads[2]
        shape[2] += pads[1] + pads[3]

    def value(*idx):
        inside = [idx[-1] < last]
        source = list(idx)
        if pads:
            y, x = idx[1], idx[2]
            inside += [y >= top, y < lead[1] + top, x >= left, x < lead[2] + left]
            source[1], source[2] = y - top, x - left
        raw = tirx.if_then_else(tirx.all(*inside), data[tuple(source)].astype("int32"), 0)
        return (raw + offset).astype(dtype)

    return te.compute((*shape, channels), value, name=STAGE)


def corrected(acc: te.Tensor, offset_fix: tuple) -> te.Tensor:
    """``acc`` plus the offset correction, when there is one (``offset_fix``: the kernel's
    trailing tensor arguments, empty or the correction, broadcast as numpy does: ``[O]`` per
    output channel for constant weights, ``[…, 1, N]`` per batch and column for a run-time
    right operand)."""
    if not offset_fix:
        return acc
    (fix,) = offset_fix
    dims = [int(d) for d in fix.shape]

    def value(*i):
        at = [0 if d == 1 else axis for d, axis in zip(dims, i[len(i) - len(dims) :], strict=True)]
        return acc(*i) + fix[tuple(at)]

    return te.compute(acc.shape, value, name=CORRECTION)


def conv2d_int8_nhwc(data, weight, *offset_fix, strides, padding, dilation, instruction, offset):
    """``out[n, y, x, o] = Σ s[n, y·s + ky·d, x·s + kx·d, c] · w[o / ob, ky, kx, c / depth,
    (o % ob) · depth + c % depth]`` (+ the offset correction), ``s`` the staged activations;
    ``instruction`` the intrinsic's name (the block names it for the schedule)."""
    instruction = DOT_INSTRUCTIONS[instruction]
    depth = instruction.depth
    n, h, w, _ = (int(d) for d in data.shape)
    blocks, kh, kw, groups, packed = (int(d) for d in weight.shape)
    ob = packed // depth
    (sh, sw), (dh, dw) = strides, dilation
    oh = out_size(h, kh, sh, dh, padding[0], padding[2])
    ow = out_size(w, kw, sw, dw, padding[1], padding[3])
    staged = stage(data, padding, groups * depth, instruction.data_dtype, offset)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    rc = te.reduce_axis((0, groups * depth), "rc")
    acc = te.compute(
        (n, oh, ow, blocks * ob),
        lambda b, y, x, o: te.sum(
            staged[b, y * sh + ry * dh, x * sw + rx * dw, rc].astype("int32")
            * weight[o // ob, ry, rx, rc // depth, o % ob * depth + rc % depth].astype("int32"),
            axis=[ry, rx, rc],
        ),
        name=CONV,
        attrs={INSTRUCTION: instruction.intrinsic},
    )
    return corrected(acc, offset_fix)


def depthwise_conv2d_int8_nhwc(data, weight, strides, padding, dilation):
    """``out[n, y, x, c] = Σ pad[n, y·s + ky·d, x·s + kx·d, c] · w[ky, kx, c]`` in int32."""
    n, h, w, c = (int(d) for d in data.shape)
    kh, kw, _ = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    oh = out_size(h, kh, sh, dh, padding[0], padding[2])
    ow = out_size(w, kw, sw, dw, padding[1], padding[3])
    padded = stage(data, padding, c, data.dtype, 0)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    return te.compute(
        (n, oh, ow, c),
        lambda b, y, x, k: te.sum(
            padded[b, y * sh + ry * dh, x * sw + rx * dw, k].astype("int32")
            * weight[ry, rx, k].astype("int32"),
            axis=[ry, rx],
        ),
        name=DEPTHWISE,
    )


def depthwise_conv2d_int8_pairs(data, weight, strides, padding, dilation, kernel_w, instruction):
    """``out[n, y, x, c] = Σ half(p[n, y·s + ky·d, (x·s + 2·kp·d) / g, c], j) · w[ky, kp, 2c + j]``,
    ``p`` the tap pairs: at ``x / g`` an int32 word holding ``pad[n, y, x, c]`` (low int16) and
    ``pad[n, y, x + d, c]`` (high int16), so taps ``kx = 2kp + j``; only the columns the conv
    reads, multiples of ``g = gcd(s, 2d)`` (a stride-2 conv reads every other pair);
    ``instruction`` the pair instruction's name (the block names it for the schedule)."""
    n, h, w, c = (int(d) for d in data.shape)
    kh, pairs, _ = (int(d) for d in weight.shape)
    (sh, sw), (dh, dw) = strides, dilation
    top, left, bottom, right = padding
    oh = out_size(h, kh, sh, dh, top, bottom)
    ow = out_size(w, kernel_w, sw, dw, left, right)
    step = math.gcd(sw, 2 * dw)

    def tap(b, y, x, k):  # past the right edge too: the tap of a zero weight
        inside = tirx.all(y >= top, y < h + top, x >= left, x < w + left)
        return tirx.if_then_else(inside, data[b, y - top, x - left, k].astype("int32"), 0)

    paired = te.compute(
        (n, h + top + bottom, -(-(w + left + right) // step), c),
        lambda b, y, x, k: (tap(b, y, x * step + dw, k) << 16) | (tap(b, y, x * step, k) & 0xFFFF),
        name=STAGE,
    )
    ry, rp, rj = (
        te.reduce_axis((0, e), name) for e, name in ((kh, "ry"), (pairs, "rp"), (2, "rj"))
    )

    def half(word, j):  # the sign-extended int16 half j of an int32 word
        return tirx.Select(j == 0, (word << 16) >> 16, word >> 16)

    return te.compute(
        (n, oh, ow, c),
        lambda b, y, x, k: te.sum(
            half(paired[b, y * sh + ry * dh, x * (sw // step) + rp * (2 * dw // step), k], rj)
            * weight[ry, rp, 2 * k + rj].astype("int32"),
            axis=[ry, rp, rj],
        ),
        name=DEPTHWISE_PAIRS,
        attrs={INSTRUCTION: instruction},
    )


def pack_tap_pairs(w: np.ndarray) -> np.ndarray:
    """Depthwise ``[C, KH, KW]`` → int16 ``[KH, ⌈KW/2⌉, 2C]``: taps ``2kp, 2kp + 1`` of each
    channel side by side, the missing last one zero."""
    channels, kh, kw = w.shape
    pairs = -(-kw // 2)
    w = np.pad(w, [(0, 0), (0, 0), (0, 2 * pairs - kw)]).reshape(channels, kh, pairs, 2)
    return np.ascontiguousarray(w.transpose(1, 2, 0, 3).reshape(kh, pairs, 2 * channels))


def pack_weights(w: np.ndarray, ob: int, instruction: DotInstruction) -> np.ndarray:
    """``[O, *taps, C]`` → ``[O/ob, *taps, C/depth, ob·depth]`` in the instruction's weight type,
    channels zero-padded to a multiple of ``depth``."""
    out_ch, *taps, channels = w.shape
    depth = instruction.depth
    groups = -(-channels // depth)
    w = np.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, groups * depth - channels)])
    w = w.reshape(out_ch // ob, ob, *taps, groups, depth)
    order = (0, *range(2, 2 + len(taps)), 2 + len(taps), 1, 3 + len(taps))
    packed = w.transpose(order).reshape(out_ch // ob, *taps, groups, ob * depth)
    return np.ascontiguousarray(packed.astype(instruction.weight_dtype))


def correction(w: np.ndarray, offset: int) -> relax.Constant | None:
    """``-offset · Σw`` per output channel (axis 0), or None when there is no offset."""
    if offset == 0:
        return None
    sums = w.reshape(w.shape[0], -1).astype(np.int64).sum(axis=1)
    return relax.const((-offset * sums).astype("int32"), "int32")


def output_block(width: int, channels: int, instruction: DotInstruction) -> int:
    """Output channels per packed weight block: one, two or four vectors of the instruction, the
    one whose ``tile × ob`` register tile holds the most accumulators. Ties go to two vectors
    (then four): on Zen 3 a 3×3 conv ran 1.62 ms with two, 1.89 with four, 1.72 with one, the
    same number of accumulators each."""
    best, best_ob = 0, 0
    for vectors in (2, 4, 1):
        ob = vectors * instruction.lanes
        if channels % ob == 0 and instruction.tile(width, ob) * vectors > best:
            best, best_ob = instruction.tile(width, ob) * vectors, ob
    return best_ob


def dot_layout(
    isa: Isa, channels: int, max_weight: int, dtype: str, rows: int
) -> tuple[DotInstruction, int] | None:
    """The dot instruction ``isa`` chooses for ``dtype`` activations, ``channels`` outputs and
    weights up to ``max_weight`` in magnitude (:meth:`~.isa.Isa.dot`), and the output block
    the weights are packed in, ``rows`` (the register tile's axis) deciding it
    (:func:`output_block`); None when no instruction fits."""
    instruction = isa.dot(channels, max_weight, dtype)
    if instruction is None:
        return None
    return instruction, output_block(rows, channels, instruction)


def dot_kernel(
    bb: relax.BlockBuilder, isa: Isa, kernel, name: str, data, w: np.ndarray, rows: int, **args
):
    """``kernel`` (the conv or the dense compute) of 8-bit or int16 ``data`` × int8 weights ``w``
    (``[O, …, C]``) on a dot instruction of ``isa``: the first for ``data``'s type whose lanes
    divide ``O`` and which is exact for ``w``'s range, weights packed for it with ``rows`` (the
    register tile's axis) deciding the output block, the offset correction when the activations
    change type. None when no instruction fits."""
    dtype = str(data.ty.dtype)
    layout = dot_layout(isa, w.shape[0], int(np.abs(w.astype(np.int32)).max()), dtype, rows)
    if layout is None:
        return None
    instruction, ob = layout
    offset = instruction.data_offset(dtype)
    packed = relax.const(pack_weights(w, ob, instruction))
    fix = correction(w, offset)
    operands = (data, packed) if fix is None else (data, packed, fix)
    return bb.call_te(
        kernel,
        *operands,
        primfunc_name_hint=name,
        instruction=instruction.intrinsic,
        offset=offset,
        **args,
    )


def legalize_conv2d_int8(bb: relax.BlockBuilder, call: relax.Call, isa: Isa):
    """NHWC/OHWI 8-bit or int16 conv2d with constant int8 weights → a dot-product or depthwise
    kernel on ``isa``'s instructions."""
    attrs = call.attrs
    data, weight = call.args
    layouts = (attrs.data_layout, attrs.kernel_layout, attrs.out_layout)
    if layouts != ("NHWC", "OHWI", "NHWC") or not is_integer(call):
        return default_legalize(bb, call)
    w = weight.value.numpy()  # [O, KH, KW, I / groups]
    out_ch, in_per_group = w.shape[0], w.shape[-1]
    args = dict(strides=attrs.strides, padding=attrs.padding, dilation=attrs.dilation)
    args = {k: [int(v) for v in vals] for k, vals in args.items()}
    if in_per_group == 1 and attrs.groups == out_ch and out_ch > 1:
        pair = isa.pair(out_ch)
        if pair is not None:
            packed = relax.const(pack_tap_pairs(w[..., 0].astype("int16")))
            kernel, name = depthwise_conv2d_int8_pairs, DEPTHWISE_PAIRS
            args.update(kernel_w=int(w.shape[2]), instruction=pair.intrinsic)
        else:
            packed = relax.const(np.ascontiguousarray(w[..., 0].transpose(1, 2, 0)).astype("int16"))
            kernel, name = depthwise_conv2d_int8_nhwc, DEPTHWISE
        return bb.call_te(kernel, data, packed, primfunc_name_hint=name, **args)
    if attrs.groups == 1:
        width = int(call.ty.shape[2])
        legalized = dot_kernel(bb, isa, conv2d_int8_nhwc, CONV, data, w, width, **args)
        if legalized is not None:
            return legalized
    return default_legalize(bb, call)


def schedule_stage(sch: s_tir.Schedule) -> None:
    """The stage, when there is one: once per call at root, ``parallel`` and vectorised."""
    staged = find_block(sch, STAGE)
    if staged is not None:
        schedule_spatial(sch, staged)


def finish_dot_tile(
    sch: s_tir.Schedule, block, out, outer, unrolled, reduction, lanes, instruction, tile=None
):
    """What the integer rules share once their loops are split and ordered: ``outer``
    ``parallel`` with the epilogue ``out`` computed at it (or at the ``tile`` loop, when the
    whole reduction is under it), the int32 tile of ``block`` in
    registers (``unrolled`` loops unrolled, its init split off at ``reduction``), the
    instruction marked on the ``lanes`` loop and the input stage scheduled."""
    sch.parallel(outer)
    sch.reverse_compute_at(out, outer if tile is None else tile)
    sch.set_scope(block, 0, "local")
    for loop in unrolled:
        sch.unroll(loop)
    init = sch.decompose_reduction(block, reduction)
    mark(sch, lanes, instruction)
    unroll_vectorize_tile(sch, init, out)
    schedule_stage(sch)


def _schedule_dense(sch: s_tir.Schedule, conv, instruction: DotInstruction) -> None:
    """``n, y/Y, o/ob | c/chunk, Y, x/T, ky, kx, c, T, ob/lanes | lanes, depth``."""
    n, y, x, o, ry, rx, rc = sch.get_loops(conv)
    lanes, depth = instruction.lanes, instruction.depth
    weight = sch.get(conv).reads[-1].source
    ob = int(weight.shape[-1]) // depth
    width = extent(sch, x)
    tile = instruction.tile(width, ob)
    rows = largest_divisor(extent(sch, y), max(1, ACCUMULATOR_BYTES // (width * ob * 4)))
    taps = extent(sch, ry) * extent(sch, rx)
    group_bytes = taps * ob * depth * tvm.runtime.DataType(instruction.weight_dtype).bits // 8
    chunk = largest_divisor(extent(sch, rc) // depth, max(1, WEIGHT_BYTES // group_bytes))

    out = inline_epilogue(sch, conv, keep=(STAGE,))
    yo, yi = sch.split(y, [None, rows])
    xo, xi = sch.split(x, [None, tile])
    oo, ov, ol = sch.split(o, [None, ob // lanes, lanes])
    rco, rci, rcd = sch.split(rc, [None, chunk, depth])
    # All input channels in one chunk: each register tile is zeroed, reduced and requantized in
    # turn, its accumulators never stored (a 1×1 16 → 96 conv alone 30 % faster).
    whole = extent(sch, rco) == 1
    tiles = (yi, xo, rco) if whole else (rco, yi, xo)
    sch.reorder(n, yo, oo, *tiles, ry, rx, rci, xi, ov, ol, rcd)
    outer = sch.fuse(n, yo, oo)
    tile = xo if whole else None
    finish_dot_tile(sch, conv, out, outer, (xi, ov), rco, ol, instruction, tile)


def _schedule_depthwise(sch: s_tir.Schedule, conv) -> None:
    """The FP32 depthwise tiling (:func:`.conv2d.schedule_depthwise`) after the int8 stage."""
    schedule_depthwise(sch, conv, keep=(STAGE,))
    schedule_stage(sch)


def _schedule_depthwise_pairs(sch: s_tir.Schedule, conv) -> None:
    """``n, c/ob, y/R | R, x/T | ky, kp, T, ob/lanes | lanes, 2``: the depthwise tiling with one
    ``vpmaddwd`` per two taps of ``lanes`` channels, ``R`` (:data:`DEPTHWISE_ROWS`) output rows
    per parallel task, which computes the tap pairs they read."""
    n, y, x, k, ry, rp, rj = sch.get_loops(conv)
    channels = extent(sch, k)
    instruction = chosen_instruction(sch, conv)
    lanes = instruction.lanes
    ob = 2 * lanes if channels % (2 * lanes) == 0 else lanes
    tile = vector_unit().tile(extent(sch, x), ob)

    out = inline_epilogue(sch, conv, keep=(STAGE,))
    xo, xi = sch.split(x, [None, tile])
    ko, kv, kl = sch.split(k, [None, ob // lanes, lanes])
    yo, yi = sch.split(y, [None, largest_divisor(extent(sch, y), DEPTHWISE_ROWS)])
    sch.reorder(n, ko, yo, yi, xo, ry, rp, xi, kv, kl, rj)
    outer = sch.fuse(n, ko, yo)
    sch.parallel(outer)
    sch.reverse_compute_at(out, xo)
    sch.set_scope(conv, 0, "local")
    for loop in (ry, rp, xi, kv):
        sch.unroll(loop)
    init = sch.decompose_reduction(conv, ry)
    mark(sch, kl, instruction)
    unroll_vectorize_tile(sch, init, out)
    # The task's slab of tap pairs, computed in the task (in cache, not the whole padded input
    # through memory first), vectorised over channels only: its padding test then holds for a
    # whole vector (over fused pixels and channels LLVM gets per-lane branches).
    staged = find_block(sch, STAGE)
    sch.compute_at(staged, outer)
    *_, k = sch.get_loops(staged)
    _, ki = sch.split(k, [None, lanes])
    sch.vectorize(ki)


def schedule_conv2d_int8(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding an integer NHWC conv; False when there is none."""
    conv = find_block(sch, CONV)
    if conv is not None:
        _schedule_dense(sch, conv, chosen_instruction(sch, conv))
    elif (conv := find_block(sch, DEPTHWISE)) is not None:
        _schedule_depthwise(sch, conv)
    elif (conv := find_block(sch, DEPTHWISE_PAIRS)) is not None:
        _schedule_depthwise_pairs(sch, conv)
    else:
        return False
    return True
