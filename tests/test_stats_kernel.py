"""The compiled statistics kernels agree with the numpy statistics, bit for bit where it matters."""

from __future__ import annotations

import functools
import json
import math
import os

import numpy as np
import pytest
import tvm

from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.profiling.statistics import TensorStats, exact_units
from rangeprof.profiler.profiling.stats_kernel import (
    Totals,
    decode,
    kernel_view,
    output_length,
    stats_kernel,
)


@functools.cache
def _compiled(dtype: str, per_channel: bool, bins: int):
    kernel = stats_kernel(dtype, per_channel, bins, os.cpu_count() or 1)
    module = tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})
    return tvm.compile(module, host_target())["main"]


def _kernel_vector(x: np.ndarray, axis: int | None, bins: int) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros(output_length(x.shape, axis, bins)))
    kernel = _compiled(str(x.dtype), axis is not None, bins)
    kernel(tvm.runtime.tensor(x.reshape(kernel_view(x.shape, axis))), out)
    return out.numpy()


def _kernel_stats(x: np.ndarray, axis: int | None, bins: int, recorded_axis: int | None):
    return decode(_kernel_vector(x, axis, bins), bins, recorded_axis)


def _assert_same(got: TensorStats, want: TensorStats) -> None:
    assert (got.count, got.nan_count, got.inf_count) == (want.count, want.nan_count, want.inf_count)
    assert (got.min, got.max) == (want.min, want.max)
    assert got.histogram == want.histogram
    assert got.per_channel == want.per_channel
    if want.mean is None:
        assert got.mean is None
    else:  # sums add in the kernel's own order: equal up to float64 rounding
        assert math.isclose(got.mean, want.mean, rel_tol=1e-9, abs_tol=1e-30)
        assert math.isclose(got.std, want.std, rel_tol=1e-6, abs_tol=1e-30)


def _normal(shape, seed, scale=1.0, shift=0.0):
    return (np.random.default_rng(seed).normal(size=shape) * scale + shift).astype("float32")


def _relu(shape, seed=0):
    return np.maximum(np.random.default_rng(seed).normal(size=shape), 0).astype("float32")


def _uniform(n, seed):
    return np.random.default_rng(seed).uniform(size=n)


def _with_tiny(shape, seed):
    x = (np.random.default_rng(seed).normal(size=shape) * 3000).astype("float32")
    flat = x.reshape(-1)
    flat[:6] = [-1e-45, -1e-39, -3e-38, 1e-45, -0.0, 0.0]
    return x


CASES = {
    # name: (array, kernel channel axis) — the big ones take the parallel paths
    "nhwc-64": (_relu((1, 56, 56, 64)), 3),
    "nhwc-24": (np.random.default_rng(1).normal(size=(1, 28, 28, 24)).astype("float32"), 3),
    "dense-1000": (np.random.default_rng(2).normal(size=(1, 1000)).astype("float32"), 1),
    "tail-7": (np.arange(7, dtype="float32") - 3, None),
    "zeros": (np.zeros((3, 5), "float32"), None),
    "constant": (np.full((33,), 3.0, "float32"), None),
    "subnormal": ((np.random.default_rng(3).normal(size=(40000,)) * 1e-40).astype("float32"), None),
    "huge": (
        (np.random.default_rng(4).normal(size=(100000,)) * 1e30 + 5e30).astype("float32"),
        None,
    ),
    # float32 bin numbers: exact up to 2**24 (and the float64 path beyond), a product that
    # underflows float32 for a tiny negative value (its bin is -1 below zero's)
    "below-2**24": ((2.0**24 - 1 - _uniform(50000, 11) * 2000).astype("float32"), None),
    "across-2**24": ((2.0**24 + 999 - _uniform(50000, 12) * 2000).astype("float32"), None),
    "tiny-negatives": (_with_tiny((1, 24, 24, 32), 13), 3),
    "small": ((np.random.default_rng(14).normal(size=(5000,)) * 1e-35).astype("float32"), None),
    "channels-inner": (np.random.default_rng(5).normal(size=(2, 8, 5, 5)).astype("float32"), 1),
    "float64": (np.random.default_rng(6).normal(size=(3, 128)), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("bins", [2048, 0])
def test_kernel_matches_numpy_statistics(name, bins):
    x, axis = CASES[name]
    _assert_same(_kernel_stats(x, axis, bins, axis), TensorStats.observe(x, bins or None, axis))


def test_nan_and_inf_are_counted_and_skipped():
    x = np.random.default_rng(7).normal(size=(2, 24, 5, 5)).astype("float32")
    x[0, 3, 1, 1] = np.nan
    x[1, 2, 0, 0] = np.inf
    x[0, 0, 0, 0] = -np.inf
    x[:, 5] = np.nan  # a channel without any finite value
    got = _kernel_stats(x, 1, 2048, 1)
    _assert_same(got, TensorStats.observe(x, 2048, 1))
    assert (got.nan_count, got.inf_count) == (1 + 2 * 25, 2)
    assert got.per_channel.min[5] is None and got.per_channel.max[5] is None


def test_all_nan_tensor_has_no_range():
    got = _kernel_stats(np.full((20,), np.nan, "float32"), None, 2048, None)
    assert (got.count, got.nan_count, got.min, got.histogram) == (20, 20, None, None)


def test_kernel_layout_channels_are_recorded_under_the_initial_axis():
    """NHWC in the kernel, NCHW in the initial IR: same per-channel ranges, axis 1 recorded."""
    nchw = np.random.default_rng(8).normal(size=(1, 32, 14, 14)).astype("float32")
    nhwc = np.ascontiguousarray(nchw.transpose(0, 2, 3, 1))
    _assert_same(_kernel_stats(nhwc, 3, 2048, 1), TensorStats.observe(nchw, 2048, 1))


def test_sums_are_deterministic_for_a_shape():
    x = np.random.default_rng(9).normal(size=(1, 300000)).astype("float32")
    first, second = (_kernel_stats(x, None, 0, None) for _ in range(2))
    assert (first.sum, first.sum_sq) == (second.sum, second.sum_sq)


def _runs() -> list[np.ndarray]:
    """Runs of one NHWC tensor whose range settles, grows (re-binning), holds NaN, inf, a
    channel without finite values, signed zeros, and nothing finite at all."""
    rng = np.random.default_rng(10)
    runs = [_relu((1, 6, 6, 16), seed) for seed in range(2)]
    runs += [(rng.normal(size=(1, 6, 6, 16)) * scale).astype("float32") for scale in (0.5, 40)]
    odd = rng.normal(size=(1, 6, 6, 16)).astype("float32")
    odd[0, 1, 2, 3], odd[0, 2, 2, 2], odd[..., 7] = np.inf, -np.inf, np.nan
    runs += [odd, np.full((1, 6, 6, 16), np.nan, "float32"), -runs[0], runs[2] * 1e-3]
    return runs


@pytest.mark.parametrize("bins", [2048, 64, 0])
@pytest.mark.parametrize("axis", [3, None])
def test_totals_equal_the_merge_of_decoded_runs(bins, axis):
    vectors = [_kernel_vector(x, axis, bins) for x in _runs()]
    for order in (vectors, vectors[::-1], vectors[4:] + vectors[:4]):
        merged = None
        total = Totals(bins, axis)
        for vector in order:
            record = decode(vector, bins, axis)
            merged = record if merged is None else merged.merge(record)
            total.add(vector)
            assert json.dumps(total.stats().to_json()) == json.dumps(merged.to_json())


def test_numpy_histogram_scales_like_ldexp():
    """``Histogram.of`` multiplies by ``2**-e`` where ldexp was the definition: the same bins,
    also where the scaled value falls below float64's normal range."""
    rng = np.random.default_rng(15)
    wide = np.concatenate([rng.normal(size=1000) * 1e150, [-5e-324, -1e-310, 1e-310, -0.0]])
    for x in (wide, _with_tiny((4, 32), 16).reshape(-1), CASES["subnormal"][0]):
        stats = TensorStats.observe(x, 2048)
        h = stats.histogram
        index = np.floor(np.ldexp(x.astype(np.float64), -h.exponent)).astype(np.int64) - h.offset
        assert np.array_equal(h.counts, np.bincount(index, minlength=len(h.counts)))


def test_float64_values_past_the_float_range_of_their_squares():
    """Uninitialised float64 memory (PyTorch's operator tests) holds values like 6e199: their
    squares leave float64. numpy's record sums exactly; the kernel's saturates its moments; both
    keep min, max and the histogram, and neither raises."""
    from fractions import Fraction

    x = np.array([5.8568940091729575e199, -3e200, 1.0, 1.4e-322], dtype=np.float64)
    record = TensorStats.observe(x, 64)
    exact = sum(Fraction(v) ** 2 for v in x.tolist())
    assert record.sum_sq == math.floor(exact * 2**1074)
    assert record.sum == exact_units(x.sum())  # the sum itself fits: float64 as usual
    assert math.isfinite(record.std) and record.std > 1e200
    kernel = _kernel_stats(x, None, 64, None)
    assert (kernel.min, kernel.max) == (record.min, record.max)
    assert kernel.histogram == record.histogram
    assert math.isfinite(kernel.mean)
