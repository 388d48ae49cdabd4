"""The instrumented FP32 executor: compiled TVM code that exposes every initial-IR tensor.

How initial-IR boundaries are observed (measured by ``benchmarks/instrumentation_options.py``,
see the README): the profiling program is the tagged initial IR with every float tensor binding
added to ``main``'s outputs ("extra outputs kept alive"), compiled by the normal pipeline
(DecomposeOpsForInference, FoldConstant, legalization, fusion). Keeping a tensor as an output
stops the compiler from folding it away, so a conv output that the fast build absorbs into a
folded batch norm still exists here, while everything else is fused and compiled as usual.
VM instrumentation cannot see values inside fused kernels, and an unfused build is slower. The
model's own outputs are computed by the same kernels, so they are bitwise equal to an
uninstrumented build of the same IR (tested).

Statistics are computed by :mod:`profiler.statistics` on the returned buffers, zero-copy.
Tensors that depend on no input (weights, weight transforms the frontend emitted) are observed
once, not per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, topi

from .bindings import function_bindings, used_vars
from .schedules import build
from .spans import ids_of
from .statistics import DEFAULT_BINS, TensorStats
from .tagging import LayerRecord

_CHANNEL_AXIS_BY_OP = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1, "MatMul": -1}


@dataclass(frozen=True)
class Observed:
    """One tensor the program returns, and how to summarise it."""

    profile_id: str
    channel_axis: int | None


@dataclass
class ProfilingProgram:
    """A compiled instrumented program for one input batch size."""

    vm: relax.VirtualMachine
    input_names: list[str]
    observed: list[Observed]  # data-dependent tensors, in output order after the model output
    static: dict[str, TensorStats]  # tensors that depend on no input, observed once

    def run(self, batch: dict[str, np.ndarray], bins: int | None):
        """Runs one batch; returns the model output and the stats of every observed tensor."""
        args = [tvm.runtime.tensor(np.ascontiguousarray(batch[n])) for n in self.input_names]
        result = self.vm["main"](*args)
        stats = {}
        values = list(result)[1 : 1 + len(self.observed)]
        for obs, value in zip(self.observed, values, strict=True):
            array = np.from_dlpack(value)
            stats[obs.profile_id] = TensorStats.observe(array, bins, _axis(obs, array))
        return result[0], stats


def _axis(obs: Observed, array: np.ndarray) -> int | None:
    if obs.channel_axis is None or array.ndim < 2:
        return None
    return obs.channel_axis % array.ndim


def channel_axis(layer: LayerRecord) -> int | None:
    """Channel axis of conv / dense / matmul outputs (NCHW convs, features last for dense)."""
    return _CHANNEL_AXIS_BY_OP.get(layer.source_op or "")


def instrument(mod: tvm.IRModule, layers: list[LayerRecord]) -> tuple[tvm.IRModule, list, list]:
    """``mod`` with ``main`` returning ``(model output, *tensors)``.

    Returns the module, the data-dependent tensors (in output order) and the data-independent
    ones (observed once).
    """
    func = mod["main"]
    by_id = {layer.profile_id: layer for layer in layers}
    depends = set(func.params)
    observed, static = [], []
    values = {}
    for ref in function_bindings("main", func):
        values[ref.var] = ref.value
        if any(v in depends for v in used_vars(ref.value)):
            depends.add(ref.var)
        ty = ref.var.ty
        if not isinstance(ty, relax.TensorType) or "float" not in str(ty.dtype):
            continue
        if isinstance(ref.value, relax.Var):
            continue  # a rename: observed under the Var it names
        (profile_id,) = ids_of(ref.value)
        entry = (ref.var, Observed(profile_id, channel_axis(by_id[profile_id])))
        (observed if ref.var in depends else static).append(entry)

    bb = relax.BlockBuilder(mod)
    with bb.function("observed_main", list(func.params), attrs=dict(func.attrs)):
        with bb.dataflow():
            for block in func.body.blocks:
                for binding in block.bindings:
                    bb.emit_normalized(binding)
            exposed = [_observable(bb, var, values[var]) for var, _ in observed + static]
            out = bb.emit_output(relax.Tuple([func.body.body, *exposed]))
        bb.emit_func_output(out)
    instrumented = bb.get()
    for gvar, prim in list(instrumented.functions_items()):
        if gvar.name_hint.startswith(_RECOMPUTE):
            instrumented[gvar] = prim.with_attr("op_pattern", _OPAQUE)
    instrumented["main"] = instrumented["observed_main"]
    del instrumented["observed_main"]
    return instrumented, [o for _, o in observed], [o for _, o in static]


# Exposing a product that the model then adds to would stop LLVM from contracting the two into a
# fused multiply-add, changing the model's output in the last bit. Products are therefore
# observed through a recomputation in a kernel of its own (opaque: never fused), which rounds
# exactly as the initial IR says, while the model's own kernels stay as they are.
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_RECOMPUTE = "observe_multiply"
_OPAQUE = 8  # TVM's kOpaque op pattern


def _observable(bb: relax.BlockBuilder, var: relax.Var, value: relax.Expr) -> relax.Expr:
    if isinstance(value, tvm.ir.Call) and value.op.same_as(_MULTIPLY):
        return bb.emit_te(topi.multiply, *value.args, primfunc_name_hint=_RECOMPUTE)
    return var


def compile_program(
    mod: tvm.IRModule,
    layers: list[LayerRecord],
    input_names: list[str],
    bins: int | None = DEFAULT_BINS,
    target: tvm.target.Target | None = None,
) -> tuple[relax.VMExecutable, ProfilingProgram]:
    """Compiles the instrumented program; observes data-independent tensors right away."""
    instrumented, observed, static = instrument(mod, layers)
    executable = build(instrumented, target, fold_scales=False)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    program = ProfilingProgram(vm, input_names, observed, {})
    if static:
        # Run once on zeros: static tensors do not depend on the inputs' values.
        params = mod["main"].params
        zeros = [np.zeros(_shape(p), dtype=str(p.ty.dtype)) for p in params]
        result = list(vm["main"](*[tvm.runtime.tensor(z) for z in zeros]))
        for obs, value in zip(static, result[1 + len(observed) :], strict=True):
            array = np.from_dlpack(value)
            program.static[obs.profile_id] = TensorStats.observe(array, bins, _axis(obs, array))
    return executable, program


def _shape(param: relax.Var) -> list[int]:
    return [int(d) for d in param.ty.shape.values]
