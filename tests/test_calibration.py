"""Calibration from stored statistics: hand-computed cases for every method, scheme and dtype."""

from __future__ import annotations

import math

import jsonschema
import numpy as np
import pytest

from rangeprof.profiler.calibrate.methods import (
    CalibrationOptions,
    _kl_threshold,
    calibrate,
    qparams_for,
    schema,
)
from rangeprof.profiler.errors import RangeprofError

from profile_builders import entry, profile


def qp(values, **options):
    return qparams_for(entry(values), CalibrationOptions(**options))


def gaussian_with_outliers(n: int, outliers: int, at: float = 50.0, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    x[: outliers // 2] = at
    x[outliers // 2 : outliers] = -at
    return x


# --- max ------------------------------------------------------------------------------------


def test_max_symmetric_int8():
    p = qp([-2.0, 0.5, 1.0])
    assert (p.method, p.scale, p.zero_point, p.axis) == ("max", 2 / 127, 0, None)
    assert p.range == pytest.approx((-2.0, 2.0))


def test_max_symmetric_uint8_is_the_int8_grid_shifted_by_128():
    p = qp([-2.0, 0.5, 1.0], dtype="uint8")
    assert (p.scale, p.zero_point) == (2 / 127, 128)
    assert p.range == pytest.approx((-2.0, 2.0))  # q in [1, 255]


def test_max_symmetric_int16():
    p = qp([-2.0, 0.5, 1.0], dtype="int16")
    assert (p.scale, p.zero_point) == (2 / 32767, 0)
    assert p.range == pytest.approx((-2.0, 2.0))


def test_max_asymmetric():
    s = 4 / 255
    u8 = qp([-1.0, 3.0], scheme="asym", dtype="uint8")
    assert (u8.scale, u8.zero_point) == (s, 64)  # round(0 + 1 / s) = round(63.75)
    assert u8.range == pytest.approx((-64 * s, 191 * s))
    i8 = qp([-1.0, 3.0], scheme="asym", dtype="int8")
    assert (i8.scale, i8.zero_point) == (s, -64)  # round(-128 + 63.75)
    i16 = qp([-1.0, 3.0], scheme="asym", dtype="int16")
    assert (i16.scale, i16.zero_point) == (4 / 65535, round(-32768 + 65535 / 4))


def test_asymmetric_range_always_holds_zero():
    relu = qp([0.5, 4.0], scheme="asym", dtype="uint8")
    assert (relu.scale, relu.zero_point) == (4 / 255, 0)
    assert relu.range == pytest.approx((0.0, 4.0))
    negative = qp([-4.0, -0.5], scheme="asym", dtype="int8")
    assert (negative.scale, negative.zero_point) == (4 / 255, 127)
    assert negative.range == pytest.approx((-4.0, 0.0))


def test_power_of_two_rounds_the_scale_up():
    p = qp([-2.0, 1.0], power_of_two=True)
    assert (p.scale, p.zero_point) == (2.0**-5, 0)  # 2/127 = 0.0157 -> 1/32
    assert p.range == (-127 / 32, 127 / 32)
    exact = qp([-127 / 16, 1.0], power_of_two=True)
    assert exact.scale == 1 / 16


def test_power_of_two_asymmetric_keeps_the_range_on_the_grid():
    p = qp([-1.0, 3.0], scheme="asym", dtype="uint8", power_of_two=True)
    assert (p.scale, p.zero_point) == (1 / 32, 32)
    # round(0 + 1.01 * 32) = 32 would put -1.01 off the grid; 33 keeps it.
    q = qp([-1.01, 3.0], scheme="asym", dtype="uint8", power_of_two=True)
    assert (q.scale, q.zero_point) == (1 / 32, 33)
    lo, hi = q.range
    assert lo <= -1.01 and hi >= 3.0


# --- percentile -----------------------------------------------------------------------------


def test_percentile_symmetric_matches_numpy_within_a_bin():
    x = np.arange(10000, dtype=np.float32)
    e = entry(x)
    width = 2.0 ** e["histogram"]["exponent"]
    p = qparams_for(e, CalibrationOptions(method="percentile", percentile=99))
    assert p.method == "percentile"
    assert abs(p.range[1] - np.percentile(x, 99)) <= width
    assert p.range[1] == pytest.approx(9899, abs=width)
    assert p.scale == p.range[1] / 127


def test_percentile_symmetric_folds_negative_values():
    x = np.concatenate([np.arange(5000), -np.arange(1, 5001)]).astype(np.float32)
    e = entry(x)
    width = 2.0 ** e["histogram"]["exponent"]
    p = qparams_for(e, CalibrationOptions(method="percentile", percentile=99))
    assert abs(p.range[1] - np.percentile(np.abs(x), 99)) <= width


def test_percentile_asymmetric_cuts_both_tails():
    x = np.arange(-5000, 5000, dtype=np.float32)
    e = entry(x)
    width = 2.0 ** e["histogram"]["exponent"]
    options = CalibrationOptions(method="percentile", percentile=99, scheme="asym", dtype="uint8")
    p = qparams_for(e, options)
    lo, hi = np.percentile(x, [0.5, 99.5])
    # The represented range differs from the clip range by under a step (zero point rounding).
    assert p.range[0] == pytest.approx(lo, abs=width + p.scale)
    assert p.range[1] == pytest.approx(hi, abs=width + p.scale)


def test_percentile_100_is_the_max():
    x = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    p = qp(x, method="percentile", percentile=100)
    assert p.range[1] == pytest.approx(np.abs(x).max())


# --- entropy --------------------------------------------------------------------------------


def test_entropy_clips_rare_outliers():
    # 99.9% N(0, 1) and 0.1% at +-50: the threshold cuts the outliers, keeps the bulk.
    p = qp(gaussian_with_outliers(100_000, 100), method="entropy")
    assert p.method == "entropy" and p.note is None
    assert 3.0 < p.range[1] < 10.0


def test_entropy_keeps_the_range_of_uniform_data():
    x = np.random.default_rng(1).uniform(-1, 1, 100_000).astype(np.float32)
    p = qp(x, method="entropy")
    assert p.range[1] == pytest.approx(1.0, rel=0.03)


def test_entropy_is_not_pulled_down_by_the_zeros_of_a_relu_output():
    # Half the values are exact zeros: counted as they are, they dominate the divergence and the
    # search clips at 2σ; with the zero bin levelled the threshold keeps the tail up to ~4σ.
    x = np.maximum(np.random.default_rng(4).normal(size=200_000), 0).astype(np.float32)
    for scheme, dtype in (("sym", "int8"), ("asym", "uint8")):
        p = qp(x, method="entropy", scheme=scheme, dtype=dtype)
        assert 3.5 < p.range[1] <= x.max()


def test_entropy_asymmetric_intersects_the_threshold_with_the_data_range():
    x = np.abs(gaussian_with_outliers(100_000, 100))
    p = qp(x, method="entropy", scheme="asym", dtype="uint8")
    assert p.zero_point == 0 and p.range[0] == 0.0
    assert 3.0 < p.range[1] < 10.0


def naive_kl_threshold(counts, width: float, levels: int) -> float:
    """TensorRT's search written out directly, bin by bin (reference for the prefix-sum form)."""
    split = 1
    while len(counts) * split < 16 * levels:
        split *= 2
    f = np.repeat(np.asarray(counts, dtype=np.float64) / split, split)
    best, best_i = math.inf, None
    for i in range(levels, len(f) + 1):
        clipped = f[:i]
        if clipped.sum() == 0:
            continue
        p = clipped.copy()
        p[-1] += f[i:].sum()
        q = np.zeros(i)
        for level in range(levels):
            a, b = -(-level * i // levels), -(-(level + 1) * i // levels)
            nonzero = clipped[a:b] > 0
            if nonzero.any():
                q[a:b][nonzero] = clipped[a:b].sum() / nonzero.sum()
        if q[-1] == 0 and p[-1] > 0:
            q[-1] = 1e-4
        p, q = p / p.sum(), q / q.sum()
        m = p > 0
        kl = float(np.sum(p[m] * np.log(p[m] / q[m])))
        if kl < best:
            best, best_i = kl, i
    return best_i * width / split


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("levels", [8, 16])
def test_kl_search_matches_the_direct_formulation(seed, levels):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(60, 120))
    counts = rng.poisson(300 * np.exp(-np.arange(n) / rng.uniform(6, 30))).tolist()
    counts[-1] += 2  # a few outliers, usually past empty bins
    assert _kl_threshold(counts, 0.5, levels) == naive_kl_threshold(counts, 0.5, levels)


def test_entropy_falls_back_to_max_on_a_coarse_histogram():
    x = gaussian_with_outliers(10_000, 10)
    coarse = qparams_for(entry(x, bins=64), CalibrationOptions(method="entropy"))
    assert coarse.method == "max" and "fewer than the 128 levels" in coarse.note
    assert coarse.range[1] == pytest.approx(50.0)
    int16 = qp(x, method="entropy", dtype="int16")  # 2048 bins cannot resolve 32768 levels
    assert int16.method == "max" and "32768" in int16.note


# --- mse ------------------------------------------------------------------------------------


def test_mse_keeps_about_the_max_of_uniform_data():
    # For uniform data the optimal clip is the max less half a step (0.996 for int8).
    x = np.random.default_rng(1).uniform(-1, 1, 200_000).astype(np.float32)
    p = qp(x, method="mse")
    assert p.method == "mse"
    assert p.range[1] == pytest.approx(1.0, rel=0.02)
    asym = qp(x, method="mse", scheme="asym", dtype="uint8")
    assert asym.range[0] == pytest.approx(-1.0, rel=0.02)
    assert asym.range[1] == pytest.approx(1.0, rel=0.02)


def test_mse_clips_rare_far_outliers():
    # 1 in 500 000 at +-50: saturating them costs less than the coarser grid of a 50 range.
    x = gaussian_with_outliers(1_000_000, 2)
    p = qp(x, method="mse")
    assert 4.0 < p.range[1] < 25.0
    asym = qp(x, method="mse", scheme="asym")
    assert -25.0 < asym.range[0] < -4.0 and 4.0 < asym.range[1] < 25.0


def test_mse_keeps_frequent_outliers():
    # 0.1% at +-50 is too much mass to saturate: the squared error favours the full range.
    p = qp(gaussian_with_outliers(100_000, 100), method="mse")
    assert p.range[1] > 45.0


# --- per-channel ----------------------------------------------------------------------------


def test_per_channel_weights_use_each_channels_max():
    w = np.random.default_rng(4).standard_normal((4, 3, 2, 2)).astype(np.float32)
    w[2] *= 10
    e = entry(w, kind="weight", channel_axis=0)
    p = qparams_for(e, CalibrationOptions(granularity="per-channel"))
    expected = np.abs(w).max(axis=(1, 2, 3)) / 127
    assert p.axis == 0 and p.method == "max" and p.note is None
    assert p.scale == pytest.approx(tuple(expected.tolist()))
    assert p.zero_point == (0, 0, 0, 0)
    assert p.range[1] == pytest.approx(tuple((expected * 127).tolist()))
    entropy = qparams_for(e, CalibrationOptions(method="entropy", granularity="per-channel"))
    assert entropy.method == "max" and entropy.scale == p.scale and "per-channel" in entropy.note


def test_per_channel_asymmetric_and_degenerate_channels():
    w = np.array([[-1.0, 3.0], [0.0, 0.0], [np.nan, np.nan]], dtype=np.float32)
    e = entry(w, kind="weight", channel_axis=0)
    options = CalibrationOptions(granularity="per-channel", scheme="asym", dtype="uint8")
    p = qparams_for(e, options)
    assert p.scale == (4 / 255, 1.0, 1.0)
    assert p.zero_point == (64, 0, 0)


def test_per_channel_leaves_activations_per_tensor():
    x = np.random.default_rng(5).standard_normal((1, 3, 4, 4)).astype(np.float32)
    e = entry(x, channel_axis=1)  # conv outputs carry per-channel ranges too
    p = qparams_for(e, CalibrationOptions(granularity="per-channel"))
    assert p.axis is None and isinstance(p.scale, float)


def test_per_channel_applies_to_static_weight_transforms():
    w = np.random.default_rng(5).standard_normal((4, 3)).astype(np.float32)
    e = {**entry(w, channel_axis=1), "static": True}  # e.g. a Gemm's transposed weight
    p = qparams_for(e, CalibrationOptions(granularity="per-channel"))
    assert p.axis == 1 and p.scale == pytest.approx(tuple(np.abs(w).max(axis=0) / 127))


# --- degenerate tensors ---------------------------------------------------------------------


@pytest.mark.parametrize("values", [np.zeros(16), np.full(16, np.nan), np.array([np.inf, np.nan])])
@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse"])
def test_degenerate_tensors_get_scale_one(values, method):
    sym = qp(values, method=method)
    assert (sym.method, sym.scale, sym.zero_point) == ("max", 1.0, 0)
    assert "zero-width" in sym.note
    assert qp(values, method=method, dtype="uint8").zero_point == 128
    assert qp(values, method=method, scheme="asym", dtype="uint8").zero_point == 0


def test_constant_tensor():
    assert qp(np.full(8, 3.0)).scale == 3 / 127
    p = qp(np.full(8, 3.0), method="mse", scheme="asym", dtype="uint8")
    assert (p.scale, p.zero_point) == (3 / 255, 0)


# --- options and errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "kl"}, "unknown calibration method 'kl'"),
        ({"scheme": "affine"}, "unknown quantization scheme"),
        ({"dtype": "int4"}, "unknown quantized dtype 'int4'"),
        ({"granularity": "per-block"}, "unknown granularity"),
        ({"percentile": 0}, "percentile must be a number in \\(0, 100\\]"),
        ({"percentile": 100.5}, "percentile must be"),
        ({"percentile": "99"}, "percentile must be"),
        ({"percentile": True}, "percentile must be"),
        ({"power_of_two": "yes"}, "power_of_two must be true or false"),
    ],
)
def test_options_are_validated(options, message):
    with pytest.raises(RangeprofError, match=message):
        CalibrationOptions(**options)


def test_methods_other_than_max_need_a_histogram():
    e = entry([-1.0, 2.0], bins=None, name="/conv/Conv")
    assert qparams_for(e, CalibrationOptions()).scale == 2 / 127
    with pytest.raises(RangeprofError, match=r"'/conv/Conv' has no histogram.*'percentile'"):
        qparams_for(e, CalibrationOptions(method="percentile"))


# --- the QPARAMS document -------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        CalibrationOptions(),
        CalibrationOptions(method="entropy", scheme="asym", dtype="uint8", power_of_two=True),
        CalibrationOptions(method="mse", granularity="per-channel", dtype="int16"),
        CalibrationOptions(method="percentile", percentile=99.9, granularity="per-channel"),
    ],
)
def test_calibrate_document_validates(options):
    rng = np.random.default_rng(6)
    doc = profile(
        entry(rng.standard_normal((1, 4)), kind="input", name="input:x", source_tensor="x"),
        entry(rng.standard_normal((4, 3)), kind="weight", channel_axis=1, name="weight:w"),
        entry(rng.standard_normal((1, 3)), name="/mm/MatMul#0", source_tensor=None),
        entry(np.zeros(3), name="/relu/Relu"),
    )
    out = calibrate(doc, options)
    jsonschema.validate(out, schema())
    assert out["model"] == doc["model"] and out["options"] == options.to_json()
    assert [q["profile_id"] for q in out["qparams"]] == [t["profile_id"] for t in doc["tensors"]]
    weight = out["qparams"][1]
    per_channel = options.granularity == "per-channel"
    assert (weight["axis"] == 1) == per_channel
    assert isinstance(weight["scale"], list) == per_channel
