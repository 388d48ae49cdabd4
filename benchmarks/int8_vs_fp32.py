"""INT8 latency: our x86 INT8 build vs our FP32 build vs onnxruntime FP32 and INT8, one process.

For each model: a profile on ``--samples`` seeded random samples (``rangeprof profile --data
random``), qparams from it with the x86 policy (``--method``), our INT8 builds
(``rangeprof.byoc``: x86 plugin, fast CPU path) with the default weight bits (the CPU's policy:
8 with VNNI, per layer on AVX2), with 8-bit weights and with 7-bit weights (``--weight-bits
7``: on x86 without VNNI, ``vpmaddubsw`` instead of ``vpmaddwd``), for ``--mcpu`` (default this
machine's CPU; ``znver3`` measures the AVX2 kernels on any AVX2 machine), our FP32
build (``rangeprof.profiler.compile.schedules.build``), onnxruntime FP32, and onnxruntime INT8
(``quantize_static``: QDQ, per-channel int8 weights, uint8 activations, calibrated (MinMax) on
the same samples, after its recommended ``quant_pre_process``; its kernels are always this
machine's). Latency over ``--runs`` runs of
one more random input, and each INT8 model's output SQNR against its own FP32 model on
``--samples`` inputs. The six are timed in rounds of one block of 5 calls each
(``interleaved_blocks_ms``): latencies are the median of block medians, and ratios the median
over rounds of the ratio within a round (``round_ratio``), as this shared machine's speed
drifts by tens of percent within one run (mobilenet_v2 FP32 6.5 to 10 ms between runs).
Every block median is kept in the JSON (``block_ms``). A model is a name of ../shared/models,
of the PyPI test zoo (``tests/pypi_models.py``: ``ppocrv4_rec``, the attention text recognizer,
``ppocrv4_det``, ``magika``...) or a path; ``--input-shape NAME=DIMS`` fixes dynamic inputs
(PP-OCRv4 rec: ``x=1x3x48x320``). Run::

    python benchmarks/int8_vs_fp32.py [--models resnet18 mobilenet_v2] [--input-shape NAME=DIMS]
        [--mcpu znver3] [--json out.json]
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
sys.path.insert(0, str(REPO))
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

import rangeprof  # noqa: E402, F401, I001  (before onnxruntime.quantization: tests/conftest.py)
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    host,
    interleaved_blocks_ms,
    median_ms,
    model_path,
    ort_int8_model,
    round_ratio,
)
from rangeprof.byoc.plugin import get_plugin  # noqa: E402
from rangeprof.byoc.quantized import (  # noqa: E402
    qparams_from_profile,
    quantize_model,
)
from rangeprof.profiler.profiling.data import model_inputs, open_data  # noqa: E402
from rangeprof.profiler.ir.importer import import_onnx  # noqa: E402
from rangeprof.profiler.ir.onnx_load import load_model, parse_input_shape  # noqa: E402
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model  # noqa: E402
from rangeprof.profiler.compile.schedules import build  # noqa: E402


def _sqnr(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    signal = sum(float(np.square(r.astype(np.float64)).sum()) for r in ref)
    noise = sum(
        float(np.square(r.astype(np.float64) - g).sum()) for r, g in zip(ref, got, strict=True)
    )
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _int8_build(path: Path, profile: dict, method: str, weight_bits: int | None, shapes: dict):
    """The x86 INT8 model with ``weight_bits``-bit weights (None: the CPU's choice), its VM and
    its compile seconds."""
    x86 = get_plugin("x86", weight_bits=weight_bits)
    qparams = qparams_from_profile(profile, x86, method, 99.99)
    qm = quantize_model(path, qparams, x86, shapes)
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
    default, default_vm, _ = _int8_build(path, profile, method, None, shapes)
    fp32_vm = relax.VirtualMachine(build(import_onnx(loaded).mod), tvm.cpu())

    fp32_session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory() as tmp:
        quantized = ort_int8_model(path, calibration, Path(tmp))
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
        "ours_default": _sqnr(reference, [ours(default_vm, b) for b in calibration]),
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
            "ours_int8_default": lambda: default_vm["main"](*args),
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
        # the default build's weight bits, region by region (None: FP32 or no weights)
        "default_weight_bits": [default.weight_bits(r, "int8") for r in default.regions],
        "ms": {k: round(v, 3) for k, v in ms.items()},
        "int8_speedup_over_our_fp32": round(round_ratio(blocks, "ours_fp32", "ours_int8"), 3),
        "ours_int8_vs_ort_int8": round(round_ratio(blocks, "ours_int8", "ort_int8"), 3),
        "int8_w7_speedup_over_our_fp32": round(round_ratio(blocks, "ours_fp32", "ours_int8_w7"), 3),
        "ours_int8_w7_vs_ort_int8": round(round_ratio(blocks, "ours_int8_w7", "ort_int8"), 3),
        "ours_int8_default_vs_ort_int8": round(
            round_ratio(blocks, "ours_int8_default", "ort_int8"), 3
        ),
        "ours_int8_default_vs_w8": round(round_ratio(blocks, "ours_int8_default", "ours_int8"), 3),
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
    parser.add_argument("--mcpu", help="The x86 CPU our INT8 builds are for (LLVM name).")
    parser.add_argument(
        "--input-shape", action="append", default=[], type=parse_input_shape, metavar="NAME=DIMS"
    )
    args = parser.parse_args()
    if args.mcpu:
        os.environ["RANGEPROF_X86_MCPU"] = args.mcpu  # read by get_plugin("x86")
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
            f"{row['ours_int8_w7_vs_ort_int8']:.2f} of ort) | int8 default "
            f"{ms['ours_int8_default']:7.2f} ms "
            f"({row['ours_int8_default_vs_ort_int8']:.2f} of ort, "
            f"{sum(b == 7 for b in row['default_weight_bits'])} 7-bit layers) "
            f"| ort fp32 {ms['ort_fp32']:7.2f} ms "
            f"int8 {ms['ort_int8']:7.2f} ms | SQNR dB ours {sqnr['ours']}, 7-bit w "
            f"{sqnr['ours_w7']}, default {sqnr['ours_default']}, ort {sqnr['ort']}",
            flush=True,
        )
    if args.json:
        # The CPU decides which instructions the kernels use: record it with the figures.
        int8_target = json.loads(str(get_plugin("x86").target()))  # --mcpu's
        args.json.write_text(
            json.dumps({**host(), "int8_target": int8_target, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
