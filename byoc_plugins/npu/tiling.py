"""Tiling an NPU operation to the on-chip buffer.

The NPU computes only out of its on-chip buffer ("SRAM"): for each tile, DMA copies the tile's
operands in, the compute array works on them there, and DMA copies the results back out. A tile
is a block of **output channels** (conv2d) / columns (matmul) by a block of **output rows**
(conv2d: rows of the output image, per image; matmul: rows of ``x``), and the buffer holds, at
once, for the largest tile:

============  ===============================================  =====================================
section       conv2d (``tc`` channels × ``tr`` rows)           matmul (``tc`` columns × ``tr`` rows)
============  ===============================================  =====================================
accumulators  ``4 · OW`` (one output row, int32)               — (one dot product at a time)
params        ``9 · tc`` (bias, M: int32; shift: uint8)        ``9 · tc``
weights       ``tc · C/groups · KH · KW``                      ``K · tc``
input         ``cin · ((tr−1)·sh + (KH−1)·dh + 1) · Wp · ex``  ``tr · K · ex``
output        ``tc · tr · OW · ey``                            ``tr · tc · ey``
============  ===============================================  =====================================

where ``cin`` is the input channels of the groups the channel block covers, ``Wp = (OW−1)·sw
+ (KW−1)·dw + 1`` the width of the padded window (the DMA writes the padding, with the input's
zero point, while it copies) and ``ex`` / ``ey`` the bytes of an input / output element: 1 for
8 bits, 2 for the int16 layers. The sections lie back to back in that order, so the int32 ones
come first, aligned; in an int16 region each section is rounded up to an even size, so that the
int16 ones are aligned too (the compiler may vectorise on that alignment).

**The rule**: the most output channels whose tile fits with one output row, then the most
output rows that fit with them. Channels come first because the weights then stay in the
buffer for every row tile of their block (each weight byte is copied in once per image) and
the input is read once per channel block. For grouped convolutions a channel block never
straddles a group boundary (it lies in one group or covers whole groups), so it needs the input
channels of its own groups only. An operation whose single-channel, single-row tile does not
fit is an error that says how much buffer it needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rangeprof.profiler.errors import RangeprofError

from .core import Conv2dOp, MatmulOp, NpuOp

PARAM_BYTES = 9  # per output channel: int32 bias, int32 multiplier, uint8 shift


@dataclass(frozen=True)
class TilePlan:
    """How one region is cut into tiles, and where each operand sits in the buffer."""

    symbol: str
    op: str  # "conv2d" | "matmul"
    sram_bytes: int
    channels: int  # output channels (columns) per tile
    rows: int  # output rows per tile
    channel_tiles: int
    row_tiles: int
    images: int  # the channel × row grid repeats per image (conv2d batch)
    sections: dict[str, int]  # bytes of each section for the largest tile, in buffer order

    @property
    def tiles(self) -> int:
        return self.images * self.channel_tiles * self.row_tiles

    @property
    def footprint(self) -> int:
        return sum(self.sections.values())

    def offset(self, section: str) -> int:
        """Byte offset of ``section`` in the buffer (the sections lie back to back)."""
        names = list(self.sections)
        return sum(self.sections[s] for s in names[: names.index(section)])

    def to_json(self) -> dict:
        return {
            "symbol": self.symbol,
            "op": self.op,
            "sram_bytes": self.sram_bytes,
            "tile": {"channels": self.channels, "rows": self.rows},
            "grid": {
                "images": self.images,
                "channel_tiles": self.channel_tiles,
                "row_tiles": self.row_tiles,
            },
            "tiles": self.tiles,
            "footprint_bytes": self.footprint,
            "sections": dict(self.sections),
        }

    def describe(self) -> str:
        """The plan in a few lines (the comment above the region's code)."""
        parts = ", ".join(f"{name} {size}" for name, size in self.sections.items())
        return (
            f"tile plan: {self.channels} output channels x {self.rows} output rows per tile; "
            f"{self.images} x {self.channel_tiles} x {self.row_tiles} = {self.tiles} tiles "
            f"(images x channel blocks x row blocks)\n"
            f"buffer: {self.footprint} of {self.sram_bytes} bytes ({parts})"
        )


def _bytes(dtype: str) -> int:
    """Bytes of one element of an operand of type ``dtype`` in the buffer."""
    return np.dtype(dtype).itemsize


def _largest(limit: int, fits: Callable[[int], bool]) -> int:
    """The largest ``t`` in ``[1, limit]`` with ``fits(t)`` (monotone), given ``fits(1)``."""
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _plan(
    op: NpuOp,
    kind: str,
    sram: int,
    channels: int,
    rows: int,
    candidates: list[int],
    sections: Callable[[int, int], dict[str, int]],
    images: int,
) -> TilePlan:
    align = max(_bytes(op.in_dtype), _bytes(op.out_dtype))

    def aligned(tc: int, tr: int) -> dict[str, int]:
        return {name: -(-size // align) * align for name, size in sections(tc, tr).items()}

    def fits(tc: int, tr: int) -> bool:
        return sum(aligned(tc, tr).values()) <= sram

    tc = next((c for c in candidates if fits(c, 1)), None)
    if tc is None:
        need = sum(aligned(candidates[-1], 1).values())
        raise RangeprofError(
            f"npu: region {op.symbol} needs {need} bytes of on-chip buffer for its smallest tile "
            f"(1 output channel x 1 output row); the buffer has {sram} "
            "(raise sram_kb / RANGEPROF_NPU_SRAM_KB)"
        )
    tr = _largest(rows, lambda t: fits(tc, t))
    return TilePlan(
        symbol=op.symbol,
        op=kind,
        sram_bytes=sram,
        channels=tc,
        rows=tr,
        channel_tiles=math.ceil(channels / tc),
        row_tiles=math.ceil(rows / tr),
        images=images,
        sections=aligned(tc, tr),
    )


def conv2d_input_channels(op: Conv2dOp, tc: int) -> int:
    """Input channels a block of ``tc`` output channels reads (a straddle-free block)."""
    groups = op.groups
    per_group = op.out_shape[1] // groups
    in_per_group = op.in_shape[1] // groups
    return in_per_group * max(1, tc // per_group)


def window_width(op: Conv2dOp) -> int:
    """Columns of the padded input window (all the output row's taps)."""
    return (op.out_shape[3] - 1) * op.strides[1] + (op.weight.shape[3] - 1) * op.dilation[1] + 1


def window_rows(op: Conv2dOp, tr: int) -> int:
    """Rows of the padded input window behind ``tr`` output rows."""
    return (tr - 1) * op.strides[0] + (op.weight.shape[2] - 1) * op.dilation[0] + 1


def _plan_conv2d(op: Conv2dOp, sram: int) -> TilePlan:
    n, k, oh, ow = op.out_shape
    per_group = k // op.groups
    taps = op.weight[0].size
    ex, ey = _bytes(op.in_dtype), _bytes(op.out_dtype)
    # Blocks lie inside one group or cover whole groups (only whole groups when groups == 1).
    candidates = [
        c for c in range(k, 0, -1) if op.groups == 1 or per_group % c == 0 or c % per_group == 0
    ]

    def sections(tc: int, tr: int) -> dict[str, int]:
        cin = conv2d_input_channels(op, tc)
        return {
            "accumulators": 4 * ow,
            "params": PARAM_BYTES * tc,
            "weights": tc * taps,
            "input": cin * window_rows(op, tr) * window_width(op) * ex,
            "output": tc * tr * ow * ey,
        }

    return _plan(op, "conv2d", sram, k, oh, candidates, sections, n)


def _plan_matmul(op: MatmulOp, sram: int) -> TilePlan:
    depth, cols = op.weight.shape
    ex, ey = _bytes(op.in_dtype), _bytes(op.out_dtype)

    def sections(tc: int, tr: int) -> dict[str, int]:
        return {
            "params": PARAM_BYTES * tc,
            "weights": depth * tc,
            "input": tr * depth * ex,
            "output": tr * tc * ey,
        }

    return _plan(op, "matmul", sram, cols, op.rows, list(range(cols, 0, -1)), sections, 1)


def plan_tiles(op: NpuOp, sram_bytes: int) -> TilePlan:
    """The tile plan of ``op`` for a buffer of ``sram_bytes`` (the rule: module docstring)."""
    if isinstance(op, Conv2dOp):
        return _plan_conv2d(op, sram_bytes)
    return _plan_matmul(op, sram_bytes)
