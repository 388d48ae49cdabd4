"""The tracked compilation stages, from the tagged initial IR to fused and partitioned IR.

Stages run in this order, each one on the previous stage's module, except that ``fuse_ops``
(what the executor compiles) and ``partition`` (what BYOC plugins see) both start from
``fold_scale_axis``:

    initial -> simplify_inference -> fold_constant -> fold_scale_axis -> fuse_ops
                                                                    \\-> partition

Every TVM pass that may drop spans is wrapped in :class:`~rangeprof.profiler.ir.lineage.Tracked`.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from rangeprof.profiler.ir.lineage import StageReport, Tracked, stage_report
from rangeprof.profiler.ir.passes.fold_constant import fold_constant_numpy
from rangeprof.profiler.ir.passes.fold_scale_axis import FoldScaleAxis

STAGE_NAMES = (
    "initial",
    "simplify_inference",
    "fold_constant",
    "fold_scale_axis",
    "fuse_ops",
    "partition",
)


def conv_dense_patterns(prefix: str = "rangeprof") -> list[relax.transform.FusionPattern]:
    """A generic pattern table: conv2d / matmul with constant weights, optional bias and relu.

    Longest patterns first: FuseOpsByPattern takes the first pattern that matches.
    """
    patterns = []
    for op in ("relax.nn.conv2d", "relax.matmul"):
        short = op.rsplit(".", 1)[-1]
        base = is_op(op)(wildcard(), is_const())
        biased = is_op("relax.add")(base, is_const())
        patterns += [
            (f"{prefix}.{short}_bias_relu", is_op("relax.nn.relu")(biased)),
            (f"{prefix}.{short}_bias", biased),
            (f"{prefix}.{short}_relu", is_op("relax.nn.relu")(base)),
            (f"{prefix}.{short}", base),
        ]
    return [relax.transform.FusionPattern(name, pattern) for name, pattern in patterns]


@dataclass
class Stage:
    name: str
    mod: tvm.IRModule
    report: StageReport


def _fuse_ops() -> list[tvm.transform.Pass]:
    return [
        Tracked(relax.transform.LegalizeOps()),
        Tracked(relax.transform.AnnotateTIROpPattern()),
        Tracked(relax.transform.FuseOps()),
        Tracked(relax.transform.FuseTIR()),
    ]


def _partition(patterns) -> list[tvm.transform.Pass]:
    return [
        Tracked(
            relax.transform.FuseOpsByPattern(patterns, bind_constants=False, annotate_codegen=True)
        ),
        Tracked(relax.transform.MergeCompositeFunctions()),
    ]


def run_stages(
    mod: tvm.IRModule,
    all_ids: set[str],
    initial_fates: dict[str, str] | None = None,
    patterns: list[relax.transform.FusionPattern] | None = None,
) -> list[Stage]:
    """Runs every stage on the tagged initial module and reports lineage after each."""
    # numpy first: TVM's FoldConstant compiles each call with LLVM; it folds what is left.
    fold = [Tracked(fold_constant_numpy), Tracked(relax.transform.FoldConstant())]
    plan = [
        ("simplify_inference", "initial", [Tracked(relax.transform.DecomposeOpsForInference())]),
        ("fold_constant", "simplify_inference", fold),
        ("fold_scale_axis", "fold_constant", [Tracked(FoldScaleAxis())]),
        ("fuse_ops", "fold_scale_axis", _fuse_ops()),
        ("partition", "fold_scale_axis", _partition(patterns or conv_dense_patterns())),
    ]
    initial = stage_report("initial", mod, all_ids, previous_fates=initial_fates)
    stages = {"initial": Stage("initial", mod, initial)}
    for name, source, passes in plan:
        before = stages[source]
        after = tvm.transform.Sequential(passes)(before.mod)
        report = stage_report(name, after, all_ids, before.mod, before.report.fates)
        stages[name] = Stage(name, after, report)
    return [stages[n] for n in STAGE_NAMES]
