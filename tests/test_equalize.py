"""Cross-layer equalization: the same function with even weight ranges, identity kept, and the
profile and the builds made from it agreeing on the equalized weights."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import tvm
from tvm import relax

from rangeprof.profiler.ir.passes.equalize import NAME
from rangeprof.profiler.ir.spans import ids_of
from rangeprof.profiler.ir.stages import stage_names
from rangeprof.profiler.ir.tracking import track_model
from rangeprof.workflows import profiling, quantize
from rangeprof.workflows.requests import EvaluateRequest, ProfileRequest

import onnx_builders as mb
from conftest import SHARED, zoo_model


def _constants(mod) -> dict[str, np.ndarray]:
    found = {}

    def visit(expr):
        if isinstance(expr, tvm.ir.GenericConst):
            found.update(dict.fromkeys(ids_of(expr), expr.value.numpy()))

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


def _conv_weights(mod) -> list[np.ndarray]:
    weights = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and str(value.op.name) == "relax.nn.conv2d":
                weights.append(value.args[1].value.numpy().astype(np.float64))
    return weights


def _per_channel(w: np.ndarray, axis: int) -> np.ndarray:
    return np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)


def _run(mod, x):
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_equalization_keeps_the_function_and_evens_the_ranges(tmp_path):
    model = mb.unbalanced_pair()
    tracked = track_model(mb.save(model, tmp_path), equalize=True)
    assert [s.name for s in tracked.stages] == list(stage_names(equalize=True, partitioned=False))
    assert tracked.problems() == []  # every binding keeps its lineage
    initial, equalized = tracked.stage("initial").mod, tracked.stage("equalize").mod
    before, after = _constants(initial), _constants(equalized)
    assert set(before) == set(after)  # every constant keeps its profileID
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert {"weight:w1", "weight:b1", "weight:w2", "weight:w3"} <= changed
    assert "weight:bn.v" not in changed and "weight:bn.g" not in changed

    x = np.random.default_rng(0).normal(size=(1, 3, 6, 6)).astype("float32")
    (expected,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(_run(equalized, x), expected, rtol=1e-4, atol=1e-4)

    # After folding, conv1's output channel c, the depthwise channel c and the pointwise input
    # channel c have one range: the scales have settled.
    spreads = {}
    for stage in ("fold_scale_axis",):
        conv1, dw, pw = _conv_weights(tracked.stage(stage).mod)
        ranges = [_per_channel(conv1, 0), _per_channel(dw, 0), _per_channel(pw, 1)]
        np.testing.assert_allclose(ranges[0], ranges[1], rtol=1e-3)
        np.testing.assert_allclose(ranges[1], ranges[2], rtol=1e-3)
        spreads[stage] = ranges[0].max() / ranges[0].min()
    unequalized = track_model(mb.save(model, tmp_path, "plain.onnx"))
    conv1 = _conv_weights(unequalized.stage("fold_scale_axis").mod)[0]
    plain = _per_channel(conv1, 0)
    assert spreads["fold_scale_axis"] < plain.max() / plain.min() / 10


def test_a_bounded_activation_stops_equalization(tmp_path):
    # Clip(0, 6) is not homogeneous: conv1 and the depthwise conv keep their weights; the
    # depthwise -> pointwise pair, with nothing between them, is still equalized.
    tracked = track_model(mb.save(mb.unbalanced_pair("Clip"), tmp_path), equalize=True)
    before = _constants(tracked.stage("initial").mod)
    after = _constants(tracked.stage("equalize").mod)
    assert np.array_equal(before["weight:w1"], after["weight:w1"])
    assert not np.array_equal(before["weight:w3"], after["weight:w3"])
    assert tracked.problems() == []


@pytest.fixture(scope="module")
def equalized_profile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cle")
    request = ProfileRequest(
        model=zoo_model("digits_cnn"),
        data=f"{SHARED / 'data' / 'digits.npz'}:calib",
        samples=128,
        equalize=True,
    )
    doc = profiling.profile(request).to_json()
    path = folder / "profile.json"
    path.write_text(json.dumps(doc))
    return doc, path


@pytest.mark.zoo
def test_a_profile_of_the_equalized_model_builds_equalized(equalized_profile):
    doc, path = equalized_profile
    assert doc["model"]["transforms"] == [NAME]
    assert doc["run"]["options"]["equalize"] is True
    # The profile's weight statistics are those of the equalized weights.
    tracked = track_model(zoo_model("digits_cnn"), equalize=True)
    equalized = _constants(tracked.stage("equalize").mod)
    original = _constants(tracked.stage("initial").mod)
    entries = {e["profile_id"]: e for e in doc["tensors"]}
    moved = [k for k in equalized if not np.array_equal(equalized[k], original[k])]
    assert moved
    for key in moved:
        if key in entries and entries[key]["max"] is not None:
            assert entries[key]["max"] == pytest.approx(float(equalized[key].max()), rel=1e-6)

    data = SHARED / "data" / "digits.npz"
    report = quantize.evaluate(
        EvaluateRequest(
            model=zoo_model("digits_cnn"),
            profile=path,
            data=f"{data}:test",
            labels=f"{data}:test_labels",
            samples=200,
        )
    ).to_json()
    # The build equalized the model as the profile was: its ranges fit (a build of the
    # unequalized weights with these ranges would clip conv1's wide channels).
    assert report["int8_top1"] >= report["fp32_top1"] - 0.02
    assert report["output_sqnr_db"] > 20
