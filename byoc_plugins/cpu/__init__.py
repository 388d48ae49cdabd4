"""The integer kernels of the CPU targets (x86, aarch64, and the npu's host part), for the CPU
build of the pipeline (:func:`rangeprof.profiler.compile.schedules.build`) as extra rules
(:func:`integer_rules`).

* :mod:`.conv2d_int8`, :mod:`.dense_int8`: legalizations and schedules of 8-bit or int16
  activations × int8 weights → int32 on a dot-product instruction (:mod:`.dot` lowers the
  blocks they mark into instruction calls); :mod:`.conv1d_int8` fits row convs to that kernel;
* :mod:`.requantize`: the fixed-point requantization epilogue in 32-bit instructions;
* :mod:`.prepare`: layout clean-ups of the quantized graph after the layout rewrite;
* :mod:`.isa`: the instructions; each plugin chooses those of its target (an
  :class:`~.isa.Isa`: :mod:`rangeprof.byoc.x86.isa`, :mod:`rangeprof.byoc.aarch64.isa`).
"""

from __future__ import annotations

import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules import Rules
from rangeprof.profiler.compile.schedules import build as cpu_build

from .conv1d_int8 import fold_row_conv_taps, legalize_conv_int8
from .conv2d_int8 import is_integer, schedule_conv2d_int8
from .dense_int8 import legalize_matmul_int8, schedule_dense_int8, schedule_pack
from .dense_w4 import emit_dense_w4
from .dense_w4a8 import SCHEDULES as W4_SCHEDULES
from .dense_w4a8 import emit_dense_w4a8
from .dot import lower_dot_blocks
from .isa import Isa
from .prepare import pad_int8_channels, untranspose_quantize
from .requantize import fold_bias, legalize_multiply, legalize_right_shift

__all__ = ["Isa", "build", "emit_dense_w4", "emit_dense_w4a8", "integer_rules"]


def _integer(legalize, isa: Isa):
    """``legalize`` on ``isa`` for 8-bit or int16 × int8 → int32 calls (which keeps TVM's own
    for what its kernels do not cover); None, the build's own, for the others."""

    def integer(bb: relax.BlockBuilder, call: relax.Call):
        return legalize(bb, call, isa) if is_integer(call, constant=False) else None

    return integer


def integer_rules(isa: Isa) -> Rules:
    """The integer kernels on ``isa``'s instructions, as rules of the CPU build."""
    return Rules(
        legalize={
            "relax.nn.conv2d": _integer(legalize_conv_int8, isa),
            "relax.matmul": _integer(legalize_matmul_int8, isa),
            "relax.multiply": legalize_multiply,
            "relax.right_shift": legalize_right_shift,
        },
        schedules=(schedule_conv2d_int8, schedule_dense_int8, schedule_pack, *W4_SCHEDULES),
        layout_passes=(untranspose_quantize, fold_row_conv_taps, pad_int8_channels, fold_bias),
        lowering_passes=(lower_dot_blocks,),
    )


def build(
    mod: tvm.IRModule, target: tvm.target.Target, isa: Isa, fold_scales: bool = True
) -> tvm.runtime.Executable:
    """``mod`` (FP32 operators and integer ones) compiled for ``target`` by the CPU build, the
    integer kernels on ``isa``'s instructions."""
    return cpu_build(mod, target, fold_scales=fold_scales, rules=integer_rules(isa))
