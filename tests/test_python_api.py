"""The Python API (``import rangeprof``) on the trained digits CNN: the same documents as the CLI
from arrays, from an iterable of batches of any sizes, and from files; options of the shared
groups, refused in one line; typed results with short reprs; INT8 builds that run any batch,
clean up after themselves, keep excluded layers FP32 and fit a budget to a user's metric.

The default run covers every entry point on the model built for batch 8 (one profile, one
build); the CLI comparisons on more data and every calibration method are marked ``zoo``."""

from __future__ import annotations

import gc
import json

import numpy as np
import onnxruntime
import pytest
from typer.testing import CliRunner

import rangeprof
from rangeprof.byoc.manifest import Manifest
from rangeprof.cli import app
from rangeprof.profiler.errors import CalibrationDataError, RangeprofError

from conftest import SHARED, zoo_model

DATA = SHARED / "data" / "digits.npz"


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


@pytest.mark.zoo
def test_arrays_give_the_cli_profile(digits, from_file):
    model, calib, _, _ = digits
    profile = rangeprof.profile(model, {"image": calib})
    assert profile.document["tensors"] == from_file["tensors"]
    assert profile.document["run"]["data"] == "arrays"
    single = rangeprof.profile(model, calib)  # the one array of a one-input model
    assert single.document["tensors"] == from_file["tensors"]


@pytest.mark.zoo
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


@pytest.mark.zoo
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


@pytest.mark.zoo
def test_bad_arrays_are_named(digits):
    model, calib, _, _ = digits
    with pytest.raises(CalibrationDataError, match=r"no array for input 'image' \(has 'x'\)"):
        rangeprof.profile(model, {"x": calib})
    with pytest.raises(CalibrationDataError, match=r"shape \[48, 64\] does not fit input"):
        rangeprof.profile(model, calib.reshape(48, 64))
    with pytest.raises(CalibrationDataError, match="batch 1, input 'image'"):
        rangeprof.profile(model, [calib[:4], calib[:4, 0]])


@pytest.mark.zoo
def test_build_runs_int8(digits, tmp_path):
    model, calib, test, labels = digits
    profile = rangeprof.profile(model, {"image": calib})
    int8 = rangeprof.build(model, profile, method="mse", out=tmp_path / "int8")
    assert (tmp_path / "int8" / "model.so").exists()
    assert all(r.mode == "int8" for r in int8.manifest.regions)
    batch = model.inputs["image"][0][0]
    predictions = [
        int(np.argmax(int8.run({"image": test[i : i + batch]})[0], axis=-1)[0])
        for i in range(0, 100, batch)
    ]
    accuracy = np.mean(np.array(predictions) == labels[:100:batch])
    assert accuracy > 0.9


@pytest.mark.zoo
def test_evaluate_and_a_budget_build_from_python(digits, tmp_path):
    model, calib, _, _ = digits
    data = SHARED / "data" / "digits.npz"
    profile = rangeprof.profile(model, {"image": calib})
    report = rangeprof.evaluate(
        model, profile, f"{data}:test", labels=f"{data}:test_labels", method="all", samples=64
    )
    methods = [m.method for m in report.methods]
    assert methods == ["max", "percentile", "entropy", "mse", "best"]
    assert report.samples == 64 and report.int8_top1 >= report.fp32_top1 - 2
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
    assert int8.manifest.kept_fp32


def test_a_cross_compiled_build_is_not_run_here(tmp_path):
    built = Manifest.model_validate(
        {
            "model": {"name": "m", "sha256": "0" * 64},
            "inputs": {"x": {"shape": [1, 4], "dtype": "float32"}},
            "target": "aarch64",
            "policy": {},
            "calibration": None,
            "regions": [],
            "library": "model.so",
            "library_sha256": "0" * 64,
            "kept_fp32": [],
            "timings": {},
        }
    )
    int8 = rangeprof.Int8Model(tmp_path, built, {"x": ((1, 4), "float32")})
    with pytest.raises(RangeprofError, match="this aarch64 build runs on its target"):
        int8.run(np.zeros((1, 4), np.float32))


# The default run: the digits CNN built for batch 8, one profile and one build for all.


@pytest.fixture(scope="module")
def eight():
    """The model loaded for batch 8, its profile on 64 calibration images, 64 test images."""
    model = rangeprof.load(zoo_model("digits_cnn"), {"image": (8, 1, 8, 8)})
    with np.load(DATA) as data:
        calib, test, labels = data["calib"][:64], data["test"][:64], data["test_labels"][:64]
    return model, rangeprof.profile(model, calib), calib, test, labels


@pytest.fixture(scope="module")
def int8(eight, tmp_path_factory):
    model, profile, *_ = eight
    return rangeprof.build(model, profile, out=tmp_path_factory.mktemp("int8"))


def _refused(call, match: str) -> None:
    with pytest.raises(RangeprofError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_options_are_the_groups_refused_in_one_line(eight, tmp_path):
    model, profile, calib, test, _ = eight
    _refused(lambda: rangeprof.profile(model, calib, bogus=1), r"^bogus: no such option$")
    _refused(lambda: rangeprof.profile(model, calib, bins=-1), r"^bins: .*greater than or equal")
    _refused(lambda: profile.calibrate(method="median"), r"^method: Input should be 'max'")
    _refused(lambda: profile.calibrate(percentile=99.9, sample=1), r"^sample: no such option$")
    out = tmp_path / "t.aimet.json"
    _refused(lambda: profile.export("aimet", out, scheme="odd"), r"^scheme: Input should be")
    _refused(lambda: rangeprof.build(model, profile, weight_bits=9), r"^weight_bits: .* 7, 8")
    _refused(lambda: rangeprof.build(model, profile, exclude="/fc2/*"), r"^exclude: ")
    _refused(lambda: rangeprof.evaluate(model, profile, test, target="arm"), r"^target: ")
    _refused(lambda: rangeprof.quantize(model, calib, bins=8, bogus=1), r"^bogus: no such option")
    _refused(lambda: rangeprof.quantize(model, calib, bins=-1), r"^bins: ")
    # A metric is the budget's: a build without one has no use for it.
    _refused(lambda: rangeprof.build(model, profile, metric=len), r"^metric: .*accuracy_budget")
    assert not out.exists()


def test_calibrate_is_the_cli_calibration_and_the_builds(eight, int8, tmp_path):
    _, profile, *_ = eight
    profile.save(tmp_path / "p.json")
    result = CliRunner().invoke(
        app, ["calibrate", str(tmp_path / "p.json"), "--out", str(tmp_path / "q.json")]
    )
    assert result.exit_code == 0, result.output
    qparams = profile.calibrate()
    assert qparams.to_json() == (tmp_path / "q.json").read_text().rstrip("\n")
    assert int8.manifest.calibration == qparams.record.options
    assert qparams.document["options"]["target"] == "x86"
    assert profile.calibrate(target="npu").document["options"]["target"] == "npu"
    # An export resolves its options as `rangeprof export` does: the target's policy.
    command = ["export", str(tmp_path / "p.json"), "--format", "ort-json", "--target", "npu"]
    result = CliRunner().invoke(app, [*command, "--out", str(tmp_path / "cli.json")])
    assert result.exit_code == 0, result.output
    profile.export("ort-json", tmp_path / "py.json", target="npu")
    assert (tmp_path / "py.json").read_bytes() == (tmp_path / "cli.json").read_bytes()


def test_short_reprs_and_the_public_names(eight, int8):
    model, profile, *_ = eight
    assert repr(model) == "<Model digits_cnn.onnx: image [8, 1, 8, 8] float32>"
    assert repr(profile) == f"<Profile digits_cnn: {len(profile.tensors)} tensors, 64 samples>"
    qparams = profile.calibrate(method="max", target="npu")
    options = qparams.document["options"]
    assert repr(qparams) == (
        f"<QParams max, npu, {options['scheme']} {options['dtype']}: "
        f"{len(qparams.document['qparams'])} tensors>"
    )
    assert repr(int8) == f"<Int8Model x86 in {int8.folder}: 5 regions, 5 int8>"
    assert dir(rangeprof) == sorted(rangeprof.__all__)
    assert {"load", "profile", "build", "evaluate", "quantize", "Int8Model"} <= set(dir(rangeprof))
    assert all(hasattr(rangeprof, name) for name in dir(rangeprof))


def test_run_takes_any_batch_and_safe_dtypes(eight, int8):
    _, _, _, test, _ = eight
    assert int8.batch == 8 and int8.inputs == {"image": ((8, 1, 8, 8), "float32")}
    full = [int8.run(test[i : i + 8])[0] for i in range(0, 24, 8)]
    three = int8.run({"image": test[:3]})[0]
    assert three.shape == (3, 10) and np.array_equal(three, full[0][:3])
    # More than a batch: a batch at a time, the last one padded.
    assert np.array_equal(int8.run(test[:19])[0], np.concatenate(full)[:19])
    # Types that cast within their kind or up: float64, integers.
    assert np.array_equal(int8.run(test[:8].astype(np.float64))[0], full[0])
    pixels = np.round(test[:8]).astype(np.int16)
    assert np.array_equal(int8.run(pixels)[0], int8.run(pixels.astype(np.float32))[0])
    _refused(
        lambda: int8.run(test[:8].astype(np.complex64)),
        r"^input 'image': dtype complex64 does not cast safely to the built float32",
    )
    _refused(
        lambda: int8.run(test[:8, :, :4]),
        r"^input 'image': shape \[8, 1, 4, 8\] does not fit: it takes \[N, 1, 8, 8\]",
    )
    _refused(lambda: int8.run(test[0]), r"shape \[1, 8, 8\] does not fit")
    _refused(lambda: int8.run({"x": test[:8]}), r"^no array for input 'image'")


def test_quantize_is_profile_then_build_and_cleans_up(eight, int8):
    """One call gives the build of the profile bit for bit; its temporary folder goes with it."""
    model, _, calib, test, _ = eight
    one = rangeprof.quantize(model, calib, target="x86")
    folder = one.folder
    assert (folder / "model.so").read_bytes() == (int8.folder / "model.so").read_bytes()
    timeless = [m.manifest.model_dump(exclude={"timings"}) for m in (one, int8)]
    assert timeless[0] == timeless[1]
    assert np.array_equal(one.run(test[:8])[0], int8.run(test[:8])[0])
    del one
    gc.collect()
    assert not folder.exists()


def test_an_excluded_layer_stays_fp32(eight):
    model, profile, _, test, labels = eight
    int8 = rangeprof.build(model, profile, exclude=("/fc2/*",))
    modes = {r.output_id: r.mode for r in int8.manifest.regions}
    assert modes.pop("/fc2/Gemm#2") == "fp32"
    assert set(modes.values()) == {"int8"}
    assert np.mean(int8.run(test)[0].argmax(-1) == labels) > 0.9
    _refused(lambda: rangeprof.build(model, profile, exclude=("/nothing/*",)), "/nothing/")


def test_the_first_and_last_layers_can_stay_fp32(eight):
    model, profile, *_ = eight
    int8 = rangeprof.build(model, profile, first_last_fp32=True)
    modes = [r.mode for r in int8.manifest.regions]
    assert len(modes) > 2 and modes[0] == modes[-1] == "fp32"
    assert set(modes[1:-1]) == {"int8"}
    assert "excluded by" in int8.manifest.regions[0].fallback


def test_evaluate_takes_arrays_as_files(eight):
    """Arrays evaluate as the same samples from files do, and an iterable of uneven batches is
    the calibration data of bias correction as a file is; a metric in points reports beside
    top-1."""
    model, profile, _, test, labels = eight
    with np.load(DATA) as data:
        calib = data["calib"]
    options = {"bias_correction": "measured", "method": "max"}
    spec = rangeprof.evaluate(
        model,
        profile,
        f"{DATA}:test",
        labels=f"{DATA}:test_labels",
        calibration_data=f"{DATA}:calib",
        samples=64,
        **options,
    ).to_json()

    def accuracy(outputs, truth):
        return 100.0 * float(np.mean(outputs.argmax(-1) == truth))

    batches = iter([calib[:90], calib[90:97], calib[97:]])
    held = rangeprof.evaluate(
        model, profile, {"image": test}, labels=labels, calibration_data=batches, metric=accuracy,
        **options,
    ).to_json()  # fmt: skip
    assert held["fp32_metric"] == pytest.approx(held["fp32_top1"], abs=1e-3)
    assert held.pop("int8_metric") == pytest.approx(held["int8_top1"], abs=1e-3)
    assert held["methods"][0].pop("int8_metric") == pytest.approx(held["int8_top1"], abs=1e-3)
    del held["fp32_metric"]
    assert spec["bias_correction"].pop("data") == f"{DATA}:calib"
    assert held["bias_correction"].pop("data") == "arrays"
    assert held == spec


def test_a_metric_drives_the_accuracy_budget(eight):
    """A metric far stricter than top-1 (the logits' largest error against onnxruntime's, in
    thousandths): the budget widens the quantized layer, which top-1 would leave alone."""
    model, profile, _, test, _ = eight
    session = onnxruntime.InferenceSession(str(model.path))
    (reference,) = session.run(None, {"image": test[:8]})
    scores = []

    def closeness(outputs, expected):
        scores.append(-1000.0 * float(np.abs(outputs - expected).max()))
        return scores[-1]

    report = rangeprof.evaluate(
        model,
        profile,
        test[:8],
        labels=reference,
        metric=closeness,
        accuracy_budget=1.0,
        exclude=("/c*", "/fc1/*"),  # one layer to widen
    )
    fp32, int8 = scores[:2]  # the first evaluation, every layer INT8
    assert fp32 - int8 > 1.0 and report.agreement == 100.0
    assert report.kept_int16 == ["/fc2/Gemm#2"]
    assert report.int8_metric > int8 and report.fp32_metric == fp32
    assert "int8_top1" not in report.to_json()  # the labels are no classes
