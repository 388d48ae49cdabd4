"""The instrumented FP32 executor: compiled TVM code that observes every initial-IR tensor.

How initial-IR boundaries are observed (measured by ``benchmarks/instrumentation_options.py``;
``docs/performance.md``): the profiling program is the tagged initial IR with every float tensor
binding added to ``main``'s outputs ("extra outputs kept alive"), compiled by the fast pipeline
(DecomposeOpsForInference, constant folding, NHWC layout, legalization, fusion). Keeping a tensor
as an output stops the compiler from folding it away, so a conv output that the fast build
absorbs into a folded batch norm still exists here, while everything else is fused and compiled
as usual. VM instrumentation cannot see values inside fused kernels, and an unfused build is
slower. The model's own outputs are computed by the same kernels, so they are bitwise equal to an
uninstrumented build of the same IR (tested).

Statistics are computed inside the program: after ``ConvertLayout``,
:class:`~rangeprof.profiler.profiling.observe_statistics.ObserveStatistics` replaces each
returned tensor by a compiled statistics kernel over the tensor as the fast kernels lay it out
(:mod:`rangeprof.profiler.profiling.stats_kernel`), so a run returns kilobytes, not the model's
activations.
Tensors that depend on no input (weights, weight transforms the frontend emitted) are observed
once, by a second function of the same program.

Every profile observes the inputs of dense layers (a matmul whose other operand is a weight) per
channel along the axis the layer sums over (the last): per-channel ranges of what a dense layer
reads are what SmoothQuant's scales need (:mod:`rangeprof.profiler.calibrate.smoothing`), and
they cost a few tensors. Channel statistics (``channel_stats``) extend this to every activation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules import build, host_target
from rangeprof.profiler.compile.threads import vm_function
from rangeprof.profiler.ir.bindings import function_bindings, used_vars
from rangeprof.profiler.ir.spans import ids_of
from rangeprof.profiler.ir.tagging import LayerRecord
from rangeprof.profiler.profiling.masks import mask_sources
from rangeprof.profiler.profiling.observe_statistics import ObservedOutputs, ObserveStatistics
from rangeprof.profiler.profiling.statistics import DEFAULT_BINS, TensorStats
from rangeprof.profiler.profiling.stats_kernel import Totals, decode

_CHANNEL_AXIS_BY_OP = {"Conv": 1, "ConvTranspose": 1, "Gemm": -1, "MatMul": -1}
STATIC = "observe_static"  # the program's function returning the data-independent statistics


@dataclass(frozen=True)
class Observed:
    """One observed tensor: its profileID and channel axis (None: no per-channel ranges); for
    a tensor that reads constant NaN or inf (a mask), the static tensors holding them that it
    reads and the constants they come from (:mod:`~rangeprof.profiler.profiling.masks`)."""

    profile_id: str
    channel_axis: int | None
    nonfinite_inputs: tuple[str, ...] = ()
    nonfinite_origins: tuple[str, ...] = ()

    def __post_init__(self):
        # A build cache's sidecar gives lists back.
        object.__setattr__(self, "nonfinite_inputs", tuple(self.nonfinite_inputs))
        object.__setattr__(self, "nonfinite_origins", tuple(self.nonfinite_origins))


@dataclass(frozen=True)
class Instrumented:
    """The tagged module with every observed tensor returned.

    ``main`` returns ``(model output, *tensors of observed)``; ``observe_static`` (present when
    ``static`` is not empty) takes the same inputs and returns the tensors of ``static``.
    """

    mod: tvm.IRModule
    observed: list[Observed]  # data-dependent tensors
    static: list[Observed]  # tensors that depend on no input


@dataclass
class ProfilingProgram:
    """A compiled instrumented program for one input batch size."""

    vm: relax.VirtualMachine
    input_names: list[str]
    observed: list[Observed]  # data-dependent tensors, in output order after the model output
    static: dict[str, TensorStats]  # tensors that depend on no input, observed once
    bins: int  # histogram bins the statistics kernels count (0: none)
    channel_sums: bool = False  # per-channel sums and counts beside the ranges (channel stats)

    def run(self, batch: dict[str, np.ndarray]) -> tuple[tvm.runtime.Tensor, dict]:
        """Runs one batch; returns the model output and the stats of every observed tensor."""
        result = list(self._call(batch))
        return result[0], _decode(self.observed, result[1:], self.bins, self.channel_sums)

    def run_into(self, batch: dict[str, np.ndarray], totals: dict[str, Totals]) -> None:
        """Runs one batch and adds the statistics of every observed tensor to ``totals`` (by
        profileID, created on first use): the merge of what :meth:`run` returns, run after
        run, for less than the cost of decoding it."""
        result = self._call(batch)
        for index, obs in enumerate(self.observed, start=1):
            total = totals.get(obs.profile_id)
            if total is None:
                total = Totals(self.bins, obs.channel_axis, self.channel_sums)
                totals[obs.profile_id] = total
            total.add(np.from_dlpack(result[index]))

    def _call(self, batch: dict[str, np.ndarray]):
        # Not ascontiguousarray, which makes a 0-d array (a scalar input) 1-d.
        args = [tvm.runtime.tensor(np.asarray(batch[n], order="C")) for n in self.input_names]
        return vm_function(self.vm)(*args)


def _decode(observed: list[Observed], vectors, bins: int, sums: bool) -> dict[str, TensorStats]:
    return {
        obs.profile_id: decode(np.from_dlpack(vector), bins, obs.channel_axis, sums)
        for obs, vector in zip(observed, vectors, strict=True)
    }


def channel_axis(layer: LayerRecord, ndim: int, every: bool = False) -> int | None:
    """Channel axis of conv / dense / matmul outputs (NCHW convs, features last for dense);
    with ``every`` (channel statistics of activations) also of any other tensor by its rank:
    axis 1 of a 3-D or 4-D tensor (NCW / NCHW), the last of a 2-D one."""
    axis = _CHANNEL_AXIS_BY_OP.get(layer.source_op or "")
    if axis is None and every:
        axis = {2: -1, 3: 1, 4: 1}.get(ndim)
    return None if axis is None or ndim < 2 else axis % ndim


def _data_dependent(func: relax.Function) -> set[relax.Var]:
    """The Vars of ``func`` that depend on an input: its parameters and what reads them."""
    depends = set(func.params)
    for ref in function_bindings("main", func):
        if any(v in depends for v in used_vars(ref.value)):
            depends.add(ref.var)
    return depends


def _contracted_axes(
    func: relax.Function, depends: set[relax.Var], every: bool
) -> dict[relax.Var, int]:
    """The axis a dense layer (a matmul whose right operand depends on no input: the last) sums
    over, of each data-dependent Var it reads as its data; with ``every`` also of the data of
    any matmul, and of convs (axis 1, NCHW): the channels whose means weigh a layer's bias
    correction. A transformer's ``[B, T, D]`` activations feed dense layers along ``D``, not
    along axis 1 as images do."""
    axes: dict[relax.Var, int] = {}
    for ref in function_bindings("main", func):
        value = ref.value
        if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)):
            continue
        data = value.args[0] if value.args else None
        if data not in depends or not isinstance(data.ty, relax.TensorType):
            continue
        if value.op.name == "relax.nn.conv2d" and every:
            axes.setdefault(data, 1)
        elif value.op.name == "relax.matmul" and (every or value.args[1] not in depends):
            axes.setdefault(data, data.ty.ndim - 1)
    return axes


def instrument(
    mod: tvm.IRModule, layers: list[LayerRecord], channel_stats: bool = False
) -> Instrumented:
    """``mod`` with every float tensor binding of ``main`` returned (see :class:`Instrumented`);
    the data of dense layers is observed per channel along the axis they sum over, and with
    ``channel_stats`` every data-dependent tensor with a channel axis, along the axis its conv
    or matmul consumer sums over where it has one (weights keep theirs)."""
    func = mod["main"]
    depends = _data_dependent(func)
    contracted = _contracted_axes(func, depends, channel_stats)
    by_id = {layer.profile_id: layer for layer in layers}
    observed: list[tuple[relax.Var, Observed]] = []
    static: list[tuple[relax.Var, Observed]] = []
    for ref in function_bindings("main", func):
        ty = ref.var.ty
        if not isinstance(ty, relax.TensorType) or "float" not in str(ty.dtype):
            continue
        if isinstance(ref.value, relax.Var):
            continue  # a rename: observed under the Var it names
        (profile_id,) = ids_of(ref.value)
        every = channel_stats and ref.var in depends
        axis = contracted.get(ref.var, channel_axis(by_id[profile_id], ty.ndim, every))
        entry = (ref.var, Observed(profile_id, axis))
        (observed if ref.var in depends else static).append(entry)

    bb = relax.BlockBuilder(mod)
    _returning(bb, "observed_main", func, [func.body.body, *(v for v, _ in observed)])
    if static:
        _returning(bb, STATIC, func, [v for v, _ in static])
    instrumented = bb.get()
    instrumented["main"] = instrumented["observed_main"]
    del instrumented["observed_main"]
    if static:
        # A function of its own: fresh variables, and only the bindings it needs.
        copied = relax.utils.copy_with_new_vars(instrumented[STATIC])
        instrumented[STATIC] = relax.analysis.remove_all_unused(copied)
    return Instrumented(instrumented, [o for _, o in observed], [o for _, o in static])


def _returning(bb: relax.BlockBuilder, name: str, func: relax.Function, outputs: list) -> None:
    """Adds ``name``: ``func``'s bindings, returning the tuple of ``outputs``."""
    with bb.function(name, list(func.params), attrs=dict(func.attrs)):
        with bb.dataflow():
            for block in func.body.blocks:
                for binding in block.bindings:
                    bb.emit_normalized(binding)
            out = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(out)


def compile_program(
    mod: tvm.IRModule,
    layers: list[LayerRecord],
    input_names: list[str],
    bins: int | None = DEFAULT_BINS,
    target: tvm.target.Target | None = None,
    load: Callable[[relax.VMExecutable], relax.VirtualMachine] | None = None,
    channel_stats: bool = False,
) -> tuple[relax.VMExecutable, ProfilingProgram]:
    """Compiles the instrumented program; observes data-independent tensors right away.

    ``load`` makes the VM from the executable (default: in memory, LLVM's JIT); the build
    cache exports it first and loads the library instead (:meth:`BuildCache.store_library`).
    ``channel_stats``: per-channel ranges and sums of every activation (:func:`instrument`).
    The observed tensors that read constant NaN or inf say so (:class:`Observed`)."""
    bins = bins or 0
    inst = instrument(mod, layers, channel_stats)
    functions = {"main": ObservedOutputs(1, tuple(o.channel_axis for o in inst.observed))}
    if inst.static:
        functions[STATIC] = ObservedOutputs(0, tuple(o.channel_axis for o in inst.static))
    target = target or host_target()
    workers = int(target.attrs.get("num-cores", 1))  # the cores the program is built for
    observe = ObserveStatistics(functions, bins, workers, channel_stats)
    executable = build(inst.mod, target, fold_scales=False, layout_passes=[observe])
    vm = load(executable) if load else relax.VirtualMachine(executable, tvm.cpu())
    program = ProfilingProgram(vm, input_names, inst.observed, {}, bins, channel_stats)
    if inst.static:
        # Static tensors do not depend on the inputs' values: run once, on zeros.
        params = mod["main"].params
        zeros = [tvm.runtime.tensor(np.zeros(_shape(p), dtype=str(p.ty.dtype))) for p in params]
        static = list(vm[STATIC](*zeros))
        program.static.update(_decode(inst.static, static, bins, channel_stats))
    nonfinite = {k for k, v in program.static.items() if v.nan_count or v.inf_count}
    masks = mask_sources(mod["main"], _data_dependent(mod["main"]), nonfinite)
    program.observed = [_with_masks(o, masks.get(o.profile_id)) for o in program.observed]
    return executable, program


def _with_masks(observed: Observed, sources) -> Observed:
    if sources is None:
        return observed
    return replace(observed, nonfinite_inputs=sources.inputs, nonfinite_origins=sources.origins)


def _shape(param: relax.Var) -> list[int]:
    return [int(d) for d in param.ty.shape.values]
