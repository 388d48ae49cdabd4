"""Integer dense / matmul (8-bit or int16 activations × an int8 ``[…, K, N]`` → int32) on the
target's dot-product instruction.

Legalization: ``matmul(x[…, K], W[K, N], out_dtype="int32")`` with ``x`` uint8, int8 or int16 and a
constant int8 ``W`` becomes ``dense_int8``: the activations staged into the instruction's type and
``K`` padded to its depth (:func:`~.conv2d_int8.stage`, with the same exact ±128 offset correction
as the conv; int16 activations, on the int16 pairs, need neither for an even ``K``), ``W`` packed at
build time to ``[N/nb, K/depth, nb·depth]`` so one instruction reads ``lanes × depth`` contiguous
weights.

A matmul of two activations (attention's ``Q·Kᵀ`` and ``P·V`` as the x86 quantizer writes them:
``B`` int8 ``[…, K, N]`` with the batch axes of ``x``, or 2-D) gets the same kernel with ``B``
packed **at run time**, per batch, into that layout (:func:`pack_operand`, a kernel of its own
that FuseOps joins to ``B``'s quantize), in the instruction's weight type. ``B`` may hold any int8,
so the instruction is one exact for every weight: ``vpdpbusd`` (AVX-512 VNNI), ``sdot`` (NEON),
and on AVX2 ``vpmaddwd`` on int16 pairs (``vpmaddubsw`` saturates beyond ±64). An offset
correction, when the activations change type, is ``-offset · Σ_k B`` per batch and column
(:func:`offset_sums`), at run time too. Constant weights whose ``N`` no instruction's lanes
divide are padded with zero rows to a multiple of the widest lanes, the padding columns dropped
after the kernel. Other integer matmuls (a run-time ``B`` of such an ``N``, broadcast batch axes,
dynamic shapes) keep TVM's legalization (and the FP32 rule's schedule, :mod:`.dense`, which does
not mind the dtype).

Schedule, loops ``batch…, m, n, k``: with constant weights all leading axes form one ``M`` (the
weights are shared); a run-time ``B`` keeps its batch axes outermost, fused into the parallel
loop. Register tile ``Tm × nb`` (``m`` unrolled, ``nb`` in whole instructions), the reduction
outside it, the innermost ``lanes × depth`` loops one instruction call (:mod:`.dot`);
``parallel`` over the ``batch… × M/Tm × N/nb`` tiles, the epilogue computed per tile. A single
row (a classifier at batch 1) takes the widest block: four independent accumulators per step
instead of one. On a Zen 3 EPYC (AVX2) the attention matmuls of tiny_bert ([4, 128, 64] ×
[4, 64, 128] and [4, 128, 128] × [4, 128, 64]) ran 2.2× faster than on TVM's matmul, single
thread, packing included, the ``vpmaddwd`` loop at that core's ``vpmaddwd`` throughput.

Where the target has AMX (Sapphire Rapids on), a ``vpdpbusd`` kernel whose rows, columns and
reduction fill whole tiles (16, 16, 64) runs on ``tdpbusd`` instead (:mod:`.amx`), the same
operands and layout, the same results: ``parallel`` over the ``batch… × M/rows × N/columns``
output tiles (32 × 32 where the shape allows), each the whole reduction on tile registers,
then the epilogue on its int32 outputs.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from rangeprof.profiler.compile.schedules.conv2d import find_block
from rangeprof.profiler.compile.schedules.dense import COLUMNS, first_columns
from rangeprof.profiler.compile.schedules.elementwise import (
    PARALLEL_MIN,
    extent,
    inline_all,
    inline_epilogue,
    schedule_spatial,
)

from . import amx
from .conv2d_int8 import (
    STAGE,
    corrected,
    dot_kernel,
    dot_layout,
    finish_dot_tile,
    is_integer,
    schedule_stage,
    stage,
)
from .dot import INSTRUCTION, chosen_instruction
from .isa import DOT_INSTRUCTIONS, Isa

DENSE = "dense_int8"
PACK = "int8_pack"  # a run-time right operand packed for the instruction
OFFSET_SUMS = "int8_offset_sums"  # its column sums, for the offset correction


def dense_int8(data, weight, *offset_fix, instruction, offset):
    """``out[…, m, n] = Σ_k s[…, m, k] · w[…, n / nb, k / depth, (n % nb) · depth + k % depth]``
    (+ the offset correction), ``s`` the staged activations, ``w`` shared by all rows (constant
    weights, 3-D) or one per batch (a packed run-time operand, with ``data``'s batch axes);
    ``instruction`` the intrinsic's name (the block names it for the schedule)."""
    instruction = DOT_INSTRUCTIONS[instruction]
    depth = instruction.depth
    *batch, blocks, groups, packed = (int(d) for d in weight.shape)
    nb = packed // depth
    staged = stage(data, (), groups * depth, instruction.data_dtype, offset)
    k = te.reduce_axis((0, groups * depth), "k")

    def product(*idx):
        n = idx[-1]
        w = weight[(*idx[: len(batch)], n // nb, k // depth, n % nb * depth + k % depth)]
        return staged[(*idx[:-1], k)].astype("int32") * w.astype("int32")

    acc = te.compute(
        (*data.shape[:-1], blocks * nb),
        lambda *idx: te.sum(product(*idx), axis=k),
        name=DENSE,
        attrs={INSTRUCTION: instruction.intrinsic},
    )
    return corrected(acc, offset_fix)


def pack_operand(operand, nb: int, instruction: str):
    """A run-time ``[…, K, N]`` operand → ``[…, N/nb, K/depth, nb·depth]`` in the instruction's
    weight type, ``K`` zero-padded to a multiple of ``depth``: per batch, the layout
    :func:`~.conv2d_int8.pack_weights` gives constant weights."""
    instruction = DOT_INSTRUCTIONS[instruction]
    depth = instruction.depth
    *batch, k_dim, n = (int(d) for d in operand.shape)
    groups = -(-k_dim // depth)

    def value(*idx):
        *lead, block, group, j = idx
        k = group * depth + j % depth
        element = operand[(*lead, k, block * nb + j // depth)]
        if groups * depth != k_dim:
            element = tirx.if_then_else(k < k_dim, element, tirx.const(0, "int8"))
        return element.astype(instruction.weight_dtype)

    return te.compute((*batch, n // nb, groups, nb * depth), value, name=PACK)


def offset_sums(operand, offset: int):
    """``-offset · Σ_k operand[…, k, n]``, shaped ``[…, 1, N]``: the offset correction of a
    run-time right operand (activations that change type, :func:`~.conv2d_int8.corrected`)."""
    *batch, k_dim, n = (int(d) for d in operand.shape)
    k = te.reduce_axis((0, k_dim), "k")
    return te.compute(
        (*batch, 1, n),
        lambda *idx: te.sum(-offset * operand[(*idx[:-2], k, idx[-1])].astype("int32"), axis=k),
        name=OFFSET_SUMS,
    )


def _legalize_runtime(bb: relax.BlockBuilder, isa: Isa, data, other) -> relax.Expr | None:
    """``dense_int8`` of a run-time int8 ``[…, K, N]`` right operand (one per batch, the
    batch axes those of ``data``, or a shared 2-D one), packed by a kernel of its own
    (:func:`pack_operand`); None when no instruction fits or the batch axes broadcast."""
    a_shape = [int(d) for d in data.ty.shape.values]
    *batch, _, n = (int(d) for d in other.ty.shape.values)
    if batch and batch != a_shape[:-2]:
        return None
    rows = a_shape[-2] if batch else math.prod(a_shape[:-1])
    dtype = str(data.ty.dtype)
    layout = dot_layout(isa, n, 128, dtype, rows)  # any int8 value: exact instructions only
    if layout is None:
        return None
    instruction, nb = layout
    offset = instruction.data_offset(dtype)
    operands = [
        data,
        bb.emit_te(
            pack_operand, other, nb=nb, instruction=instruction.intrinsic, primfunc_name_hint=PACK
        ),
    ]
    if offset:
        operands.append(
            bb.emit_te(offset_sums, other, offset=offset, primfunc_name_hint=OFFSET_SUMS)
        )
    return bb.call_te(
        dense_int8,
        *operands,
        primfunc_name_hint=DENSE,
        instruction=instruction.intrinsic,
        offset=offset,
    )


# Columns of a constant dense that no instruction's lanes divide are padded to a multiple of
# the widest lanes (AVX-512's 16; AVX2's 8 and NEON's 4 divide it).
_COLUMN_MULTIPLE = 16


def _padded_columns(bb: relax.BlockBuilder, isa: Isa, data, w: np.ndarray, rows: int):
    """The dense on ``w`` padded with zero weight rows (a recognizer's 6625 classes would
    otherwise run on TVM's scalar matmul), its padding columns dropped; None when no instruction
    fits the padded weights either."""
    columns = w.shape[0]
    padded = np.pad(w, ((0, -columns % _COLUMN_MULTIPLE), (0, 0)))
    legalized = dot_kernel(bb, isa, dense_int8, DENSE, data, padded, rows)
    if legalized is None:
        return None
    return bb.call_te(first_columns, bb.emit(legalized), columns, primfunc_name_hint=COLUMNS)


def legalize_matmul_int8(bb: relax.BlockBuilder, call: relax.Call, isa: Isa):
    """8-bit or int16 ``matmul`` with an int8 right operand → ``dense_int8`` on ``isa``'s
    instructions: a constant ``[K, N]`` one packed at build time, a run-time one packed per
    call."""
    data, weight = call.args
    legalized = None
    if is_integer(call) and data.ty.ndim >= 2 and weight.ty.ndim == 2:
        rows = math.prod(int(d) for d in data.ty.shape.values[:-1])
        w = weight.value.numpy().T  # [N, K]
        legalized = dot_kernel(bb, isa, dense_int8, DENSE, data, w, rows)
        if legalized is None and w.shape[0] % _COLUMN_MULTIPLE:
            legalized = _padded_columns(bb, isa, data, w, rows)
    elif is_integer(call, constant=False) and data.ty.ndim >= 2 and weight.ty.ndim >= 2:
        legalized = _legalize_runtime(bb, isa, data, weight)
    if legalized is not None:
        return legalized
    return tvm.ir.Op.get("relax.matmul").get_attr("FLegalize")(bb, call)


def _flatten_rows(sch: s_tir.Schedule, block, extents: list[int]) -> None:
    """The leading axes as one row axis of the block itself: ``blockize`` cannot split the
    bindings of loops fused the usual way (``fuse``) into its inner block."""

    def rows(*axes):
        *lead, n, k = axes
        row = lead[0]
        for axis, size in zip(lead[1:], extents[1:], strict=True):
            row = row * size + axis
        return (row, n, k)

    sch.transform_block_layout(block, tirx.IndexMap.from_func(rows, ndim=len(extents) + 2))


def schedule_dense_int8(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding ``dense_int8``; False when there is none."""
    block = find_block(sch, DENSE)
    if block is None:
        return False
    instruction = chosen_instruction(sch, block)
    lanes, depth = instruction.lanes, instruction.depth
    weight = sch.get(block).reads[-1].source
    nb = int(weight.shape[-1]) // depth
    *batch, m, n, k = sch.get_loops(block)
    if batch and len(weight.shape) == 3:  # shared weights: every row alike
        _flatten_rows(sch, block, [extent(sch, loop) for loop in (*batch, m)])
        (m, n, k), batch = sch.get_loops(block), []
    if _tiles_fit(instruction, extent(sch, m), nb, extent(sch, k)):
        _schedule_tiles(sch, block, batch, (m, n, k), nb)
        return True
    rows = instruction.tile(extent(sch, m), nb)

    out = inline_epilogue(sch, block, keep=(STAGE,))
    mo, mi = sch.split(m, [None, rows])
    no, nv, nl = sch.split(n, [None, nb // lanes, lanes])
    ko, kd = sch.split(k, [None, depth])
    sch.reorder(*batch, mo, no, ko, mi, nv, nl, kd)
    outer = sch.fuse(*batch, mo, no)
    finish_dot_tile(sch, block, out, outer, (mi, nv), ko, nl, instruction)
    return True


def _tiles_fit(instruction, rows: int, nb: int, depth: int) -> bool:
    """Whether the target has AMX tiles and the kernel fits them: ``vpdpbusd``'s operands (u8
    activations, s8 weights in groups of 4, the layout ``tdpbusd`` reads) in whole tiles."""
    return (
        (instruction.data_dtype, instruction.weight_dtype, instruction.depth)
        == ("uint8", "int8", 4)
        and amx.available(tvm.target.Target.current(allow_none=True))
        and amx.fits(rows, nb, depth)
    )


def _schedule_tiles(sch: s_tir.Schedule, block, batch: list, loops: tuple, nb: int) -> None:
    """``batch…, M/rows, N/columns`` ``parallel`` | the AMX tile (``rows × columns`` outputs,
    the whole reduction: :func:`~.amx.mark_tile`), then the epilogue on its int32 outputs.
    Two accumulator tiles each way where the shape allows."""
    m, n, k = loops
    rows = 2 * amx.ROWS if extent(sch, m) % (2 * amx.ROWS) == 0 else amx.ROWS
    columns = 2 * amx.COLUMNS if nb % (2 * amx.COLUMNS) == 0 else amx.COLUMNS
    out = inline_epilogue(sch, block, keep=(STAGE,))
    mo, mi = sch.split(m, [None, rows])
    no, ni = sch.split(n, [None, columns])
    sch.reorder(*batch, mo, no, mi, ni, k)
    outer = sch.fuse(*batch, mo, no)
    sch.parallel(outer)
    sch.reverse_compute_at(out, outer)
    amx.mark_tile(sch, mi)
    sch.vectorize(sch.get_loops(out)[-1])
    schedule_stage(sch)


def schedule_pack(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding :func:`pack_operand`: ``parallel`` over the packed rows,
    each row (``nb · depth`` elements, ``depth`` rows of the operand interleaved) unrolled,
    which LLVM's SLP vectoriser turns into contiguous loads and shuffles (vectorised as a loop,
    each lane gathered its element: 8× slower, 16 µs for a [4, 64, 128] operand on Zen 3).
    The producers FuseOps put in it (the operand's quantize, with the head split's reshapes and
    transposes) stay one block, scheduled as any elementwise kernel: inlined into the unrolled
    rows their index arithmetic defeats the SLP vectoriser (attention's ``V``: 22 µs instead
    of 9)."""
    block = find_block(sch, PACK)
    if block is None:
        return False
    producers = {sch.get(p).name_hint for p in sch.get_producers(block)}
    inline_all(sch, keep=(PACK, *producers))
    for producer in sch.get_producers(block):
        schedule_spatial(sch, producer)
    *lead, group, row = sch.get_loops(block)
    rows = sch.fuse(*lead, group)
    if extent(sch, rows) * extent(sch, row) >= PARALLEL_MIN:
        sch.parallel(rows)
    sch.unroll(row)
    return True
