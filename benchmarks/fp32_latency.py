"""FP32 latency of our CPU build (rangeprof.profiler.compile.schedules.build) against onnxruntime,
same process.

For each model (a shared model's name, a PyPI test model's name or a path, :func:`model_path`):
cold build time, median latency (of block medians) over ``--runs`` runs after warm-up, the same
for onnxruntime's CPUExecutionProvider with default options but as many threads as ours
(``TVM_NUM_THREADS``, default every core; the two timed in alternating blocks,
:func:`interleaved_blocks_ms`), and the ratio (within each round of blocks, the median over
rounds: :func:`round_ratio`). PyPI models take their zoo entry's input shapes, ``--input-shape
NAME=DIMS`` fixes others' dynamic inputs (PP-LCNet's ``ppocr_cls``: ``x=1x3x48x192``). Run::

    [TVM_NUM_THREADS=1] python benchmarks/fp32_latency.py [--models NAME...] [--runs 50]
        [--input-shape NAME=DIMS] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
NAMES = ("resnet18", "mobilenet_v2", "tiny_bert", "digits_cnn")
sys.path.insert(0, str(REPO))
# TVM halves the core count on x86 (hyper-threading) unless told: set it before any kernel runs.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from benchmarks.harness import (  # noqa: E402
    input_shapes,
    interleaved_blocks_ms,
    median_ms,
    model_path,
    round_ratio,
)
from rangeprof.profiler.compile.schedules import build, host_target  # noqa: E402
from rangeprof.profiler.ir.importer import import_onnx  # noqa: E402
from rangeprof.profiler.ir.onnx_load import load_model, parse_input_shape  # noqa: E402


def _feeds(mod, session) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for inp, param in zip(session.get_inputs(), mod["main"].params, strict=False):
        shape = [int(d) for d in param.ty.shape.values]
        dtype = str(param.ty.dtype)
        if "int" in dtype:
            feeds[inp.name] = rng.integers(0, 100, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.random(shape).astype(dtype)
    return feeds


def measure(name: str, runs: int, shapes: dict) -> dict:
    path = model_path(name)
    mod = import_onnx(load_model(path, {**input_shapes(name), **shapes})).mod
    start = time.perf_counter()
    executable = build(mod)
    build_s = time.perf_counter() - start
    vm = relax.VirtualMachine(executable, tvm.cpu())
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ["TVM_NUM_THREADS"])
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = _feeds(mod, session)
    args = [tvm.runtime.tensor(x) for x in feeds.values()]
    blocks = interleaved_blocks_ms(
        {"ours": lambda: vm["main"](*args), "theirs": lambda: session.run(None, feeds)}, runs
    )
    ms = median_ms(blocks)
    return {
        "model": name,
        "build_s": build_s,
        "tvm_ms": ms["ours"],
        "ort_ms": ms["theirs"],
        "ratio": round_ratio(blocks, "ours", "theirs"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--models", nargs="*", default=list(NAMES))
    parser.add_argument(
        "--input-shape", action="append", default=[], type=parse_input_shape, metavar="NAME=DIMS"
    )
    opts = parser.parse_args()
    rows = [measure(name, opts.runs, dict(opts.input_shape)) for name in opts.models]
    print(f"{'model':<14}{'build s':>9}{'ours ms':>10}{'ort ms':>9}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['model']:<14}{r['build_s']:>9.2f}{r['tvm_ms']:>10.2f}{r['ort_ms']:>9.2f}"
            f"{r['ratio']:>8.2f}"
        )
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {
                    "threads": os.environ["TVM_NUM_THREADS"],
                    "target": json.loads(str(host_target())),
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
