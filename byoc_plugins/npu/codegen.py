"""The external codegen ``relax.ext.rangeprof_npu``: integer cores in, a C source module out.

``relax.transform.RunCodegen`` hands it every function of the module marked ``{"Codegen":
"rangeprof_npu"}`` (the integer cores :mod:`rangeprof.byoc.lowering` makes with
``external="rangeprof_npu"``), with the options given as ``RunCodegen({"rangeprof_npu":
{"sram_kb": N}})``: the C depends on those functions and that buffer size only (the plugin
decides the size when it is obtained, :func:`rangeprof.byoc.npu.make_plugin`). Each core is
read (:mod:`.core`), tiled for the buffer (:mod:`.tiling`) and emitted as C (:mod:`.emit`) into
one ``CSourceModule``; RunCodegen replaces the calls in ``main`` by ``call_dps_packed`` of the
region's ``global_symbol``. The C is compiled when the
executable is exported (``export_library``) or run (``Executable.jit``, which exports to a
temporary library and loads it): with the system compiler, into the same shared library as
the host code.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from rangeprof.profiler.errors import RangeprofError

from .core import NpuOp, read_core
from .emit import c_source
from .tiling import TilePlan, plan_tiles

NAME = "rangeprof_npu"


def sram_bytes(sram_kb: int) -> int:
    """The on-chip buffer of ``sram_kb`` KB, in bytes."""
    if sram_kb < 1:
        raise RangeprofError(f"the NPU buffer must be at least 1 KB, not {sram_kb}")
    return int(sram_kb) * 1024


def offloaded(mod: tvm.IRModule) -> list[relax.Function]:
    """The functions of ``mod`` marked for this codegen, by name."""
    return [
        func
        for _, func in sorted(mod.functions_items(), key=lambda item: item[0].name_hint)
        if isinstance(func, relax.Function)
        and func.attrs
        and str(func.attrs.get("Codegen", "")) == NAME
    ]


def _program(funcs, sram: int) -> list[tuple[NpuOp, TilePlan]]:
    program = []
    for func in funcs:
        op = read_core(func)
        program.append((op, plan_tiles(op, sram)))
    return program


def tile_plans(mod: tvm.IRModule, sram_kb: int) -> dict[str, TilePlan]:
    """The tile plan of every offloaded region of a lowered module, by symbol (what the codegen
    will emit for the same buffer size); raises on a core the NPU cannot run."""
    sram = sram_bytes(sram_kb)
    return {op.symbol: plan for op, plan in _program(offloaded(mod), sram)}


def c_program(mod: tvm.IRModule, sram_kb: int) -> str:
    """The C the codegen emits for the offloaded regions of a lowered module."""
    sram = sram_bytes(sram_kb)
    return c_source(_program(offloaded(mod), sram), sram)


@tvm_ffi.register_global_func(f"relax.ext.{NAME}", override=True)
def _codegen(funcs, options, constant_names):
    """RunCodegen's entry point; the constants are embedded in the C, so ``constant_names``
    (RunCodegen's names for them) is unused."""
    del constant_names
    sram = sram_bytes(int(options["sram_kb"]))
    program = _program(funcs, sram)
    create = tvm.get_global_func("runtime.CSourceModuleCreate")
    symbols = [op.symbol for op, _ in program]
    return [create(c_source(program, sram), "c", symbols, [])]
