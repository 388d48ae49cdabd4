"""Bias correction on the trained digits CNN, empirical (measured on calibration data) and
stored (derived from the profile's per-channel means): folded into the int32 biases, recorded
in the report and the manifest, and worth it. The default run has the smoke test of both modes
on a small profile; the rest is the zoo step's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rangeprof.byoc.bias_correction import corrected, derive, measure
from rangeprof.byoc.plugin import get_plugin
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model
from rangeprof.cli import app
from rangeprof.workflows import profiling, quantize
from rangeprof.workflows.requests import BuildRequest, EvaluateRequest, ProfileRequest

from conftest import SHARED, zoo_model

DATA = SHARED / "data" / "digits.npz"
CALIB = f"{DATA}:calib"


def _profile(tmp_path_factory, channel_stats: bool, samples: int | None = None):
    request = ProfileRequest(
        model=zoo_model("digits_cnn"), data=CALIB, channel_stats=channel_stats, samples=samples
    )
    path = tmp_path_factory.mktemp("bc") / "profile.json"
    path.write_text(profiling.profile(request).dumps())
    return path


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A profile with per-channel means (the empirical mode reads only its ranges)."""
    return _profile(tmp_path_factory, channel_stats=True)


@pytest.fixture(scope="module")
def plain_profile_path(tmp_path_factory):
    return _profile(tmp_path_factory, channel_stats=False)


def test_stored_and_measured_corrections_on_a_small_profile(tmp_path_factory):
    """Both modes end to end on 32 samples (the default run's smoke test): the evaluation
    report records the mode and the regions corrected, and the correction moves the INT8
    output (not its FP32 reference)."""
    profile_path = _profile(tmp_path_factory, channel_stats=True, samples=32)
    plain = _evaluate(profile_path, samples=32)
    stored = _evaluate(profile_path, samples=32, bias_correction="stored")
    measured = _evaluate(
        profile_path, samples=32, bias_correction="measured", calibration_data=CALIB
    )
    assert stored.bias_correction == {"mode": "stored", "regions": 5}
    assert measured.bias_correction == {"mode": "empirical", "data": CALIB, "regions": 5}
    assert plain.bias_correction is None and "bias_correction" not in plain.to_json()
    for corrected_report in (stored, measured):
        assert corrected_report.samples == plain.samples == 32
        assert corrected_report.fp32_top1 == plain.fp32_top1
        assert corrected_report.output_sqnr_db != plain.output_sqnr_db


def _quantized(profile: dict):
    plugin = get_plugin("x86")
    return quantize_model(
        zoo_model("digits_cnn"), qparams_from_profile(profile, plugin, "max", 99.99), plugin
    )


def _evaluate(profile_path, **options):
    request = EvaluateRequest(
        model=zoo_model("digits_cnn"),
        profile=profile_path,
        method="max",
        data=f"{DATA}:test",
        labels=f"{DATA}:test_labels",
        **options,
    )
    return quantize.evaluate(request)


@pytest.mark.zoo
def test_corrections_move_biases_by_the_measured_shift(profile_path):
    qm = _quantized(json.loads(profile_path.read_text()))
    corrections = measure(qm, CALIB, samples=64)
    quantized = [r for r in qm.regions if r.fallback is None]
    assert set(corrections) == {r.output_id for r in quantized}
    assert any(np.abs(c).max() > 0 for c in corrections.values())
    fixed = corrected(qm, corrections, {"data": CALIB})
    for before, after in zip(qm.regions, fixed.regions, strict=True):
        delta = corrections[before.output_id]
        old = before.float_region.bias
        old = np.zeros_like(delta) if old is None else old.astype(np.float64).reshape(-1)
        np.testing.assert_allclose(after.float_region.bias, old + delta, rtol=1e-6, atol=1e-7)
    assert fixed.manifest()["bias_correction"] == {"data": CALIB}
    assert "bias_correction" not in qm.manifest()


@pytest.mark.zoo
def test_bias_correction_raises_the_output_sqnr(profile_path):
    plain = _evaluate(profile_path)
    fixed = _evaluate(profile_path, bias_correction="measured", calibration_data=CALIB)
    assert fixed.bias_correction == {"mode": "empirical", "data": CALIB, "regions": 5}
    # Measured: 40.9 -> 42.1 dB; the top-1 is the FP32 one either way.
    assert fixed.output_sqnr_db > plain.output_sqnr_db + 0.5
    assert fixed.int8_top1 >= plain.int8_top1 - 0.5


@pytest.mark.zoo
def test_a_corrected_build_records_its_correction(profile_path, tmp_path):
    request = BuildRequest(
        model=zoo_model("digits_cnn"),
        profile=profile_path,
        out=tmp_path,
        bias_correction="measured",
        calibration_data=CALIB,
    )
    manifest = quantize.build(request)
    assert manifest.bias_correction["data"] == CALIB
    assert manifest.bias_correction["mode"] == "empirical"
    assert manifest.bias_correction["regions"] >= 2
    assert json.loads((tmp_path / "manifest.json").read_text())["bias_correction"]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.zoo
def test_stored_corrections_point_where_the_measured_ones_do(profile_path):
    """The shift derived from the weights' rounding and the input means against the one
    measured on the same calibration data, per region. They differ by what the first-order
    form leaves out (conv padding: a 3x3 conv on 8x8 maps has 28 of 64 positions on the border;
    the input's own quantization; the clamp's rescaling of the measured shift), so the bound is
    loose where those weigh (measured cosines 0.83-0.97) and tight for the last layer, a dense
    layer without padding or clamp (measured 0.998): a sign error, a wrong axis or another
    group's means would bring them near 0 or below."""
    profile = json.loads(profile_path.read_text())
    qm = _quantized(profile)
    stored, skipped = derive(qm, profile)
    measured = measure(qm, CALIB)
    assert not skipped and set(stored) == set(measured) == {r.output_id for r in qm.regions}
    cosines = {pid: _cosine(stored[pid], measured[pid]) for pid in stored}
    assert min(cosines.values()) > 0.7, cosines
    last = qm.regions[-1]
    assert last.float_region.clamp is None and cosines[last.output_id] > 0.98, cosines


@pytest.mark.zoo
def test_regions_without_stored_means_are_left_alone_and_reported(profile_path):
    """A region whose input entry lacks means (a profile merged from one without channel
    statistics drops them) gets no correction; the others still do."""
    profile = json.loads(profile_path.read_text())
    qm = _quantized(profile)
    dense = next(r for r in qm.regions if r.input.profile_id.startswith("/Flatten"))
    for entry in profile["tensors"]:
        if entry["profile_id"] == "/Flatten":
            entry["per_channel"] = {k: entry["per_channel"][k] for k in ("axis", "min", "max")}
    corrections, skipped = derive(qm, profile)
    assert dense.output_id not in corrections and len(corrections) == len(qm.regions) - 1
    assert list(skipped) == [dense.name] and "/Flatten" in skipped[dense.name]


@pytest.mark.zoo
def test_stored_bias_correction_raises_the_output_sqnr(profile_path):
    plain = _evaluate(profile_path)
    fixed = _evaluate(profile_path, bias_correction="stored")
    assert fixed.bias_correction == {"mode": "stored", "regions": 5}
    # Measured: 40.9 -> 42.1 dB (the empirical mode's 42.1 too); top-1 the FP32 one either way.
    assert fixed.output_sqnr_db > plain.output_sqnr_db + 0.5
    assert fixed.int8_top1 >= plain.int8_top1 - 0.5


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.zoo
def test_a_stored_correction_build_from_the_cli(profile_path, tmp_path):
    result = _cli(
        "build", zoo_model("digits_cnn"), "--profile", profile_path, "--out", tmp_path,
        "--bias-correction", "stored",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["bias_correction"] == {"mode": "stored", "regions": 5}


@pytest.mark.zoo
def test_stored_correction_without_means_is_refused(plain_profile_path, tmp_path):
    """A profile made without --channel-stats, or a QPARAMS document: one line, exit 2."""
    model = zoo_model("digits_cnn")
    qparams = tmp_path / "qparams.json"
    assert _cli("calibrate", plain_profile_path, "--out", qparams).exit_code == 0
    for source, needle in (
        (["--profile", plain_profile_path], "--channel-stats"),
        (["--qparams", qparams], "--profile"),
    ):
        for command in (["build", model, "--out", tmp_path], ["evaluate", model]):
            result = _cli(
                *command, *source, "--data", f"{DATA}:test", "--bias-correction", "stored"
            )
            assert result.exit_code == 2, result.output
            (line,) = result.stderr.splitlines()
            assert "stored" in line and needle in line and "Traceback" not in result.output
