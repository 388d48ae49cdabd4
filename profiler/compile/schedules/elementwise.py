"""Injective and reduction kernels, epilogues, and the generic fallback schedule.

Rules (each PrimFunc that no operator rule claims gets :func:`schedule_generic`):

* **Inline what can be inlined.** Every non-output block is inlined into its consumer (or, for
  blocks after a reduction, its producer) when TIR allows it: padding, broadcasts, transposes and
  epilogues then cost no memory pass of their own.
* **Spatial blocks**: all loops fused, split into a ``parallel`` outer loop over both cores and a
  16-wide inner loop (one AVX-512 or two AVX2 vectors of float32) that is vectorised when the
  extent divides evenly, so no tail predicate lands in the vector loop (narrower, 8 or 4, when
  the last axis is no multiple of 16: a vector then never spans two of its rows). Tiny blocks stay
  serial: waking the thread pool costs more than they do. Padding or transposing into a last
  axis narrower than a vector (3 image channels) goes row by row instead, and a transpose whose
  vectors gather down the rows of its input strip by strip of vectors (see
  :func:`schedule_spatial`).
* **Reduction blocks** (mean, softmax sums and maxima, layer norm statistics): their spatial loops
  fused and ``parallel``, the reduction loop serial inside. Where the last axis is kept (a sum
  over rows, a global pooling in NHWC), its vector of columns goes innermost, under the
  reduction: contiguous vector loads instead of one strided scalar per element.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx

VECTOR = 16  # lanes of elementwise loops: one AVX-512 register, two AVX2 ones
# Below this many output elements a kernel runs on one core (a parallel launch costs ~2 µs).
PARALLEL_MIN = 4096


def extent(sch: s_tir.Schedule, loop) -> int:
    return int(sch.get(loop).extent)


def largest_divisor(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is at most ``cap`` (1 if none is larger)."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def root_blocks(sch: s_tir.Schedule) -> list:
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def inline_all(sch: s_tir.Schedule, keep=()) -> None:
    """Inlines every block that TIR lets us inline except the ``keep`` blocks (by name)."""
    progress = True
    while progress:
        progress = False
        blocks = root_blocks(sch)
        outputs = {sch.get(b).name_hint for b in sch.get_output_blocks(sch.get_sblock("root"))}
        for block in blocks:
            name = sch.get(block).name_hint
            if name in keep or name in outputs or is_reduction(sch, block):
                continue
            for inline in (sch.compute_inline, sch.reverse_compute_inline):
                try:
                    inline(block)
                except Exception:  # TIR refuses (e.g. a non-injective read): keep the block
                    continue
                progress = True
                break
            if progress:
                break


def inline_epilogue(sch: s_tir.Schedule, block, keep=()):
    """Inlines everything around ``block`` (but ``keep``) and returns its single output block.

    The epilogue may be a DAG (GELU reads the matmul twice); after inlining, one block is left
    that writes the function's output. When ``block`` writes the output directly, a cache-write
    block takes that role, so the caller can always compute ``block`` inside its consumer's
    tile. Raises ``ValueError`` when no single output block remains.
    """
    inline_all(sch, keep={sch.get(block).name_hint, *keep})
    consumers = sch.get_consumers(block)
    if not consumers:
        return sch.cache_write(block, 0, "global")
    if len(consumers) != 1 or sch.get_consumers(consumers[0]):
        raise ValueError("the epilogue does not reduce to one elementwise output block")
    return consumers[0]


def unroll_vectorize_tile(sch: s_tir.Schedule, *blocks) -> None:
    """Register tiles outside the reduction (accumulator init, epilogue): the tile's rows
    unrolled, its vector of lanes vectorised (the blocks' last two loops). A tile of one row
    may have lost its row loop: the loop above the lanes then holds more than them (the tile's
    parent, around the reduction too), and stays as it is."""
    for block in blocks:
        *_, rows, lanes = sch.get_loops(block)
        if sch.get(rows).body.same_as(sch.get(lanes)):
            sch.unroll(rows)
        sch.vectorize(lanes)


def _reads_in_step(sch: s_tir.Schedule, block) -> bool:
    """Whether every tensor the block reads has the block's shape and is indexed by the block's
    own axes in order (or is a scalar): then the fused loop walks each of them straight through
    memory. (Padding the channels, 3 → 4, reads in order a tensor of another shape.)"""
    iters = sch.get(block).iter_vars
    for region in sch.get(block).reads:
        index = [r.min for r in region.region]
        if not index:
            continue
        if len(index) != len(iters) or not all(
            iv.var.same_as(i) and int(iv.dom.extent) == int(d)
            for iv, i, d in zip(iters, index, region.source.shape, strict=True)
        ):
            return False
    return True


def schedule_spatial(sch: s_tir.Schedule, block) -> None:
    """``parallel`` outer × vectorised inner over the fused loops of a spatial block.

    A block whose last axis is narrower than a vector and which reads something else than its
    own elements in order (padding, a transpose: an NCHW image into NHWC, three channels) goes
    row by row instead, that axis unrolled: fused and vectorised, every lane computed its own
    indices by division and gathered them (with the padding test per lane), 15× slower on a
    3 × 226 × 226 image.
    """
    loops = sch.get_loops(block)
    if not loops:
        return
    if len(loops) > 2 and extent(sch, loops[-1]) < VECTOR and not _reads_in_step(sch, block):
        rows = sch.fuse(*loops[:-2]) if len(loops) > 3 else loops[0]
        if math.prod(extent(sch, lp) for lp in sch.get_loops(block)) >= PARALLEL_MIN:
            sch.parallel(rows)
        sch.unroll(loops[-1])
        return
    last = extent(sch, loops[-1])
    if len(loops) > 1 and last % VECTOR == 0 and _gathers(sch, block):
        _strips(sch, block, loops)
        return
    # Vectors must not straddle rows of the last axis: with 24 channels a 16-wide vector does,
    # its lanes' indices no longer form one ramp, and it gathers (a quantize 6× slower); the
    # largest power of two dividing that axis keeps every vector one contiguous load.
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = extent(sch, fused)
    inner = VECTOR if total % VECTOR == 0 else largest_divisor(total, VECTOR)
    if last % VECTOR and math.gcd(last, VECTOR) >= 4:
        inner = math.gcd(last, VECTOR)
    outer, inner_loop = sch.split(fused, [None, inner])
    if inner > 1:
        sch.vectorize(inner_loop)
    if total >= PARALLEL_MIN:
        sch.parallel(outer)


def _gathers(sch: s_tir.Schedule, block) -> bool:
    """Whether the block reads a tensor along its last axis elsewhere than in that tensor's
    last dimension: each lane of a vector then reads another row (a transpose's gather)."""
    last = sch.get(block).iter_vars[-1].var

    def uses(index) -> bool:
        return any(v.same_as(last) for v in tirx.analysis.undefined_vars(index))

    return any(
        region.region
        and not uses(region.region[-1].min)
        and any(uses(r.min) for r in region.region[:-1])
        for region in sch.get(block).reads
    )


def _strips(sch: s_tir.Schedule, block, loops: list) -> None:
    """A transposing block (attention's ``Kᵀ``: heads × 64 × 128 from 128 rows of 256): its
    last axis split into vectors, the strips of vectors outermost and every other axis inside,
    so that the input rows one strip gathers from stay in cache while the strip is swept (3×
    faster than in output order, where each gather missed)."""
    outer, lanes = sch.split(loops[-1], [None, VECTOR])
    sch.reorder(outer, *loops[:-1], lanes)
    strips = sch.fuse(outer, *loops[:-1])
    if extent(sch, strips) * VECTOR >= PARALLEL_MIN:
        sch.parallel(strips)
    sch.vectorize(lanes)


def schedule_reduction(sch: s_tir.Schedule, block) -> None:
    """``parallel`` over the fused spatial loops of a reduction block, reduction serial; a last
    axis that is kept (a sum over rows, a mean over NHWC pixels) is split into vector lanes
    under the reduction (:func:`_reduce_columns`)."""
    loops = sch.get_loops(block)
    kinds = [iv.iter_type for iv in sch.get(block).iter_vars]
    spatial = [lp for lp, k in zip(loops, kinds, strict=True) if k == tirx.IterVar.DataPar]
    reduce = [lp for lp, k in zip(loops, kinds, strict=True) if k != tirx.IterVar.DataPar]
    if not spatial:
        return
    if _reads_columns(sch, block) and math.gcd(extent(sch, spatial[-1]), VECTOR) >= 4:
        _reduce_columns(sch, block, spatial, reduce)
        return
    sch.reorder(*spatial, *reduce)
    fused = sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]
    if extent(sch, fused) > 1:
        sch.parallel(fused)


def _reads_columns(sch: s_tir.Schedule, block) -> bool:
    """Whether the reduction keeps the contiguous axis of what it reads: a tensor it reads is
    indexed by the block's last spatial axis in its last dimension, and none by a reduced axis
    there (TE puts the reduced loops last whichever axes they reduce)."""
    ivs = sch.get(block).iter_vars
    last = [iv.var for iv in ivs if iv.iter_type == tirx.IterVar.DataPar][-1]
    reduced = [iv.var for iv in ivs if iv.iter_type != tirx.IterVar.DataPar]
    written = [w.source for w in sch.get(block).writes]
    reads = [r for r in sch.get(block).reads if not any(r.source.same_as(w) for w in written)]
    lasts = [r.region[-1].min for r in reads if r.region]
    in_step = any(index.same_as(last) for index in lasts)
    return in_step and not any(
        v.same_as(r)
        for index in lasts
        for v in tirx.analysis.undefined_vars(index)
        for r in reduced
    )


def _reduce_columns(sch: s_tir.Schedule, block, spatial: list, reduce: list) -> None:
    """``spatial…, last / lanes | reduce… | lanes``: each step of the reduction reads a vector
    of contiguous columns into a vector of partial results. Serial over the reduced axis and
    vectorised over the kept one, it adds in the same order as the plain loop, lane by lane."""
    work = math.prod(extent(sch, lp) for lp in sch.get_loops(block))
    outer, lanes = sch.split(spatial[-1], [None, math.gcd(extent(sch, spatial[-1]), VECTOR)])
    sch.reorder(*spatial[:-1], outer, *reduce, lanes)
    rows = sch.fuse(*spatial[:-1], outer) if len(spatial) > 1 else outer
    if extent(sch, rows) > 1 and work >= PARALLEL_MIN:
        sch.parallel(rows)
    sch.vectorize(lanes)  # before the init is split off: TIR vectorises only whole reductions
    init = sch.decompose_reduction(block, reduce[0])
    sch.vectorize(sch.get_loops(init)[-1])


def schedule_generic(sch: s_tir.Schedule) -> None:
    """The fallback: inline, then parallelise and vectorise each remaining root block."""
    inline_all(sch)
    for block in root_blocks(sch):
        if len(sch.get_loops(block)) != len(sch.get(block).iter_vars):
            continue  # already nested by an earlier rule or opaque: leave it as it is
        if is_reduction(sch, block):
            schedule_reduction(sch, block)
        else:
            schedule_spatial(sch, block)
