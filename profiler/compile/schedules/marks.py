"""Marks a rule leaves on a block, lowered after the schedules: the second half of a
``tensorize`` (which segfaults in this TVM), done by hand. The targets' dot-product
instructions (:mod:`rangeprof.byoc.cpu.dot`) are lowered so."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx


def lower_marked_blocks(mod: tvm.IRModule, annotation: str, lower_body) -> tvm.IRModule:
    """Every PrimFunc of ``mod`` with the body of each block a rule annotated with
    ``annotation`` replaced by ``lower_body(block, value)`` (``value`` the annotation's) and
    the annotation dropped: the second half of a rule's mark, after the schedules."""

    def lower(block: s_tir.SBlock, mutator) -> s_tir.SBlock:
        block = mutator.default_mutate(block)
        value = block.annotations.get(annotation)
        if value is None:
            return block
        return s_tir.SBlock(
            block.iter_vars,
            block.reads,
            block.writes,
            block.name_hint,
            lower_body(block, value),
            block.init,
            block.alloc_buffers,
            block.match_buffers,
            {k: v for k, v in block.annotations.items() if k != annotation},
        )

    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc):
            mod[gvar] = tvm_ffi.structural_mutate(func, (s_tir.SBlock, lower))
    return mod
