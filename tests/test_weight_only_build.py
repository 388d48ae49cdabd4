"""4-bit weight-only builds (``--weight-bits 4``): every dense layer on 4-bit groups with FP32
activations, its input AWQ-scaled and its clipping chosen from the stored statistics, the rest
as the target quantizes it; the manifest says so, and the outputs stay near FP32's."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import rangeprof

import onnx_builders as mb

T, D = mb.TRANSFORMER_TOKENS, mb.TRANSFORMER_WIDTH


def _inputs(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, T, D)).astype(np.float32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w4")
    return rangeprof.load(mb.save(mb.pre_ln_transformer(hidden_outlier=10.0), folder))


@pytest.fixture(scope="module")
def profile(model):
    return rangeprof.profile(model, _inputs(1, 32))


@pytest.fixture(scope="module")
def held_out(model):
    x = _inputs(7, 8)
    session = ort.InferenceSession(str(model.path))
    return x, np.stack([session.run(None, {"x": xi[None]})[0] for xi in x])


def _error(int8: rangeprof.Int8Model, held_out) -> float:
    x, reference = held_out
    outputs = np.stack([int8.run(xi[None])[0] for xi in x])
    return float(np.mean((outputs - reference) ** 2) / np.mean(reference**2))


@pytest.fixture(scope="module")
def w4(model, profile):
    return rangeprof.build(model, profile, method="max", weight_bits=4, group_size=32)


def test_every_dense_layer_is_4_bit_and_the_attention_stays_int8(w4):
    modes = {r.op: set() for r in w4.manifest.regions}
    for r in w4.manifest.regions:
        modes[r.op].add(r.mode)
    assert modes["matmul"] == {"w4"} and modes["batch_matmul"] == {"int8"}
    dense = [r for r in w4.manifest.regions if r.op == "matmul"]
    assert all(r.weight.dtype == "int4" and r.weight.group_size == 32 for r in dense)
    assert w4.manifest.weight_only == {
        "bits": 4,
        "group_size": 32,
        "scheme": "asym",
        "activations": "fp32",
    }


def test_inputs_are_scaled_by_the_4_bit_error(w4):
    smoothing = w4.manifest.smoothing
    assert smoothing["method"] == "awq"
    assert all(v["estimated_error_ratio"] < 1 for v in smoothing["smoothed"].values())


def test_the_outputs_stay_near_fp32_and_awq_halves_the_error(model, profile, w4, held_out):
    """4-bit steps are 17 times 8-bit ones: a few percent of the output's energy, about half
    of it without the activation-aware scaling."""
    error = _error(w4, held_out)
    unscaled = rangeprof.build(model, profile, method="max", weight_bits=4, smooth_quant=False)
    assert 0 < error < 0.1
    assert error < 0.7 * _error(unscaled, held_out)


def test_int8_activations_take_the_w4a8_kernel_and_stay_close(model, profile, w4, held_out):
    """W4A8 adds the activations' per-row 8-bit rounding to the 4-bit weights' error: a
    little, on the kernel of its own (the library holds it, the FP32-activation one not)."""
    w4a8 = rangeprof.build(
        model, profile, method="max", weight_bits=4, group_size=32, int4_activations="int8"
    )
    assert w4a8.manifest.weight_only["activations"] == "int8"
    assert b"dense_w4a8" in (w4a8.folder / w4a8.manifest.library).read_bytes()
    assert b"dense_w4a8" not in (w4.folder / w4.manifest.library).read_bytes()
    error, fp32_activations = _error(w4a8, held_out), _error(w4, held_out)
    assert error != fp32_activations and error < 1.5 * fp32_activations


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_4_bit_kernels_for_an_avx2_cpu(model, profile, held_out, monkeypatch, activations):
    """The 4-bit kernels are packed for (W4A8: on the instruction of) the build's CPU, not
    this machine's: they are emitted while lowering, outside the build's target. Built for an
    AVX2 CPU, W4A8 (AVX2's ``vpmaddubsw``, exact on 4-bit codes) equals the build for this
    machine bit for bit; FP32 activations, up to the order of the float sums."""
    options = dict(method="max", weight_bits=4, int4_activations=activations)
    here = rangeprof.build(model, profile, **options)
    monkeypatch.setenv("RANGEPROF_X86_MCPU", "haswell")  # AVX2 code: runs on every x86 host here
    avx2 = rangeprof.build(model, profile, **options)
    assert avx2.manifest.target_options == {"mcpu": "haswell"}
    for x in held_out[0][:2]:
        got, want = avx2.run(x[None])[0], here.run(x[None])[0]
        if activations == "int8":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_coarser_group_costs_accuracy(model, profile, w4, held_out):
    """Groups of 32 rows on a 16-row weight are per column: the same; fc2's 64 rows split in
    two with 32, one group with 64: more error."""
    coarse = rangeprof.build(model, profile, method="max", weight_bits=4, group_size=64)
    assert _error(coarse, held_out) > _error(w4, held_out)


def test_a_target_without_4_bit_kernels_refuses_in_one_line(model, profile):
    with pytest.raises(rangeprof.RangeprofError, match=r"^--weight-bits 4: target npu has no"):
        rangeprof.build(model, profile, target="npu", weight_bits=4)


def test_a_group_size_outside_the_choices_is_refused(model, profile):
    with pytest.raises(rangeprof.RangeprofError, match="group_size: group size must be one"):
        rangeprof.build(model, profile, weight_bits=4, group_size=48)
