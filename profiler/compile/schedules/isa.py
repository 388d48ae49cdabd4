"""The vector unit the schedules tile for, read from the build target.

Register tiles must fit the register file: an AVX-512 core holds 32 registers of 16 float32
lanes, an AVX2 core 16 of 8 (the same tile there spills every accumulator: 4× slower, measured
on a Zen 3 EPYC), NEON 32 of 4. Rules ask :func:`vector_unit` inside the build (the target is
the current one), and legalizations pack weights for the same unit. The integer dot-product
instructions are the targets' (:mod:`rangeprof.byoc.cpu.isa`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import tvm

from rangeprof.profiler.compile.schedules.elementwise import largest_divisor


@dataclass(frozen=True)
class VectorUnit:
    lanes: int  # float32 lanes per register
    registers: int

    @property
    def accumulators(self) -> int:
        """Registers a register tile may hold; the rest feed the FMAs (weights, broadcasts)."""
        return self.registers * 3 // 4

    def tile(self, extent: int, block: int) -> int:
        """Rows of a ``rows × block`` register tile: the largest divisor of ``extent`` whose
        rows of ``block`` float32 lanes fit the accumulators (a divisor: no tail predicate)."""
        return largest_divisor(extent, self.accumulators // math.ceil(block / self.lanes))


_AVX512 = VectorUnit(16, 32)
_AVX2 = VectorUnit(8, 16)
_NEON = VectorUnit(4, 32)
_SSE = VectorUnit(4, 16)


def vector_unit(target: tvm.target.Target | None = None) -> VectorUnit:
    """The vector unit of ``target`` (default: the current target)."""
    target = target or tvm.target.Target.current()
    if target is None or str(target.kind) != "llvm":
        return _SSE
    triple = str(target.attrs.get("mtriple", ""))
    if triple.startswith(("aarch64", "arm64")):
        return _NEON
    has = tvm.target.codegen.target_has_features
    if has("avx512f", target):
        return _AVX512
    if has("avx2", target):
        return _AVX2
    return _SSE
