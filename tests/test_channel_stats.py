"""Per-channel means of activations (``rangeprof profile --channel-stats``): exact merges in any
order, the compiled kernel against numpy, profiles against onnxruntime, and old profiles."""

from __future__ import annotations

import functools
import itertools
import json
import os

import numpy as np
import pytest
import tvm

from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.profiling.document import (
    SCHEMA_VERSION,
    ProfileError,
    load_profile,
    merge_profiles,
    tensors_bytes,
    validate,
)
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model
from rangeprof.profiler.profiling.statistics import ChannelRange, TensorStats
from rangeprof.profiler.profiling.stats_kernel import (
    Totals,
    decode,
    kernel_view,
    output_length,
    stats_kernel,
)

import onnx_builders as mb
from conftest import SHARED, zoo_model
from ort_reference import exposed_session

DIGITS = SHARED / "data" / "digits.npz"


def _with_gaps(shape, seed: int, axis: int) -> np.ndarray:
    """Normal values with a NaN, an inf and a channel without finite values."""
    x = np.random.default_rng(seed).normal(size=shape).astype("float32")
    flat = x.reshape(-1)
    flat[3], flat[17] = np.nan, -np.inf
    np.moveaxis(x, axis, 0)[2] = np.nan
    return x


def _means(x: np.ndarray, axis: int) -> np.ndarray:
    moved = np.moveaxis(x.astype(np.float64), axis, 0).reshape(x.shape[axis], -1)
    finite = np.isfinite(moved)
    with np.errstate(invalid="ignore"):
        return np.where(finite, moved, 0).sum(axis=1) / finite.sum(axis=1)


def _close(got: tuple, want: np.ndarray) -> None:
    got = np.array(got, dtype=np.float64)  # None (no finite value) is NaN, as numpy's 0 / 0
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True)


def test_channel_means_merge_exactly_in_any_order():
    """Shards merged in any order and grouping: the record of one pass over all of them."""
    shards = [_with_gaps((2, 6, 3, 3), seed, 1) for seed in range(4)]
    shards[1] *= 1e6  # magnitudes far apart: float64 sums would depend on the order
    records = [TensorStats.observe(x, 64, 1, channel_sums=True) for x in shards]
    expected = functools.reduce(TensorStats.merge, records).to_json()
    for order in itertools.permutations(records):
        left = functools.reduce(TensorStats.merge, order)
        right = order[0].merge(order[1].merge(order[2].merge(order[3])))
        assert json.dumps(left.to_json()) == json.dumps(right.to_json()) == json.dumps(expected)
    merged = functools.reduce(TensorStats.merge, records).per_channel
    _close(merged.mean, _means(np.concatenate(shards), 1))
    assert merged.mean[2] is None and merged.counts[2] == 0
    assert merged.counts[0] == 4 * (2 * 9 - 1)  # every shard's first NaN is in channel 0
    assert ChannelRange.from_json(json.loads(json.dumps(merged.to_json()))) == merged


def test_ranges_without_means_still_read_and_merge():
    """A per-channel record of a 1.0 profile (no sums) reads back; merged with one that has
    sums, the means are unknown (None), the ranges are still merged."""
    x = _with_gaps((2, 6, 3, 3), 0, 1)
    with_sums = TensorStats.observe(x, 64, 1, channel_sums=True).per_channel
    old = {k: v for k, v in with_sums.to_json().items() if k in ("axis", "min", "max")}
    plain = ChannelRange.from_json(old)
    assert plain.sums is None and plain.mean is None and "mean" not in plain.to_json()
    merged = plain.merge(with_sums)
    assert merged.mean is None and merged == ChannelRange(1, with_sums.lo, with_sums.hi)


@functools.cache
def _kernel(dtype: str, bins: int):
    kernel = stats_kernel(dtype, True, bins, os.cpu_count() or 1, channel_sums=True)
    module = tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")})
    return tvm.compile(module, host_target())["main"]


def _vector(x: np.ndarray, axis: int, bins: int) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros(output_length(x.shape, axis, bins, channel_sums=True)))
    _kernel(str(x.dtype), bins)(tvm.runtime.tensor(x.reshape(kernel_view(x.shape, axis))), out)
    return out.numpy()


CASES = {  # every path of the kernel's per-channel pass: 16 and 8 lanes, the scalar loop
    "nhwc-64-parallel": (np.random.default_rng(1).normal(size=(1, 56, 56, 64)), 3),
    "nhwc-24": (np.random.default_rng(2).normal(size=(1, 28, 28, 24)), 3),
    "nchw-inner": (np.random.default_rng(3).normal(size=(2, 8, 5, 5)), 1),
    "gaps-nhwc": (_with_gaps((1, 6, 6, 16), 4, 3), 3),
    "gaps-inner": (_with_gaps((2, 6, 5, 5), 5, 1), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_channel_sums_match_numpy(name):
    x, axis = CASES[name]
    x = x.astype("float32")
    got = decode(_vector(x, axis, 2048), 2048, axis, channel_sums=True).per_channel
    want = TensorStats.observe(x, 2048, axis, channel_sums=True).per_channel
    assert got.counts == want.counts
    assert np.array_equal(got.lo, want.lo, equal_nan=True)
    assert np.array_equal(got.hi, want.hi, equal_nan=True)
    # the kernel adds in its own order: equal up to float64 rounding
    _close(got.mean, np.array(want.mean, dtype=np.float64))
    _close(got.mean, _means(x, axis))


def test_totals_of_channel_sums_equal_the_merge_of_decoded_runs():
    runs = [_with_gaps((1, 6, 6, 16), seed, 3) * scale for seed, scale in enumerate((1, 40, 1e-3))]
    runs.append(np.full((1, 6, 6, 16), np.nan, "float32"))
    vectors = [_vector(x.astype("float32"), 3, 64) for x in runs]
    for order in (vectors, vectors[::-1], vectors[2:] + vectors[:2]):
        total, merged = Totals(64, 3, channel_sums=True), None
        for vector in order:
            record = decode(vector, 64, 3, channel_sums=True)
            merged = record if merged is None else merged.merge(record)
            total.add(vector)
        assert json.dumps(total.stats().to_json()) == json.dumps(merged.to_json())


def test_profile_shards_with_channel_stats_merge_exactly(tmp_path):
    path = mb.save(mb.conv_bn_relu_scale(), tmp_path)
    data = np.random.default_rng(6).normal(size=(9, 3, 6, 6)).astype("float32")
    data[4, 0, 0, 0] = np.nan
    options = ProfileOptions(bins=128, channel_stats=True, allow_nonfinite=True)
    whole = profile_model(path, data, options=options)
    validate(whole)
    activations = [t for t in whole["tensors"] if not t["static"] and len(t["shape"]) in (2, 4)]
    assert activations and all("mean" in t["per_channel"] for t in activations)
    shards = [profile_model(path, data[a:b], options=options) for a, b in ((0, 2), (2, 7), (7, 9))]
    for order in itertools.permutations(shards):
        merged = functools.reduce(merge_profiles, order)
        assert tensors_bytes(merged) == tensors_bytes(whole)
    plain = profile_model(path, data, options=ProfileOptions(bins=128, allow_nonfinite=True))
    with pytest.raises(ProfileError, match="channel statistics"):
        merge_profiles(whole, plain)
    # a profile of schema 1.0 (no channel statistics) still loads; other versions do not
    old = {**plain, "schema_version": "1.0"}
    del old["run"]["options"]["channel_stats"]
    assert validate(old) is old
    with pytest.raises(ProfileError, match="schema_version"):
        validate({**plain, "schema_version": "2.0"})


@pytest.fixture(scope="module")
def digits_profile(tmp_path_factory):
    from rangeprof.workflows import profiling
    from rangeprof.workflows.requests import ProfileRequest

    request = ProfileRequest(model=zoo_model("digits_cnn"), data=f"{DIGITS}:calib")
    doc = profiling.profile(request.model_copy(update={"channel_stats": True})).to_json()
    path = tmp_path_factory.mktemp("channel-stats") / "profile.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.zoo
def test_digits_channel_means_match_onnxruntime(digits_profile):
    """Per-channel means of the profile against the same data through onnxruntime, for the
    graph input, conv outputs, a pooled map and a dense layer's input (NCHW axis 1, 2-D last)."""
    doc = load_profile(digits_profile)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["run"]["options"]["channel_stats"]
    by_tensor = {t["source_tensor"]: t for t in doc["tensors"]}
    calib = np.load(DIGITS)["calib"]
    session = exposed_session(zoo_model("digits_cnn"), {"image": (200, 1, 8, 8)})
    names = ["/Relu_output_0", "/MaxPool_output_0", "/Relu_2_output_0", "/Flatten_output_0"]
    values = dict(zip(names, session.run(names, {"image": calib}), strict=True))
    values["image"] = calib
    for name, value in values.items():
        channels = by_tensor[name]["per_channel"]
        axis = 1  # NCHW's channels, and a 2-D tensor's last axis
        assert channels["axis"] == axis
        assert channels["count"] == [value.size // value.shape[axis]] * value.shape[axis]
        want = _means(value, axis)
        # TVM and onnxruntime compute the float32 activations in their own orders
        np.testing.assert_allclose(channels["mean"], want, rtol=1e-5, atol=1e-6 * abs(want).max())


@pytest.mark.zoo
def test_transformer_activations_have_means_along_the_features_their_dense_layers_sum():
    """``[T, B, D]`` / ``[B, T, D]`` activations feed dense layers along ``D`` (the last axis),
    not axis 1 as images feed convolutions: their means are taken along what the layer sums."""
    options = ProfileOptions(samples=2, channel_stats=True)
    profile = profile_model(zoo_model("tiny_bert"), "random", options=options)
    by_id = {entry["profile_id"]: entry for entry in profile["tensors"]}
    norm = by_id["/layers.0/norm1/LayerNormalization"]  # read by linear1's MatMul
    assert norm["shape"] == [1, 128, 256]
    assert norm["per_channel"]["axis"] == 2 and len(norm["per_channel"]["min"]) == 256
