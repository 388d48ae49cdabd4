"""How to observe initial-IR tensors: the options the executor could take, measured.

    python benchmarks/instrumentation_options.py [--models digits_cnn ppocr_cls] [--samples 32]

For each model (../shared/models) it times, per sample, on the same random data:

* ``plain``: the uninstrumented model, our fast build without scale folding (the arithmetic the
  profiling program keeps), the baseline;
* ``extra_outputs``: our choice — every initial float tensor added to ``main``'s outputs, the
  same fused pipeline, each such tensor summarised by a compiled statistics kernel right where
  it is produced (:mod:`rangeprof.profiler.profiling.executor`), the kernels' vectors decoded
  per batch;
* ``vm_instrument_unfused``: TVM's default pipeline without fusion, one kernel per op, a VM
  instrument callback computing the statistics of every kernel output in numpy (fused kernels
  would hide intermediates from it);

and prints ms/sample, the ratio to ``plain`` and how many tensors each option observes. It also
checks that ``extra_outputs`` reproduces ``plain``'s outputs bit for bit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.compile.schedules import build, host_target
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data
from rangeprof.profiler.profiling.executor import compile_program
from rangeprof.profiler.profiling.statistics import TensorStats

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHAPES = {"ppocr_cls": {"x": (1, 3, 48, 192)}}


def _vm(mod, pipeline="default"):
    mod = relax.transform.DecomposeOpsForInference()(mod)
    executable = tvm.compile(mod, target=host_target(), relax_pipeline=pipeline)
    return relax.VirtualMachine(executable, tvm.cpu())


def _time(fn, batches) -> float:
    fn(batches[0])  # warm-up
    start = time.perf_counter()
    for batch in batches:
        fn(batch)
    return (time.perf_counter() - start) / len(batches) * 1e3


def measure(name: str, samples: int) -> dict:
    loaded = load_model(SHARED / "models" / f"{name}.onnx", SHAPES.get(name))
    imported = import_onnx(loaded)
    source = open_data("random", model_inputs(loaded), samples=samples)
    batches = [[tvm.runtime.tensor(a) for a in batch.values()] for batch in source.batches()]

    plain = relax.VirtualMachine(build(imported.mod, fold_scales=False), tvm.cpu())
    names = list(loaded.input_shapes)
    _, program = compile_program(imported.mod, imported.layers, names)

    def run_extra(args):
        return program.run(dict(zip(names, (a.numpy() for a in args), strict=True)))

    no_fusion = tvm.transform.Sequential(
        [relax.transform.LegalizeOps(), relax.pipeline.default_build_pipeline()]
    )
    unfused = _vm(imported.mod, no_fusion)
    seen = []

    def callback(_func, _symbol, before_run, _ret, *args):
        if not before_run and args:
            out = args[-1]
            if isinstance(out, tvm.runtime.Tensor) and "float" in str(out.dtype):
                TensorStats.observe(np.from_dlpack(out))
                seen.append(1)
        return 0

    unfused.set_instrument(callback)
    same = all(
        plain["main"](*b).numpy().tobytes() == run_extra(b)[0].numpy().tobytes()
        for b in batches[:4]
    )
    row = {
        "plain_ms": _time(lambda b: plain["main"](*b), batches),
        "extra_outputs_ms": _time(run_extra, batches),
        "vm_instrument_unfused_ms": _time(lambda b: unfused["main"](*b), batches),
        "extra_outputs_tensors": len(program.observed),
        "vm_instrument_tensors_per_sample": len(seen) // (len(batches) + 1),
        "extra_outputs_bitwise_equal": same,
    }
    row["extra_outputs_ratio"] = row["extra_outputs_ms"] / row["plain_ms"]
    row["vm_instrument_ratio"] = row["vm_instrument_unfused_ms"] / row["plain_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["digits_cnn", "ppocr_cls"])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    table = {name: measure(name, args.samples) for name in args.models}
    header = f"{'model':<14}{'plain ms':>10}{'extra ms':>10}{'x':>7}{'vm-unfused ms':>15}{'x':>7}"
    print(header)
    for name, row in table.items():
        print(
            f"{name:<14}{row['plain_ms']:>10.2f}{row['extra_outputs_ms']:>10.2f}"
            f"{row['extra_outputs_ratio']:>7.2f}{row['vm_instrument_unfused_ms']:>15.2f}"
            f"{row['vm_instrument_ratio']:>7.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
