"""aarch64's integer instructions (:class:`~rangeprof.byoc.cpu.isa.Isa`): ``sdot`` (s8 × s8)
where the target has the dot product; no int16 pairs (``sdot`` is 8-bit only)."""

from __future__ import annotations

import tvm

from ..cpu.isa import SDOT, Instructions, Isa


def _dots(target: tvm.target.Target | None) -> Instructions:
    has = target is not None and tvm.target.codegen.target_has_features("dotprod", target)
    return SDOT if has else ()


ISA = Isa(dots=_dots, pairs=lambda _target: ())
