"""Dot-product micro-kernels: the blocks the integer rules mark become instruction calls.

``Schedule.tensorize`` segfaults in this TVM, so the integer rules do its two halves apart
(:mod:`rangeprof.profiler.compile.schedules.marks`):

* the rule ``blockize``\\ s the innermost ``lanes × depth`` loops of its reduction (one
  instruction's worth: ``lanes`` int32 accumulators, ``depth`` products each) and annotates the
  new block with the instruction's name (:func:`mark`);
* :data:`lower_dot_blocks`, run right after the schedules, replaces the body of each annotated
  block with one vector statement, ``acc[0:lanes] = instruction(acc, data[0:depth],
  weight[0:lanes·depth])``, built by :meth:`~.isa.DotInstruction.call`.

The inner block must be ``acc[..] = acc[..] + int32(data[..]) * int32(weight[..])`` with the
lanes and the depth on the last axis of ``acc`` / ``data`` / ``weight`` (the int8 legalizations
lay their buffers out so), ``data`` either the same for every lane (broadcast: a conv's input
channels) or one group per lane (a depthwise conv's taps, which may come packed in int32
words: the factor is then that word's int16 half, and the lowering reads the words' bits);
anything else is an error, not a silent scalar fallback.

The same pass lowers the AMX tiles the dense rule marks (:mod:`.amx`), whose multiply-accumulate
block has that form too.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from rangeprof.profiler.compile.schedules.marks import lower_marked_blocks

from . import amx
from .isa import DOT_INSTRUCTIONS, DotInstruction

ANNOTATION = "rangeprof.dot"
# On an integer rule's compute block: the instruction its legalization chose (and packed for).
INSTRUCTION = "rangeprof.instruction"


def chosen_instruction(sch: s_tir.Schedule, block) -> DotInstruction:
    """The instruction ``block`` was legalized for (its :data:`INSTRUCTION` annotation)."""
    return DOT_INSTRUCTIONS[str(sch.get(block).annotations[INSTRUCTION])]


def mark(sch: s_tir.Schedule, loop, instruction: DotInstruction):
    """Blockizes ``loop`` (the ``lanes`` loop, the ``depth`` loop inside it) for
    :data:`lower_dot_blocks`."""
    block = sch.blockize(loop)
    sch.annotate(block, ANNOTATION, instruction.intrinsic)
    return block


def _substitute(expr, mapping: dict):
    return tvm_ffi.structural_mutate(expr, (tirx.Var, lambda var, _m: mapping.get(var, var)))


def _vector(access, base: dict, lanes: int) -> list:
    """The indices of ``access`` at the block's first lane, the last one a ``lanes`` ramp."""
    *lead, last = (_substitute(i, base) for i in access.indices)
    return [*lead, tirx.Ramp(last, tirx.const(1, str(last.ty)), lanes)]


def _bits(dtype) -> int:
    return tvm.runtime.DataType(str(dtype)).bits


def _uses(exprs, var) -> bool:
    found = []
    tvm_ffi.structural_walk(list(exprs), (tirx.Var, lambda v: found.append(v.same_as(var))))
    return any(found)


def _load(expr):
    """The one element a factor reads (``int32(x[..])``, or an int16 half of a word)."""
    loads = []
    tvm_ffi.structural_walk(expr, (tvm.ir.expr.TensorLoad, loads.append))
    if not loads or not all(tvm_ffi.structural_equal(load, loads[0]) for load in loads):
        raise ValueError(f"a dot block's factor reads {len(loads)} different elements, not one")
    return loads[0]


def multiply_accumulate(inner: s_tir.SBlock):
    """The accesses of ``acc[..] = acc[..] + int32(data[..]) * int32(weight[..])``: the store,
    the data load and the weight load."""
    store = inner.body
    value = store.value
    if not (
        isinstance(store, tirx.BufferStore)
        and isinstance(value, tirx.Add)
        and isinstance(value.b, tirx.Mul)
    ):
        raise ValueError(f"{inner.name_hint} is no multiply-accumulate")
    return store, _load(value.b.a), _load(value.b.b)


def _dot_statement(block: s_tir.SBlock, instruction: DotInstruction) -> tirx.BufferStore:
    """One instruction call for the ``lanes × depth`` loop nest under ``block``."""
    realize = block.body
    while isinstance(realize, tirx.For):
        realize = realize.body
    inner = realize.block
    store, data, weight = multiply_accumulate(inner)
    base = {iv.var: tirx.const(0, str(iv.var.ty)) for iv in inner.iter_vars}
    lanes, depth = instruction.lanes, instruction.depth
    acc_index = _vector(store, base, lanes)
    # A conv broadcasts one group of activations to every lane; a depthwise conv reads a
    # group per lane (its data index moves with the lane), possibly packed in wider words.
    groups = lanes if _uses(data.indices, inner.iter_vars[0].var) else 1
    bits = groups * depth * _bits(instruction.data_dtype)
    call = instruction.call(
        tirx.BufferLoad(store.buffer, acc_index),
        tirx.BufferLoad(data.source, _vector(data, base, bits // _bits(data.source.dtype))),
        tirx.BufferLoad(weight.source, _vector(weight, base, lanes * depth)),
    )
    return tirx.BufferStore(store.buffer, call, acc_index)


@tvm.transform.module_pass(opt_level=0, name="LowerDotBlocks")
def lower_dot_blocks(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each block annotated by :func:`mark` → one dot-product instruction call; each AMX tile
    (:func:`~.amx.mark_tile`) → its tile program."""
    mod = lower_marked_blocks(
        mod, ANNOTATION, lambda block, name: _dot_statement(block, DOT_INSTRUCTIONS[str(name)])
    )
    return amx.lower_tiles(mod, multiply_accumulate)
