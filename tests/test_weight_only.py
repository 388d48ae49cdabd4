"""4-bit weight-only quantization from stored statistics: the group-wise grids against ONNX
Runtime's own quantizer, the clipping search never worse than round-to-nearest under its own
error, and the AWQ-style scaling chosen from per-channel statistics checked on sampled data."""

from __future__ import annotations

import logging
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from rangeprof.profiler.calibrate.smoothing import DenseInput
from rangeprof.profiler.calibrate.weight_only import (
    Int4Weights,
    awq_scales,
    choose_awq,
    estimate_w4_error,
    quantize_groups,
    search_clip,
    weighted_error,
)
from rangeprof.profiler.errors import RangeprofError

GROUPS = (32, 64, 128)


def _heavy(rng: np.random.Generator, k: int, n: int) -> np.ndarray:
    """Weights with the occasional large value, as trained layers have."""
    return (rng.standard_t(4, size=(k, n)) * 0.05).astype(np.float32)


@pytest.mark.parametrize("symmetric", [False, True])
def test_grid_layout_and_bounds(symmetric):
    """Codes 0..15, one scale (and zero point) per group and column, a last group shorter than
    the others, every weight within a step of its value; 0 exact (asymmetric) and the extreme
    exact (symmetric); zero groups stay zero; the packed size."""
    rng = np.random.default_rng(0)
    k, n, group = 200, 24, 64
    w = _heavy(rng, k, n)
    w[64:128, 3] = 0.0
    q = quantize_groups(w, group, symmetric)
    assert q.q.shape == (k, n) and q.q.dtype == np.uint8 and q.q.max() <= 15
    assert q.scales.shape == (4, n) and q.scales.dtype == np.float32
    assert (q.zero_points is None) == symmetric
    deq = q.dequantize()
    assert deq.dtype == np.float32 and deq.shape == (k, n)
    rows = np.arange(k) // group
    assert np.all(np.abs(deq - w) <= np.abs(q.scales[rows]) * 1.0001)
    assert np.all(deq[64:128, 3] == 0.0)
    if symmetric:
        for g in range(4):
            block = w[g * group : (g + 1) * group]
            at = np.abs(block).argmax(axis=0)
            extreme = block[at, np.arange(n)]
            np.testing.assert_allclose(deq[g * group + at, np.arange(n)], extreme, rtol=1e-6)
    else:
        exact_zero = w == 0
        assert np.all(deq[exact_zero] == 0.0)
    zeros = 0 if symmetric else (4 * n + 1) // 2
    assert q.nbytes == k * n // 2 + 4 * n * 4 + zeros


def test_symmetric_grid_beats_seven_levels():
    """The symmetric grid (the extreme on level -8) against ``max|w| / 7`` on levels -7..7: the
    documented choice is the smaller error at every group size."""
    w = np.random.default_rng(1).normal(size=(512, 256)).astype(np.float32)
    for group in GROUPS:
        blocks = w.reshape(-1, group, 256)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 7
        seven = (np.round(blocks / step) * step).reshape(w.shape)
        ours = weighted_error(w, quantize_groups(w, group, True))
        assert ours < 0.85 * float(np.mean(((seven - w) ** 2).sum(axis=0)))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", GROUPS)
def test_clip_search_never_worse_than_rtn(symmetric, group):
    """Under its own weighted error, per group and in total, the clipping search is at least as
    good as round-to-nearest, better overall; a grid of 1 alone is round-to-nearest."""
    rng = np.random.default_rng(group)
    k, n = 384, 96
    w = _heavy(rng, k, n)
    c = rng.lognormal(sigma=1.5, size=k)
    rtn, clipped = quantize_groups(w, group, symmetric), search_clip(w, group, symmetric, c)
    per_group = [
        (c[:, None] * (q.dequantize() - w) ** 2).reshape(-1, group, n).sum(axis=1)
        for q in (rtn, clipped)
    ]
    assert np.all(per_group[1] <= per_group[0] * (1 + 1e-9))
    assert weighted_error(w, clipped, c) < 0.97 * weighted_error(w, rtn, c)
    only_rtn = search_clip(w, group, symmetric, c, ratios=(1.0,))
    np.testing.assert_array_equal(only_rtn.q, rtn.q)
    np.testing.assert_array_equal(only_rtn.scales, rtn.scales)


def test_clip_search_is_fast_on_a_large_layer():
    """1024 x 1024, every group's ratio out of 21: well under a few seconds."""
    w = _heavy(np.random.default_rng(2), 1024, 1024)
    start = time.perf_counter()
    search_clip(w, 32, False, np.ones(1024))
    assert time.perf_counter() - start < 5.0


def test_bad_arguments_are_refused():
    w = np.ones((64, 8), dtype=np.float32)
    with pytest.raises(RangeprofError, match="power of two"):
        quantize_groups(w, 48, True)
    with pytest.raises(RangeprofError, match="clip ratio"):
        quantize_groups(w, 32, True, clip=1.5)
    with pytest.raises(RangeprofError, match="channel weights"):
        search_clip(w, 32, True, np.ones(10))
    x = DenseInput(-np.ones(32), np.ones(32), 1.0, 100)
    with pytest.raises(RangeprofError, match="32 channels"):
        choose_awq(x, [w], 32, True)


def _single_matmul(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="dense")],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _ort_dequantized(w: np.ndarray, group: int, symmetric: bool) -> np.ndarray:
    """The weight ONNX Runtime's ``MatMulNBitsQuantizer`` (its default RTN) stores, read back
    by running its model on the identity."""
    logging.disable(logging.INFO)  # the quantizer logs every node at INFO
    try:
        quantizer = MatMulNBitsQuantizer(
            _single_matmul(w), block_size=group, is_symmetric=symmetric
        )
        quantizer.process()
    finally:
        logging.disable(logging.NOTSET)
    model = quantizer.model.model
    assert [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": np.eye(w.shape[0], dtype=np.float32)})[0]


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", GROUPS)
def test_rtn_matches_onnxruntime_and_clipping_beats_it(symmetric, group):
    """Our round-to-nearest is ONNX Runtime's (same grids, to float rounding); the clipping
    search lowers the squared error below it."""
    w = _heavy(np.random.default_rng(3), 256, 160)
    theirs = float(np.mean((_ort_dequantized(w, group, symmetric) - w) ** 2))
    ours = float(np.mean((quantize_groups(w, group, symmetric).dequantize() - w) ** 2))
    clipped = float(np.mean((search_clip(w, group, symmetric).dequantize() - w) ** 2))
    assert ours <= theirs * (1 + 1e-4)
    assert clipped < 0.97 * theirs


def _outlier_activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Tokens of ``k`` channels, uniform in ``±a_j`` (one draw of ``a`` for every call), four
    channels 25x the others."""
    amplitude = np.random.default_rng(7).uniform(0.5, 1.5, size=k)
    amplitude[[3, 17, 40, 77]] *= 25.0
    return rng.uniform(-1.0, 1.0, size=(m, k)) * amplitude


def _statistics(x: np.ndarray) -> DenseInput:
    """What a profile records of ``x``: per-channel ranges, the mean square, values per channel."""
    return DenseInput(x.min(axis=0), x.max(axis=0), float(np.mean(x**2)), x.shape[0])


def _measured(x: np.ndarray, weights, s: np.ndarray, quantized) -> float:
    """The mean squared output error of the layers on ``x`` read as ``x / s``."""
    total = sum(
        float(np.sum(((x / s) @ q.dequantize() - x @ w) ** 2))
        for w, q in zip(weights, quantized, strict=True)
    )
    return total / (x.shape[0] * sum(w.shape[1] for w in weights))


@pytest.mark.parametrize("symmetric", [False, True])
def test_awq_lowers_the_error_on_sampled_data(symmetric):
    """With a few outlier channels, an alpha is chosen; on new samples of the distribution the
    statistics describe, the output error is lower than round-to-nearest's and than clipping's
    alone, and the estimate is within 5 % of what is measured."""
    rng = np.random.default_rng(4)
    k = 128
    weights = [_heavy(rng, k, 192), _heavy(rng, k, 64)]
    stats = _statistics(_outlier_activations(rng, 4096, k))
    choice = choose_awq(stats, weights, 32, symmetric)
    assert choice.scaled and choice.error < 0.8 * choice.unscaled
    assert estimate_w4_error(stats, weights, choice) == pytest.approx(choice.error, rel=1e-12)
    assert set(choice.errors) and min(choice.errors.values()) == choice.error

    held_out = _outlier_activations(np.random.default_rng(5), 4096, k)
    ones = np.ones(k)
    rtn = [quantize_groups(w, 32, symmetric) for w in weights]
    clipped = [search_clip(w, 32, symmetric, stats.channel_mean_squares()) for w in weights]
    measured = _measured(held_out, weights, choice.scales, choice.weights)
    assert measured < 0.8 * _measured(held_out, weights, ones, clipped)
    assert measured < 0.8 * _measured(held_out, weights, ones, rtn)
    assert choice.error == pytest.approx(measured, rel=0.05)


def test_no_scaling_when_channels_are_alike():
    """Channels of one range: every alpha's scales are ones, none beats no scaling."""
    rng = np.random.default_rng(6)
    k = 64
    stats = DenseInput(-np.full(k, 2.0), np.full(k, 2.0), 4.0 / 3.0, 1000)
    choice = choose_awq(stats, [_heavy(rng, k, 32)], 32, False)
    assert not choice.scaled and np.all(choice.scales == 1.0)
    assert choice.error == choice.unscaled
    assert all(isinstance(q, Int4Weights) for q in choice.weights)


def test_awq_scales_normalised_and_dead_channels_small():
    absmax = np.array([0.0, 1.0, 4.0, 16.0, np.nan])
    s = awq_scales(absmax, 0.5)
    np.testing.assert_allclose(s[1:4], [0.5, 1.0, 2.0])
    assert s[0] == s[4] == 0.5
