"""Every output on every face: the REST API serves the Model Explorer overlays (a zip) and the
HTML report as the CLI writes them, the service's root leads to the dashboard, the report names
its data by file name and stays small per tensor, and the ONNX Runtime exports keep a ReLU
output's asymmetric range."""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest
from onnxruntime.quantization.calibrate import load_tensors_data
from onnxruntime.quantization.quant_utils import write_calibration_table

from rangeprof.profiler.calibrate.methods import CalibrationOptions, qparams_for
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.export.formats import export
from rangeprof.profiler.export.report import MAX_BARS
from rangeprof.service.limits import Limits

from onnx_builders import conv_relu, save
from profile_builders import entry, profile
from service_fixtures import live_service, rangeprof, start_run, upload_model, wait_for_run

LIMITS = Limits(max_model_bytes=400_000, max_data_bytes=200_000)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A conv + ReLU model and 16 samples of data for it."""
    folder = tmp_path_factory.mktemp("files")
    model, _, _ = conv_relu(np.random.default_rng(0), 3, 8, 8)
    save(model, folder, "conv_relu.onnx")
    x = np.random.default_rng(1).standard_normal((16, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "calib.npz", x=x)
    return folder


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with live_service("sqlite", tmp_path_factory.mktemp("sqlite"), LIMITS) as service:
        yield service


@pytest.fixture(scope="module")
def run(live, files) -> dict:
    uploaded = upload_model(live.owner, files / "conv_relu.onnx")
    assert uploaded.status_code == 201, uploaded.text
    queued = start_run(live.owner, uploaded.json()["id"], files / "calib.npz", key="x")
    done = wait_for_run(live.owner, queued["id"])
    assert done["status"] == "done", done["error"]
    return done


@pytest.fixture(scope="module")
def cli(live, run, files) -> dict[str, Path]:
    """The run's profile and an evaluation of it by ``rangeprof evaluate --json``; the report
    uploaded to the run (its id under ``evaluation_id``)."""
    folder = files / "cli"
    folder.mkdir()
    profile_path = folder / "profile.json"
    profile_path.write_text(json.dumps(live.owner.get(f"/api/runs/{run['id']}/profile").json()))
    model, data = files / "conv_relu.onnx", f"{files / 'calib.npz'}:x"
    report = rangeprof(
        "evaluate", str(model), "--profile", str(profile_path), "--data", data, "--json"
    )
    evaluation_path = folder / "evaluation.json"
    evaluation_path.write_text(report)
    uploaded = live.owner.post(f"/api/runs/{run['id']}/evaluations/report", json=json.loads(report))
    assert uploaded.status_code == 201, uploaded.text
    return {
        "model": model,
        "profile": profile_path,
        "evaluation": evaluation_path,
        "evaluation_id": uploaded.json()["id"],
    }


def _zip(content: bytes) -> dict[str, str]:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        return {name: archive.read(name).decode() for name in archive.namelist()}


def _cli_overlays(cli: dict, out: Path, *evaluation: str) -> dict[str, str]:
    rangeprof(
        "export",
        str(cli["profile"]),
        "--format",
        "model-explorer",
        "--model",
        str(cli["model"]),
        *evaluation,
        "--out",
        str(out),
    )
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def test_model_explorer_overlays_are_the_cli_folder_zipped(live, run, cli, tmp_path):
    url = f"/api/runs/{run['id']}/export"
    response = live.owner.get(url, params={"format": "model-explorer"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/zip"
    assert "model-explorer.zip" in response.headers["content-disposition"]
    served = _zip(response.content)
    assert list(served) == ["range.json"]
    assert served == _cli_overlays(cli, tmp_path / "plain")
    assert live.owner.get(url, params={"format": "model-explorer"}).content == response.content

    evaluated = live.owner.get(f"/api/evaluations/{cli['evaluation_id']}/model-explorer")
    assert evaluated.status_code == 200, evaluated.text
    assert evaluated.headers["content-type"] == "application/zip"
    with_evaluation = _zip(evaluated.content)
    figures = ["range", "isolated_sqnr", "accumulated_sqnr", "kept_fp32"]
    assert sorted(with_evaluation) == sorted(f"{name}.json" for name in figures)
    expected = _cli_overlays(cli, tmp_path / "evaluated", "--evaluation", str(cli["evaluation"]))
    assert with_evaluation == expected
    assert json.loads(with_evaluation["isolated_sqnr.json"])["results"]  # figures, not empty


def test_overlays_of_an_evaluation_are_its_owners_alone(live, run, cli):
    url = f"/api/evaluations/{cli['evaluation_id']}/model-explorer"
    assert live.stranger.get(url).status_code == 404
    assert live.anonymous.get(url).status_code == 401
    for missing, code in ((2**31 - 2, 404), (0, 422)):
        response = live.owner.get(f"/api/evaluations/{missing}/model-explorer")
        assert response.status_code == code, response.text
        assert isinstance(response.json()["detail"], str)
    # An export takes no evaluation: its figures are the evaluation's own overlays.
    export = f"/api/runs/{run['id']}/export"
    response = live.owner.get(export, params={"format": "ort", "evaluation": cli["evaluation_id"]})
    assert response.status_code == 422 and "evaluation" in response.json()["detail"]


def test_the_report_route_serves_the_cli_report(live, run, cli, tmp_path):
    url = f"/api/runs/{run['id']}/report"
    plain = live.owner.get(url)
    assert plain.status_code == 200, plain.text
    assert plain.headers["content-type"].startswith("text/html")
    out = tmp_path / "report.html"
    rangeprof("report", str(cli["profile"]), "--out", str(out))
    assert plain.text == out.read_text()
    assert "<dt>scales for</dt><dd>x86: activations asym uint8" in plain.text

    evaluated = live.owner.get(url, params={"evaluation": cli["evaluation_id"]})
    assert evaluated.status_code == 200, evaluated.text
    args = ["--evaluation", str(cli["evaluation"]), "--out", str(out)]
    rangeprof("report", str(cli["profile"]), *args)
    assert evaluated.text == out.read_text() and 'id="evaluation-summary"' in evaluated.text

    npu = live.owner.get(url, params={"target": "npu"})
    rangeprof("report", str(cli["profile"]), "--target", "npu", "--out", str(out))
    assert npu.text == out.read_text() and "<dd>npu: activations" in npu.text

    assert live.owner.get(url, params={"target": "arm"}).status_code == 422
    assert live.owner.get(url, params={"evaluation": 2**31 - 2}).status_code == 404
    assert live.stranger.get(url).status_code == 404


def test_the_report_names_the_data_by_its_file_name(live, run, cli):
    head = live.owner.get(f"/api/runs/{run['id']}/report").text.split("</header>")[0]
    (data,) = re.findall(r"<dt>data</dt><dd>([^<]*)</dd>", head)
    assert data == "calib.npz:x"
    assert str(live.storage) not in head and "/" not in data


def test_each_histogram_stays_small_whatever_the_bins(live, run, cli):
    """What keeps a large model's report small (ppocr_cls: tests/test_report.py): a figure's
    size does not grow with the profile's 2048 bins."""
    report = live.owner.get(f"/api/runs/{run['id']}/report").text
    figures = re.findall(r"<figure .*?</figure>", report, re.S)
    doc = json.loads(cli["profile"].read_text())
    assert len(figures) == sum(bool(t["histogram"]) for t in doc["tensors"]) > 0
    assert max(len(f.encode()) for f in figures) < 1400
    for figure in figures:
        widths = re.findall(r"V\d+h([\d.]+)", figure)
        assert sum(float(w) for w in widths) <= MAX_BARS


def test_the_root_leads_to_the_dashboard(live):
    root = live.anonymous.get("/")
    assert root.status_code == 307 and root.headers["location"] == "/dashboard/"
    page = live.anonymous.get("/", follow_redirects=True)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert str(page.url).endswith("/dashboard/")


# --- ONNX Runtime: a one-sided tensor's asymmetric range ----------------------------------


def _relu_profile() -> dict:
    values = np.maximum(np.random.default_rng(2).normal(0.5, 1.0, (64, 8)), 0).astype(np.float32)
    return profile(
        entry(values * 2 - 1, name="pre", source_tensor="pre"),
        entry(values, name="relu", source_tensor="relu_out"),
    )


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_ort_json_keeps_a_relu_outputs_asymmetric_range(dtype):
    doc = _relu_profile()
    asym = CalibrationOptions(method="percentile", scheme="asym", dtype=dtype)
    data = json.loads(export(doc, "ort-json", asym))["data"]
    relu = qparams_for(doc["tensors"][1], asym)
    lowest, highest = (data["relu_out"][k]["data"] for k in ("lowest", "highest"))
    assert lowest == 0.0 and highest == float(np.float32(relu.range[1])) > 0
    assert relu.zero_point == (0 if dtype == "uint8" else -128)  # every level on [0, hi]
    pre = data["pre"]
    assert pre["lowest"]["data"] < 0 < pre["highest"]["data"]  # a signed one keeps both sides

    sym = json.loads(export(doc, "ort-json", CalibrationOptions(scheme="sym")))["data"]
    assert sym["relu_out"]["lowest"]["data"] == -sym["relu_out"]["highest"]["data"]


def test_ort_table_holds_the_upper_end_of_a_relu_outputs_range(tmp_path):
    # One number per line: for a one-sided range, what ORT itself writes from the JSON.
    doc = _relu_profile()
    asym = CalibrationOptions(method="mse", scheme="asym", dtype="uint8")
    cache = tmp_path / "calibration.json"
    cache.write_text(export(doc, "ort-json", asym))
    write_calibration_table(load_tensors_data(cache), dir=str(tmp_path))
    ours = export(doc, "ort", asym)
    lines = dict(line.split(" ") for line in ours.splitlines())
    assert float(lines["relu_out"]) == float(
        np.float32(qparams_for(doc["tensors"][1], asym).range[1])
    )
    theirs = dict(
        line.split(" ") for line in (tmp_path / "calibration.cache").read_text().splitlines()
    )
    assert lines["relu_out"] == theirs["relu_out"]


def test_tensorrt_still_refuses_asymmetric_ranges():
    with pytest.raises(RangeprofError, match="TensorRT calibration caches hold symmetric int8"):
        export(_relu_profile(), "tensorrt", CalibrationOptions(scheme="asym", dtype="uint8"))
