"""Small Relax modules built with ``relax.BlockBuilder`` for the kernel and schedule tests."""

from __future__ import annotations

import tvm
from tvm import relax


def single_input_module(shape, op) -> tvm.IRModule:
    """``main(x) = op(x)`` for a float32 ``x`` of ``shape``; ``op`` maps a Relax expression to
    one."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(op(x))
        bb.emit_func_output(y)
    return bb.get()
