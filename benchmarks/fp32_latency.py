"""FP32 latency of our CPU build (rangeprof.profiler.compile.schedules.build) against onnxruntime,
same process.

For each shared model: cold build time, median latency (of block medians) over ``--runs`` runs
after warm-up, the same for onnxruntime's CPUExecutionProvider with default options (the two
timed in alternating blocks, :func:`interleaved_blocks_ms`), and the ratio (within each round
of blocks, the median over rounds: :func:`round_ratio`). Run::

    python benchmarks/fp32_latency.py [--runs 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
NAMES = ("resnet18", "mobilenet_v2", "tiny_bert", "digits_cnn")
sys.path.insert(0, str(REPO))
# TVM halves the core count on x86 (hyper-threading) unless told: set it before any kernel runs.
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from rangeprof.profiler.compile.schedules import build  # noqa: E402
from rangeprof.profiler.ir.importer import import_onnx  # noqa: E402
from rangeprof.profiler.ir.onnx_load import load_model  # noqa: E402


def interleaved_blocks_ms(fns: dict, runs: int, block: int = 5) -> dict[str, list[float]]:
    """Each callable's median ms per block of ``block`` calls, ``⌈runs / block⌉`` blocks timed
    round-robin (round ``r`` is block ``r`` of every contender) so that a slow spell of this
    shared machine lands on every contender alike instead of on whichever ran during it. Each
    block follows a pause and an untimed call: a thread pool spins for a while after its last
    call (onnxruntime's made the next TVM call 3-5x slower) and would steal the cores of the
    next contender."""
    blocks: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(math.ceil(runs / block)):
        for name, fn in fns.items():
            time.sleep(0.2)
            fn()
            times = []
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            blocks[name].append(float(np.median(times) * 1e3))
    return blocks


def median_ms(blocks: dict[str, list[float]]) -> dict[str, float]:
    """The median of each contender's block medians."""
    return {name: float(np.median(b)) for name, b in blocks.items()}


def round_ratio(blocks: dict[str, list[float]], a: str, b: str) -> float:
    """``a``'s time over ``b``'s, the median over rounds of the ratio within each round: the
    machine's speed drifts by tens of percent over a run, a round's contenders share it."""
    return float(np.median(np.divide(blocks[a], blocks[b])))


def _feeds(mod, session) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for inp, param in zip(session.get_inputs(), mod["main"].params, strict=False):
        shape = [int(d) for d in param.ty.shape.values]
        if "int" in inp.type:
            feeds[inp.name] = rng.integers(0, 100, shape).astype(np.int64)
        else:
            feeds[inp.name] = rng.random(shape).astype(np.float32)
    return feeds


def measure(name: str, runs: int) -> dict:
    path = MODELS / f"{name}.onnx"
    mod = import_onnx(load_model(path)).mod
    start = time.perf_counter()
    executable = build(mod)
    build_s = time.perf_counter() - start
    vm = relax.VirtualMachine(executable, tvm.cpu())
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
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
    opts = parser.parse_args()
    rows = [measure(name, opts.runs) for name in opts.models if (MODELS / f"{name}.onnx").exists()]
    print(f"{'model':<14}{'build s':>9}{'ours ms':>10}{'ort ms':>9}{'ratio':>8}")
    for r in rows:
        print(
            f"{r['model']:<14}{r['build_s']:>9.2f}{r['tvm_ms']:>10.2f}{r['ort_ms']:>9.2f}"
            f"{r['ratio']:>8.2f}"
        )
    if opts.json:
        opts.json.write_text(
            json.dumps({"threads": os.environ["TVM_NUM_THREADS"], "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
