"""Real exported models of the kinds users bring (``tests/pypi_models.py``): text detection
(ConvTranspose, Resize, sigmoid head), text recognition with attention, an LSTM with its state as
inputs, a byte classifier on integer inputs. Each is profiled with ``rangeprof profile``, every
data-dependent float tensor checked against onnxruntime (1e-4 of its range), and built for x86
with ``rangeprof build``. Magika, the byte classifier, is also evaluated in INT8 on files of known
kinds (``tests/labelled_data.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data, sample_batch
from rangeprof.profiler.profiling.document import load_profile
from rangeprof.workflows import profiling, quantize
from rangeprof.workflows.requests import EvaluateRequest, ProfileRequest

from labelled_data import magika_dataset
from ort_reference import assert_fidelity, exposed_session, reference_ranges
from pypi_models import MODELS, fetch

pytestmark = pytest.mark.zoo
RUNS = 2
# Magika's labelled set: files of about 12 kinds (tests/labelled_data.py), some 8 test each.
MAGIKA_CALIB, MAGIKA_TEST = 32, 96
# Measured: FP32 97.9 % (onnxruntime alike); every calibration method 97.9 % in INT8, output SQNR
# 36-47 dB. A wrong input layout or wrong labels fall far below the floor; the drop allows two
# of the 96 files.
MAGIKA_FP32_FLOOR, MAGIKA_MAX_DROP, MAGIKA_MIN_SQNR_DB = 90.0, 2.1, 30.0


def _model(name: str):
    try:
        return fetch(name)
    except RuntimeError as err:
        pytest.skip(f"{name} not available: {err}")


def _rangeprof(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rangeprof", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize("name", sorted(MODELS))
def test_profile_matches_onnxruntime_and_builds(name, tmp_path):
    spec = MODELS[name]
    path = _model(name)
    shapes = [f"{k}={'x'.join(map(str, v))}" for k, v in spec.input_shapes.items()]
    options = [a for s in shapes for a in ("--input-shape", s)]
    options += [a for c in spec.constant_inputs for a in ("--constant-input", c)]
    inputs = model_inputs(load_model(path, spec.input_shapes), spec.constant_inputs)
    batch = sample_batch(inputs)
    profile = tmp_path / "p.json"
    _rangeprof(
        "profile", str(path), "--data", "random", "--samples", str(RUNS * batch), "--out",
        str(profile), *options,
    )  # fmt: skip
    doc = load_profile(profile)
    assert doc["run"]["batches"] == RUNS
    batches = open_data("random", inputs, batch_size=batch, samples=RUNS * batch).batches()
    session = exposed_session(path, spec.input_shapes)
    assert_fidelity(doc, reference_ranges(session, batches), path)

    out = tmp_path / "build"
    shape_args = [a for s in shapes for a in ("--input-shape", s)]
    _rangeprof(
        "build", str(path), "--profile", str(profile), "--out", str(out), "--fp32-fallback",
        *shape_args,
    )  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert (out / manifest["library"]).is_file()


def test_magika_int8_top1_on_labelled_files(tmp_path):
    """Magika profiled on files of known kinds, then FP32 against every calibration method in
    INT8 on the x86 target: FP32 top-1 as onnxruntime's, the best INT8 top-1 close to it."""
    path = _model("magika")
    try:
        npz = magika_dataset(MAGIKA_CALIB, MAGIKA_TEST)
    except RuntimeError as err:
        pytest.skip(f"Magika's config not available: {err}")
    shapes = MODELS["magika"].input_shapes
    profile = tmp_path / "p.json"
    request = ProfileRequest(model=path, data=f"{npz}:calib", input_shapes=shapes)
    profile.write_text(json.dumps(profiling.profile(request).to_json()))
    report = quantize.evaluate(
        EvaluateRequest(
            model=path,
            profile=profile,
            method="all",
            data=f"{npz}:test",
            labels=f"{npz}:test_labels",
            input_shapes=shapes,
        )
    ).to_json()
    with np.load(npz) as data:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        scores = session.run(None, {"bytes": data["test"]})[0]
        ort_top1 = 100.0 * float((scores.argmax(1) == data["test_labels"]).mean())
    assert report["samples"] == MAGIKA_TEST
    assert report["fp32_top1"] == pytest.approx(ort_top1, abs=1e-3)
    assert report["fp32_top1"] >= MAGIKA_FP32_FLOOR
    assert report["int8_top1"] >= report["fp32_top1"] - MAGIKA_MAX_DROP, report["methods"]
    assert report["output_sqnr_db"] >= MAGIKA_MIN_SQNR_DB, report["methods"]
