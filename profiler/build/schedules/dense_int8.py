"""Integer dense / matmul (8-bit or int16 activations × a constant int8 ``[K, N]`` → int32) on
the target's dot-product instruction.

Legalization: ``matmul(x[…, K], W[K, N], out_dtype="int32")`` with ``x`` uint8, int8 or int16 and a
constant int8 ``W`` becomes ``dense_int8``: the activations staged into the instruction's type and
``K`` padded to its depth (:func:`~.conv2d_int8.stage`, with the same exact ±128 offset correction
as the conv; int16 activations, on the int16 pairs, need neither for an even ``K``), ``W`` packed at
build time to ``[N/nb, K/depth, nb·depth]`` so one instruction reads ``lanes × depth`` contiguous
weights. Other integer matmuls keep TVM's legalization (and the FP32 rule's schedule, :mod:`.dense`,
which does not mind the dtype).

Schedule, loops ``batch…, m, n, k``: all leading axes form one ``M`` (the weights are shared);
register tile ``Tm × nb`` (``m`` unrolled, ``nb`` in whole instructions), the reduction outside
it, the innermost ``lanes × depth`` loops one instruction call (:mod:`.dot`); ``parallel``
over the ``M/Tm × N/nb`` tiles, the epilogue computed per tile. A single row (a classifier at
batch 1) takes the widest block: four independent accumulators per step instead of one.
"""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, te, tirx

from rangeprof.profiler.build.schedules.conv2d import find_block
from rangeprof.profiler.build.schedules.conv2d_int8 import (
    STAGE,
    corrected,
    dot_kernel,
    finish_dot_tile,
    is_integer,
    stage,
)
from rangeprof.profiler.build.schedules.dot import INSTRUCTION, chosen_instruction
from rangeprof.profiler.build.schedules.elementwise import extent, inline_epilogue
from rangeprof.profiler.build.schedules.isa import DOT_INSTRUCTIONS

DENSE = "dense_int8"


def dense_int8(data, weight, *offset_fix, instruction, offset):
    """``out[…, m, n] = Σ_k s[…, m, k] · w[n / nb, k / depth, (n % nb) · depth + k % depth]``
    (+ the offset correction), ``s`` the staged activations; ``instruction`` the intrinsic's
    name (the block names it for the schedule)."""
    instruction = DOT_INSTRUCTIONS[instruction]
    depth = instruction.depth
    blocks, groups, packed = (int(d) for d in weight.shape)
    nb = packed // depth
    staged = stage(data, (), groups * depth, instruction.data_dtype, offset)
    k = te.reduce_axis((0, groups * depth), "k")
    acc = te.compute(
        (*data.shape[:-1], blocks * nb),
        lambda *idx: te.sum(
            staged[(*idx[:-1], k)].astype("int32")
            * weight[idx[-1] // nb, k // depth, idx[-1] % nb * depth + k % depth].astype("int32"),
            axis=k,
        ),
        name=DENSE,
        attrs={INSTRUCTION: instruction.intrinsic},
    )
    return corrected(acc, offset_fix)


def legalize_matmul_int8(bb: relax.BlockBuilder, call: relax.Call):
    """8-bit or int16 ``matmul`` with a constant int8 ``[K, N]`` right operand →
    ``dense_int8``."""
    data, weight = call.args
    if is_integer(call) and data.ty.ndim >= 2 and weight.ty.ndim == 2:
        rows = 1
        for dim in data.ty.shape.values[:-1]:
            rows *= int(dim)
        w = weight.value.numpy().T  # [N, K]
        legalized = dot_kernel(bb, dense_int8, DENSE, data, w, rows)
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
    nb = int(sch.get(block).reads[-1].source.shape[-1]) // depth
    *batch, m, n, k = sch.get_loops(block)
    if batch:
        _flatten_rows(sch, block, [extent(sch, loop) for loop in (*batch, m)])
        m, n, k = sch.get_loops(block)
    rows = instruction.tile(extent(sch, m), nb)

    out = inline_epilogue(sch, block, keep=(STAGE,))
    mo, mi = sch.split(m, [None, rows])
    no, nv, nl = sch.split(n, [None, nb // lanes, lanes])
    ko, kd = sch.split(k, [None, depth])
    sch.reorder(mo, no, ko, mi, nv, nl, kd)
    finish_dot_tile(sch, block, out, sch.fuse(mo, no), (mi, nv), ko, nl, instruction)
    return True
