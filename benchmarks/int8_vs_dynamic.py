"""Our default INT8 build against onnxruntime's dynamic INT8 model and both FP32 builds: the
latency acceptance of the transformer models (ours ≥ 1.5× faster than our FP32, ≤ 1.0× ORT's
``quantize_dynamic`` model, batch 1, same host).

Contenders, timed in interleaved rounds in one process (``harness.interleaved_blocks_ms``):
``ours_fp32`` (``rangeprof.profiler.compile.schedules.build``), ``ours_int8``
(``rangeprof.quantize``: the profile of ``--data``, then the build with the x86 defaults),
``ort_fp32``, and
onnxruntime's ``quantize_dynamic`` model (int8 weights, uint8 activations quantized per call)
made from the model as it is (``ort_dynamic``) and after ORT's recommended pre-processing
(``ort_dynamic_prep``): the faster of the two is the reference. Ours runs pinned to ``--threads``
threads, onnxruntime with ``intra_op_num_threads`` set to the same. ``RANGEPROF_X86_MCPU`` builds
both of ours for another CPU (e.g. ``znver3``: AVX2 code on an AVX-512 host; onnxruntime keeps
this host's kernels). Ratios are the median over
rounds of the ratio within a round (``harness.round_ratio``). Run::

    python benchmarks/int8_vs_dynamic.py [--models char_gpt tiny_bert]
        [--data ../shared/data/pycode.npz:calib] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: I001  (imports rangeprof before onnxruntime.quantization)
import onnxruntime as ort
import rangeprof
import tvm
from onnxruntime import quantization as ortq
from tvm import relax

from benchmarks.ort_prepare import prepared_for_quantization
from rangeprof.byoc.plugin import get_plugin
from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.compile.threads import use_threads
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data, sample_batch


def ours(path: Path, shapes: dict, data: str, samples: int, folder: Path) -> dict[str, Path]:
    """Our FP32 library and our default INT8 library of ``path`` (``rangeprof.quantize``: the
    profile on ``samples`` of ``data``, then the x86 build), built in ``folder``."""
    fp32 = folder / "fp32.so"
    target = get_plugin("x86").target()  # the INT8 build's CPU: RANGEPROF_X86_MCPU's, if set
    build(import_onnx(load_model(path, shapes)).mod, target).export_library(str(fp32))
    model = rangeprof.load(path, shapes)
    int8 = rangeprof.quantize(model, data, out=folder / "int8", samples=samples)
    return {"ours_fp32": fp32, "ours_int8": int8.folder / int8.manifest.library}


def ort_dynamic(path: Path, folder: Path) -> dict[str, Path]:
    """onnxruntime's ``quantize_dynamic`` model of ``path``, as it is and pre-processed."""
    models = {"ort_dynamic": folder / "dynamic.onnx", "ort_dynamic_prep": folder / "prep.onnx"}
    ortq.quantize_dynamic(str(path), str(models["ort_dynamic"]))
    ortq.quantize_dynamic(
        str(prepared_for_quantization(path, folder)), str(models["ort_dynamic_prep"])
    )
    return models


def _probe(path: Path, shapes: dict, data: str) -> dict[str, np.ndarray]:
    """One batch-1 input from ``data`` (or random): the batch every contender is timed on."""
    inputs = model_inputs(load_model(path, shapes).facts, ())
    batch = next(open_data(data, inputs, batch_size=sample_batch(inputs), samples=1).batches())
    return {name: np.ascontiguousarray(value) for name, value in batch.items()}


def contenders(models: dict[str, Path], probe: dict, threads: int) -> dict:
    """Each contender's call on ``probe``."""
    fns = {}
    for kind, path in models.items():
        if path.suffix == ".onnx":
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            fns[kind] = lambda s=session: s.run(None, probe)
        else:
            main = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())["main"]
            args = [tvm.runtime.tensor(value) for value in probe.values()]
            fns[kind] = lambda f=main, a=args: (use_threads(threads), f(*a))
    return fns


def measure(name: str, data: str, samples: int, threads: int, runs: int) -> dict:
    path, shapes = harness.model_path(name), harness.input_shapes(name)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        models = {**ours(path, shapes, data, samples, Path(tmp)), "ort_fp32": path}
        models.update(ort_dynamic(path, Path(tmp)))
        blocks = harness.interleaved_blocks_ms(
            contenders(models, _probe(path, shapes, data), threads), runs
        )
    ms = harness.median_ms(blocks)
    reference = min(("ort_dynamic", "ort_dynamic_prep"), key=ms.get)
    ratios = {
        f"int8_vs_{reference}": harness.round_ratio(blocks, "ours_int8", reference),
        "fp32_over_int8": harness.round_ratio(blocks, "ours_fp32", "ours_int8"),
        "int8_vs_ort_fp32": harness.round_ratio(blocks, "ours_int8", "ort_fp32"),
    }
    return {"model": name, "threads": threads, "ms": ms, "ratios": ratios, "blocks": blocks}


def main() -> None:
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's quantizer warns per node
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["char_gpt"])
    parser.add_argument("--data", default="random", help="calibration data (the CLI's --data)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    os.environ["TVM_NUM_THREADS"] = str(opts.threads)
    host = harness.host()
    print(f"{host['cpu']} (family {host['family']} model {host['model']}, {host['isa']})")
    rows = []
    for name in opts.models:
        row = measure(name, opts.data, opts.samples, opts.threads, opts.runs)
        rows.append(row)
        print(f"{name} @{opts.threads}: " + " ".join(f"{k} {v:.2f}" for k, v in row["ms"].items()))
        print("  ratios " + " ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()), flush=True)
    if opts.json:
        opts.json.write_text(json.dumps({"host": host, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
