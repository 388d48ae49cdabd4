"""The documented two-step flow — ``rangeprof profile``, ``rangeprof calibrate`` with default
options, ``rangeprof evaluate --qparams`` — keeps the trained text-direction classifier within
half a point of FP32 on held-out text lines, as the one-step ``evaluate --profile`` does: the
calibration follows the x86 target's policy unless told otherwise (marker ``zoo``: minutes)."""

from __future__ import annotations

import json

import pytest

from conftest import SHARED, zoo_model
from service_fixtures import rangeprof

pytestmark = pytest.mark.zoo

TEXTLINES = SHARED / "data" / "textlines.npz"
SHAPE = ("--input-shape", "x=1x3x48x192")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppocr") / "profile.json"
    model = str(zoo_model("ppocr_cls"))
    rangeprof("profile", model, "--data", f"{TEXTLINES}:calib", "--out", str(path), *SHAPE)
    return path


@pytest.mark.parametrize("method", [[], ["--method", "best"]], ids=["default", "best"])
def test_calibrate_then_evaluate_loses_at_most_half_a_point(profile, tmp_path, method):
    qparams = tmp_path / "qparams.json"
    rangeprof("calibrate", str(profile), "--out", str(qparams), *method)
    report = json.loads(
        rangeprof(
            "evaluate",
            str(zoo_model("ppocr_cls")),
            *SHAPE,
            "--data",
            f"{TEXTLINES}:test",
            "--labels",
            f"{TEXTLINES}:test_labels",
            "--qparams",
            str(qparams),
            "--json",
        )
    )
    assert report["samples"] == 400
    assert report["fp32_top1"] - report["int8_top1"] <= 0.5, report
