"""Weight bits chosen per CPU and per layer: 8 on CPUs with VNNI, and on AVX2 without it 7 for
each layer whose output error budget allows them (:func:`rangeprof.byoc.policy.layer_weight_bits`,
from the profile's moments), 8 elsewhere; an explicit ``weight_bits`` wins. The CPU is forced
with ``RANGEPROF_X86_MCPU`` (every machine of ours runs AVX2 code, VNNI or not); the AVX2 build
states its bits in its manifest and in evaluate's report, and computes exactly the integers of
TVM's own (unscheduled) lowering of the same module."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tvm
from onnx import helper
from tvm import relax

import rangeprof
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.policy import ActivationQ, QuantPolicy, layer_weight_bits, quantize_weights
from rangeprof.byoc.quantized import (
    document_moments,
    input_statistics,
    qparams_from_profile,
    quantize_model,
)
from rangeprof.byoc.smoothing import target_grid
from rangeprof.byoc.x86 import make_plugin
from rangeprof.profiler.calibrate.smoothing import Grid
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model
from rangeprof.workflows import quantize
from rangeprof.workflows.requests import BuildRequest, EvaluateRequest

import onnx_builders as mb
from onnx_builders import save, single_io_model

AVX2_CPU = "haswell"  # AVX2, no VNNI; AMD CPUs' code (znver*) holds SSE4A, which Intel hosts lack
MCPU = "RANGEPROF_X86_MCPU"


@pytest.mark.parametrize(
    "mcpu, bits",
    [("znver3", None), ("znver1", None), ("haswell", None), ("znver4", 8), ("cascadelake", 8)],
)
def test_the_policy_follows_the_cpu(mcpu, bits, monkeypatch):
    """Per layer (None) where the CPU's fastest 8-bit dot product needs 7-bit weights."""
    monkeypatch.setenv(MCPU, mcpu)
    plugin = get_plugin("x86")
    assert plugin.policy.weight_bits == bits and plugin.options == {"mcpu": mcpu}
    assert str(plugin.target().attrs["mcpu"]) == mcpu
    for explicit in (7, 8):  # an explicit choice wins
        assert get_plugin("x86", weight_bits=explicit).policy.weight_bits == explicit
    assert make_plugin(mcpu).policy == plugin.policy


def test_other_targets_keep_eight_bits_and_a_bad_cpu_is_refused(monkeypatch):
    monkeypatch.setenv(MCPU, AVX2_CPU)
    assert get_plugin("aarch64").policy.weight_bits == get_plugin("npu").policy.weight_bits == 8
    monkeypatch.setenv(MCPU, "zen9000")
    with pytest.raises(RangeprofError, match=r"^x86 CPU 'zen9000': LLVM knows no such CPU"):
        get_plugin("x86")


def _added_noise(w: np.ndarray, mean: float, std: float, samples: int = 20000) -> float:
    """The mean square 7-bit weights add to a conv's output over 8-bit ones, mean over output
    channels, measured on inputs drawn with ``mean`` and ``std``."""
    rng = np.random.default_rng(1)
    x = rng.normal(mean, std, size=(samples, w[0].size))
    rows = w.reshape(len(w), -1)
    squares = {}
    for bits in (7, 8):
        wq, scales = quantize_weights(w, 0, QuantPolicy(weight_bits=bits))
        error = wq.reshape(len(w), -1) * scales[:, None] - rows
        squares[bits] = np.square(x @ error.T).mean(axis=0)
    return float(np.mean(squares[7] - squares[8]))


def test_seven_bits_where_the_added_noise_is_within_the_output_rounding():
    """The decision flips where the noise 7-bit weights add, measured on sampled inputs of the
    profile's mean and std, crosses the output grid's rounding noise ``s_y² / 12``; without an
    output grid or without moments it is 8."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 4, 3, 3))
    mean, std = 0.5, 0.3
    threshold = np.sqrt(12 * _added_noise(w, mean, std))  # the output scale where they are equal
    x = ActivationQ("x", 0.01, 0, "uint8")
    policy = QuantPolicy(weight_bits=None)

    def bits(y_scale, moments=(mean, std)):
        y = None if y_scale is None else ActivationQ("y", y_scale, 0, "uint8")
        return layer_weight_bits(w, 0, policy, x, y, moments)

    assert bits(1.1 * threshold) == 7
    assert bits(0.9 * threshold) == 8
    assert bits(None) == 8 and bits(10 * threshold, None) == 8


def test_a_smoothed_input_is_judged_in_its_source_units():
    """SmoothQuant divides an input by ``s_i`` and multiplies the weights' rows by ``s_i``: the
    product is unchanged, and so is the choice, made on the source's moments with the scales
    (a constant ``s`` gives the same integers: the same decision at every output scale)."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 8))  # a matmul's [K, N]: output channels on axis 1
    moments, s = (0.2, 0.7), np.full(16, 4.0)
    x, policy = ActivationQ("x", 0.01, 0, "uint8"), QuantPolicy(weight_bits=None)
    seen = set()
    for y_scale in np.geomspace(1e-3, 1.0, 25):
        y = ActivationQ("y", float(y_scale), 0, "uint8")
        plain = layer_weight_bits(w, 1, policy, x, y, moments)
        smoothed = layer_weight_bits(w * s[:, None], 1, policy, x, y, moments, None, s)
        assert smoothed == plain
        seen.add(plain)
    assert seen == {7, 8}


def test_smoothing_is_planned_for_the_bits_the_layers_prefer(monkeypatch):
    """Where x86 chooses bits per layer (AVX2), SmoothQuant's strengths are chosen for 7-bit
    weights, which the rule prefers; where every layer has 8 bits (VNNI, or asked), for 8."""
    monkeypatch.setenv(MCPU, AVX2_CPU)
    assert target_grid(get_plugin("x86").policy) == Grid("asym", 63)
    assert target_grid(get_plugin("x86", weight_bits=8).policy) == Grid("asym", 127)
    monkeypatch.setenv(MCPU, "znver4")
    assert target_grid(get_plugin("x86").policy) == Grid("asym", 127)


def test_smoothed_layers_take_their_sources_moments(monkeypatch, tmp_path):
    """On AVX2 each smoothed dense layer (a LayerNorm folded or a multiply inserted) is judged
    on the moments of the tensor it smooths, with the scales: the profile's moments of a folded
    LayerNorm's output are of its values before smoothing, which the weights no longer see (on
    char_gpt, built for znver3, that kept every LayerNorm-fed layer on 8 bits)."""
    monkeypatch.setenv(MCPU, AVX2_CPU)
    path = mb.save(mb.pre_ln_transformer(hidden_outlier=10.0), tmp_path)
    inputs = np.random.default_rng(1).normal(size=(32, mb.TRANSFORMER_TOKENS, mb.TRANSFORMER_WIDTH))
    profile = rangeprof.profile(rangeprof.load(path), inputs.astype(np.float32)).document
    plugin = get_plugin("x86")
    qparams = qparams_from_profile(profile, plugin, "max", 99.99)
    qm = quantize_model(path, qparams, plugin)
    moments = document_moments(qparams)
    weighted = [r for r in qm.regions if r.input is not None and r.float_region.weight is not None]
    smoothed = {r.input.profile_id: qm.smoothing.source(r.input.profile_id) for r in weighted}
    assert {"ln1", "relu#smoothed"} <= {pid for pid, source in smoothed.items() if source}
    for region in weighted:
        source = smoothed[region.input.profile_id]
        x, scales = input_statistics(region, moments, qm.smoothing)
        if source is None:
            assert x == moments[region.input.profile_id] and scales is None
        else:
            assert x == moments[source[0]] and scales is source[1]
        fr = region.float_region
        expected = layer_weight_bits(
            fr.weight, fr.channel_axis, plugin.policy, region.input, region.output, x, fr.bias,
            scales,
        )  # fmt: skip
        assert region.weight_bits == expected, region.name


def _conv(name: str, inp: str, out: str, w: np.ndarray, inits: dict) -> list:
    inits[f"{name}.w"] = w
    conv = helper.make_node("Conv", [inp, f"{name}.w"], [f"{name}.c"], name=name, pads=[1] * 4)
    return [conv, helper.make_node("Relu", [f"{name}.c"], [out], name=f"{name}.relu")]


@pytest.fixture(scope="module")
def two_convs(tmp_path_factory):
    """A model whose first conv's weights are exact on 7 bits (all ±0.1: 7 bits add nothing)
    and whose second's lose most of their values on 7 bits (one weight per channel 50 times
    the others), its profile on random data, and data to evaluate on."""
    folder = tmp_path_factory.mktemp("two_convs")
    rng = np.random.default_rng(3)
    exact = 0.1 * rng.choice([-1.0, 1.0], size=(16, 3, 3, 3))
    spread = rng.normal(0, 0.02, size=(16, 16, 3, 3))
    spread[np.arange(16), np.arange(16), 1, 1] = 1.0
    inits: dict = {}
    nodes = _conv("first", "x", "r", exact, inits) + _conv("second", "r", "y", spread, inits)
    path = save(single_io_model(nodes, inits, (1, 3, 8, 8), (1, 16, 8, 8)), folder)
    profile = profile_model(path, "random", options=ProfileOptions(samples=8))
    (folder / "profile.json").write_text(json.dumps(profile))
    data = folder / "data.npz"
    np.savez(data, x=rng.normal(size=(4, 3, 8, 8)).astype(np.float32))
    return path, profile, data


def _bits(manifest) -> list:
    return [r.weight.bits for r in manifest.regions]


def test_the_avx2_build_states_its_bits_and_computes_the_integer_reference(
    two_convs, monkeypatch, tmp_path
):
    """By default on AVX2: 7 bits for the first conv, 8 for the second, in the manifest; the
    artifact (``vpmaddubsw`` for the first, ``vpmaddwd`` for the second) computes what TVM's
    own lowering of the same integer module computes."""
    path, profile, data = two_convs
    monkeypatch.setenv(MCPU, AVX2_CPU)
    request = BuildRequest(model=path, profile=path.parent / "profile.json", out=tmp_path / "art")
    manifest = quantize.build(request)
    assert _bits(manifest) == [7, 8] and manifest.target_options == {"mcpu": AVX2_CPU}
    assert "7-bit ±63 where a layer's error budget allows it" in manifest.policy["weights"]

    plugin = get_plugin("x86")
    qparams = qparams_from_profile(profile, plugin, "mse", 99.99)
    qm = quantize_model(path, qparams, plugin)
    module = qm.lower()[0]
    x = tvm.runtime.tensor(np.load(data)["x"][:1])
    library = str(tmp_path / "art" / manifest.library)
    built = relax.VirtualMachine(tvm.runtime.load_module(library), tvm.cpu())["main"](x)
    reference = tvm.compile(module, target=tvm.target.Target({"kind": "llvm"}))
    expected = relax.VirtualMachine(reference, tvm.cpu())["main"](x)
    assert np.array_equal(built.numpy(), expected.numpy())

    (llvm,) = [m for m in plugin.compile(module).mod.imports if m.kind == "llvm"]
    assembly = llvm.inspect_source("asm")
    assert "vpmaddubsw" in assembly and "vpmaddwd" in assembly
    assert "vpdpbusd" not in assembly and "zmm" not in assembly


def test_the_evaluate_report_states_each_layers_bits(two_convs, monkeypatch):
    path, _, data = two_convs
    monkeypatch.setenv(MCPU, AVX2_CPU)
    profile = path.parent / "profile.json"
    request = EvaluateRequest(model=path, profile=profile, data=f"{data}:x")
    report = quantize.evaluate(request)
    assert report.weight_bits is None  # chosen per layer
    assert {layer.profile_id: layer.weight_bits for layer in report.layers} == {
        "first.relu": 7,
        "second.relu": 8,
    }


def test_a_budget_search_starts_from_seven_bits(two_convs, monkeypatch):
    """With an accuracy budget every layer starts on 7-bit weights (the fastest exact kernel on
    AVX2), the second conv too, and only the layers the budget needs are widened: a loose budget
    widens none; none at all widens the layers that lower the drop (int16 activations, 8-bit
    weights), the others stay on 7."""
    path, _, data = two_convs
    monkeypatch.setenv(MCPU, AVX2_CPU)
    profile = path.parent / "profile.json"

    def bits(budget):
        request = EvaluateRequest(
            model=path, profile=profile, data=f"{data}:x", accuracy_budget=budget
        )
        report = quantize.evaluate(request)
        return report, {layer.profile_id: layer.weight_bits for layer in report.layers}

    loose, loose_bits = bits(100.0)
    assert loose_bits == {"first.relu": 7, "second.relu": 7}
    assert not loose.kept_int16 and not loose.kept_fp32
    tight, tight_bits = bits(0.0)
    widened = {*tight.kept_int16, *tight.kept_fp32}
    assert widened
    assert all(tight_bits[pid] == 8 for pid in tight.kept_int16)
    assert all(tight_bits[pid] == 7 for pid in tight_bits if pid not in widened)


@pytest.mark.parametrize(
    "mcpu, weight_bits, moments, expected",
    [
        (AVX2_CPU, 8, True, [8, 8]),  # explicit: every layer
        (AVX2_CPU, 7, True, [7, 7]),
        (AVX2_CPU, None, False, [8, 8]),  # qparams without the profile's moments
        ("znver4", None, True, [8, 8]),  # VNNI: 8
    ],
)
def test_explicit_bits_win_and_eight_without_statistics_or_on_vnni(
    two_convs, monkeypatch, mcpu, weight_bits, moments, expected
):
    path, profile, _ = two_convs
    monkeypatch.setenv(MCPU, mcpu)
    plugin = get_plugin("x86", weight_bits)
    qparams = qparams_from_profile(profile, plugin, "mse", 99.99)
    if not moments:  # as an imported document: no moments of the inputs
        del qparams["moments"]
    qm = quantize_model(path, qparams, plugin)
    assert [r["weight"]["bits"] for r in qm.manifest()["regions"]] == expected


def test_layers_on_int16_activations_take_eight_bits(two_convs, monkeypatch):
    """The most sensitive layers (an accuracy budget's int16 ones) gain nothing from 7 bits."""
    path, profile, _ = two_convs
    monkeypatch.setenv(MCPU, AVX2_CPU)
    plugin = get_plugin("x86")
    qparams = qparams_from_profile(profile, plugin, "mse", 99.99)
    qm = quantize_model(path, qparams, plugin)
    first = qm.regions[0]
    assert qm.weight_bits(first, "int8") == 7 and qm.weight_bits(first, "int16") == 8
    assert qm.weight_bits(first, "fp32") is None
