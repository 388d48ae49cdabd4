"""Compiled TIR statistics kernels: the statistics of :mod:`.statistics`, computed in the
profiling program right where each tensor is produced, so a run returns a few kilobytes of
statistics instead of every tensor.

:func:`stats_kernel` gives the PrimFunc for a tensor rank, dtype, channel axis and bin count (any
shape: dimensions are symbolic, so a model needs a handful of kernels); :func:`decode` turns its
float64 output vector into a :class:`~rangeprof.profiler.profiling.statistics.TensorStats` equal to
what ``TensorStats.observe`` computes in numpy: the same finite min and max, NaN and inf counts,
per-channel ranges and canonical histogram, bit for bit (tested). Only the float64 sums may differ
in the last bits, because the kernel adds in its own fixed order (16 lanes per chunk of 8192 values,
chunks in order): deterministic for a given shape, which is all the exact merge needs.

Passes over the tensor, all in one call (the tensor is still in cache from the kernel that wrote
it):

1. moments: min, max, sum, sum of squares — vectorised over 16 lanes, ``parallel`` over chunks.
   A NaN or inf makes the sums non-finite; only then a masked pass recounts, skipping them and
   counting NaN and inf;
2. the exponent of :func:`~rangeprof.profiler.profiling.statistics.canonical_exponent`, on the
   float64 bits
   (``frexp`` reads the exponent field);
3. the histogram: bin indices in a vector loop (in float32, 8 lanes a register, where that is
   exact: most tensors), counts in private arrays per worker (counts add in any order, so the
   split need not be fixed), merged at the end;
4. per-channel min and max along the channel axis as the kernel lays the tensor out
   (``[outer, C, inner]``; reduced in registers per group of channels when they are innermost),
   and with ``channel_sums`` each channel's float64 sum and count of finite values in the same
   pass (per worker in row order, workers added in order: a fixed order for a shape, as the
   moments' sums; the exact merge converts each run's sums, as it does the tensor's).

Output layout (:data:`HEADER` values, then ``bins`` counts, then ``C`` minima and ``C`` maxima,
then with ``channel_sums`` ``C`` sums and ``C`` counts):
``count, nan_count, inf_count, min, max, sum, sum_sq, exponent, offset, length``.

:class:`Totals` adds up the vectors of many runs of one tensor: what decoding each and merging
the records in order gives, bit for bit, without building a record per run.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from rangeprof.profiler.profiling.statistics import (
    INDEX_BITS,
    MIN_EXPONENT,
    ChannelRange,
    Histogram,
    TensorStats,
    canonical_exponent,
    saturated_units,
    units_of,
)

HEADER = 10
LANES = 16  # float32 lanes of two AVX2 (one AVX-512) registers
CHUNK = 8192  # values per moments chunk: fixes the float64 summation order
_PARALLEL_MIN = 32768  # below this many values one core is faster than waking the pool
# a second worker's counts cost a merge pass of their own: worth it for larger tensors only
_PARALLEL_HISTOGRAM = _PARALLEL_MIN
_BLOCK = 1024  # histogram values whose bin indices are computed in one vector loop
_SPREAD = 4  # copies of the counts per worker: runs of equal values (ReLU zeros) interleave
_ROWS = 32  # rows per block of the per-channel reduction
_MAX_FINITE = {
    "float16": 65504.0,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


def kernel_view(shape: tuple[int, ...], channel_axis: int | None) -> tuple[int, ...]:
    """The shape a kernel reads a tensor as: ``(n,)``, or ``(outer, C, inner)`` around the
    channel axis (a view: the same memory)."""
    n = math.prod(shape)
    if channel_axis is None:
        return (n,)
    channels = shape[channel_axis]
    outer = math.prod(shape[:channel_axis])
    return (outer, channels, n // (outer * channels) if n else 1)


def _per_channel_values(channel_sums: bool) -> int:
    """Values per channel in the output: min and max, and sum and count with ``channel_sums``."""
    return 4 if channel_sums else 2


def output_length(
    shape: tuple[int, ...], channel_axis: int | None, bins: int, channel_sums: bool = False
) -> int:
    channels = 0 if channel_axis is None else shape[channel_axis]
    return HEADER + bins + _per_channel_values(channel_sums) * channels


def kernel_name(dtype: str, per_channel: bool, bins: int, channel_sums: bool = False) -> str:
    channels = ("_channel_sums" if channel_sums else "_channels") if per_channel else ""
    return f"observe_stats_{dtype}{channels}_b{bins}"


@functools.cache
def stats_kernel(
    dtype: str, per_channel: bool, bins: int, workers: int, channel_sums: bool = False
) -> tirx.PrimFunc:
    """The statistics kernel for tensors viewed as :func:`kernel_view` gives (see the module
    doc); with ``per_channel`` the view is ``(outer, C, inner)`` and per-channel ranges are
    computed too, with ``channel_sums`` also per-channel sums and counts."""
    spec = _Spec(dtype, per_channel, bins, workers, channel_sums)
    moments = _moments(spec, False), _moments(spec, True)
    return _kernel(spec, *moments, _histogram(spec), _channel_ranges(spec))


class _Spec:
    """One kernel's parameters and what its passes share: the symbolic view, the working dtype
    and its constants, the loop sizes of each pass, and the element readers the passes build
    their expressions with."""

    def __init__(self, dtype: str, per_channel: bool, bins: int, workers: int, channel_sums: bool):
        self.dtype, self.per_channel, self.bins = dtype, per_channel, bins
        self.workers, self.channel_sums = workers, channel_sums
        self.dims = [tirx.Var(f"d{i}", "int64") for i in range(3 if per_channel else 1)]
        self.n = functools.reduce(lambda a, b: a * b, self.dims, tirx.const(1, "int64"))
        self.work = "float64" if dtype == "float64" else "float32"  # min / max are exact in it
        self.big = tirx.const(_MAX_FINITE[dtype], self.work)
        self.inf = tirx.const(math.inf, self.work)
        self.zero = tirx.const(0.0, "float64")
        # 1. moments: chunks of CHUNK values, 16 lanes each, then a scalar tail
        self.groups = self.n // LANES
        self.per_chunk = CHUNK // LANES
        self.chunks = (self.groups + self.per_chunk - 1) // self.per_chunk
        # 3. histogram: blocks of _BLOCK values; bins, then the non-finite column, in whole vectors
        self.blocks = self.n // _BLOCK
        self.padded = (bins // LANES + 1) * LANES
        # 4. per-channel ranges over the [outer, C, inner] view, workers over `outer`
        one = tirx.const(1, "int64")
        self.outer, self.channels, self.inner = self.dims if per_channel else (one, one, one)
        self.c_workers = T.max(T.int64(1), T.min(T.int64(workers), self.outer))
        self.c_span = (self.outer + self.c_workers - 1) // self.c_workers
        self.c0 = HEADER + bins
        # per-channel sums and counts: (workers, channels) with channel_sums, a placeholder without
        self.summed = self.channels if channel_sums else one
        self.f_one = tirx.const(1.0, "float64")

    def value(self, flat, i):
        return T.Cast(self.work, flat[i])

    def wide(self, flat, i):
        return T.Cast("float64", flat[i])

    def finite(self, flat, i):
        return T.abs(self.value(flat, i)) <= self.big

    def finite_or(self, flat, i, other):
        # Select, not if_then_else: both sides are safe to compute, and it vectorises.
        return T.Select(self.finite(flat, i), self.value(flat, i), other)

    def bin_of(self, flat, i, scale, offset, narrow=False):
        """The histogram bin of element ``i`` (``bins``: the non-finite column)."""
        work = self.work
        if narrow:
            # In float32, where `_narrow_bins` holds: the offset, the bin numbers and 2**-e are
            # float32-exact, so is x * 2**-e unless it falls below float32's normal range,
            # where only a negative x's floor can be wrong (rounded to -0 instead of -1).
            scaled = T.floor(self.value(flat, i) * T.Cast(work, scale))
            low = T.Select(
                self.value(flat, i) < T.Cast(work, 0), T.min(scaled, T.Cast(work, -1)), scaled
            )
            number = T.Cast("int32", low - T.Cast(work, offset))
        else:
            number = T.Cast("int32", T.floor(self.wide(flat, i) * scale) - offset)
        return T.Select(self.finite(flat, i), number, T.int32(self.bins))


def _exponent_bits(x):
    """``frexp(x)[1] + 1022``: the biased exponent field of a normal float64."""
    return T.bitwise_and(T.shift_right(T.reinterpret("int64", x), 52), T.int64(0x7FF))


def _power_of_two(exponent):
    return T.reinterpret("float64", T.shift_left(T.int64(1023) + exponent, 52))


def _narrow_bins(exponent, offset, length):
    """Whether float32 computes the bin numbers exactly: 2**-e a normal float32, bin numbers
    (before the offset) integers of at most 24 bits."""
    return tirx.all(
        exponent >= -127,
        exponent <= 126,
        T.max(T.abs(offset), T.abs(offset + length)) <= T.float64(1 << 24),
    )


def _kernel(spec: _Spec, fast_moments, masked_moments, histogram, channel_ranges) -> tirx.PrimFunc:
    """The PrimFunc of the passes' macros: the moments (masked when a value is not finite),
    then the histogram and the per-channel ranges, into the output layout of the module doc."""
    dims, dtype, n, chunks = spec.dims, spec.dtype, spec.n, spec.chunks
    bins, per_channel, zero = spec.bins, spec.per_channel, spec.zero

    @T.prim_func(private=True, check_well_formed=False)  # the verifier predates s_tir blocks
    def kernel(x_handle: T.handle, out_handle: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8, "tirx.is_scheduled": True})
        x = T.match_buffer(x_handle, dims, dtype)
        length = T.int64()
        out = T.match_buffer(out_handle, (length,), "float64")
        # One opaque root block: Relax analyses expect a block-structured body.
        with T.sblock("root"):
            flat = T.decl_buffer((n,), dtype, data=x.data)
            part = T.alloc_buffer((T.max(chunks, 1), 6, LANES), "float64")
            out[0] = T.Cast("float64", n)
            if n >= _PARALLEL_MIN:
                fast_moments(flat, out, part, T.parallel)
            else:
                fast_moments(flat, out, part, T.serial)
            if not (T.isfinite(out[5]) and T.isfinite(out[6])):  # a NaN or inf somewhere
                masked_moments(flat, out, part, T.serial)
            for k in range(7, length):
                out[k] = zero
            if bins > 0 and out[1] + out[2] < out[0]:  # some finite value to count
                histogram(flat, out)
            if per_channel:
                channel_ranges(flat, out)

    return kernel


# --- 1. moments -----------------------------------------------------------------------------


def _chunk_moments(spec: _Spec, masked: bool):
    """The macro of pass 1 over whole chunks: each chunk's 16 lanes of min, max, sum, sum of
    squares (and, ``masked``, of finite values only, with NaN and inf counts) into ``part``."""
    work, inf, zero = spec.work, spec.inf, spec.zero
    chunks, groups, per_chunk = spec.chunks, spec.groups, spec.per_chunk
    value, wide, finite, finite_or = spec.value, spec.wide, spec.finite, spec.finite_or

    @T.macro
    def body(flat, part, loop):
        for c in loop(chunks):
            lo = T.alloc_buffer((LANES,), work)
            hi = T.alloc_buffer((LANES,), work)
            s = T.alloc_buffer((LANES,), "float64")
            q = T.alloc_buffer((LANES,), "float64")
            bad = T.alloc_buffer((2, LANES), "int32")  # NaN and inf counts
            for lane in T.vectorized(LANES):
                lo[lane] = inf
                hi[lane] = -inf
                s[lane] = zero
                q[lane] = zero
                bad[0, lane] = 0
                bad[1, lane] = 0
            for i in range(T.min(per_chunk, groups - c * per_chunk)):
                for lane in T.vectorized(LANES):
                    if masked:
                        lo[lane] = T.min(
                            lo[lane], finite_or(flat, c * CHUNK + i * LANES + lane, inf)
                        )
                        hi[lane] = T.max(
                            hi[lane], finite_or(flat, c * CHUNK + i * LANES + lane, -inf)
                        )
                        s[lane] = s[lane] + T.Select(
                            finite(flat, c * CHUNK + i * LANES + lane),
                            wide(flat, c * CHUNK + i * LANES + lane),
                            zero,
                        )
                        q[lane] = q[lane] + T.Select(
                            finite(flat, c * CHUNK + i * LANES + lane),
                            wide(flat, c * CHUNK + i * LANES + lane)
                            * wide(flat, c * CHUNK + i * LANES + lane),
                            zero,
                        )
                        bad[0, lane] = bad[0, lane] + T.Cast(
                            "int32", T.isnan(flat[c * CHUNK + i * LANES + lane])
                        )
                        bad[1, lane] = bad[1, lane] + T.Cast(
                            "int32", T.isinf(flat[c * CHUNK + i * LANES + lane])
                        )
                    else:
                        lo[lane] = T.min(lo[lane], value(flat, c * CHUNK + i * LANES + lane))
                        hi[lane] = T.max(hi[lane], value(flat, c * CHUNK + i * LANES + lane))
                        s[lane] = s[lane] + wide(flat, c * CHUNK + i * LANES + lane)
                        q[lane] = q[lane] + wide(flat, c * CHUNK + i * LANES + lane) * wide(
                            flat, c * CHUNK + i * LANES + lane
                        )
            for lane in T.vectorized(LANES):
                part[c, 0, lane] = T.Cast("float64", lo[lane])
                part[c, 1, lane] = T.Cast("float64", hi[lane])
                part[c, 2, lane] = s[lane]
                part[c, 3, lane] = q[lane]
                part[c, 4, lane] = T.Cast("float64", bad[0, lane])
                part[c, 5, lane] = T.Cast("float64", bad[1, lane])

    return body


def _moments(spec: _Spec, masked: bool):
    """The macro of pass 1: the chunks (:func:`_chunk_moments`), their lanes added in order into
    the header, then the scalar tail."""
    inf, zero, chunks, n, groups = spec.inf, spec.zero, spec.chunks, spec.n, spec.groups
    wide, finite = spec.wide, spec.finite
    chunk_moments = _chunk_moments(spec, masked)

    @T.macro
    def body(flat, out, part, loop):
        chunk_moments(flat, part, loop)
        for k in range(1, 7):
            out[k] = zero
        out[3] = T.Cast("float64", inf)
        out[4] = T.Cast("float64", -inf)
        for c, lane in T.grid(chunks, LANES):
            out[1] = out[1] + part[c, 4, lane]
            out[2] = out[2] + part[c, 5, lane]
            out[3] = T.min(out[3], part[c, 0, lane])
            out[4] = T.max(out[4], part[c, 1, lane])
            out[5] = out[5] + part[c, 2, lane]
            out[6] = out[6] + part[c, 3, lane]
        for i in range(groups * LANES, n):
            if finite(flat, i):
                out[3] = T.min(out[3], wide(flat, i))
                out[4] = T.max(out[4], wide(flat, i))
                out[5] = out[5] + wide(flat, i)
                out[6] = out[6] + wide(flat, i) * wide(flat, i)
            elif T.isnan(flat[i]):
                out[1] = out[1] + T.float64(1)
            else:
                out[2] = out[2] + T.float64(1)

    return body


# --- 2 and 3. canonical exponent, histogram -------------------------------------------------


def _count_bins(spec: _Spec):
    """The macro of pass 3's vector loop: bin indices a block at a time, counted into each
    worker's ``_SPREAD`` private copies."""
    padded, blocks, bin_of = spec.padded, spec.blocks, spec.bin_of

    @T.macro
    def count_bins(flat, counts, scale, offset, loop, count_workers, narrow):
        for w in loop(count_workers):
            index = T.alloc_buffer((_BLOCK,), "int32")
            for k, b0 in T.grid(_SPREAD, padded // LANES):
                for lane in T.vectorized(LANES):
                    counts[w, k, b0 * LANES + lane] = 0
            per_worker = (blocks + count_workers - 1) // count_workers
            for blk in range(w * per_worker, T.min(blocks, (w + 1) * per_worker)):
                for j0 in range(_BLOCK // LANES):
                    for lane in T.vectorized(LANES):
                        index[j0 * LANES + lane] = bin_of(
                            flat, blk * _BLOCK + j0 * LANES + lane, scale, offset, narrow
                        )
                for j0, k in T.grid(_BLOCK // _SPREAD, _SPREAD):
                    counts[w, k, index[j0 * _SPREAD + k]] += 1

    return count_bins


def _histogram(spec: _Spec):
    """The macro of passes 2 and 3: the canonical exponent, then the counts, merged."""
    bins, workers, padded, blocks, n = spec.bins, spec.workers, spec.padded, spec.blocks, spec.n
    work, zero, bin_of = spec.work, spec.zero, spec.bin_of
    exponent_bits, power_of_two, narrow_bins = _exponent_bits, _power_of_two, _narrow_bins
    count_bins = _count_bins(spec)

    @T.macro
    def histogram(flat, out):
        # canonical_exponent, on the bits (every value here is a normal float64)
        e = T.alloc_buffer((1,), "int64")
        e[0] = T.int64(MIN_EXPONENT)
        if T.max(T.abs(out[3]), T.abs(out[4])) > zero:
            e[0] = T.max(
                e[0],
                exponent_bits(T.max(T.abs(out[3]), T.abs(out[4]))) - (1022 + INDEX_BITS),
            )
        if out[4] - out[3] > zero:
            e[0] = T.max(e[0], exponent_bits((out[4] - out[3]) / T.float64(bins)) - 1023)
        for _ in range(4):  # the while loop, bounded: at most two steps from the first guess
            if T.floor(out[4] * power_of_two(-e[0])) - T.floor(
                out[3] * power_of_two(-e[0])
            ) >= T.float64(bins):
                e[0] = e[0] + T.int64(1)
        scale = power_of_two(-e[0])
        offset = T.floor(out[3] * scale)  # an integer below 2**53: exact as float64
        out[7] = T.Cast("float64", e[0])
        out[8] = offset
        out[9] = T.floor(out[4] * scale) - offset + T.float64(1)
        counts = T.alloc_buffer((workers, _SPREAD, padded), "int32")
        # float32 bin numbers: no widening, two thirds of the vector instructions of float64
        if work == "float32" and narrow_bins(e[0], offset, out[9]):
            if n >= _PARALLEL_HISTOGRAM:
                count_bins(flat, counts, scale, offset, T.parallel, workers, True)
            else:
                count_bins(flat, counts, scale, offset, T.serial, 1, True)
        elif n >= _PARALLEL_HISTOGRAM:
            count_bins(flat, counts, scale, offset, T.parallel, workers, False)
        else:
            count_bins(flat, counts, scale, offset, T.serial, 1, False)
        for i in range(blocks * _BLOCK, n):
            counts[0, 0, bin_of(flat, i, scale, offset)] += 1
        # the copies summed a vector of bins at a time (the last column holds non-finite values)
        total = T.alloc_buffer((LANES,), "int32")
        for b0 in range(padded // LANES):
            for lane in T.vectorized(LANES):
                total[lane] = 0
            for w, k in T.grid(T.if_then_else(n >= _PARALLEL_HISTOGRAM, workers, 1), _SPREAD):
                for lane in T.vectorized(LANES):
                    total[lane] = total[lane] + counts[w, k, b0 * LANES + lane]
            for lane in range(LANES):
                if b0 * LANES + lane < bins:
                    out[HEADER + b0 * LANES + lane] = T.Cast("float64", total[lane])

    return histogram


# --- 4. per-channel ranges ------------------------------------------------------------------


def _channel_rows(spec: _Spec):
    """The macro of pass 4 where channels are innermost: per block of rows, each group of
    ``lanes`` channels is reduced in registers."""
    work, inf, zero, f_one = spec.work, spec.inf, spec.zero, spec.f_one
    outer, channels, c_span, channel_sums = (
        spec.outer,
        spec.channels,
        spec.c_span,
        spec.channel_sums,
    )
    wide, finite, finite_or = spec.wide, spec.finite, spec.finite_or

    @T.macro
    def channel_rows(flat, lo, hi, sm, ct, w, lanes):
        for r0 in range((T.min(c_span, outer - w * c_span) + _ROWS - 1) // _ROWS):
            for g in range(channels // lanes):
                rlo = T.alloc_buffer((lanes,), work)
                rhi = T.alloc_buffer((lanes,), work)
                rsm = T.alloc_buffer((lanes,), "float64")
                rct = T.alloc_buffer((lanes,), "float64")
                for lane in T.vectorized(lanes):
                    rlo[lane] = lo[w, g * lanes + lane]
                    rhi[lane] = hi[w, g * lanes + lane]
                    if channel_sums:
                        rsm[lane] = sm[w, g * lanes + lane]
                        rct[lane] = ct[w, g * lanes + lane]
                for o in range(
                    w * c_span + r0 * _ROWS,
                    T.min(T.min(outer, (w + 1) * c_span), w * c_span + (r0 + 1) * _ROWS),
                ):
                    for lane in T.vectorized(lanes):
                        rlo[lane] = T.min(
                            rlo[lane], finite_or(flat, o * channels + g * lanes + lane, inf)
                        )
                        rhi[lane] = T.max(
                            rhi[lane], finite_or(flat, o * channels + g * lanes + lane, -inf)
                        )
                        if channel_sums:
                            rsm[lane] = rsm[lane] + T.Select(
                                finite(flat, o * channels + g * lanes + lane),
                                wide(flat, o * channels + g * lanes + lane),
                                zero,
                            )
                            rct[lane] = rct[lane] + T.Select(
                                finite(flat, o * channels + g * lanes + lane), f_one, zero
                            )
                for lane in T.vectorized(lanes):
                    lo[w, g * lanes + lane] = rlo[lane]
                    hi[w, g * lanes + lane] = rhi[lane]
                    if channel_sums:
                        sm[w, g * lanes + lane] = rsm[lane]
                        ct[w, g * lanes + lane] = rct[lane]

    return channel_rows


def _channel_worker(spec: _Spec):
    """The macro of pass 4 for one worker's rows: in registers (:func:`_channel_rows`) when the
    channels are innermost and fill whole vectors, else a scalar loop."""
    inf, zero, f_one, channel_sums = spec.inf, spec.zero, spec.f_one, spec.channel_sums
    outer, channels, inner, c_span = spec.outer, spec.channels, spec.inner, spec.c_span
    wide, finite, finite_or = spec.wide, spec.finite, spec.finite_or
    channel_rows = _channel_rows(spec)

    @T.macro
    def channel_worker(flat, lo, hi, sm, ct, w):
        for cc in range(channels):
            lo[w, cc] = inf
            hi[w, cc] = -inf
            if channel_sums:
                sm[w, cc] = zero
                ct[w, cc] = zero
        if inner == 1 and channels % LANES == 0:
            channel_rows(flat, lo, hi, sm, ct, w, LANES)
        elif inner == 1 and channels % 8 == 0:
            channel_rows(flat, lo, hi, sm, ct, w, 8)
        else:
            for o in range(w * c_span, T.min(outer, (w + 1) * c_span)):
                for cc, ii in T.grid(channels, inner):
                    lo[w, cc] = T.min(
                        lo[w, cc], finite_or(flat, (o * channels + cc) * inner + ii, inf)
                    )
                    hi[w, cc] = T.max(
                        hi[w, cc], finite_or(flat, (o * channels + cc) * inner + ii, -inf)
                    )
                    if channel_sums:
                        sm[w, cc] = sm[w, cc] + T.Select(
                            finite(flat, (o * channels + cc) * inner + ii),
                            wide(flat, (o * channels + cc) * inner + ii),
                            zero,
                        )
                        ct[w, cc] = ct[w, cc] + T.Select(
                            finite(flat, (o * channels + cc) * inner + ii), f_one, zero
                        )

    return channel_worker


def _channel_ranges(spec: _Spec):
    """The macro of pass 4: every worker's rows (:func:`_channel_worker`), merged in order."""
    work, inf, zero, n, channel_sums = spec.work, spec.inf, spec.zero, spec.n, spec.channel_sums
    channels, c_workers, c0, summed = spec.channels, spec.c_workers, spec.c0, spec.summed
    channel_worker = _channel_worker(spec)

    @T.macro
    def channel_ranges(flat, out):
        lo = T.alloc_buffer((c_workers, channels), work)
        hi = T.alloc_buffer((c_workers, channels), work)
        sm = T.alloc_buffer((c_workers, summed), "float64")
        ct = T.alloc_buffer((c_workers, summed), "float64")
        if n >= _PARALLEL_MIN:
            for w in T.parallel(c_workers):
                channel_worker(flat, lo, hi, sm, ct, w)
        else:
            for w in range(c_workers):
                channel_worker(flat, lo, hi, sm, ct, w)
        for cc in range(channels):
            out[c0 + cc] = T.Cast("float64", inf)
            out[c0 + channels + cc] = T.Cast("float64", -inf)
            for w in range(c_workers):
                out[c0 + cc] = T.min(out[c0 + cc], T.Cast("float64", lo[w, cc]))
                out[c0 + channels + cc] = T.max(
                    out[c0 + channels + cc], T.Cast("float64", hi[w, cc])
                )
            if channel_sums:
                out[c0 + 2 * channels + cc] = zero
                out[c0 + 3 * channels + cc] = zero
                for w in range(c_workers):
                    out[c0 + 2 * channels + cc] = out[c0 + 2 * channels + cc] + sm[w, cc]
                    out[c0 + 3 * channels + cc] = out[c0 + 3 * channels + cc] + ct[w, cc]

    return channel_ranges


def decode(
    vector: np.ndarray, bins: int, channel_axis: int | None, channel_sums: bool = False
) -> TensorStats:
    """The :class:`TensorStats` in a kernel's output vector (``bins`` and ``channel_sums`` as
    the kernel computed them); per-channel ranges, when the kernel computed them, are recorded
    under ``channel_axis``, the axis in the initial IR's layout."""
    head = vector[:HEADER].tolist()  # Python floats: cheaper than numpy scalars one by one
    count, nans, infs = int(head[0]), int(head[1]), int(head[2])
    if nans + infs == count:
        return TensorStats(count=count, nan_count=nans, inf_count=infs)
    histogram = None
    if bins:
        exponent, offset, length = int(head[7]), int(head[8]), int(head[9])
        counts = vector[HEADER : HEADER + length].astype(np.int64)
        histogram = Histogram(bins, exponent, offset, counts)
    per_channel = None
    if len(vector) > HEADER + bins:
        per_channel = _channel_record(vector[HEADER + bins :], channel_axis, channel_sums)
    return TensorStats(
        count=count,
        nan_count=nans,
        inf_count=infs,
        min=head[3],
        max=head[4],
        sum=saturated_units(head[5]),
        sum_sq=saturated_units(head[6]),
        histogram=histogram,
        per_channel=per_channel,
    )


def _channel_record(values: np.ndarray, axis: int, channel_sums: bool) -> ChannelRange:
    """The per-channel part of a kernel's output vector (or of :class:`Totals`' running one)."""
    rows = values.reshape(_per_channel_values(channel_sums), -1)
    # A channel without finite values keeps the kernel's infinite start: NaN here.
    lo, hi = (np.where(np.isinf(r), np.nan, r) for r in rows[:2])
    if not channel_sums:
        return ChannelRange(axis, lo, hi)
    sums = tuple(units_of(rows[2]))
    return ChannelRange(axis, lo, hi, sums, tuple(int(c) for c in rows[3].tolist()))


class Totals:
    """The running statistics of one tensor over its kernel vectors, run after run.

    Equal, bit for bit, to decoding every vector and merging the records in order (the exact
    merge of :class:`TensorStats`), at a fraction of the cost: once the range has settled, a run
    adds its counts in place, and nothing is built per run. Counts add as float64, exact below
    2**53 values, and become integers once, in :meth:`stats`.
    """

    def __init__(self, bins: int, channel_axis: int | None, channel_sums: bool = False):
        self.bins, self.channel_axis, self.channel_sums = bins, channel_axis, channel_sums
        self.count = self.nan_count = self.inf_count = self.sum = self.sum_sq = 0
        self.min: float | None = None  # None until a run has a finite value
        self.max: float | None = None
        self.exponent = self.offset = 0
        self.counts: np.ndarray | None = None  # bins of 2**exponent from offset
        self.lo: np.ndarray | None = None  # per channel; infinite: no finite value yet
        self.hi: np.ndarray | None = None
        self.sums: list[int] | None = None  # per channel, exact (with channel_sums)
        self.finite: np.ndarray | None = None  # per channel, counts as float64

    def add(self, vector: np.ndarray) -> None:
        """Adds one run's kernel output vector (``bins`` and ``channel_sums`` as this total was
        made for)."""
        head = vector[:HEADER].tolist()  # Python floats: cheaper than numpy scalars one by one
        count, nans, infs = int(head[0]), int(head[1]), int(head[2])
        self.count += count
        self.nan_count += nans
        self.inf_count += infs
        if nans + infs == count:
            return
        self.sum += saturated_units(head[5])
        self.sum_sq += saturated_units(head[6])
        c0 = HEADER + self.bins
        rows = vector[c0:].reshape(_per_channel_values(self.channel_sums), -1)
        channels = rows.shape[1]
        if self.min is None:
            self.min, self.max = head[3], head[4]
            if self.bins:
                self.exponent, self.offset = int(head[7]), int(head[8])
                self.counts = vector[HEADER : HEADER + int(head[9])].copy()
            if channels:
                self.lo, self.hi = rows[0].copy(), rows[1].copy()
                if self.channel_sums:
                    self.sums = units_of(rows[2])
                    self.finite = rows[3].copy()
            return
        # The same operations, in the same order, as TensorStats.merge (signed zeros included).
        vmin, vmax = min(self.min, head[3]), max(self.max, head[4])
        if self.bins:
            exponent, offset = int(head[7]), int(head[8])
            counts = vector[HEADER : HEADER + int(head[9])]
            if vmin != self.min or vmax != self.max:  # a wider range: re-bin to its exponent
                self._rebin(canonical_exponent(vmin, vmax, self.bins), vmin, vmax)
            if exponent == self.exponent:  # the common case once the range has settled
                start = offset - self.offset
                self.counts[start : start + len(counts)] += counts
            else:
                _add_rebinned(self.counts, self.exponent, self.offset, counts, exponent, offset)
        self.min, self.max = vmin, vmax
        if channels:
            np.fmin(self.lo, rows[0], out=self.lo)
            np.fmax(self.hi, rows[1], out=self.hi)
            if self.channel_sums:
                self.sums = list(map(operator.add, self.sums, units_of(rows[2])))
                self.finite += rows[3]

    def _rebin(self, exponent: int, vmin: float, vmax: float) -> None:
        offset = math.floor(math.ldexp(vmin, -exponent))
        total = np.zeros(math.floor(math.ldexp(vmax, -exponent)) - offset + 1)
        _add_rebinned(total, exponent, offset, self.counts, self.exponent, self.offset)
        self.exponent, self.offset, self.counts = exponent, offset, total

    def stats(self) -> TensorStats:
        """The merged record of every run added so far."""
        if self.min is None:
            return TensorStats(count=self.count, nan_count=self.nan_count, inf_count=self.inf_count)
        histogram = None
        if self.counts is not None:
            counts = self.counts.astype(np.int64)
            histogram = Histogram(self.bins, self.exponent, self.offset, counts)
        per_channel = None
        if self.lo is not None:
            # A channel without finite values keeps the kernel's infinite start: NaN here.
            lo, hi = (np.where(np.isinf(r), np.nan, r) for r in (self.lo, self.hi))
            sums = counts = None
            if self.channel_sums:
                sums, counts = tuple(self.sums), tuple(int(c) for c in self.finite.tolist())
            per_channel = ChannelRange(self.channel_axis, lo, hi, sums, counts)
        return TensorStats(
            count=self.count,
            nan_count=self.nan_count,
            inf_count=self.inf_count,
            min=self.min,
            max=self.max,
            sum=self.sum,
            sum_sq=self.sum_sq,
            histogram=histogram,
            per_channel=per_channel,
        )


def _add_rebinned(
    total: np.ndarray, exponent: int, offset: int, counts: np.ndarray, finer: int, first: int
) -> None:
    """Adds ``counts`` (bins of ``2**finer`` from ``first``) to ``total`` (bins of the coarser
    ``2**exponent`` from ``offset``): bin ``i`` goes to ``i >> (exponent - finer)``."""
    index = ((np.arange(len(counts), dtype=np.int64) + first) >> (exponent - finer)) - offset
    total += np.bincount(index, weights=counts, minlength=len(total))
