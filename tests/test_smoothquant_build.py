"""SmoothQuant in builds: on by default on x86 where the stored statistics say the error drops,
chosen from the QPARAMS document alone (a build from ``calibrate``'s file equals one from the
profile), shown in the manifest, off on npu, and its error lower than without it on new data."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

import rangeprof
from rangeprof.profiler.ir.passes.smooth_quant import SMOOTHED

import onnx_builders as mb

T, D = mb.TRANSFORMER_TOKENS, mb.TRANSFORMER_WIDTH


def _inputs(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, T, D)).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return rangeprof.load(
        mb.save(mb.pre_ln_transformer(hidden_outlier=10.0), tmp_path_factory.mktemp("sq"))
    )


@pytest.fixture(scope="module")
def profile(model):
    return rangeprof.profile(model, _inputs(1, 32))


@pytest.fixture(scope="module")
def held_out(model):
    """New samples and the FP32 model's outputs on them (onnxruntime)."""
    x = _inputs(7, 16)
    session = ort.InferenceSession(str(model.path))
    return x, np.stack([session.run(None, {"x": xi[None]})[0] for xi in x])


def _error(int8: rangeprof.Int8Model, held_out) -> float:
    x, reference = held_out
    outputs = np.stack([int8.run(xi[None])[0] for xi in x])
    return float(np.mean((outputs - reference) ** 2))


@pytest.fixture(scope="module")
def builds(model, profile):
    return {
        "default": rangeprof.build(model, profile, method="max"),
        "off": rangeprof.build(model, profile, method="max", smooth_quant=False),
    }


def test_the_outlier_layernorm_is_smoothed_by_default_and_the_error_drops(builds, held_out):
    smoothing = builds["default"].manifest.smoothing
    assert smoothing["smoothed"]["ln1"]["folded"] == "into its LayerNorm"
    assert smoothing["smoothed"]["ln1"]["estimated_error_ratio"] < 0.8
    assert builds["off"].manifest.smoothing is None
    assert _error(builds["default"], held_out) < 0.8 * _error(builds["off"], held_out)


def test_every_dense_input_is_smoothed_or_said_why_not(builds):
    smoothing = builds["default"].manifest.smoothing
    dense_inputs = {"ln1", "att", "ln2", "relu", "rows"}
    assert set(smoothing["smoothed"]) | set(smoothing["unsmoothed"]) >= dense_inputs - {"att"}
    for reason in smoothing["unsmoothed"].values():
        assert reason


def test_an_inserted_multiply_names_the_region_it_feeds(builds):
    """A smoothed input that is no LayerNorm's alone (the residual reads it too, or ReLU's)
    gets a multiply; the region reading it names the multiply's derived profileID, whose
    qparams the smoothed range gives."""
    int8 = builds["default"]
    inserted = [
        k
        for k, v in int8.manifest.smoothing["smoothed"].items()
        if v["folded"] != "into its LayerNorm"
    ]
    boundary = {r.input.profile_id for r in int8.manifest.regions if r.input}
    assert inserted == ["relu"] and "relu" + SMOOTHED in boundary


def test_the_qparams_file_alone_gives_the_same_build(model, profile, builds, held_out, tmp_path):
    qparams = profile.calibrate(method="max", target="x86")
    assert qparams.document["dense_inputs"]
    path = tmp_path / "q.json"
    qparams.save(path)
    again = rangeprof.build(model, rangeprof.QParams(json.loads(path.read_text())))
    assert again.manifest.smoothing == builds["default"].manifest.smoothing
    x, _ = held_out
    for xi in x[:4]:  # one at a time: the head's output has no batch axis
        np.testing.assert_array_equal(again.run(xi[None])[0], builds["default"].run(xi[None])[0])


def test_one_strength_for_every_input(model, profile):
    int8 = rangeprof.build(model, profile, method="max", smooth_alpha=0.5)
    alphas = {v["alpha"] for v in int8.manifest.smoothing["smoothed"].values()}
    assert alphas == {0.5}


def test_npu_does_not_smooth_unless_asked(model, profile):
    assert rangeprof.build(model, profile, method="max", target="npu").manifest.smoothing is None
    asked = rangeprof.build(model, profile, method="max", target="npu", smooth_quant=True)
    assert "ln1" in asked.manifest.smoothing["smoothed"]


def test_forcing_it_without_statistics_is_one_line(model, profile):
    document = profile.calibrate(method="max").document
    del document["dense_inputs"]
    with pytest.raises(rangeprof.RangeprofError, match=r"^--smooth-quant: the qparams hold no"):
        rangeprof.build(model, rangeprof.QParams(document), smooth_quant=True)
    assert rangeprof.build(model, rangeprof.QParams(document)).manifest.smoothing is None


def test_stored_bias_correction_reads_the_smoothed_means(model):
    """A smoothed input's per-channel means are its source's divided by the scales: every
    region reading a smoothed tensor is corrected, none skipped for want of means."""
    profile = rangeprof.profile(model, _inputs(1, 32), channel_stats=True)
    int8 = rangeprof.build(model, profile, method="max", bias_correction="stored")
    assert {"ln1", "relu"} <= set(int8.manifest.smoothing["smoothed"])
    assert "skipped" not in int8.manifest.bias_correction
