"""The CPU build (FP32, INT8): layout rewrite, weight prepacking, fusion, a schedule per kernel.

Order of passes, and why:

1. The canonical stages of :mod:`rangeprof.profiler.ir.stages` (the stage table ``inspect`` and
   the plugins share): ``DecomposeOpsForInference`` and
   :data:`~rangeprof.profiler.ir.passes.canonicalize.canonicalize` (numpy constant folding,
   ``Clip`` back to operators) make batch norms per-channel constants.
2. :class:`~rangeprof.profiler.ir.passes.fold_scale_axis.FoldScaleAxis` folds them into conv /
   dense weights, leaving one bias add per layer. (Skipped with ``fold_scales=False``, the
   profiling build, where every tensor is observed and none folds: it stops at ``PROFILED``.)
3. ``ConvertLayout`` to NHWC/OHWI: channels innermost, so every conv, pooling and elementwise
   kernel vectorises over channels; ``canonicalize`` folds the transposed weights, and
   :data:`~.prepare.untranspose_quantize` takes per-tensor quantizes out of the NCHW round
   trips ``ConvertLayout`` wraps them in; :data:`~.prepare.pad_int8_channels`
   pads the input channels of unpadded int8 convs (RGB images) to 4.
4. ``LegalizeOps`` with our conv2d and matmul legalizations (weights repacked in numpy, at build
   time), chosen by dtype: float32 (:mod:`.conv2d`, :mod:`.dense`) or 8-bit or int16 activations ×
   int8 constant weights → int32 (:mod:`.conv2d_int8`, :mod:`.dense_int8`; a matmul's int8
   right operand may be an activation too, packed at run time by a kernel of its own), and the int64
   requantization arithmetic in 32-bit instructions (:mod:`.requantize`), float32 ``erf`` as a
   vectorisable approximation (:mod:`.activations`). ``FuseOps`` / ``FuseTIR``
   then keep elementwise epilogues in the conv / dense kernels.
5. :data:`apply_schedules`: per PrimFunc, the first operator rule that recognises it
   (:mod:`.conv2d`, :mod:`.conv2d_int8`, :mod:`.dense_int8` and its run-time packing,
   :mod:`.dense`, :mod:`.pooling`, :mod:`.normalization`: layer norm, softmax),
   else the generic schedule of :mod:`.elementwise`; :data:`~.dot.lower_dot_blocks` turns the
   blocks the integer rules mark into dot-product instruction calls.
6. TVM's own CPU lowering passes (dataflow lowering, memory planning, VM codegen).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import tvm
from tvm import relax, s_tir, tirx
from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

from rangeprof.profiler.build.schedules.activations import legalize_erf
from rangeprof.profiler.build.schedules.conv2d import legalize_conv2d, schedule_conv2d
from rangeprof.profiler.build.schedules.conv2d_int8 import (
    is_integer,
    legalize_conv2d_int8,
    schedule_conv2d_int8,
)
from rangeprof.profiler.build.schedules.dense import legalize_matmul, schedule_dense
from rangeprof.profiler.build.schedules.dense_int8 import (
    legalize_matmul_int8,
    schedule_dense_int8,
    schedule_pack,
)
from rangeprof.profiler.build.schedules.dot import lower_dot_blocks
from rangeprof.profiler.build.schedules.elementwise import root_blocks, schedule_generic
from rangeprof.profiler.build.schedules.floor_mod import legalize_floor_mod
from rangeprof.profiler.build.schedules.normalization import lower_exp, schedule_normalization
from rangeprof.profiler.build.schedules.pooling import schedule_pooling
from rangeprof.profiler.build.schedules.prepare import pad_int8_channels, untranspose_quantize
from rangeprof.profiler.build.schedules.requantize import (
    fold_bias,
    legalize_multiply,
    legalize_right_shift,
)
from rangeprof.profiler.ir.passes.canonicalize import canonicalize
from rangeprof.profiler.ir.stages import PROFILED, canonical_passes

_LOG = logging.getLogger(__name__)
_RULES = (
    schedule_conv2d,
    schedule_conv2d_int8,
    schedule_dense_int8,
    schedule_pack,
    schedule_dense,
    schedule_pooling,
    schedule_normalization,
)


def host_target() -> tvm.target.Target:
    """The machine we run on, with all its cores."""
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    return tvm.target.Target({"kind": "llvm", "mcpu": cpu, "num-cores": os.cpu_count()})


def _schedule(name: str, func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The first operator rule that claims ``func``, else the generic schedule."""
    for rule in _RULES:
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


@tvm.transform.module_pass(opt_level=0, name="ApplySchedules")
def apply_schedules(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """One rule-based schedule per PrimFunc (see the module docstrings of each rule)."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tirx.PrimFunc) and "tirx.is_scheduled" not in func.attrs:
            mod[gvar] = _schedule(gvar.name_hint, func)
    return mod


def _by_dtype(fp32, int8):
    """One legalization per operator: the integer one for 8-bit or int16 × int8 → int32 calls
    (which keeps TVM's own for what its kernels do not cover)."""

    def legalize(bb: relax.BlockBuilder, call: relax.Call):
        return (int8 if is_integer(call, constant=False) else fp32)(bb, call)

    return legalize


def relax_pipeline(
    target: tvm.target.Target | None = None,
    fold_scales: bool = True,
    layout_passes: Sequence[tvm.transform.Pass] = (),
) -> tvm.transform.Pass:
    """The Relax → VM pipeline to hand to ``tvm.compile(..., relax_pipeline=...)``.

    ``fold_scales=False`` keeps batch norms and channel scales as fused epilogues instead of
    folding them into the weights: the arithmetic of a program whose every tensor is observed
    (where nothing can fold), so that observing changes no output bit. ``layout_passes`` run
    right after the layout rewrite, on the program as the kernels will lay it out (the
    profiler's statistics kernels go in there).
    """
    target = target or host_target()
    legalize = {
        "relax.nn.conv2d": _by_dtype(legalize_conv2d, legalize_conv2d_int8),
        "relax.matmul": _by_dtype(legalize_matmul, legalize_matmul_int8),
        "relax.multiply": legalize_multiply,
        "relax.right_shift": legalize_right_shift,
        "relax.erf": legalize_erf,
        "relax.floor_mod": legalize_floor_mod,
    }
    # conv2d_transpose stays NCHW (TVM legalizes it in no other layout): the rewrite transposes
    # around it, and only it.
    layouts = {"relax.nn.conv2d": ["NHWC", "OHWI"], "relax.nn.conv2d_transpose": ["NCHW", "IOHW"]}
    passes = [
        *canonical_passes(until="fold_scale_axis" if fold_scales else PROFILED),
        relax.transform.ConvertLayout(layouts),
        canonicalize,
        untranspose_quantize,
        pad_int8_channels,
        *layout_passes,
        fold_bias,
        # sort, topk, cumsum and sampling have no legalization: they dispatch to TOPI kernels
        *cpu_generic.library_dispatch_passes(target),
        relax.transform.LegalizeOps(customize_legalize_map=legalize),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
        apply_schedules,
        lower_dot_blocks,
        lower_exp,
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
) -> tvm.runtime.Executable:
    """Compiles a Relax module (NCHW, as imported) into a fast CPU executable.

    ``profiler`` sets ``TVM_NUM_THREADS`` on import so that TVM's pool uses every core.
    """
    target = target or host_target()
    pipeline = relax_pipeline(target, fold_scales, layout_passes)
    return tvm.compile(mod, target=target, relax_pipeline=pipeline)
