"""ObserveStatistics: replace the tensors a profiling program returns by their statistics.

The profiling program (:func:`rangeprof.profiler.profiling.executor.instrument`) returns every
observed tensor of the initial IR. This pass runs in the build after ``ConvertLayout``, where
each such output is a ``permute_dims`` of the tensor the fast kernels compute (NHWC for
convolutions): it observes that tensor as laid out, with its channel axis remapped, through one
:mod:`~rangeprof.profiler.profiling.stats_kernel` call emitted right after the binding that
computes it (the tensor is still in cache), and returns the kernels' small float64 vectors
instead. No transpose is left, and the big tensors become ordinary intermediates that the memory
planner reuses.

Products are observed through an opaque recomputation: exposing a product that the model then
adds to would stop LLVM from contracting the two into a fused multiply-add and change the model's
output in the last bit, while a kernel of its own rounds exactly as the initial IR says.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, topi

from rangeprof.profiler.profiling.stats_kernel import (
    kernel_name,
    kernel_view,
    output_length,
    stats_kernel,
)

_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_MULTIPLY = tvm.ir.Op.get("relax.multiply")
_OPAQUE = 8  # TVM's kOpaque op pattern: never fused
RECOMPUTE = "observe_multiply"
_REWRITTEN = "__observed"


@dataclass(frozen=True)
class ObservedOutputs:
    """Which outputs of a function are observed: fields ``first..`` of its returned tuple, with
    each one's channel axis in the initial IR's layout (None: no per-channel ranges)."""

    first: int
    channel_axes: tuple[int | None, ...]


@tvm.transform.module_pass(opt_level=0, name="ObserveStatistics")
class ObserveStatistics:
    """Rewrites each named function to return ``(*fields[:first], *statistics vectors)``."""

    def __init__(
        self,
        functions: dict[str, ObservedOutputs],
        bins: int,
        workers: int,
        channel_sums: bool = False,
    ):
        self.functions = functions
        self.bins = bins
        self.workers = workers
        self.channel_sums = channel_sums  # per-channel kernels also sum and count each channel

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        for name, outputs in self.functions.items():
            self._rewrite(bb, name, mod[name], outputs)
        result = bb.get()
        for name in self.functions:
            rewritten = result[f"{name}{_REWRITTEN}"]
            del result[f"{name}{_REWRITTEN}"]
            # Renamed with its symbol: passes that rebuild the module (DispatchSortScan) name a
            # function by its global_symbol.
            rewritten = rewritten.with_attr("global_symbol", name)
            result[name] = relax.analysis.remove_all_unused(rewritten)
        for gvar, func in list(result.functions_items()):
            if gvar.name_hint.startswith(RECOMPUTE):
                result[gvar] = func.with_attr("op_pattern", _OPAQUE)
        return result

    def _rewrite(
        self, bb: relax.BlockBuilder, name: str, func: relax.Function, outputs: ObservedOutputs
    ) -> None:
        """Emits ``<name><_REWRITTEN>``: ``func`` with statistics right after each source."""
        if len(func.body.blocks) != 1:
            raise ValueError(f"{name}: expected one dataflow block, found {len(func.body.blocks)}")
        (block,) = func.body.blocks
        values = {b.var: b.value for b in block.bindings}
        fields = list(values[func.body.body].fields)
        observed = fields[outputs.first :]
        sources = [
            _source(var, axis, values)
            for var, axis in zip(observed, outputs.channel_axes, strict=True)
        ]
        pending: dict[relax.Var, list[int]] = {}
        for index, (source, _) in enumerate(sources):
            pending.setdefault(source, []).append(index)
        vectors: dict[int, relax.Expr] = {}

        def observe(source: relax.Var) -> None:
            by_axis: dict[int | None, relax.Expr] = {}
            for index in pending.pop(source):
                axis = sources[index][1]
                if axis not in by_axis:
                    by_axis[axis] = self._statistics(bb, source, values.get(source), axis)
                vectors[index] = by_axis[axis]

        with bb.function(f"{name}{_REWRITTEN}", list(func.params), attrs=dict(func.attrs)):
            with bb.dataflow():
                for param in func.params:
                    if param in pending:
                        observe(param)
                for binding in block.bindings:
                    if binding.var.same_as(func.body.body):
                        continue
                    bb.emit_normalized(binding)
                    if binding.var in pending:
                        observe(binding.var)
                stats = [vectors[i] for i in range(len(observed))]
                out = bb.emit_output(relax.Tuple([*fields[: outputs.first], *stats]))
            bb.emit_func_output(out)

    def _statistics(
        self, bb: relax.BlockBuilder, var: relax.Var, value, axis: int | None
    ) -> relax.Expr:
        if isinstance(value, tvm.ir.Call) and value.op.same_as(_MULTIPLY):
            var = bb.emit_te(topi.multiply, *value.args, primfunc_name_hint=RECOMPUTE)
        ty = var.ty
        shape = tuple(int(d) for d in ty.shape.values)
        dtype = str(ty.dtype)
        per_channel, sums = axis is not None, self.channel_sums
        kernel = stats_kernel(dtype, per_channel, self.bins, self.workers, sums)
        gvar = bb.add_func(kernel, kernel_name(dtype, per_channel, self.bins, sums))
        view = bb.emit(relax.op.memory.view(var, relax.ShapeExpr(kernel_view(shape, axis))))
        out = relax.TensorType((output_length(shape, axis, self.bins, sums),), "float64")
        return bb.emit(relax.call_tir(gvar, relax.Tuple([view]), out_ty=out))


def _source(var: relax.Var, axis: int | None, values: dict) -> tuple[relax.Var, int | None]:
    """The tensor behind an output (before the layout transform back), and its channel axis."""
    value = values.get(var)
    if isinstance(value, tvm.ir.Call) and value.op.same_as(_PERMUTE):
        source = value.args[0]
        order = [int(a) for a in value.attrs.axes]
        return source, None if axis is None else order[axis]
    return var, axis
