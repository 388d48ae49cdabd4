"""SmoothQuant from stored statistics: per-channel ranges of dense-layer inputs in every profile,
masks counted but never called an overflow, smoothing scales chosen from the statistics alone
(checked against a numpy simulation of the quantized layer), and the Relax pass that folds them
in with the model's function and lineage unchanged."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.profiler.calibrate.smoothing import (
    AARCH64,
    X86,
    DenseInput,
    choose,
    clipping,
    dense_input_stats,
    estimate_error,
    plan_smoothing,
)
from rangeprof.profiler.compile.schedules import build, host_target
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.lineage import verify_lineage
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.ir.passes.smooth_quant import (
    SMOOTHED,
    SmoothingError,
    SmoothQuant,
    dense_inputs,
    smooth_quant,
    smoothed_id,
    smoothing_sites,
)
from rangeprof.profiler.ir.spans import ids_of
from rangeprof.profiler.ir.stages import run_stages
from rangeprof.profiler.profiling.document import (
    flag_nonfinite,
    merge_profiles,
    nonfinite_summary,
    tensors_bytes,
    validate,
)
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model
from rangeprof.profiler.profiling.statistics import TensorStats

import onnx_builders as mb
from conftest import SHARED, zoo_model
from ort_reference import exposed_session
from smoothing_reference import simulated

T, D = mb.TRANSFORMER_TOKENS, mb.TRANSFORMER_WIDTH


@functools.cache
def _data() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(6, T, D)).astype(np.float32)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return mb.save(mb.pre_ln_transformer(), tmp_path_factory.mktemp("smoothquant"))


@pytest.fixture(scope="module")
def profile(model_path) -> dict:
    return validate(profile_model(model_path, _data(), options=ProfileOptions(bins=128)))


# --- 1. per-channel statistics of dense inputs ------------------------------------------------


def test_a_default_profile_has_per_channel_ranges_of_every_dense_input(model_path, profile):
    entries = {t["profile_id"]: t for t in profile["tensors"]}
    mod = import_onnx(load_model(model_path)).mod
    readers = dense_inputs(mod)
    assert set(readers) == {"ln1", "att", "ln2", "relu", "rows"}
    session = exposed_session(model_path)
    names = [o.name for o in session.get_outputs()]
    runs = [dict(zip(names, session.run(names, {"x": x[None]}), strict=True)) for x in _data()]
    for profile_id, weights in readers.items():
        entry = entries[profile_id]
        channels = entry["per_channel"]
        assert channels["axis"] == len(entry["shape"]) - 1 and "mean" not in channels
        assert len(channels["max"]) == weights[0].shape[0]
        width = weights[0].shape[0]
        ref = np.concatenate([r[entry["source_tensor"]].reshape(-1, width) for r in runs])
        np.testing.assert_allclose(channels["max"], ref.max(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(channels["min"], ref.min(axis=0), rtol=1e-5, atol=1e-6)
    # other activations keep no per-channel ranges unless asked (--channel-stats)
    assert entries["masked"]["per_channel"] is None


def test_shards_merge_into_the_single_pass_profile(model_path, profile):
    options = ProfileOptions(bins=128)
    shards = [profile_model(model_path, _data()[a:b], options=options) for a, b in ((0, 2), (2, 6))]
    merged = merge_profiles(*shards)
    assert tensors_bytes(merged) == tensors_bytes(profile)


# --- 2. masks ---------------------------------------------------------------------------------


def test_the_causal_mask_is_counted_and_not_an_overflow(profile):
    entries = {t["profile_id"]: t for t in profile["tensors"]}
    masked = entries["masked"]
    assert masked["inf_count"] == len(_data()) * T * (T - 1) // 2  # above the diagonal
    assert masked["min"] is not None and np.isfinite([masked["min"], masked["max"]]).all()
    assert masked["masked"] is True and "overflow" not in masked
    assert masked["nonfinite_inputs"] == ["causal"]
    assert masked["nonfinite_origins"] == ["weight:mask"]
    assert entries["causal"]["masked"] is True and entries["causal"]["static"]
    assert not any(t.get("overflow") for t in profile["tensors"])
    (line,) = nonfinite_summary(profile)
    assert line.startswith(f"masked: {masked['inf_count']} inf values from constant weight:mask")


def _entry(profile_id: str, count: int, infs: int, static: bool = False, **more) -> dict:
    kind = "weight" if profile_id.startswith("weight:") else "activation"
    return {"profile_id": profile_id, "kind": kind, "static": static, "count": count,
            "nan_count": 0, "inf_count": infs, **more}  # fmt: skip


def test_masked_or_overflow_is_a_function_of_the_counts():
    """The scores plus a broadcast mask hold exactly the mask's share of inf (or NaN, where an
    inf met an inf of the other sign); one non-finite value more is an overflow."""
    mask = _entry("slice", 64, 28, static=True)
    for infs, nans, verdict in ((28 * 10, 0, "masked"), (28 * 10 + 1, 0, "overflow"),
                                (28 * 10 - 1, 1, "masked"), (28 * 10, 1, "overflow")):  # fmt: skip
        scores = _entry("add", 640, infs, nonfinite_inputs=["slice"])
        scores["nan_count"] = nans
        reshaped = _entry("reshape", 640, infs + nans, nonfinite_inputs=["add"])
        plain = _entry("other", 640, infs)
        tensors = [mask, scores, reshaped, plain]
        flag_nonfinite(tensors)
        assert mask.get("masked") and "overflow" not in mask
        assert scores.get(verdict) and reshaped.get(verdict), (infs, nans)
        assert plain.get("overflow") == (True if infs else None)


# --- 3. scales from stored statistics -----------------------------------------------------------


def _outlier_layer(seed: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Activations ``[4096, 64]`` with channel 5 thirty times the others, weights ``[64, 32]``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4096, 64)) + 0.3
    x[:, 5] *= 30.0
    return x, rng.normal(size=(64, 32)) * 0.1


@pytest.mark.parametrize("grid", [X86, AARCH64], ids=["x86", "aarch64"])
def test_an_outlier_channel_is_smoothed_and_the_int8_error_drops(grid):
    x, w = _outlier_layer()
    calib, held_out = x[:2048], x[2048:]
    record = TensorStats.observe(calib, 64, channel_axis=1)
    stats = DenseInput.from_entry({"shape": [2048, 64], **record.to_json()})
    choice = choose(stats, [w[:, :16], w[:, 16:]], grid)  # two layers reading one input
    assert choice.smoothed and choice.alpha > 0
    assert choice.error < choice.unsmoothed
    smoothed_lo, smoothed_hi = stats.lo / choice.scales, stats.hi / choice.scales
    assert choice.range == (smoothed_lo.min(), smoothed_hi.max())
    ones = np.ones(64)
    # on new data: less than half the error
    assert simulated(held_out, w, choice.scales, stats, grid) < 0.5 * simulated(
        held_out, w, ones, stats, grid
    )
    # on the data the statistics come from (nothing clipped) the rounding model is close
    for s in (choice.scales, ones):
        rounding = estimate_error(stats, w, s, grid) - np.mean(clipping(stats, s, grid) @ w**2)
        assert rounding / simulated(calib, w, s, stats, grid) == pytest.approx(1.0, abs=0.15)


def test_even_channels_are_left_alone():
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(2048, 32)), rng.normal(size=(32, 8))
    entry = {"shape": [2048, 32], **TensorStats.observe(x, 64, channel_axis=1).to_json()}
    choice = choose(DenseInput.from_entry(entry), [w], X86, alphas=(1.0,))
    assert not choice.smoothed and np.array_equal(choice.scales, np.ones(32))


# --- 4. the Relax pass ----------------------------------------------------------------------------


def _output(mod: tvm.IRModule, inputs: list[np.ndarray]) -> np.ndarray:
    vm = relax.VirtualMachine(build(mod, host_target()), tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(x) for x in inputs)).numpy()


def _ids(mod: tvm.IRModule) -> tuple[set[str], set[str]]:
    """The profileIDs on ``main``'s binding values, and on its constants."""
    bindings = {i for b in mod["main"].body.blocks for v in b.bindings for i in ids_of(v.value)}
    constants: set[str] = set()

    def visit(expr):
        if isinstance(expr, tvm.ir.GenericConst):
            constants.update(ids_of(expr))

    relax.analysis.post_order_visit(mod["main"], visit)
    return bindings, constants


def _check_lineage(before: tvm.IRModule, after: tvm.IRModule, sites) -> None:
    """Every binding maps to initial-IR IDs (an inserted multiply to its input's, through its
    derived ID), weights keep theirs, and the tracked stages lose none."""
    bindings, constants = _ids(before)
    new_bindings, new_constants = _ids(after)
    derived = {i for i in new_bindings if i.endswith(SMOOTHED)}
    assert derived == {smoothed_id(k) for k, site in sites.items() if not site.folded}
    assert {i.removesuffix(SMOOTHED) for i in new_bindings} == bindings
    assert new_constants == constants
    reports = [stage.report for stage in run_stages(after, bindings | constants)]
    assert verify_lineage(reports, bindings) == []


def test_the_pass_keeps_the_function_and_the_lineage(model_path, profile):
    mod = import_onnx(load_model(model_path)).mod
    plan = plan_smoothing(dense_input_stats(profile), dense_inputs(mod), X86)
    assert plan.skipped == {} and plan.choices["ln1"].smoothed  # the outlier channel
    rng = np.random.default_rng(4)
    scales = {k: np.exp(rng.normal(size=len(c.scales))) for k, c in plan.choices.items()}
    smoothed, sites = smooth_quant(mod, scales)
    folded = {k for k, site in sites.items() if site.folded}
    assert folded == {"ln1", "ln2", "rows"}  # q/k/v share ln1's scales; the head through a reshape
    assert sites["rows"].tensor_ids == ("ln3", "rows")
    assert sites["relu"].tensor_ids == ("relu#smoothed",)
    x = [_data()[0][None]]
    reference = _output(mod, x)
    np.testing.assert_allclose(_output(smoothed, x), reference, rtol=1e-5, atol=1e-5)
    _check_lineage(mod, smoothed, sites)


def test_scales_that_do_not_fit_are_refused(model_path):
    mod = import_onnx(load_model(model_path)).mod
    with pytest.raises(SmoothingError, match="smoothing masked: no dense layer reads it"):
        smooth_quant(mod, {"masked": np.ones(T)})
    with pytest.raises(SmoothingError, match="smoothing ln1: needs 16 positive scales"):
        smooth_quant(mod, {"ln1": -np.ones(D)})


@pytest.mark.parametrize("name", ["char_gpt", "tiny_bert"])
def test_zoo_transformers_compute_the_same_smoothed(name):
    mod = import_onnx(load_model(zoo_model(name))).mod
    rng = np.random.default_rng(5)
    scales = {k: np.exp(rng.normal(size=w[0].shape[0])) for k, w in dense_inputs(mod).items()}
    sites = smoothing_sites(mod, scales)
    if name == "char_gpt":  # pre-LN: the LayerNorms take the scales
        assert sum(site.folded for site in sites.values()) == 9
        tokens = np.load(SHARED / "data" / "pycode.npz")["calib"][:1]
    else:
        tokens = rng.integers(0, 8000, size=(1, 128))
    smoothed = SmoothQuant(scales)(mod)
    reference = _output(mod, [tokens])
    got = _output(smoothed, [tokens])
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-5 * np.abs(reference).max())
    bindings, constants = _ids(mod)
    new_bindings, new_constants = _ids(smoothed)
    assert {i.removesuffix(SMOOTHED) for i in new_bindings} == bindings
    assert new_constants == constants
