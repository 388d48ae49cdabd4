"""Sentence embeddings in INT8: how close our default x86 build and onnxruntime's
``quantize_dynamic`` model stay to the FP32 model on held-out sentences (``minilm_export.py``
makes the model and data). Printed per contender: the mean and least cosine similarity of each
sentence's embedding to FP32's, the output SQNR, and how often each sentence's nearest other
sentence is FP32's (what retrieval sees). Ours is ``rangeprof.quantize`` on ``calib.npz`` with
the target's defaults (``--weight-bits``, ``--group-size`` as the CLI's). Run::

    python benchmarks/sentence_embeddings.py /tmp/minilm [--weight-bits 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: I001  (imports rangeprof before onnxruntime.quantization)
import onnxruntime as ort
import rangeprof
from onnxruntime import quantization as ortq


def _ort_rows(path: Path, data: dict[str, np.ndarray]) -> np.ndarray:
    """The model's output at batch 1, sample by sample (the export's batch is dynamic)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    count = len(next(iter(data.values())))
    rows = [session.run(None, {k: v[i : i + 1] for k, v in data.items()})[0] for i in range(count)]
    return np.concatenate(rows)


def closeness(x: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Cosine similarity to the reference per sentence (mean, least), SQNR in dB, and the share
    of sentences whose nearest other sentence is the reference's."""
    cosine = (x * reference).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(reference, axis=1)
    noise = ((x - reference) ** 2).sum()

    def nearest(e: np.ndarray) -> np.ndarray:
        similarity = e @ e.T
        np.fill_diagonal(similarity, -np.inf)
        return similarity.argmax(axis=1)

    return {
        "cosine_mean": float(cosine.mean()),
        "cosine_min": float(cosine.min()),
        "sqnr_db": float(10 * np.log10((reference**2).sum() / noise)),
        "nearest_agreement": float(np.mean(nearest(x) == nearest(reference))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="minilm_export.py's output folder")
    parser.add_argument("--weight-bits", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    path = opts.folder / "minilm.onnx"
    calib, test = (dict(np.load(opts.folder / f"{n}.npz")) for n in ("calib", "test"))
    shapes = {k: (1, *v.shape[1:]) for k, v in test.items()}
    given = {"weight_bits": opts.weight_bits, "group_size": opts.group_size}
    chosen = {k: v for k, v in given.items() if v}
    ours = rangeprof.quantize(rangeprof.load(path, shapes), calib, target="x86", **chosen)
    reference = _ort_rows(path, test)
    with tempfile.TemporaryDirectory() as tmp:
        dynamic = Path(tmp) / "dynamic.onnx"
        ortq.quantize_dynamic(str(path), str(dynamic), weight_type=ortq.QuantType.QInt8)
        theirs = _ort_rows(dynamic, test)
    rows = {
        "ours_int8": closeness(ours.run(test)[0], reference),
        "ort_dynamic": closeness(theirs, reference),
    }
    host = harness.host()
    print(f"{host['cpu']} (family {host['family']} model {host['model']}, {host['isa']})")
    regions = repr(ours).split(": ", 1)[1].rstrip(">")
    print(f"{len(reference)} test sentences; ours {regions}")
    for name, row in rows.items():
        print(f"  {name}: " + " ".join(f"{k} {v:.4f}" for k, v in row.items()))
    if opts.json:
        document = {"host": host, "options": chosen, "rows": rows}
        opts.json.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
