"""4-bit weights × 8-bit activations on the integer dot-product instruction (W4A8): the same
operands as :func:`~.dense_w4.emit_dense_w4`, the activations quantized per row at run time.

:func:`emit_dense_w4a8` emits two kernels:

* ``w4a8_quantize``: per row ``m`` of ``x[…, K]``, ``a = max_k |x[m, k]| / 127`` and
  ``u[m, k] = rint(x[m, k] / a) + 128`` as uint8 (``K`` padded with 128, i.e. zero, to whole
  groups), rounded to nearest even by the float trick (add ``1.5 · 2^23``, read the bits);
* ``dense_w4a8``: per group ``g`` of rows of ``W``, the exact int32 sum
  ``A[m, g, n] = Σ_{k∈g} u[m, k] · (q[k, n] − z[g, n])`` on the instruction (``vpdpbusd`` with
  AVX-512 VNNI, ``vpmaddubsw`` on AVX2: ``|q − z| ≤ 15``, exact for both), then
  ``out[m, n] = a[m] · (Σ_g s[g, n] · A[m, g, n] − c[n]) (+ bias)``, where
  ``c[n] = Σ_g s[g, n] · 128 · Σ_{k∈g} (q − z)`` undoes the 128 added to the activations and is
  a constant of the build. Per group and vector of accumulators that is one conversion and one
  FMA besides the ``g / 4`` dot instructions.

The error against FP32 activations is the activations' rounding: ``|Δout[m, n]| ≤ a[m] / 2 ·
Σ_k |W[k, n]|``. Weights are packed at build time in the instruction's layout, two 4-bit
codes a byte: ``[N/nb, ⌈K/8⌉, nb·4]``, byte ``(j·4 + d)`` of row ``p`` holding row ``8p + d``
of column ``j`` in its low nibble and row ``8p + 4 + d`` in its high one, so that the decode is
an and or a shift, then a subtraction of the zero points (asymmetric weights: bytes
``[N/nb, G, nb·4]`` in the same order; symmetric: the literal 8), 64 weights per vector. The
kernel decodes each column block once into a local buffer, as :mod:`.dense_w4` does.

Schedule (:func:`schedule_dense_w4a8`), loops ``rows, n, g``: ``parallel`` over column
blocks of ``nb`` (two vectors of the instruction's lanes); under them the decode, then per
tile of ``Tm`` rows and per group the ``Tm × nb`` int32 accumulators in registers (the
instruction's blocks marked for :data:`~.dot.lower_dot_blocks`), folded into ``Tm × nb``
float32 accumulators. The build must run ``lower_dot_blocks`` after the schedules (the
integer rules do: :func:`rangeprof.byoc.cpu.integer_rules`).

Where the target has no such instruction (its 8-bit dot product not unsigned × signed), a
group is no multiple of 8 rows or the rows are known at run time only, :func:`emit_dense_w4a8`
emits :func:`~.dense_w4.emit_dense_w4`.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from rangeprof.profiler.compile.schedules.conv2d import find_block
from rangeprof.profiler.compile.schedules.dense import PARALLEL_MACS, first_columns
from rangeprof.profiler.compile.schedules.elementwise import (
    PARALLEL_MIN,
    extent,
    inline_epilogue,
    largest_divisor,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.pipeline import host_target

from .dense_w4 import (
    SYMMETRIC_ZERO,
    blocked,
    check_operands,
    column_block,
    emit_dense_w4,
    padded_columns,
    schedule_dense_w4,
    static_loops,
)
from .dot import INSTRUCTION, chosen_instruction, mark
from .isa import DotInstruction, Isa

DENSE = "dense_w4a8"
ACCUMULATE = "dense_w4a8_groups"
DECODE = "dense_w4a8_decode"
QUANTIZE = "w4a8_quantize"
ABSMAX_LANES = "w4a8_absmax_lanes"
ABSMAX = "w4a8_absmax"
SCALE = "w4a8_scale"
OFFSET = 128  # added to the int8 activations: the instruction multiplies uint8
DEPTH = 4  # products per int32 lane of the u8 × s8 instructions
_ROUND = 12582912.0  # 1.5 · 2^23: v + it has v's nearest integer in its low mantissa bits
_ROUND_BITS = 0x4B400000  # the bits of 1.5 · 2^23


def quantize_rows(data, padded: int):
    """``[u, a]``: ``data[…, K]`` as uint8 ``[…, padded]`` and its row scales ``[…]``."""
    *rows, k_dim = (int(d) for d in data.shape)
    lanes = largest_divisor(k_dim, 16)
    r = te.reduce_axis((0, k_dim // lanes), "r")
    part = te.compute(
        (*rows, lanes),
        lambda *i: te.max(te.abs(data[(*i[:-1], r * lanes + i[-1])]), axis=r),
        name=ABSMAX_LANES,
    )
    lane = te.reduce_axis((0, lanes), "lane")
    absmax = te.compute(tuple(rows), lambda *i: te.max(part[(*i, lane)], axis=lane), name=ABSMAX)
    scale = te.compute(
        tuple(rows), lambda *i: tirx.max(absmax[i], tirx.const(1e-30, "float32")) / 127, name=SCALE
    )

    def code(*idx):
        *i, k = idx
        v = data[(*i, tirx.min(k, k_dim - 1))] * (tirx.const(1, "float32") / scale[tuple(i)])
        bits = tirx.reinterpret("int32", v + tirx.const(_ROUND, "float32"))
        value = (bits - (_ROUND_BITS - OFFSET)).astype("uint8")
        return (
            value
            if padded == k_dim
            else tirx.if_then_else(k < k_dim, value, tirx.const(OFFSET, "uint8"))
        )

    return [te.compute((*rows, padded), code, name=QUANTIZE), scale]


def decode(packed, zeros, group_size: int):
    """``(q − z)`` as int8 in the instruction's layout ``[N/nb, K/4, nb·4]``."""
    blocks, pairs, width = (int(d) for d in packed.shape)

    def weight(b, kq, lane):
        shift = ((kq % 2) * 4).astype("uint8")
        code = tirx.bitwise_and(tirx.shift_right(packed[b, kq // 2, lane], shift), 15)
        zero = SYMMETRIC_ZERO if zeros is None else zeros[b, kq * DEPTH // group_size, lane]
        return (code - zero).astype("int8")

    return te.compute((blocks, 2 * pairs, width), weight, name=DECODE)


def dense_w4a8(codes, row_scales, packed, scales, columns_fix, *rest, **attrs):
    """``out[…, n] = a[…] · (Σ_g s[g, n] · A[…, g, n] − c[n]) (+ bias)`` for ``n <
    attrs["columns"]`` (module docstring); ``rest``: the zero points when asymmetric, then the
    bias if any."""
    group_size, columns = attrs["group_size"], attrs["columns"]
    zeros, *bias = rest if attrs["asymmetric"] else (None, *rest)
    w = decode(packed, zeros, group_size)
    blocks, _, width = (int(d) for d in w.shape)
    nb = width // DEPTH
    *rows, padded = (int(d) for d in codes.shape)
    kk = te.reduce_axis((0, group_size), "kk")

    def products(*idx):
        *i, g, n = idx
        k = g * group_size + kk
        factor = w[n // nb, k // DEPTH, n % nb * DEPTH + k % DEPTH].astype("int32")
        return te.sum(codes[(*i, k)].astype("int32") * factor, axis=kk)

    groups = padded // group_size
    sums = te.compute(
        (*rows, groups, blocks * nb),
        products,
        name=ACCUMULATE,
        attrs={INSTRUCTION: attrs["instruction"]},
    )
    g = te.reduce_axis((0, groups), "g")
    scaled = te.compute(
        (*rows, blocks * nb),
        lambda *i: te.sum(
            sums[(*i[:-1], g, i[-1])].astype("float32") * scales[i[-1] // nb, g, i[-1] % nb],
            axis=g,
        ),
        name=DENSE,
    )

    def finish(*i):
        value = row_scales[i[:-1]] * (scaled[i] - columns_fix[i[-1]])
        return value + bias[0][i[-1]] if bias else value

    out = te.compute(scaled.shape, finish, name="dense_w4a8_out")
    return out if blocks * nb == columns else first_columns(out, columns)


def dot_layout(a: np.ndarray, nb: int) -> np.ndarray:
    """``[R, N]`` (``R`` a multiple of 4) → ``[N/nb, R/4, nb·4]``, element ``(b, r, j·4 + d)``
    being ``a[4r + d, b·nb + j]`` (``N`` padded with zeros to a multiple of ``nb``)."""
    a = np.pad(a, ((0, 0), (0, -a.shape[1] % nb)))
    rows, n = a.shape
    shaped = a.reshape(rows // DEPTH, DEPTH, n // nb, nb).transpose(2, 0, 3, 1)
    return np.ascontiguousarray(shaped.reshape(n // nb, rows // DEPTH, nb * DEPTH))


def pack(q, scales, zero_points, group_size: int, nb: int) -> list[np.ndarray]:
    """The kernel's constants: codes two a byte, scales ``[N/nb, G, nb]``, the correction
    ``c[n]``, then (asymmetric) the zero points; rows padded to whole groups with the group's
    zero point (they decode to 0)."""
    groups = scales.shape[0]
    zeros = np.full(scales.shape, SYMMETRIC_ZERO, np.uint8) if zero_points is None else zero_points
    row_zeros = np.repeat(zeros, group_size, axis=0)
    padded = np.concatenate([q, row_zeros[q.shape[0] :]]).astype(np.uint8)
    levels = padded.astype(np.int64) - row_zeros
    sums = levels.reshape(groups, group_size, -1).sum(axis=1)
    fix = (scales.astype(np.float64) * OFFSET * sums).sum(axis=0)
    layout = dot_layout(padded, nb)
    out = [
        layout[:, 0::2] | (layout[:, 1::2] << 4),
        blocked(scales.astype(np.float32), nb),
        padded_columns(fix, nb),
    ]
    if zero_points is not None:
        out.append(dot_layout(np.repeat(zero_points.astype(np.uint8), DEPTH, axis=0), nb))
    return out


def _instruction(isa: Isa, group_size: int, target) -> DotInstruction | None:
    """``target``'s unsigned × signed 8-bit dot instruction (exact for ``|q − z| ≤ 15``), if
    any, and a group size it can take (whole pairs of 4-row steps)."""
    instruction = isa.dot(64, max_weight=15, data_dtype="uint8", target=target)
    if instruction is None or group_size % (2 * DEPTH):
        return None
    unsigned = (instruction.data_dtype, instruction.weight_dtype) == ("uint8", "int8")
    return instruction if unsigned else None


def emit_dense_w4a8(
    bb: relax.BlockBuilder,
    data: relax.Expr,
    q: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    group_size: int,
    bias: np.ndarray | None = None,
    *,
    isa: Isa,
    target: tvm.target.Target | None = None,
) -> relax.Expr:
    """``data[…, K] @ W (+ bias)`` as :func:`~.dense_w4.emit_dense_w4`, the activations
    quantized to 8 bits per row and the products on ``isa``'s dot instruction for ``target``
    (the build's CPU; default: the current target, else this machine);
    :func:`~.dense_w4.emit_dense_w4` where it has none or the rows are known at run time only."""
    q, scales = np.asarray(q), np.asarray(scales)
    check_operands(data, q, scales, zero_points, group_size, bias)
    target = target or tvm.target.Target.current(allow_none=True) or host_target()
    instruction = _instruction(isa, group_size, target)
    rows_known = all(isinstance(d, tirx.IntImm) for d in data.ty.shape.values)
    if instruction is None or not rows_known:
        return emit_dense_w4(bb, data, q, scales, zero_points, group_size, bias, target)
    n = q.shape[1]
    nb = column_block(n, instruction.lanes)
    zeros = None if zero_points is None else np.asarray(zero_points)
    constants = pack(q, scales, zeros, group_size, nb)
    if bias is not None:
        constants.append(padded_columns(bias, nb))
    quantized = bb.emit_te(
        quantize_rows, data, scales.shape[0] * group_size, primfunc_name_hint=QUANTIZE
    )
    return bb.call_te(
        dense_w4a8,
        bb.emit(relax.TupleGetItem(quantized, 0)),
        bb.emit(relax.TupleGetItem(quantized, 1)),
        *(relax.const(c) for c in constants),
        group_size=group_size,
        columns=n,
        asymmetric=zeros is not None,
        instruction=instruction.intrinsic,
        primfunc_name_hint=DENSE,
    )


def schedule_w4a8_quantize(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding ``w4a8_quantize``: ``parallel`` over rows, each row's
    maximum over vectors of lanes (one vector of partial maxima), then its codes, vectorised."""
    part = find_block(sch, ABSMAX_LANES)
    if part is None:
        return False
    *rows, lanes, r = sch.get_loops(part)
    m = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    sch.reorder(m, r, lanes)
    if extent(sch, m) * extent(sch, r) * extent(sch, lanes) >= PARALLEL_MIN:
        sch.parallel(m)
    sch.vectorize(lanes)
    init = sch.decompose_reduction(part, r)
    sch.vectorize(sch.get_loops(init)[-1])
    for name in (ABSMAX, SCALE, QUANTIZE):
        sch.reverse_compute_at(find_block(sch, name), m)
    *_, k = sch.get_loops(find_block(sch, QUANTIZE))
    sch.vectorize(sch.split(k, [None, largest_divisor(extent(sch, k), 16)])[1])
    return True


def schedule_dense_w4a8(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding ``dense_w4a8``; False when there is none."""
    block = find_block(sch, DENSE)
    if block is None:
        return False
    if not static_loops(sch, sch.get_loops(block)):
        return False
    sums, decoded = find_block(sch, ACCUMULATE), find_block(sch, DECODE)
    instruction = chosen_instruction(sch, sums)
    *rows, n, g = sch.get_loops(block)
    m = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    nb = int(sch.get(decoded).writes[0].source.shape[-1]) // DEPTH
    tile = instruction.tile(extent(sch, m), 2 * nb)  # int32 and float32 accumulators
    group_size = int(sch.get(sums).iter_vars[-1].dom.extent)
    macs = extent(sch, m) * extent(sch, n) * extent(sch, g) * group_size

    out = inline_epilogue(sch, block, keep=(DECODE, ACCUMULATE))
    no, ni = sch.split(n, [None, nb])
    mo, mi = sch.split(m, [None, tile])
    sch.reorder(no, mo, g, mi, ni)
    if macs >= PARALLEL_MACS:
        sch.parallel(no)
    sch.compute_at(sums, g)
    sch.compute_at(decoded, no)
    sch.reverse_compute_at(out, mo)
    for local in (block, sums, decoded):
        sch.set_scope(local, 0, "local")
    sch.unroll(mi)
    sch.vectorize(ni)
    init = sch.decompose_reduction(block, g)
    unroll_vectorize_tile(sch, init, out)
    _schedule_groups(sch, sums, instruction)
    *_, decoded_rows, lanes = sch.get_loops(decoded)
    sch.unroll(sch.split(decoded_rows, [None, 2])[1])  # low and high nibbles of a byte row
    sch.vectorize(lanes)
    return True


def _schedule_groups(sch: s_tir.Schedule, sums, instruction: DotInstruction) -> None:
    """A group's int32 tile: ``k/depth | rows, vectors | lanes, depth``, the last two one
    instruction (marked), the rest unrolled around it."""
    *_, rows, columns, k = sch.get_loops(sums)
    steps, depth = sch.split(k, [None, instruction.depth])
    vectors, lanes = sch.split(columns, [None, instruction.lanes])
    sch.reorder(steps, rows, vectors, lanes, depth)
    sch.unroll(rows)
    sch.unroll(vectors)
    init = sch.decompose_reduction(sums, steps)
    mark(sch, lanes, instruction)
    sch.vectorize(sch.get_loops(init)[-1])


# The 4-bit kernels' schedule rules, for the build's rules (with :data:`~.dot.lower_dot_blocks`
# among its lowering passes, which the W4A8 kernel's instruction marks need).
SCHEDULES = (schedule_w4a8_quantize, schedule_dense_w4a8, schedule_dense_w4)
