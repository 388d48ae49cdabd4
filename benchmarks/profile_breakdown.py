"""Where a profiling run's time per sample goes: model kernels, statistics kernels, merging the
statistics into running totals, the inputs' statistics.

    python benchmarks/profile_breakdown.py [--models resnet18 mobilenet_v2] [--samples 32]
        [--bins 2048] [--repeat 3]

For each model (../shared/models, random seeded data as ``profile_vs_ort.py`` uses) it builds the
profiling program (cached under ``$TMPDIR/rangeprof-breakdown``, keyed by the statistics code's
sources, so a changed kernel rebuilds) and the plain fast build without scale folding, then
prints per sample, each the minimum over ``--repeat`` passes over the data (the machine is
shared: the minimum is the least disturbed figure):

* ``plain``: the uninstrumented program (``fold_scales=False``, the arithmetic profiling keeps);
* ``program``: the profiling program's ``main`` (model + statistics kernels);
* ``totals``: adding the program's vectors to the running totals, as ``profile_model`` does
  (:class:`~rangeprof.profiler.profiling.stats_kernel.Totals`);
* ``inputs``: the numpy statistics of the model inputs;

and, from one instrumented pass (``vm.set_instrument``; its callbacks add their own overhead,
so only the split is meaningful), the share of the statistics kernels in the program's time
and the kernels that cost most.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.compile.cache import BuildCache
from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling import executor, observe_statistics, statistics, stats_kernel
from rangeprof.profiler.profiling.data import model_inputs, open_data
from rangeprof.profiler.profiling.run import ProfileOptions, _Builder
from rangeprof.profiler.profiling.statistics import TensorStats
from rangeprof.profiler.profiling.stats_kernel import Totals

SHARED = Path(__file__).resolve().parents[2] / "shared"


def _code_digest() -> str:
    sources = (executor, statistics, stats_kernel, observe_statistics)
    text = b"".join(Path(m.__file__).read_bytes() for m in sources)
    return hashlib.sha256(text).hexdigest()[:16]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(name: str, samples: int, bins: int, repeat: int) -> dict:
    path = SHARED / "models" / f"{name}.onnx"
    root = Path(tempfile.gettempdir()) / "rangeprof-breakdown" / _code_digest()
    builder = _Builder(path, bins or None, BuildCache(root))
    program = builder.prepare(builder.request(None, None)).program
    plain_so = root / f"{name}-plain.so"
    if not plain_so.exists():
        root.mkdir(parents=True, exist_ok=True)
        build(import_onnx(load_model(path)).mod, fold_scales=False).export_library(str(plain_so))
    plain = relax.VirtualMachine(tvm.runtime.load_module(str(plain_so)), tvm.cpu())

    options = ProfileOptions(bins=bins, samples=samples)
    loaded = load_model(path)
    source = open_data("random", model_inputs(loaded), samples=options.samples, seed=options.seed)
    batches = list(source.batches())
    args = [
        [tvm.runtime.tensor(np.ascontiguousarray(b[n])) for n in program.input_names]
        for b in batches
    ]
    outputs = [list(program.vm["main"](*a)) for a in args]

    def run_plain():
        for a in args:
            plain["main"](*a)

    def run_program():
        for a in args:
            program.vm["main"](*a)

    def totals():
        running = [Totals(program.bins, obs.channel_axis) for obs in program.observed]
        for out in outputs:
            for total, vector in zip(running, out[1:], strict=True):
                total.add(np.from_dlpack(vector))

    def inputs():
        for batch in batches:
            for array in batch.values():
                if np.issubdtype(array.dtype, np.floating):
                    TensorStats.observe(array, bins or None)

    row = {
        part: _best(fn, repeat) / samples * 1e3
        for part, fn in (
            ("plain", run_plain),
            ("program", run_program),
            ("totals", totals),
            ("inputs", inputs),
        )
    }
    row["tensors"] = len(program.observed)
    row.update(_kernel_split(program.vm, args))
    return row


def _kernel_split(vm: relax.VirtualMachine, args: list) -> dict:
    spent: dict[str, float] = defaultdict(float)
    started: list[float] = []

    def instrument(func, symbol, before, ret, *call_args):
        if before:
            started.append(time.perf_counter())
        else:
            spent[str(symbol)] += time.perf_counter() - started.pop()
        return 0

    vm.set_instrument(instrument)
    for a in args:
        vm["main"](*a)
    vm.set_instrument(None)
    total = sum(spent.values())
    stats = sum(t for s, t in spent.items() if s.startswith("observe_stats"))
    top = sorted(spent.items(), key=lambda kv: -kv[1])[:8]
    return {
        "stats_share": stats / total,
        "top": [(s, round(t / len(args) * 1e3, 3)) for s, t in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--bins", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RANGEPROF_CACHE", "off")
    for name in args.models:
        row = measure(name, args.samples, args.bins, args.repeat)
        print(
            f"{name:<13} ms/sample: plain {row['plain']:6.2f} | program {row['program']:6.2f}"
            f" (statistics kernels {row['stats_share'] * 100:4.1f}%) | totals {row['totals']:5.2f}"
            f" | inputs {row['inputs']:5.2f}"
            f" | {row['tensors']} tensors",
            flush=True,
        )
        for symbol, ms in row["top"]:
            print(f"    {ms:7.3f} ms  {symbol}")


if __name__ == "__main__":
    main()
