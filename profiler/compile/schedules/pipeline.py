"""The CPU build: layout rewrite, weight prepacking, fusion, a schedule per kernel.

The build knows FP32 kernels only; a caller adds its own as :class:`Rules` (the CPU targets'
integer kernels: :func:`rangeprof.byoc.cpu.integer_rules`). Order of passes, and why:

1. The canonical stages of :mod:`rangeprof.profiler.ir.stages` (the stage table ``inspect`` and
   the plugins share): ``DecomposeOpsForInference`` and
   :class:`~rangeprof.profiler.ir.passes.canonicalize.Canonicalize` (numpy constant folding,
   ``Clip`` back to operators, conv1d as a conv2d of height one) make batch norms per-channel
   constants.
2. :class:`~rangeprof.profiler.ir.passes.fold_scale_axis.FoldScaleAxis` folds them into conv /
   dense weights, leaving one bias add per layer. (Skipped with ``fold_scales=False``, the
   profiling build, where every tensor is observed and none folds: it stops at ``PROFILED``.)
3. :data:`~.activations.as_extrema` (HardSwish / HardSigmoid clips and LeakyReLU as
   ``maximum`` / ``minimum``, which have a layout inference), then
   ``ConvertLayout`` to NHWC/OHWI (conv2d_transpose NHWC/IOHW): channels innermost, so every
   conv, pooling and elementwise kernel vectorises over channels; ``Canonicalize`` folds the
   transposed weights; then the rules' layout passes and the caller's ``layout_passes``.
4. ``LegalizeOps`` with our legalizations (weights repacked in numpy, at build time; matmul
   weights sliced from a constant folded first, :data:`~.dense.sliced_weights`, one-hot
   matmuls as row gathers, :mod:`.embedding`): a rule's
   first, then float32 conv2d (grouped by :mod:`.grouped_conv`, row convs, i.e. conv1d, by
   :mod:`.conv1d`, then :mod:`.conv2d`),
   conv2d_transpose (:mod:`.conv_transpose`) and matmul (:mod:`.dense`), float32 ``erf`` as a
   vectorisable approximation and ``power`` by 2 or 3 as products (:mod:`.activations`),
   ``floor_mod`` (:mod:`.floor_mod`).
   ``FuseOps`` / ``FuseTIR`` then keep elementwise epilogues in the conv / dense kernels.
5. :data:`apply_schedules`: per PrimFunc, the first operator rule that recognises it (the
   rules' first, then :mod:`.conv1d`, :mod:`.conv2d`, :mod:`.conv_transpose`, :mod:`.dense`,
   :mod:`.pooling`, :mod:`.normalization` (layer norm, softmax), :mod:`.resize`), else the
   generic schedule of :mod:`.elementwise`; then the rules'
   lowering passes (the marks their schedules left, :mod:`.marks`) and
   :data:`~.activations.lower_vector_math` (``exp``, ``tanh``, ``sigmoid`` as vector arithmetic).
6. TVM's own CPU lowering passes (dataflow lowering, memory planning, VM codegen).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

from rangeprof.profiler.compile.schedules.activations import (
    as_extrema,
    legalize_erf,
    legalize_power,
    lower_vector_math,
)
from rangeprof.profiler.compile.schedules.conv1d import legalize_row_conv, schedule_row_conv
from rangeprof.profiler.compile.schedules.conv2d import legalize_conv2d, schedule_conv2d
from rangeprof.profiler.compile.schedules.conv_transpose import (
    legalize_conv2d_transpose,
    schedule_conv2d_transpose,
)
from rangeprof.profiler.compile.schedules.dense import (
    legalize_matmul,
    schedule_dense,
    sliced_weights,
)
from rangeprof.profiler.compile.schedules.elementwise import root_blocks, schedule_generic
from rangeprof.profiler.compile.schedules.embedding import one_hot_gathers
from rangeprof.profiler.compile.schedules.extremes import LEGALIZE as EXTREMES
from rangeprof.profiler.compile.schedules.floor_mod import legalize_floor_mod
from rangeprof.profiler.compile.schedules.grouped_conv import legalize_grouped_conv2d
from rangeprof.profiler.compile.schedules.normalization import (
    legalize_softmax,
    schedule_normalization,
)
from rangeprof.profiler.compile.schedules.pooling import schedule_pooling
from rangeprof.profiler.compile.schedules.resize import schedule_resize
from rangeprof.profiler.ir.passes.canonicalize import Canonicalize
from rangeprof.profiler.ir.stages import PROFILED, canonical_passes

_LOG = logging.getLogger(__name__)
_RULES = (
    schedule_row_conv,
    schedule_conv2d,
    schedule_conv2d_transpose,
    schedule_dense,
    schedule_pooling,
    schedule_normalization,
    schedule_resize,
)

Legalization = Callable[[relax.BlockBuilder, relax.Call], relax.Expr | None]
ScheduleRule = Callable[[s_tir.Schedule], bool]


@dataclass(frozen=True)
class Rules:
    """Kernels a caller adds to the build, which knows no target (a plugin's integer kernels):

    * ``legalize``: per operator (``"relax.nn.conv2d"``), a legalization tried before the
      build's own, which returns None for a call it leaves to the build;
    * ``schedules``: operator rules tried before the build's own (a rule schedules a PrimFunc
      it recognises and returns True);
    * ``layout_passes``: run right after the layout rewrite, before the caller's;
    * ``lowering_passes``: run right after the schedules (the marks they left).
    """

    legalize: Mapping[str, Legalization] = field(default_factory=dict)
    schedules: Sequence[ScheduleRule] = ()
    layout_passes: Sequence[tvm.transform.Pass] = ()
    lowering_passes: Sequence[tvm.transform.Pass] = ()


def host_target() -> tvm.target.Target:
    """The machine we run on, with all its cores."""
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": os.cpu_count()})


def _schedule(name: str, func: tirx.PrimFunc, rules: Sequence[ScheduleRule]) -> tirx.PrimFunc:
    """The first operator rule that claims ``func``, else the generic schedule."""
    for rule in rules:
        sch = s_tir.Schedule(func)
        try:
            if rule(sch):
                return sch.mod["main"].with_attr("tirx.is_scheduled", True)
        except (ValueError, RuntimeError) as err:  # a shape the rule does not cover
            _LOG.info("%s: %s does not apply (%s)", name, rule.__name__, err)
    sch = s_tir.Schedule(func)
    if not _plain(sch):
        return func
    try:
        schedule_generic(sch)
    except (ValueError, RuntimeError, TypeError) as err:
        # A kernel the generic rules do not cover (data-dependent extents, scatters): TVM's
        # default lowering compiles it as written. Correct, only not parallel or vectorised.
        _LOG.info("%s: compiled unscheduled (%s)", name, err)
        return func
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _plain(sch: s_tir.Schedule) -> bool:
    """Whether the generic rules apply: a root block whose children all have iteration
    variables. An opaque block (a sort, NMS or scan as TOPI writes it) is not one of the
    injective or reduction kernels the rules take apart; TVM compiles it as written."""
    try:
        return all(sch.get(block).iter_vars for block in root_blocks(sch))
    except (ValueError, RuntimeError):  # no root block
        return False


def apply_schedules(rules: Sequence[ScheduleRule] = ()) -> tvm.transform.Pass:
    """One rule-based schedule per PrimFunc (see the module docstrings of each rule), ``rules``
    tried before the build's own."""
    rules = (*rules, *_RULES)

    @tvm.transform.module_pass(opt_level=0, name="ApplySchedules")
    def apply(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, tirx.PrimFunc) and "tirx.is_scheduled" not in func.attrs:
                mod[gvar] = _schedule(gvar.name_hint, func, rules)
        return mod

    return apply


def _first(rule: Legalization, own: Legalization | None) -> Legalization:
    """``rule``, else the build's legalization of the operator (else TVM's)."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call):
        legalized = rule(bb, call)
        if legalized is not None:
            return legalized
        return (own or call.op.get_attr("FLegalize"))(bb, call)

    return legalize


def relax_pipeline(
    target: tvm.target.Target | None = None,
    fold_scales: bool = True,
    layout_passes: Sequence[tvm.transform.Pass] = (),
    rules: Rules = Rules(),
) -> tvm.transform.Pass:
    """The Relax → VM pipeline to hand to ``tvm.compile(..., relax_pipeline=...)``.

    ``fold_scales=False`` keeps batch norms and channel scales as fused epilogues instead of
    folding them into the weights: the arithmetic of a program whose every tensor is observed
    (where nothing can fold), so that observing changes no output bit. ``layout_passes`` run
    right after the layout rewrite, on the program as the kernels will lay it out (the
    profiler's statistics kernels go in there). ``rules``: the caller's kernels (:class:`Rules`).
    """
    target = target or host_target()
    legalize = {
        "relax.nn.conv2d": _first(
            legalize_grouped_conv2d, _first(legalize_row_conv, legalize_conv2d)
        ),
        "relax.nn.conv2d_transpose": legalize_conv2d_transpose,
        "relax.matmul": functools.partial(legalize_matmul, packed={}),
        "relax.erf": legalize_erf,
        "relax.nn.softmax": legalize_softmax,
        "relax.power": legalize_power,
        "relax.floor_mod": legalize_floor_mod,
        **EXTREMES,
    }
    for op, rule in rules.legalize.items():
        legalize[op] = _first(rule, legalize.get(op))
    layouts = {"relax.nn.conv2d": ["NHWC", "OHWI"], "relax.nn.conv2d_transpose": ["NHWC", "IOHW"]}
    passes = [
        *canonical_passes(until="fold_scale_axis" if fold_scales else PROFILED),
        as_extrema,
        relax.transform.ConvertLayout(layouts),
        Canonicalize(),
        *rules.layout_passes,
        *layout_passes,
        # sort, topk, cumsum and sampling have no legalization: they dispatch to TOPI kernels
        *cpu_generic.library_dispatch_passes(target),
        sliced_weights,
        one_hot_gathers,
        relax.transform.LegalizeOps(customize_legalize_map=legalize),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        apply_schedules(rules.schedules),
        *rules.lowering_passes,
        lower_vector_math,
        *cpu_generic.dataflow_lower_passes(target),
        *cpu_generic.finalize_passes(target),
    ]

    @tvm.transform.module_pass(opt_level=0, name="RangeprofFP32Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def build(
    mod: tvm.IRModule,
    target: tvm.target.Target | None = None,
    fold_scales: bool = True,
    layout_passes: Sequence[tvm.transform.Pass] = (),
    rules: Rules = Rules(),
) -> tvm.runtime.Executable:
    """Compiles a Relax module (NCHW, as imported) into a fast CPU executable, with the caller's
    kernels ``rules`` (:class:`Rules`) before the build's own.

    ``profiler`` sets ``TVM_NUM_THREADS`` on import so that TVM's pool uses every core.
    """
    target = target or host_target()
    pipeline = relax_pipeline(target, fold_scales, layout_passes, rules)
    return tvm.compile(mod, target=target, relax_pipeline=pipeline)
