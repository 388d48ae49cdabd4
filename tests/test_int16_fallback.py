"""int16 activations for the layers an accuracy budget finds too sensitive: the integer formula
(int16 × int8 → int32, levels capped so the accumulator cannot overflow), and the budget
trying int16 before FP32."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from onnx import helper
from test_byoc import _asym, _conv_reference, _doc
from tvm import relax

from rangeprof.byoc.evaluate import evaluate, fit_budget
from rangeprof.byoc.lowering import FP32, INT16
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.policy import ActivationQ, quantize_weights, wide_input
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model

from conftest import SHARED, zoo_model
from onnx_builders import conv_relu, save, single_io_model

X86 = get_plugin("x86")


def _run(qm, modes, x):
    mod, _ = qm.lower(modes, expose=True)
    vm = relax.VirtualMachine(X86.compile(mod), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x))[1].numpy()


def _wide(q: dict, w, axis):
    x = ActivationQ(q["profile_id"], q["scale"], q["zero_point"], q["dtype"])
    return wide_input(x, w, axis, X86.policy)


def test_int16_conv_region_equals_integer_formula(tmp_path):
    rng = np.random.default_rng(11)
    model, w, b = conv_relu(rng, 8, 16, 9)
    path = save(model, tmp_path)
    x = rng.normal(size=(1, 8, 9, 9)).astype(np.float32)
    x_q, out_q = _asym(-2.5, 3.0, "input:x"), _asym(0.0, 5.0, "act")
    qm = quantize_model(path, _doc(path, [x_q, out_q]), X86)
    (region,) = qm.regions
    got = _run(qm, {region.name: INT16}, x)

    wide, levels = _wide(x_q, w, 0)
    assert (wide.dtype, wide.zero_point, levels) == ("int16", 0, 32767)  # every level fits
    # The 8-bit range [-2.5, 3.0] (its grid's ends), symmetric: 3.0 / 32767 per level.
    assert wide.scale == pytest.approx(3.0 / 32767, rel=1e-2)
    xq = np.clip(np.round(x / np.float32(wide.scale)), -levels, levels).astype(np.int64)
    wq, w_scales = quantize_weights(w, 0, X86.policy, b, wide.scale)
    acc = _conv_reference(xq, 0, wq, 1, 1, 1, 1)
    offset = (b / (wide.scale * w_scales)).astype(np.float32).reshape(1, -1, 1, 1)
    scale = (wide.scale * w_scales).astype(np.float32).reshape(1, -1, 1, 1)
    want = np.maximum((acc.astype(np.float32) + offset) * scale, 0)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    fp32, int8 = _run(qm, {region.name: FP32}, x), _run(qm, {}, x)
    # 256 times the input resolution: the error left is mostly the int8 weights'.
    assert np.abs(got - fp32).max() < np.abs(int8 - fp32).max() / 2


def test_int16_levels_are_capped_so_the_int32_accumulator_cannot_overflow(tmp_path):
    # 512 inputs of full-scale weights: Σ|w_q| = 127 · 512, so 2^30 / 65024 = 16513 levels.
    w = np.where(np.arange(512 * 4).reshape(512, 4) % 2, 1.0, -1.0).astype(np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="fc")
    path = save(single_io_model([node], {"w": w}, (2, 512), (2, 4)), tmp_path)
    x_q, out_q = _asym(-1.0, 1.0, "input:x"), _asym(-600.0, 600.0, "fc")
    qm = quantize_model(path, _doc(path, [x_q, out_q]), X86)
    (region,) = qm.regions
    wide, levels = _wide(x_q, w, 1)
    assert levels == 2**30 // (127 * 512)
    # Inputs far outside the calibrated range saturate at ±levels: without the clamp they
    # would reach 32767 and the sums ±2^31 (wrapping); with it they stay exact.
    x = np.full((2, 512), 5.0, np.float32) * np.sign(w[:, 0])
    got = _run(qm, {region.name: INT16}, x)
    wq, w_scales = quantize_weights(w, 1, X86.policy)
    xq = np.clip(np.round(x / np.float32(wide.scale)), -levels, levels).astype(np.int64)
    acc = xq @ wq.astype(np.int64)
    assert np.abs(acc).max() < 2**31
    want = acc.astype(np.float32) * (wide.scale * w_scales).astype(np.float32)
    assert np.array_equal(got, want)


@pytest.mark.zoo
@pytest.mark.parametrize(
    "factor, mode",
    [(80.0, INT16), (1 / 20, FP32)],
    ids=["coarse_range_int16", "clipped_range_fp32"],
)
def test_accuracy_budget_tries_int16_before_fp32(digits_profile, factor, mode):
    """A range 80 times too wide leaves the 8-bit grid too coarse: int16 restores the
    resolution and is kept. A range cut to a twentieth clips: int16 clips the same, so the
    layer is kept in FP32."""
    doc = qparams_from_profile(digits_profile, X86, "max", 99.99)
    for entry in doc["qparams"]:
        if entry["profile_id"] == "/Mul":  # region 1's output, region 2's input
            entry["scale"] *= factor
    qm = quantize_model(zoo_model("digits_cnn"), doc, X86)
    data = f"{SHARED}/data/digits.npz:test"
    plain = evaluate(qm, data, samples=150)
    worst = plain.ranked()[0].profile_id
    assert plain.drop > 1 and worst == "/Relu_1"
    fitted = fit_budget(qm, data, 0.5, samples=150)
    assert fitted.drop <= 0.5
    kept = fitted.kept_int16 if mode == INT16 else fitted.kept_fp32
    assert kept == [worst]
    assert fitted.kept_int16 + fitted.kept_fp32 == [worst]
    assert {e.profile_id: e.mode for e in fitted.layers}[worst] == mode
