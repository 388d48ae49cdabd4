"""Max / average / adaptive (global) pooling in NHWC.

TVM's legalization gives a ``pad_temp`` block, a reduction block (``pool_max``, ``pool_sum``,
``adaptive_pool_sum``) over ``n, y, x, c | ky, kx`` and, for averages, a division block.

* The padding is inlined into the reduction: its ``if_then_else`` costs less than a padded
  copy of the whole input.
* The reduction runs ``parallel`` over ``n, y`` (or its flattened pixels when there is a single
  output row), window loops ``ky, kx`` inside the pixel, and the channel loop innermost,
  vectorised by 16 (a contiguous load per tap in NHWC).
* The division (and any fused elementwise epilogue) gets the generic spatial schedule.
"""

from __future__ import annotations

from tvm import s_tir

from rangeprof.profiler.compile.schedules.elementwise import (
    VECTOR,
    extent,
    largest_divisor,
    root_blocks,
    schedule_spatial,
)

_POOLS = ("pool_max", "pool_sum", "adaptive_pool_sum")
_PAD = "pad_temp"


def _find(sch: s_tir.Schedule, names):
    for name in names:
        try:
            return sch.get_sblock(name)
        except Exception:  # TIR keeps block names: absent when this kernel is no pooling
            continue
    return None


def schedule_pooling(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding an NHWC pooling; False when there is none."""
    pool = _find(sch, _POOLS)
    if pool is None or len(sch.get_loops(pool)) != 6:
        return False
    pad = _find(sch, (_PAD,))
    if pad is not None:
        sch.compute_inline(pad)
    n, y, x, c, ry, rx = sch.get_loops(pool)
    lanes = largest_divisor(extent(sch, c), VECTOR)
    co, ci = sch.split(c, [None, lanes])
    sch.reorder(n, y, x, co, ry, rx, ci)
    outer = sch.fuse(n, y) if extent(sch, y) > 1 else sch.fuse(n, y, x)
    sch.parallel(outer)
    sch.vectorize(ci)
    for block in root_blocks(sch):
        if not sch.get(block).same_as(sch.get(pool)):
            schedule_spatial(sch, block)
    return True
