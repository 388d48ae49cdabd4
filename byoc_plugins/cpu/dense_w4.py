"""Weight-only 4-bit dense: float32 activations × 4-bit weights decoded inside the kernel.

:func:`emit_dense_w4` writes ``out[…, n] = Σ_k x[…, k] · W[k, n] (+ bias[n])`` with
``W[k, n] = s[k // g, n] · (q[k, n] − z[k // g, n])`` as one ``call_tir`` whose constants are the
packed nibbles and the group scales (and zero points): the decode is a stage of the kernel,
never a Relax op, which ``FoldConstant`` would fold back into an FP32 weight (and the library
would be as large as the FP32 one).

Layout, packed in numpy at build time for blocks of ``nb`` output columns (two vectors of the
target's float32 lanes where they divide ``N``, else one, ``N`` then padded with zero-scale
columns): nibbles as uint32 words ``[N/nb, ⌈K/8⌉, nb]``, rows ``8p … 8p + 7`` of a column in
one word (row ``8p + r`` in bits ``4r … 4r + 3``), so that decoding a row of a block is one
contiguous vector load and a shift by a constant; scales ``[N/nb, G, nb]`` float32 and, when
asymmetric, the zero points alike as floats ``2^23 + z`` (symmetric: the literal ``2^23 + 8``).
A nibble becomes a float by its bits (``2^23`` has an empty mantissa: OR-ing the nibble in gives
``2^23 + q`` exactly), so a weight is shift, and-or, subtract, multiply: four vector
instructions per vector of weights, no widening or conversion, bit-exact ``s · (q − z)``.

Schedule (:func:`schedule_dense_w4`), loops ``rows, n, k``: ``parallel`` over the column blocks;
in each, the block's ``K × nb`` weights decoded once into a local buffer (the 8 rows of a word
unrolled, lanes vectorised), then the FP32 dense's register tile (:mod:`.dense`) over every row:
``Tm`` rows unrolled × ``nb`` lanes vectorised, the reduction outside them, each step
broadcasting ``Tm`` activations against one decoded row (AVX-512: 8 × 32, 16 ``vfmadd231ps``
on ``zmm`` per step). The decode is one pass over the weights per call, shared by all rows, and
the decoded block (``K = 256``: 32 KiB) stays in L1 while the FP32 kernel rereads its packed
weights for each row tile: on an Emerald Rapids core, at char_gpt's shapes (128 rows), the
kernel ran 0.95–1.0× the time of our FP32 dense, single-threaded (``benchmarks/dense_w4.py``).
With 8-bit activations the same weights go through the integer dot product instead
(:mod:`.dense_w4a8`).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, s_tir, te, tirx

from rangeprof.profiler.compile.schedules.conv2d import find_block
from rangeprof.profiler.compile.schedules.dense import PARALLEL_MACS, first_columns
from rangeprof.profiler.compile.schedules.elementwise import (
    extent,
    inline_epilogue,
    unroll_vectorize_tile,
)
from rangeprof.profiler.compile.schedules.isa import vector_unit
from rangeprof.profiler.compile.schedules.pipeline import host_target
from rangeprof.profiler.errors import RangeprofError

DENSE = "dense_w4"
DECODE = "dense_w4_decode"
BIAS = "dense_w4_bias"
SYMMETRIC_ZERO = 8  # the zero point of symmetric 4-bit weights
NIBBLES = 8  # rows per uint32 word
_MAGIC = 0x4B000000  # the bits of float32 2^23
_TWO_23 = float(2**23)


def decode(packed, scales, offsets, group_size: int):
    """``W[n / nb, k, n % nb] = ((2^23 + q) − (2^23 + z)) · s`` for the ``8·⌈K/8⌉`` rows of
    the packed words (the difference of two floats in [2^23, 2^23 + 16) is exact)."""
    blocks, words, nb = (int(d) for d in packed.shape)

    def weight(b, k, j):
        shift = ((k % NIBBLES) * 4).astype("uint32")
        nibble = tirx.bitwise_and(tirx.shift_right(packed[b, k // NIBBLES, j], shift), 15)
        value = tirx.reinterpret("float32", tirx.bitwise_or(nibble, tirx.const(_MAGIC, "uint32")))
        group = k // group_size
        offset = _TWO_23 + SYMMETRIC_ZERO if offsets is None else offsets[b, group, j]
        return (value - offset) * scales[b, group, j]

    return te.compute((blocks, words * NIBBLES, nb), weight, name=DECODE)


def dense_w4(data, packed, scales, *rest, group_size: int, columns: int, asymmetric: bool):
    """``out[…, n] = Σ_k x[…, k] · decode(W)[n / nb, k, n % nb]`` (+ bias) for ``n <
    columns``; ``rest``: the zero points' offsets when ``asymmetric``, then the bias if any."""
    offsets, *bias = rest if asymmetric else (None, *rest)
    w = decode(packed, scales, offsets, group_size)
    blocks, _, nb = (int(d) for d in w.shape)
    k = te.reduce_axis((0, int(data.shape[-1])), "k")
    out = te.compute(
        (*data.shape[:-1], blocks * nb),
        lambda *idx: te.sum(data[(*idx[:-1], k)] * w[idx[-1] // nb, k, idx[-1] % nb], axis=k),
        name=DENSE,
    )
    if bias:
        out = te.compute(out.shape, lambda *idx: out[idx] + bias[0][idx[-1]], name=BIAS)
    return out if blocks * nb == columns else first_columns(out, columns)


def column_block(n: int, lanes: int) -> int:
    """Output columns per packed block: two vectors of ``lanes`` where they divide ``n``, else
    one."""
    return 2 * lanes if n % (2 * lanes) == 0 else lanes


def blocked(a: np.ndarray, nb: int) -> np.ndarray:
    """``[R, N]`` → ``[N/nb, R, nb]`` (``N`` padded with zeros to a multiple of ``nb``)."""
    a = np.pad(a, ((0, 0), (0, -a.shape[1] % nb)))
    rows, n = a.shape
    return np.ascontiguousarray(a.reshape(rows, n // nb, nb).transpose(1, 0, 2))


def padded_columns(values, nb: int) -> np.ndarray:
    """A value per column ``[N]`` as float32, padded with zeros to a multiple of ``nb``."""
    values = np.asarray(values, np.float32)
    return np.pad(values, (0, -values.size % nb))


def pack(q: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, nb: int) -> list:
    """The kernel's constants (module docstring): words, scales, and the zero points' offsets
    when asymmetric; padding columns have scale 0, so they decode to zero."""
    q = np.pad(q.astype(np.uint32), ((0, -q.shape[0] % NIBBLES), (0, 0)))
    words = np.zeros((q.shape[0] // NIBBLES, q.shape[1]), np.uint32)
    for r in range(NIBBLES):
        words |= q[r::NIBBLES] << np.uint32(4 * r)
    out = [blocked(words, nb), blocked(scales.astype(np.float32), nb)]
    if zero_points is not None:
        out.append(blocked(_TWO_23 + zero_points.astype(np.float32), nb))
    return out


def check_operands(data: relax.Expr, q, scales, zero_points, group_size: int, bias) -> None:
    """One-line errors for operands that do not describe a 4-bit dense of ``data``."""
    shape = data.ty.shape.values if data.ty.shape is not None else []
    k_dim = int(shape[-1]) if shape and isinstance(shape[-1], tirx.IntImm) else None
    groups = math.ceil(q.shape[0] / group_size) if group_size > 0 and q.ndim == 2 else None
    problems = [
        (len(shape) < 2 or k_dim is None, "activations are not [..., M, K] with a known K"),
        (q.ndim != 2 or k_dim != q.shape[0], f"weights {q.shape} are not [K={k_dim}, N]"),
        (group_size <= 0, f"group size {group_size} is not positive"),
        (q.size and int(q.max()) > 15, "weights hold values above 15"),
        (scales.shape != (groups, q.shape[-1]), f"scales {scales.shape} are not [{groups}, N]"),
        (
            zero_points is not None
            and (np.shape(zero_points) != scales.shape or int(np.max(zero_points)) > 15),
            f"zero points are not 4-bit values shaped {scales.shape}",
        ),
        (bias is not None and np.shape(bias) != (q.shape[-1],), "bias is not [N]"),
    ]
    for failed, message in problems:
        if failed:
            raise RangeprofError(f"4-bit dense: {message}")


def emit_dense_w4(
    bb: relax.BlockBuilder,
    data: relax.Expr,
    q: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    group_size: int,
    bias: np.ndarray | None = None,
    target: tvm.target.Target | None = None,
) -> relax.Expr:
    """``data[…, K] @ W (+ bias)`` as one ``dense_w4`` kernel on packed 4-bit constants (see
    the module docstring): ``q`` uint8 ``[K, N]`` nibbles, ``scales`` float32 ``[⌈K/g⌉, N]``,
    ``zero_points`` uint8 like ``scales`` or None (symmetric: 8). Packed for the vector unit of
    ``target`` (the build's CPU; default: the current target, else this machine's)."""
    q, scales = np.asarray(q), np.asarray(scales)
    check_operands(data, q, scales, zero_points, group_size, bias)
    n = q.shape[1]
    unit = vector_unit(target or tvm.target.Target.current(allow_none=True) or host_target())
    nb = column_block(n, unit.lanes)
    constants = pack(q, scales, None if zero_points is None else np.asarray(zero_points), nb)
    if bias is not None:
        constants.append(padded_columns(bias, nb))
    return bb.call_te(
        dense_w4,
        data,
        *(relax.const(c) for c in constants),
        group_size=group_size,
        columns=n,
        asymmetric=zero_points is not None,
        primfunc_name_hint=DENSE,
    )


def static_loops(sch: s_tir.Schedule, loops) -> bool:
    """Whether every loop's extent is known at build time."""
    return all(isinstance(sch.get(loop).extent, tirx.IntImm) for loop in loops)


def schedule_dense_w4(sch: s_tir.Schedule) -> bool:
    """Schedules a PrimFunc holding ``dense_w4``; False when there is none (or its rows are
    known at run time only: the generic schedule then keeps it correct)."""
    block = find_block(sch, DENSE)
    if block is None or not static_loops(sch, sch.get_loops(block)):
        return False
    decoded = find_block(sch, DECODE)
    *rows, n, k = sch.get_loops(block)
    m = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    nb = int(sch.get(decoded).writes[0].source.shape[-1])
    tile = vector_unit().tile(extent(sch, m), nb)
    work = extent(sch, m) * extent(sch, n) * extent(sch, k)

    out = inline_epilogue(sch, block, keep=(DECODE,))
    no, ni = sch.split(n, [None, nb])
    mo, mi = sch.split(m, [None, tile])
    sch.reorder(no, mo, k, mi, ni)
    if work >= PARALLEL_MACS:
        sch.parallel(no)
    sch.compute_at(decoded, no)
    sch.reverse_compute_at(out, mo)
    sch.set_scope(block, 0, "local")
    sch.set_scope(decoded, 0, "local")
    sch.unroll(mi)
    sch.vectorize(ni)
    init = sch.decompose_reduction(block, k)
    unroll_vectorize_tile(sch, init, out)
    *_, word_rows, lanes = sch.get_loops(decoded)
    sch.unroll(sch.split(word_rows, [None, NIBBLES])[1])  # the shift a constant per row
    sch.vectorize(lanes)
    return True
