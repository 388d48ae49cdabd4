"""Lineage through every stage on small models: full coverage, absorption, fates, the check."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax

from rangeprof.byoc.plugin import get_plugin
from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.ir.lineage import Tracked, stage_report, untracked_bindings, verify_lineage
from rangeprof.profiler.ir.passes.fold_constant import FoldConstantNumpy
from rangeprof.profiler.ir.stages import STAGE_NAMES
from rangeprof.profiler.ir.tracking import track_model

import onnx_builders as mb
from conftest import zoo_model

BUILDERS = {
    "gemm": mb.gemm,
    "conv_bias": mb.conv_bias,
    "conv_bn_relu_scale": mb.conv_bn_relu_scale,
    "conv_bn_relu_negative_scale": lambda: mb.conv_bn_relu_scale(-1.0),
    "scale_before_conv": mb.scale_before_conv,
    "constant_subgraph": mb.constant_subgraph,
    "shape_arithmetic": mb.shape_arithmetic,
}


def _track(name, tmp_path):
    # Partitioned as the x86 plugin partitions, as `rangeprof inspect` shows it by default.
    return track_model(mb.save(BUILDERS[name](), tmp_path), patterns=get_plugin("x86").patterns())


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_binding_has_lineage_in_every_stage(name, tmp_path):
    tracked = _track(name, tmp_path)
    assert [s.name for s in tracked.stages] == list(STAGE_NAMES)
    for stage in tracked.stages:
        assert stage.report.bindings > 0
        assert stage.report.tracked == stage.report.bindings, stage.name
    assert tracked.problems() == []


def _lineage_of_op(stage, op_prefix):
    return [
        set(stage.report.lineage[ref_key])
        for ref_key, ops in _ops_by_key(stage).items()
        if ops.startswith(op_prefix)
    ]


def _ops_by_key(stage):
    from rangeprof.profiler.ir.bindings import module_bindings, op_name

    return {ref.key: op_name(ref.value) for ref in module_bindings(stage.mod)}


def test_conv_absorbs_batch_norm_and_channel_scale(tmp_path):
    tracked = _track("conv_bn_relu_scale", tmp_path)
    folded = tracked.stage("fold_scale_axis")
    (conv,) = _lineage_of_op(folded, "relax.nn.conv2d")
    assert "conv" in conv and "scale" in conv
    assert any(i.startswith("bn#") for i in conv)
    assert not _lineage_of_op(folded, "relax.multiply")
    assert not _lineage_of_op(folded, "relax.divide")


def test_negative_scale_through_relu_does_not_fold(tmp_path):
    tracked = _track("conv_bn_relu_negative_scale", tmp_path)
    folded = tracked.stage("fold_scale_axis")
    (mul,) = _lineage_of_op(folded, "relax.multiply")
    assert mul == {"scale"}
    (conv,) = _lineage_of_op(folded, "relax.nn.conv2d")
    assert "scale" not in conv


def test_scale_before_conv_folds_backward_unless_the_conv_is_quantized(tmp_path):
    path = mb.save(BUILDERS["scale_before_conv"](), tmp_path)
    folded = track_model(path).stage("fold_scale_axis")  # the FP32 build's stages
    assert not _lineage_of_op(folded, "relax.multiply")
    (conv,) = _lineage_of_op(folded, "relax.nn.conv2d")
    assert conv == {"conv", "scale"}
    # A quantized build quantizes the tensor the conv reads: the scale stays in front of it.
    kept = _track("scale_before_conv", tmp_path).stage("fold_scale_axis")
    (mul,) = _lineage_of_op(kept, "relax.multiply")
    assert mul == {"scale"}
    (conv,) = _lineage_of_op(kept, "relax.nn.conv2d")
    assert "scale" not in conv


def test_constant_subgraph_folds_with_a_fate(tmp_path):
    # The frontend computes Transpose and Mul of constants itself: the nodes and their weights
    # are folded into the MatMul at import.
    tracked = _track("constant_subgraph", tmp_path)
    initial = tracked.stage("initial").report.fates
    for lost in ("transpose_w", "halve_w", "weight:wt", "weight:k"):
        assert initial[lost] == "folded_into:matmul"
    # Relax's FoldConstant folds Gemm's weight transpose into a constant of the matmul.
    tracked = _track("gemm", tmp_path)
    folded = tracked.stage("fold_constant")
    (matmul_key,) = [k for k, op in _ops_by_key(folded).items() if op == "relax.matmul"]
    assert folded.report.fates["fc#0"] == f"folded_into:{matmul_key}"
    assert folded.report.fates["weight:w"] == f"folded_into:{matmul_key}"
    # Fates persist into later stages; nothing is alive and fated at once.
    for stage in tracked.stages[3:]:
        assert "fc#0" in stage.report.fates
        alive = {i for lin in stage.report.lineage.values() for i in lin}
        assert alive.isdisjoint(stage.report.fates)


def test_static_shape_arithmetic_folds_away(tmp_path):
    """Shape computations on static shapes leave no run-time calls (each was a VM call per
    inference): the reshape takes a constant shape and the row index a constant."""
    tracked = _track("shape_arithmetic", tmp_path)
    folded = tracked.stage("fold_constant")
    ops = set(_ops_by_key(folded).values())
    assert not ops & {"relax.shape_of", "relax.shape_to_tensor", "relax.less", "relax.where"}
    # The row of one constant index: a slice, which fuses (a take is a kernel of its own).
    assert {"relax.matmul", "relax.reshape", "relax.strided_slice"} <= ops
    assert "relax.take" not in ops
    # The shape ops' IDs went to the reshape and the slice that absorbed them.
    assert folded.report.fates["dims"].startswith("folded_into:")
    # And the CPU build of it computes what onnxruntime does.
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    vm = relax.VirtualMachine(build(tracked.imported.mod), tvm.cpu())
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x})[0]
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), want, rtol=1e-5)


def test_fused_and_composite_functions_list_every_id_inside(tmp_path):
    tracked = _track("conv_bn_relu_scale", tmp_path)
    fused = tracked.stage("fuse_ops")
    main = {k: set(v) for k, v in fused.report.lineage.items() if k.startswith("main/")}
    # conv + bias + relu fuse into one kernel, which carries all the IDs they came from.
    assert any({"conv", "relu", "scale"} <= lin for lin in main.values()), main

    part = tracked.stage("partition")
    calls = [
        set(part.report.lineage[k])
        for k, op in _ops_by_key(part).items()
        if k.startswith("main/") and op.startswith("call:")
    ]
    assert any({"conv", "relu"} <= lin for lin in calls), calls


def test_verify_lineage_reports_a_pass_that_drops_identity(tmp_path):
    tracked = _track("conv_bias", tmp_path)
    folded = tracked.stage("fold_scale_axis")
    untracked = relax.transform.LegalizeOps()(folded.mod)  # not wrapped in Tracked
    assert untracked_bindings(untracked)
    report = stage_report("legalized", untracked, tracked.all_ids, folded.mod)
    problems = verify_lineage([report], tracked.all_ids)
    assert any("has no lineage" in p for p in problems)


def test_stage_modules_still_compute_the_model(tmp_path):
    import numpy as np
    import onnxruntime as ort

    model = mb.conv_bn_relu_scale()
    tracked = track_model(mb.save(model, tmp_path))
    x = np.random.default_rng(9).normal(size=(1, 3, 6, 6)).astype("float32")
    (expected,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    for name in ("fold_scale_axis", "fuse_ops"):
        ex = tvm.compile(tracked.stage(name).mod, target=target)
        vm = relax.VirtualMachine(ex, tvm.cpu())
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["conv_bn_relu_scale", "digits_cnn"])
def test_numpy_folding_leaves_what_fold_constant_alone_leaves(name, tmp_path):
    """The fold_constant stage folds in numpy (fast); that folding gives the module, constants
    bit for bit, and the lineage report of TVM's FoldConstant alone."""
    path = zoo_model(name) if name == "digits_cnn" else mb.save(BUILDERS[name](), tmp_path)
    tracked = track_model(path)
    before = tracked.stage("simplify_inference").mod
    assert (
        tracked.stage("fold_constant").report.bindings
        < tracked.stage("simplify_inference").report.bindings
    )
    numpy_only = Tracked(FoldConstantNumpy())(before)
    tvm_only = Tracked(relax.transform.FoldConstant())(before)
    tvm.ir.assert_structural_equal(numpy_only, tvm_only, map_free_vars=True)
    ids = {layer.profile_id for layer in tracked.imported.layers}
    previous = tracked.stage("simplify_inference").report.fates
    reports = [
        stage_report("fold_constant", mod, ids, before, previous).to_json()
        for mod in (numpy_only, tvm_only)
    ]
    assert reports[0] == reports[1]
    # The numpy pass alone folds every constant chain of these models: nothing left for TVM's.
    alone = FoldConstantNumpy()(before)
    tvm.ir.assert_structural_equal(alone, relax.transform.FoldConstant()(alone))
