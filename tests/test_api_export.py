"""``GET /api/runs/{id}/export?format=qdq`` through real HTTP: the run's model with the QDQ pairs
of its profile, the bytes ``rangeprof export --format qdq`` writes for the same profile."""

from __future__ import annotations

import onnx
import pytest

from rangeprof.profiler.export.qdq_model import qdq_model
from rangeprof.service.limits import Limits
from rangeprof.workflows.options import CalibrationOptions as Asked
from rangeprof.workflows.profiling import calibration_options

from conftest import zoo_model
from service_fixtures import live_service, start_run, upload_model, wait_for_run, write_calib

LIMITS = Limits(max_model_bytes=400_000, max_data_bytes=200_000)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_service("sqlite", tmp_path_factory.mktemp("sqlite"), LIMITS) as service:
        yield service


@pytest.fixture(scope="module")
def run(live, tmp_path_factory) -> dict:
    model = upload_model(live.owner, zoo_model("digits_cnn"))
    assert model.status_code == 201, model.text
    calib = write_calib(tmp_path_factory.mktemp("data"))
    done = wait_for_run(live.owner, start_run(live.owner, model.json()["id"], calib)["id"])
    assert done["status"] == "done", done["error"]
    return done


def test_qdq_export_is_the_model_with_the_profiles_pairs(live, run):
    options = {"scheme": "asym", "dtype": "uint8", "granularity": "per-channel"}
    response = live.owner.get(f"/api/runs/{run['id']}/export", params={"format": "qdq", **options})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/octet-stream"
    assert "attachment" in response.headers["content-disposition"]
    served = onnx.load_model_from_string(response.content)
    onnx.checker.check_model(served)
    profile = live.owner.get(f"/api/runs/{run['id']}/profile").json()
    calibration, _ = calibration_options(Asked(**options))  # mse, the target's policy else
    expected = qdq_model(onnx.load(zoo_model("digits_cnn")), profile, calibration)
    assert response.content == expected.SerializeToString()


def test_text_formats_and_refusals_are_unchanged(live, run):
    url = f"/api/runs/{run['id']}/export"
    text = live.owner.get(url, params={"format": "ort"})
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert live.owner.get(url, params={"format": "onnx"}).status_code == 422
    assert live.stranger.get(url, params={"format": "qdq"}).status_code == 404
