"""INT8 matmuls of two activations (attention's ``Q·Kᵀ`` and ``P·V``) in the x86 plugin: the
integer formula, per-call-site lineage when blocks repeat, and accuracy on an encoder."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from onnx import helper
from test_byoc import _asym, _doc, _quantize
from tvm import relax

from rangeprof.byoc.evaluate import evaluate
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.policy import float_requantize_reference
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

from conftest import zoo_model
from onnx_builders import save, single_io_model

X86 = get_plugin("x86")
INTEGER = dataclasses.replace(X86, policy=dataclasses.replace(X86.policy, integer_outputs=True))


def _gram(tmp_path):
    """``y = x · xᵀ``: a batch matmul whose operands are both activations."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], name="xt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["x", "xt"], ["y"], name="gram"),
    ]
    return save(single_io_model(nodes, {}, (2, 6, 16), (2, 6, 6)), tmp_path)


def _symmetric(q: dict) -> float:
    lo = q["scale"] * (0 - q["zero_point"])
    hi = q["scale"] * (255 - q["zero_point"])
    return max(-lo, hi) / 127


@pytest.mark.parametrize("plugin", [X86, INTEGER], ids=["float_output", "requantized"])
def test_batch_matmul_region_equals_integer_formula(plugin, tmp_path):
    path = _gram(tmp_path)
    x = np.random.default_rng(4).normal(size=(2, 6, 16)).astype(np.float32)
    a_q, b_q, out_q = _asym(-2.5, 3.0, "input:x"), _asym(-3.0, 2.0, "xt"), _asym(-9, 20, "gram")
    qm = quantize_model(path, _doc(path, [a_q, b_q, out_q]), plugin)
    (region,) = qm.regions
    assert region.float_region.kind == "batch_matmul"
    assert (region.input.profile_id, region.operand.profile_id) == ("input:x", "xt")
    assert (region.operand.dtype, region.operand.zero_point) == ("int8", 0)
    mod, _ = qm.lower(expose=True)
    got = relax.VirtualMachine(plugin.compile(mod), tvm.cpu())["main"](tvm.runtime.tensor(x))
    got = got[1].numpy()

    s_b = _symmetric(b_q)
    bq = np.clip(np.round(x.transpose(0, 2, 1) / np.float32(s_b)), -128, 127).astype(np.int64)
    acc = (_quantize(x, a_q) - a_q["zero_point"]) @ bq
    scale = a_q["scale"] * s_b
    if plugin is X86:  # consumed by no region: leaves as the scaled accumulator, in FP32
        np.testing.assert_allclose(got, (acc * np.float32(scale)).astype(np.float32), rtol=1e-6)
    else:
        want = float_requantize_reference(acc, scale / out_q["scale"]) + out_q["zero_point"]
        want = np.clip(want, 0, 255)
        got_q = np.round(got / out_q["scale"]).astype(np.int64) + out_q["zero_point"]
        assert np.array_equal(got_q, want)


def _attention(name: str, inp: str, out: str, rng) -> tuple[list, dict]:
    """One single-head attention block over ``inp`` [1, 8, 16] (identical shapes each time)."""
    nodes = [
        helper.make_node("MatMul", [inp, f"{name}_wq"], [f"{name}_q"], name=f"{name}/q"),
        helper.make_node("MatMul", [inp, f"{name}_wk"], [f"{name}_k"], name=f"{name}/k"),
        helper.make_node(
            "Transpose", [f"{name}_k"], [f"{name}_kt"], name=f"{name}/kt", perm=[0, 2, 1]
        ),
        helper.make_node("MatMul", [f"{name}_q", f"{name}_kt"], [f"{name}_s"], name=f"{name}/qk"),
        helper.make_node("Softmax", [f"{name}_s"], [f"{name}_p"], name=f"{name}/softmax", axis=-1),
        helper.make_node("MatMul", [f"{name}_p", inp], [out], name=f"{name}/pv"),
    ]
    weights = {f"{name}_w{k}": rng.normal(size=(16, 16)) / 4 for k in "qk"}
    return nodes, weights


def test_repeated_attention_blocks_keep_their_own_lineage_and_accuracy(tmp_path):
    rng = np.random.default_rng(0)
    first, w1 = _attention("block1", "x", "h", rng)
    second, w2 = _attention("block2", "h", "y", rng)
    path = save(single_io_model(first + second, {**w1, **w2}, (1, 8, 16), (1, 8, 16)), tmp_path)
    profile = profile_model(path, "random", options=ProfileOptions(samples=32))
    qm = quantize_model(path, qparams_from_profile(profile, X86, "max", 99.99), X86)

    batch = [r for r in qm.regions if r.float_region.kind == "batch_matmul"]
    # The two blocks' matmuls are structurally equal: still one region each, named by lineage.
    assert sorted(r.output_id for r in batch) == sorted(
        f"{b}/{op}" for b in ("block1", "block2") for op in ("qk", "pv")
    )
    assert len({r.name for r in qm.regions}) == len(qm.regions)
    by_output = {r.output_id: r for r in batch}
    assert by_output["block2/qk"].input.profile_id == "block2/q"
    assert by_output["block2/qk"].operand.profile_id == "block2/kt"
    assert by_output["block2/pv"].operand.profile_id == "block1/pv"

    result = evaluate(qm, "random", samples=16)
    assert result.output.sqnr_db > 25
    layers = {layer.profile_id: layer for layer in result.layers}
    assert all(layers[r.output_id].isolated.sqnr_db > 25 for r in batch)


@pytest.mark.zoo
def test_tiny_bert_attention_runs_int8():
    path = zoo_model("tiny_bert")
    profile = profile_model(path, "random", options=ProfileOptions(samples=8))
    qm = quantize_model(path, qparams_from_profile(profile, X86, "max", 99.99), X86)
    batch = [r for r in qm.regions if r.float_region.kind == "batch_matmul"]
    assert sorted(r.output_id for r in batch) == sorted(
        f"/layers.{i}/self_attn/MatMul_{k}" for i in range(4) for k in (1, 2)
    )
    script = qm.lower()[0].script()
    assert script.count("R.matmul(") >= len(qm.regions)
    assert 'out_dtype="int32"' in script
    result = evaluate(qm, "random", samples=8)
    assert result.output.sqnr_db > 30
    assert result.agreement == 100.0
