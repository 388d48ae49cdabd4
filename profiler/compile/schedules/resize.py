"""image.resize2d (ONNX Resize) in NHWC, and whatever FuseOps put with it (a concat of upsampled
feature maps, as in FPN / DBNet necks).

TOPI computes each output element's source pixels from float coordinates (nearest: a division
and a clamp; linear: four taps and their weights). The generic schedule fuses every loop and
vectorises the fused one, so each lane redoes the coordinate arithmetic of its own pixel and
loads its taps alone (a gather per tap). Here:

* every block is inlined into the output (a concat then reads each resize directly);
* the output's rows are ``parallel``, its pixels serial: a pixel's coordinates and weights are
  computed once, loop-invariant across its channels;
* its channels are split into vectors that straddle no pixel's channels of any tensor the kernel
  reads (8 lanes for a concat of 24-channel maps), vectorised: each tap is one contiguous load.

A resize whose channels are not its last axis (NCHW, which ``ConvertLayout`` leaves only when
it cannot rewrite the graph) keeps the generic schedule.
"""

from __future__ import annotations

import math

from tvm import s_tir

from rangeprof.profiler.compile.schedules.elementwise import (
    PARALLEL_MIN,
    VECTOR,
    extent,
    inline_all,
    is_reduction,
    root_blocks,
    schedule_reduction,
    schedule_spatial,
)

RESIZE = "resize"  # TOPI's block name; FuseTIR keeps it (``resize_1``… when several are fused)


def _channels_last(sch: s_tir.Schedule, block) -> bool:
    """Whether every tensor the block reads is indexed by its last axis in its last dimension
    (NHWC: the channel passes through while the pixel coordinates are computed)."""
    last = sch.get(block).iter_vars[-1].var
    reads = sch.get(block).reads
    return bool(reads) and all(r.region[-1].min.same_as(last) for r in reads)


def _lanes(sch: s_tir.Schedule, channels: int) -> int:
    """A vector of channels that divides the last axis of every tensor the kernel reads and
    writes: no vector then spans two pixels of any of them."""
    shapes = [p.ty.shape for p in sch.mod["main"].params]
    return math.gcd(channels, VECTOR, *(int(s[-1]) for s in shapes if len(s)))


def _schedule_pixels(sch: s_tir.Schedule, block) -> None:
    """``n·y | x | c / lanes | lanes``: rows in parallel, channels in vectors."""
    n, y, x, c = sch.get_loops(block)
    lanes = _lanes(sch, extent(sch, c))
    if lanes < 4:  # no vector fits: the generic schedule does as well
        schedule_spatial(sch, block)
        return
    work = math.prod(extent(sch, lp) for lp in (n, y, x, c))
    rows = sch.fuse(n, y)
    _, inner = sch.split(c, [None, lanes])
    sch.vectorize(inner)
    if extent(sch, rows) > 1 and work >= PARALLEL_MIN:
        sch.parallel(rows)


def schedule_resize(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding an NHWC resize; False when there is none."""
    resizes = [b for b in root_blocks(sch) if sch.get(b).name_hint.startswith(RESIZE)]
    if not resizes or not all(_channels_last(sch, b) for b in resizes):
        return False
    inline_all(sch)
    for block in root_blocks(sch):
        if len(sch.get_loops(block)) != len(sch.get(block).iter_vars):
            continue  # already nested
        if is_reduction(sch, block):
            schedule_reduction(sch, block)
        elif len(sch.get_loops(block)) == 4:
            _schedule_pixels(sch, block)
        else:
            schedule_spatial(sch, block)
    return True
