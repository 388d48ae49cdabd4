"""Profiling: fidelity against onnxruntime, bitwise outputs, exact shard merges, the document."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.errors import InputShapeError
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data
from rangeprof.profiler.profiling.document import (
    load_profile,
    merge_profiles,
    tensors_bytes,
    validate,
)
from rangeprof.profiler.profiling.executor import compile_program
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

import onnx_builders as mb
from conftest import SHARED, ZOO_SHAPES, zoo_model
from ort_reference import assert_fidelity, exposed_session, reference_ranges


def _cli_profile(model, data, out, *extra):
    cmd = [sys.executable, "-m", "rangeprof", "profile", str(model), "--data", data]
    cmd += ["--out", str(out), *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return load_profile(out)


@pytest.mark.zoo
def test_digits_fidelity_cli(tmp_path):
    data = SHARED / "data" / "digits.npz"
    doc = _cli_profile(zoo_model("digits_cnn"), f"{data}:calib", tmp_path / "p.json")
    assert doc["run"]["samples"] == 200
    calib = np.load(data)["calib"]
    session = exposed_session(zoo_model("digits_cnn"), {"image": (1, 1, 8, 8)})
    reference = reference_ranges(session, ({"image": calib[i : i + 1]} for i in range(len(calib))))
    assert_fidelity(doc, reference, zoo_model("digits_cnn"))


@pytest.mark.zoo
def test_ppocr_fidelity_cli(tmp_path):
    data = SHARED / "data" / "textlines.npz"
    model = zoo_model("ppocr_cls")
    doc = _cli_profile(model, f"{data}:calib", tmp_path / "p.json", "--input-shape", "x=1x3x48x192")
    calib = np.load(data)["calib"]
    session = exposed_session(model, ZOO_SHAPES["ppocr_cls"])
    reference = reference_ranges(session, ({"x": calib[i : i + 1]} for i in range(len(calib))))
    assert_fidelity(doc, reference, model)


@pytest.mark.zoo
def test_resnet18_random_fidelity_cli(tmp_path):
    model = zoo_model("resnet18")
    doc = _cli_profile(model, "random", tmp_path / "p.json", "--samples", "2")
    assert doc["run"]["samples"] == 2
    source = open_data("random", model_inputs(load_model(model)), samples=2)
    session = exposed_session(model)
    assert_fidelity(doc, reference_ranges(session, source.batches()), model)


def _profiled_output(imported, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """The model output of a plain build and of the profiling program, and its statistics."""
    _, program = compile_program(imported.mod, imported.layers, ["x"])
    plain = relax.VirtualMachine(build(imported.mod, fold_scales=False), tvm.cpu())
    out, stats = program.run({"x": x})
    return plain["main"](tvm.runtime.tensor(x)).numpy(), out.numpy(), stats


def test_instrumented_outputs_are_bitwise_equal(tmp_path):
    imported = import_onnx(load_model(mb.save(mb.conv_bn_relu_scale(), tmp_path)))
    x = np.random.default_rng(3).normal(size=(1, 3, 6, 6)).astype("float32")
    plain, profiled, stats = _profiled_output(imported, x)
    assert len(stats) >= 4
    assert plain.tobytes() == profiled.tobytes()


def test_shard_merges_are_exact_in_any_order(tmp_path):
    path = mb.save(mb.conv_bn_relu_scale(), tmp_path)
    rng = np.random.default_rng(5)
    data = rng.normal(size=(11, 3, 6, 6)).astype("float32")
    data[4, 0, 0, 0] = np.nan
    data[7, 1, 2, 2] = np.inf
    np.save(tmp_path / "all.npy", data)
    options = ProfileOptions(bins=256, allow_nonfinite=True)
    whole = profile_model(path, str(tmp_path / "all.npy"), options=options)
    validate(whole)
    assert whole["run"]["samples"] == 11

    for cut in ([3, 8], [1, 2, 10], [6]):
        bounds = [0, *cut, len(data)]
        shards = []
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            np.save(tmp_path / f"s{k}.npy", data[a:b])
            shards.append(profile_model(path, str(tmp_path / f"s{k}.npy"), options=options))
        for order in itertools.permutations(range(len(shards))):
            merged = shards[order[0]]
            for k in order[1:]:
                merged = merge_profiles(merged, shards[k])
            assert merged["run"]["samples"] == 11
            assert tensors_bytes(merged) == tensors_bytes(whole)

    entry = next(t for t in whole["tensors"] if t["profile_id"] == "input:x")
    assert entry["nan_count"] == 1 and entry["inf_count"] == 1
    finite = data[np.isfinite(data)]
    assert entry["min"] == float(finite.min()) and entry["max"] == float(finite.max())
    assert entry["mean"] == pytest.approx(float(finite.astype(np.float64).mean()), rel=1e-12)
    assert sum(entry["histogram"]["counts"]) == finite.size


def test_document_layout_and_weights(tmp_path):
    path = mb.save(mb.gemm(), tmp_path)
    doc = profile_model(path, "random", options=ProfileOptions(samples=4, bins=64))
    validate(doc)
    by_id = {t["profile_id"]: t for t in doc["tensors"]}
    weight = by_id["weight:w"]
    assert weight["kind"] == "weight" and weight["static"] and weight["count"] == 40
    # Gemm's weight is [out, in] used transposed: its channels are along axis 0.
    assert weight["per_channel"]["axis"] == 0 and len(weight["per_channel"]["max"]) == 5
    out = by_id["fc#2"]
    assert out["source_tensor"] == "y" and out["count"] == 4 * 5
    assert doc["run"]["options"]["batch_size"] == 2 and doc["run"]["batches"] == 2
    assert out["per_channel"]["axis"] == 1
    assert {s["name"] for s in doc["lineage"]["stages"]} >= {"initial", "fuse_ops"}
    json.dumps(doc)  # serialisable as is
    with pytest.raises(InputShapeError, match="last batch of 1 samples"):
        profile_model(path, "random", options=ProfileOptions(samples=3))


def test_bad_data_is_rejected_by_the_cli(tmp_path):
    from typer.testing import CliRunner

    from rangeprof.cli import app

    path = mb.save(mb.gemm(), tmp_path)
    np.save(tmp_path / "wrong.npy", np.zeros((4, 7), dtype=np.float32))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for bad, needle in (("wrong.npy", "wrong.npy"), ("objects.npy", "objects.npy")):
        result = CliRunner().invoke(
            app, ["profile", str(path), "--data", str(tmp_path / bad), "--out", "x.json"]
        )
        assert result.exit_code == 2, result.output
        assert needle in result.stderr.strip().splitlines()[-1]
        assert not (tmp_path / "x.json").exists()


def test_second_run_reuses_the_build(tmp_path):
    from rangeprof.profiler.compile.cache import BuildCache

    path = mb.save(mb.conv_bn_relu_scale(), tmp_path)
    cache = BuildCache(tmp_path / "cache")
    options = ProfileOptions(samples=3, bins=128)
    cold = profile_model(path, "random", options=options, cache=cache)
    warm = profile_model(path, "random", options=options, cache=cache)
    assert (cold["run"]["build_cache"], warm["run"]["build_cache"]) == ("miss", "hit")
    assert tensors_bytes(cold) == tensors_bytes(warm)
    assert cold["lineage"] == warm["lineage"]
    # Another bin count is another program; a sidecar-less library is a miss, not a crash.
    other = profile_model(path, "random", options=ProfileOptions(samples=3, bins=64), cache=cache)
    assert other["run"]["build_cache"] == "miss"
    for sidecar in (tmp_path / "cache").glob("*.json"):
        sidecar.unlink()
    again = profile_model(path, "random", options=options, cache=cache)
    assert again["run"]["build_cache"] == "miss"
    assert tensors_bytes(again) == tensors_bytes(cold)


@pytest.mark.zoo
@pytest.mark.parametrize("name", ["ppocr_cls", "mobilenet_v2"])
def test_instrumented_zoo_outputs_are_bitwise_equal(name):
    imported = import_onnx(load_model(zoo_model(name), ZOO_SHAPES[name]))
    param = imported.mod["main"].params[0]
    x = np.random.default_rng(4).normal(size=[int(d) for d in param.ty.shape.values])
    plain, profiled, _ = _profiled_output(imported, x.astype("float32"))
    assert plain.tobytes() == profiled.tobytes()
