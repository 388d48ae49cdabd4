"""The integer dot-product instructions the CPU kernels are built around, and the choice a
plugin makes among them for its target (:class:`Isa`: x86's in :mod:`rangeprof.byoc.x86.isa`,
aarch64's in :mod:`rangeprof.byoc.aarch64.isa`).

Each kernel is built around one instruction (:class:`DotInstruction`): AVX-512 VNNI
``vpdpbusd`` (u8 × s8, 4 products per int32 lane), NEON ``sdot`` (s8 × s8), and on AVX2 either
``vpmaddubsw`` + ``vpmaddwd`` (u8 × s8, 4 products per lane, exact only for weights within ±64:
7-bit weights) or ``vpmaddwd`` alone (int16 pairs, exact for every int8 weight).

int16 activations (the quantizer's fallback for layers too sensitive for 8 bits, symmetric)
fit no 8-bit product: :meth:`Isa.dot` gives them the target's int16 pairs, the instructions
depthwise convs pair their taps with (:meth:`Isa.pair`: AVX-512 VNNI ``vpdpwssd``, AVX-512 BW
or AVX2 ``vpmaddwd``), exact for every int8 weight (a pair sums at most 2 · 32768 · 128 < 2^31)
and read without any conversion. Their lanes (16 or 8) must divide the output channels. NEON
has none (``sdot`` is 8-bit only): there int16 dense convs and matmuls keep TVM's
legalization, correct but slow (on a Zen 3 EPYC 2–25× slower than the pairs); depthwise convs
take the widening multiply-add kernel, as 8-bit ones do.

Kernels name their instruction by its intrinsic (a block annotation, a TE attribute):
:data:`DOT_INSTRUCTIONS` holds every instruction by that name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tvm
from tvm import tirx

from rangeprof.profiler.compile.schedules.elementwise import largest_divisor


@dataclass(frozen=True)
class DotInstruction:
    """An integer dot-product instruction: ``lanes`` int32 accumulators, each adding ``depth``
    products of a group of activations (one broadcast to every lane, or one per lane) with
    ``lanes × depth`` packed weights.

    Activations are read as ``data_dtype`` and weights as ``weight_dtype``: legalizations
    convert activations (and pack weights) to these types, exactly (see :meth:`data_offset`).
    """

    intrinsic: str  # LLVM intrinsic name, called through T.call_llvm_pure_intrin
    lanes: int
    depth: int
    data_dtype: str
    weight_dtype: str
    accumulates: bool  # the instruction adds into its first operand (else: acc + result)
    registers: int  # vector registers of the target, for the register tile
    # Largest |weight| for which the instruction is exact (an int8 weight is at most 128).
    max_weight: int = 128
    # An instruction that widens the result's int16 pair sums into int32 lanes (multiplying
    # them by ones), when the first one leaves int16.
    widen: str = ""

    def data_offset(self, dtype: str) -> int:
        """What to add to ``dtype`` activations to bring them into ``data_dtype`` exactly:
        ±128 flips int8 and uint8 (the accumulator is corrected by ``-offset · Σw``)."""
        if dtype == "int8" and self.data_dtype == "uint8":
            return 128
        if dtype == "uint8" and self.data_dtype == "int8":
            return -128
        return 0

    def tile(self, extent: int, block: int) -> int:
        """Rows of a ``rows × block`` int32 register tile (as :meth:`VectorUnit.tile`)."""
        return largest_divisor(extent, self.registers * 3 // 4 // (block // self.lanes))

    def call(self, acc, data, weight):
        """``acc + dot(data, weight)`` on vectors: ``acc`` int32 × lanes, ``weight``
        ``lanes × depth`` packed weights, ``data`` either the ``depth`` activations of one
        group (broadcast to every lane: a conv's input channels) or the bits of
        ``lanes × depth`` of them (one group per lane: a depthwise conv's taps)."""
        width = self.lanes * self.depth
        loaded = tvm.runtime.DataType(str(data.ty.dtype))
        if loaded.bits * loaded.lanes == 8 * self.depth * _bytes(self.data_dtype):
            word = tirx.reinterpret(f"int{8 * self.depth * _bytes(self.data_dtype)}", data)
            data = tirx.Broadcast(word, self.lanes)
        # LLVM types the operands without signedness: int8 vectors for u8 and s8 alike.
        data_vec = tirx.reinterpret(f"int{8 * _bytes(self.data_dtype)}x{width}", data)
        weight_vec = tirx.reinterpret(f"int{8 * _bytes(self.weight_dtype)}x{width}", weight)
        out = f"int32x{self.lanes}"
        if self.widen:
            pairs = f"int16x{2 * self.lanes}"
            sums = tirx.call_llvm_pure_intrin(pairs, self.intrinsic, data_vec, weight_vec)
            ones = tirx.Broadcast(tirx.const(1, "int16"), 2 * self.lanes)
            return acc + tirx.call_llvm_pure_intrin(out, self.widen, sums, ones)
        if self.accumulates:
            return tirx.call_llvm_pure_intrin(out, self.intrinsic, acc, data_vec, weight_vec)
        return acc + tirx.call_llvm_pure_intrin(out, self.intrinsic, data_vec, weight_vec)


def _bytes(dtype: str) -> int:
    return tvm.runtime.DataType(dtype).bits // 8


# Widest first: a rule takes the first whose lanes divide the output channels.
VNNI = (
    DotInstruction("llvm.x86.avx512.vpdpbusd.512", 16, 4, "uint8", "int8", True, 32),
    DotInstruction("llvm.x86.avx512.vpdpbusd.256", 8, 4, "uint8", "int8", True, 32),
)
# No 8-bit dot product on AVX2. vpmaddubsw adds u8·s8 pairs into int16 with saturation: exact
# while |w| <= 64 (255·64·2 = 32640), then vpmaddwd by ones widens the pair sums to int32 (MLAS's
# kernel, which saturates on full-range weights). vpmaddwd on int16 pairs is exact for any int8.
PMADDUBSW = (
    DotInstruction(
        "llvm.x86.avx2.pmadd.ub.sw", 8, 4, "uint8", "int8", False, 16, 64, "llvm.x86.avx2.pmadd.wd"
    ),
)
PMADDWD = (
    DotInstruction("llvm.x86.avx2.pmadd.wd", 8, 2, "int16", "int16", False, 16),
    DotInstruction("llvm.x86.sse2.pmadd.wd", 4, 2, "int16", "int16", False, 16),
)
SDOT = (DotInstruction("llvm.aarch64.neon.sdot.v4i32.v16i8", 4, 4, "int8", "int8", True, 32),)
# Pairs of int16 products per int32 lane, for depthwise taps: AVX-512 VNNI's vpdpwssd adds
# them into the accumulator (one instruction per two taps), AVX-512 BW's vpmaddwd does 16 lanes.
PAIRS_VNNI = (
    DotInstruction("llvm.x86.avx512.vpdpwssd.512", 16, 2, "int16", "int16", True, 32),
    DotInstruction("llvm.x86.avx512.vpdpwssd.256", 8, 2, "int16", "int16", True, 32),
)
PAIRS_AVX512 = (
    DotInstruction("llvm.x86.avx512.pmaddw.d.512", 16, 2, "int16", "int16", False, 32),
    PMADDWD[0],
)
DOT_INSTRUCTIONS = {
    d.intrinsic: d for d in (*VNNI, *PMADDUBSW, *PMADDWD, *SDOT, *PAIRS_VNNI, *PAIRS_AVX512)
}


Instructions = tuple[DotInstruction, ...]


@dataclass(frozen=True)
class Isa:
    """A plugin's choice of instructions for a target: ``dots(target)`` its 8-bit dot products,
    ``pairs(target)`` its int16 pairs, each widest (fastest) first, empty when it has none.
    The methods ask about the current target when given none (the build's)."""

    dots: Callable[[tvm.target.Target | None], Instructions]
    pairs: Callable[[tvm.target.Target | None], Instructions]

    def dot(
        self,
        channels: int,
        max_weight: int = 128,
        data_dtype: str = "uint8",
        target: tvm.target.Target | None = None,
    ) -> DotInstruction | None:
        """The first dot instruction of the target for ``data_dtype`` activations whose lanes
        divide ``channels`` and which is exact for weights up to ``max_weight`` in magnitude,
        else None. int16 activations take the int16 pairs."""
        if _bytes(data_dtype) == 2:
            return self.pair(channels, target)
        return next(
            (
                d
                for d in self.dots(_llvm(target))
                if channels % d.lanes == 0 and max_weight <= d.max_weight
            ),
            None,
        )

    def narrow_weights_faster(self, target: tvm.target.Target | None = None) -> bool:
        """Whether the target's fastest 8-bit dot instruction is exact only for weights
        narrower than int8 (AVX2's ``vpmaddubsw``: within ±64), so that 7-bit weights take a
        faster kernel than 8-bit ones."""
        dots = self.dots(_llvm(target))
        return bool(dots) and dots[0].max_weight < 128

    def pair(self, channels: int, target: tvm.target.Target | None = None) -> DotInstruction | None:
        """The widest instruction of the target that multiplies-adds two int16 products per
        int32 lane and whose lanes divide ``channels``, else None: depthwise convs pair their
        taps with it, int16 activations take it as their dot instruction."""
        return next((p for p in self.pairs(_llvm(target)) if channels % p.lanes == 0), None)


def _llvm(target: tvm.target.Target | None) -> tvm.target.Target | None:
    """``target`` (default: the current one) if LLVM builds for it, else None (no instruction)."""
    target = target or tvm.target.Target.current()
    return target if target is not None and str(target.kind) == "llvm" else None
