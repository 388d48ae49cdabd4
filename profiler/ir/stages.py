"""The stage table: one list of the passes that lead from the tagged initial IR to what each
consumer compiles, shared by ``rangeprof inspect``, the profiling build, the CPU build and every
BYOC plugin, so that what ``inspect`` shows is what they run.

    initial [-> equalize] -> simplify_inference -> fold_constant -> fold_scale_axis -> fuse_ops
                                                                                  \\-> partition

* the **canonical** stages (:data:`CANONICAL`) are what everyone runs first; the profiling build
  stops after ``fold_constant``, where every tensor of the initial IR still exists to be
  observed (nothing folds into a weight); the CPU build and the plugins go on to
  ``fold_scale_axis`` — the plugins folding forward only (:func:`fold_scale_axis_passes`);
* ``equalize`` (cross-layer equalization,
  :mod:`~rangeprof.profiler.ir.passes.equalize`) runs only when asked, on the initial IR: the
  profiling build instruments the equalized model; a profile made with it records so and every
  later build of that profile runs it again (it depends on the weights alone);
* ``fuse_ops`` is TVM's operator fusion, ``partition`` a plugin's pattern table
  (:func:`partition`) — ``inspect`` shows the one of the target it is given.

Every pass here keeps spans, or is wrapped in :class:`~rangeprof.profiler.ir.lineage.Tracked`
where it is tracked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tvm
from tvm import relax

from rangeprof.profiler.ir.lineage import StageReport, Tracked, stage_report
from rangeprof.profiler.ir.passes.canonicalize import Canonicalize, LegalizeTrainingBatchNorm
from rangeprof.profiler.ir.passes.equalize import CrossLayerEqualization
from rangeprof.profiler.ir.passes.fold_scale_axis import FoldScaleAxis, ForwardFoldScaleAxis

Patterns = list[relax.transform.FusionPattern]


@dataclass(frozen=True)
class StageSpec:
    name: str
    passes: Callable[[bool], list[tvm.transform.Pass]]  # of ``quantized``


def fold_scale_axis_passes(quantized: bool) -> list[tvm.transform.Pass]:
    """The ``fold_scale_axis`` stage. A quantized build folds forward only: an integer conv /
    dense quantizes the tensor it reads in the initial IR — the tensor the profile measured and
    every QDQ tool pairs — so a scale in front of it stays an FP32 operator (fused into the
    quantize) instead of moving into its weights and making it quantize the tensor before."""
    return [ForwardFoldScaleAxis() if quantized else FoldScaleAxis(), Canonicalize()]


# Batch norms become per-channel constants, folded in numpy (``Canonicalize``), then fold into
# conv / dense weights, leaving one bias add per layer (``Canonicalize`` again makes the biases
# full rank).
CANONICAL = (
    StageSpec("equalize", lambda _: [CrossLayerEqualization()]),
    StageSpec(
        "simplify_inference",
        lambda _: [LegalizeTrainingBatchNorm(), relax.transform.DecomposeOpsForInference()],
    ),
    StageSpec("fold_constant", lambda _: [Canonicalize()]),
    StageSpec("fold_scale_axis", fold_scale_axis_passes),
)
PROFILED = "fold_constant"  # the last stage of the profiling build


def _canonical(until: str, equalize: bool) -> list[StageSpec]:
    names = [s.name for s in CANONICAL]
    specs = CANONICAL[: names.index(until) + 1]
    return [s for s in specs if equalize or s.name != "equalize"]


def canonical_passes(
    until: str = "fold_scale_axis",
    equalize: bool = False,
    tracked: bool = False,
    quantized: bool = False,
) -> list[tvm.transform.Pass]:
    """The canonical stages' passes, in order, up to and including stage ``until``, for a
    ``quantized`` build or not; ``tracked`` wraps each in :class:`Tracked` (carrying lineage
    through TVM's own passes)."""
    passes = [p for spec in _canonical(until, equalize) for p in spec.passes(quantized)]
    return [Tracked(p) for p in passes] if tracked else passes


def canonicalized(mod: tvm.IRModule, equalize: bool = False) -> tvm.IRModule:
    """``mod`` through every canonical stage of a quantized build, lineage tracked: what
    plugins partition."""
    passes = canonical_passes(equalize=equalize, tracked=True, quantized=True)
    return tvm.transform.Sequential(passes)(mod)


def partition(mod: tvm.IRModule, patterns: Patterns) -> tvm.IRModule:
    """Composite functions for every match of a plugin's ``patterns`` (constants bound inside
    them), with lineage carried onto their call sites."""
    fuse = relax.transform.FuseOpsByPattern(patterns, bind_constants=True, annotate_codegen=False)
    return Tracked(fuse)(mod)


def _fuse_ops() -> list[tvm.transform.Pass]:
    return [
        Tracked(relax.transform.LegalizeOps()),
        Tracked(relax.transform.AnnotateTIROpPattern()),
        Tracked(relax.transform.FuseOps()),
        Tracked(relax.transform.FuseTIR()),
    ]


@dataclass
class Stage:
    name: str
    mod: tvm.IRModule
    report: StageReport


def stage_names(equalize: bool = False, partitioned: bool = True) -> tuple[str, ...]:
    """The stages :func:`run_stages` reports, in order."""
    names = ["initial", *(s.name for s in _canonical("fold_scale_axis", equalize)), "fuse_ops"]
    return tuple([*names, "partition"] if partitioned else names)


STAGE_NAMES = stage_names()


def run_stages(
    mod: tvm.IRModule,
    all_ids: set[str],
    initial_fates: dict[str, str] | None = None,
    patterns: Patterns | None = None,
    equalize: bool = False,
) -> list[Stage]:
    """Runs every stage on the tagged initial module and reports lineage after each;
    ``partition`` with a plugin's ``patterns``, when given (the stages then those of a quantized
    build)."""
    plan: list[tuple[str, str, Sequence[tvm.transform.Pass]]] = []
    source = "initial"
    for spec in _canonical("fold_scale_axis", equalize):
        passes = spec.passes(patterns is not None)
        plan.append((spec.name, source, [Tracked(p) for p in passes]))
        source = spec.name
    plan.append(("fuse_ops", source, _fuse_ops()))
    initial = stage_report("initial", mod, all_ids, previous_fates=initial_fates)
    stages = [Stage("initial", mod, initial)]
    by_name = {"initial": stages[0]}

    def report(name: str, before: Stage, after: tvm.IRModule) -> None:
        rep = stage_report(name, after, all_ids, before.mod, before.report.fates)
        by_name[name] = Stage(name, after, rep)
        stages.append(by_name[name])

    for name, source, passes in plan:
        before = by_name[source]
        report(name, before, tvm.transform.Sequential(list(passes))(before.mod))
    if patterns is not None:
        before = by_name[source]
        report("partition", before, partition(before.mod, patterns))
    return stages
