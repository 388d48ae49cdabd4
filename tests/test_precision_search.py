"""The precision search: an accuracy budget on a language model's bits per character widens
the most sensitive layers of a 4-bit build (4-bit to 8-bit, then int16, then FP32) until it
holds; the plan it reports is what ``build`` takes as ``layer_modes`` and reproduces."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import rangeprof
from rangeprof.byoc.evaluate import BitsPerCharacter

import onnx_builders as mb

T, D = mb.TRANSFORMER_TOKENS, mb.TRANSFORMER_WIDTH


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    return rangeprof.load(mb.save(mb.pre_ln_transformer(10.0, lm_head=True), folder))


@pytest.fixture(scope="module")
def data(model):
    """Inputs, and as labels the FP32 model's own most likely class at each position, so
    FP32's bpc is low and INT8's rounding shows."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, T, D)).astype(np.float32)
    session = ort.InferenceSession(str(model.path))
    logits = np.concatenate([session.run(None, {"x": xi[None]})[0] for xi in x])
    return x, logits.argmax(-1)


@pytest.fixture(scope="module")
def profile(model, data):
    return rangeprof.profile(model, data[0][:16])


def test_bits_per_character_is_the_mean_negative_log2_likelihood():
    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.125, 0.75, 0.125]]]))
    labels = np.array([[0, 2]])
    assert BitsPerCharacter()(logits, labels) == pytest.approx(-(1 + 3) / 2)
    with pytest.raises(rangeprof.RangeprofError, match="do not index the logits"):
        BitsPerCharacter()(logits, labels[:, :1])


OPTIONS = {"weight_bits": 4, "method": "max", "metric": "bpc"}


@pytest.fixture(scope="module")
def searched(model, profile, data):
    """The 4-bit build's evaluation, and the search under half its bpc loss."""
    x, labels = data
    plain = rangeprof.evaluate(model, profile, x, labels=labels, **OPTIONS)
    budget = _drop(plain) / 2
    fitted = rangeprof.evaluate(model, profile, x, labels=labels, accuracy_budget=budget, **OPTIONS)
    return plain, budget, fitted


def _drop(report) -> float:
    return 100 * (report.fp32_metric - report.int8_metric) / abs(report.fp32_metric)


def test_a_bpc_budget_widens_the_most_sensitive_layers_until_it_holds(searched):
    plain, budget, fitted = searched
    assert _drop(plain) > 0.5 and _drop(fitted) <= budget
    assert fitted.plan and all("=" in entry for entry in fitted.plan)
    assert fitted.kept_int8  # the ladder's first rung: 4-bit layers raised to 8 bits
    widened = len(fitted.kept_int8) + len(fitted.kept_int16) + len(fitted.kept_fp32)
    assert widened < len(plain.layers)  # the least sensitive stay 4-bit


def test_the_plan_builds_the_same_program(model, profile, data, searched):
    x, labels = data
    _, _, fitted = searched
    built = rangeprof.build(model, profile, layer_modes=tuple(fitted.plan), **OPTIONS)
    assert sorted(built.manifest.kept_int8) == fitted.kept_int8
    assert sorted(built.manifest.kept_fp32) == fitted.kept_fp32
    again = rangeprof.evaluate(model, profile, x, labels=labels, layer_modes=fitted.plan, **OPTIONS)
    assert again.int8_metric == pytest.approx(fitted.int8_metric)


def test_a_plan_naming_no_layer_is_one_line(model, profile):
    with pytest.raises(rangeprof.RangeprofError, match=r"^--layer-modes nope=int8: 'nope' matches"):
        rangeprof.build(model, profile, layer_modes=("nope=int8",))
    with pytest.raises(rangeprof.RangeprofError, match=r"layer_modes: .* is not PROFILEID=MODE"):
        rangeprof.build(model, profile, layer_modes=("fc1=int4",))


def test_raised_layers_take_the_cpus_8_bit_choice(model, profile, monkeypatch):
    """On AVX2 code the policy chooses 7 or 8 bits per layer: a 4-bit layer raised to int8 gets
    that choice, never 4 as an integer kernel's weight bits."""
    monkeypatch.setenv("RANGEPROF_X86_MCPU", "haswell")  # AVX2 code: runs on every x86 host here
    built = rangeprof.build(model, profile, layer_modes=("*=int8",), **OPTIONS)
    assert built.manifest.target_options == {"mcpu": "haswell"}
    dense = [r for r in built.manifest.regions if r.op == "matmul"]
    assert dense and all(r.mode == "int8" and r.weight.bits in (7, 8) for r in dense)
