"""Valid uploads for the fuzz run: a tiny ONNX model and an .npz of its inputs with labels, and
for each upload operation a request body the service accepts. A schema cannot describe an ONNX
model, so the fuzzer's own files are never one; these let its sequences create real objects."""

from __future__ import annotations

import io

import numpy as np
from onnx import helper

import onnx_builders as mb

SAMPLES = 16


def _model() -> bytes:
    rng = np.random.default_rng(0)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1)
    inits = {"w": rng.normal(size=(5, 8)), "b": rng.normal(size=5)}
    return mb.single_io_model([node], inits, (1, 8), (1, 5), name="fuzz").SerializeToString()


def _data() -> bytes:
    rng = np.random.default_rng(1)
    buffer = io.BytesIO()
    x = rng.normal(size=(SAMPLES, 8)).astype(np.float32)
    np.savez(buffer, x=x, labels=np.arange(SAMPLES) % 5)
    return buffer.getvalue()


MODEL = _model()
DATA = _data()
# The fields that go with DATA: its array of inputs for a run; for an evaluation, its labels too.
RUN_FORM = {"key": "x"}
EVALUATION_FORM = {"key": "x", "labels_key": "labels"}
# Request bodies by operation label: a model, its run, an evaluation of the run.
BODIES = {
    "POST /api/models": {"file": MODEL},
    "POST /api/models/{model_id}/runs": {"data": DATA, **RUN_FORM},
    "POST /api/runs/{run_id}/evaluations": {"data": DATA, **EVALUATION_FORM},
}
