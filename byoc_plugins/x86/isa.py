"""x86's integer instructions, by CPU feature (:class:`~rangeprof.byoc.cpu.isa.Isa`).

8-bit activations: ``vpdpbusd`` with AVX-512 VNNI; on AVX2 ``vpmaddubsw`` where every weight of
the layer is within ±64, else ``vpmaddwd`` on int16. int16 pairs (int16 activations, depthwise
taps): ``vpdpwssd`` with AVX-512 VNNI, ``vpmaddwd`` with AVX-512 BW (16 lanes) or AVX2 (8).
"""

from __future__ import annotations

import tvm

from ..cpu.isa import PAIRS_AVX512, PAIRS_VNNI, PMADDUBSW, PMADDWD, VNNI, Instructions, Isa


def _has(feature: str, target: tvm.target.Target) -> bool:
    return tvm.target.codegen.target_has_features(feature, target)


def _dots(target: tvm.target.Target | None) -> Instructions:
    if target is None:
        return ()
    if _has("avx512vnni", target):
        return VNNI
    if _has("avx2", target):
        return PMADDUBSW + PMADDWD
    return ()


def _pairs(target: tvm.target.Target | None) -> Instructions:
    if target is None:
        return ()
    if _has("avx512vnni", target):
        return PAIRS_VNNI
    if _has("avx512bw", target):
        return PAIRS_AVX512
    if _has("avx2", target):
        return PMADDWD[:1]
    return ()


ISA = Isa(dots=_dots, pairs=_pairs)
