"""The Python API (``import rangeprof``) on the trained digits CNN: the same documents as the CLI
from arrays, from an iterable of batches of any sizes, and from files; typed results; an INT8
build that runs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import rangeprof
from rangeprof.cli import app
from rangeprof.profiler.errors import CalibrationDataError, RangeprofError

from conftest import SHARED, zoo_model

pytestmark = pytest.mark.zoo


@pytest.fixture(scope="module")
def digits():
    model = rangeprof.load(zoo_model("digits_cnn"))
    with np.load(SHARED / "data" / "digits.npz") as data:
        return model, data["calib"][:48], data["test"][:200], data["test_labels"][:200]


@pytest.fixture(scope="module")
def from_file(digits, tmp_path_factory):
    """The CLI's profile of the same 48 samples, from an .npz."""
    model, calib, _, _ = digits
    folder = tmp_path_factory.mktemp("cli")
    np.savez(folder / "calib.npz", calib=calib)
    out = folder / "p.json"
    result = CliRunner().invoke(
        app, ["profile", str(model.path), "--data", f"{folder}/calib.npz:calib", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_load_and_inspect(digits):
    model = digits[0]
    assert list(model.inputs) == ["image"]
    shape, dtype = model.inputs["image"]
    assert shape[1:] == (1, 8, 8) and dtype == "float32"
    report = model.inspect()
    assert [layer["profile_id"] for layer in report["layers"]][:1] == ["input:image"]
    assert report["stages"][0]["name"] == "initial"


def test_arrays_give_the_cli_profile(digits, from_file):
    model, calib, _, _ = digits
    profile = rangeprof.profile(model, {"image": calib})
    assert profile.document["tensors"] == from_file["tensors"]
    assert profile.document["run"]["data"] == "arrays"
    single = rangeprof.profile(model, calib)  # the one array of a one-input model
    assert single.document["tensors"] == from_file["tensors"]


def test_batches_of_any_size_read_once(digits, from_file):
    """A generator of uneven batches (a DataLoader's (images, labels) tuples): regrouped into
    the model's batches, so the statistics are the file's, bit for bit."""
    model, calib, _, _ = digits
    sizes, reads, seen = [5, 11, 1, 31], [], []

    def loader():
        start = 0
        for size in sizes:
            reads.append(size)
            yield calib[start : start + size], np.zeros(size, np.int64)
            start += size

    profile = rangeprof.profile(
        model, loader(), progress=lambda done, total: seen.append((done, total))
    )
    assert reads == sizes  # read once
    assert profile.document["tensors"] == from_file["tensors"]
    assert profile.document["run"]["samples"] == 48 and seen[-1] == (48, None)
    limited = rangeprof.profile(model, iter([calib[:20], calib[20:]]), samples=7)
    assert limited.document["run"]["samples"] == 7


def test_typed_results(digits, from_file):
    model, calib, _, _ = digits
    profile = rangeprof.profile(model, {"image": calib})
    relu = next(t for t in profile.tensors.values() if t.op == "relax.nn.relu")
    assert relu.min == 0.0 and relu.max > 0
    assert int(relu.histogram.counts.sum()) == relu.stats.finite_count
    assert relu.histogram.edges()[0] <= relu.min and relu.histogram.edges()[-1] >= relu.max
    qparams = profile.calibrate(method="entropy", scheme="asym", dtype="uint8")
    cli = rangeprof.Profile(from_file).calibrate(method="entropy", scheme="asym", dtype="uint8")
    assert qparams.document == cli.document
    assert qparams[relu.profile_id]["profile_id"] == relu.profile_id
    assert json.loads(profile.to_json()) == profile.document


def test_bad_arrays_are_named(digits):
    model, calib, _, _ = digits
    with pytest.raises(CalibrationDataError, match=r"no array for input 'image' \(has 'x'\)"):
        rangeprof.profile(model, {"x": calib})
    with pytest.raises(CalibrationDataError, match=r"shape \[48, 64\] does not fit input"):
        rangeprof.profile(model, calib.reshape(48, 64))
    with pytest.raises(CalibrationDataError, match="batch 1, input 'image'"):
        rangeprof.profile(model, [calib[:4], calib[:4, 0]])


def test_build_runs_int8(digits, tmp_path):
    model, calib, test, labels = digits
    profile = rangeprof.profile(model, {"image": calib})
    int8 = rangeprof.build(model, profile, method="mse", out=tmp_path / "int8")
    assert (tmp_path / "int8" / "model.so").exists()
    assert all(r["mode"] == "int8" for r in int8.manifest["regions"])
    batch = model.inputs["image"][0][0]
    predictions = [
        int(np.argmax(int8.run({"image": test[i : i + batch]})[0], axis=-1)[0])
        for i in range(0, 100, batch)
    ]
    accuracy = np.mean(np.array(predictions) == labels[:100:batch])
    assert accuracy > 0.9


def test_evaluate_and_a_budget_build_from_python(digits, tmp_path):
    model, calib, _, _ = digits
    data = SHARED / "data" / "digits.npz"
    profile = rangeprof.profile(model, {"image": calib})
    report = rangeprof.evaluate(
        model, profile, f"{data}:test", labels=f"{data}:test_labels", method="all", samples=64
    )
    methods = [m["method"] for m in report["methods"]]
    assert methods == ["max", "percentile", "entropy", "mse", "best"]
    assert report["samples"] == 64 and report["int8_top1"] >= report["fp32_top1"] - 2
    # A budget of 0 points keeps layers FP32 until nothing is lost on these samples.
    int8 = rangeprof.build(
        model,
        profile.calibrate(method="percentile", percentile=50.0, scheme="asym", dtype="uint8"),
        accuracy_budget=0.0,
        data=f"{data}:test",
        labels=f"{data}:test_labels",
        samples=64,
        out=tmp_path / "budget",
    )
    assert int8.manifest["kept_fp32"]


def test_a_cross_compiled_build_is_not_run_here(tmp_path):
    int8 = rangeprof.Int8Model(tmp_path, {"target": "aarch64", "library": "model.so"}, ("x",))
    with pytest.raises(RangeprofError, match="this aarch64 build runs on its target"):
        int8.run(np.zeros((1, 4), np.float32))
