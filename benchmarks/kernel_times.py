"""Where a compiled model spends its time: each kernel of our build timed on its own.

The model is lowered the way ``build`` lowers it (FP32, or with ``--int8`` the x86 plugin's
INT8 program on a profile of random samples), each PrimFunc that ``main`` calls is compiled
alone and timed with ``time_evaluator`` on random arguments of its call's shapes, and the
kernels are listed by their share of one inference (time × calls), with the build's target
(``RANGEPROF_X86_MCPU`` names another CPU, to time its kernels on this host).
A kernel far slower than its neighbours' work is a schedule that did not apply; that is how
PP-OCRv4 rec's 6625-class dense (15 of 31 ms, packed five columns wide) was found. Run::

    python benchmarks/kernel_times.py MODEL [--input-shape NAME=DIMS] [--int8] [--top 25]

``MODEL`` is a shared model's name, a PyPI test model's name or a path (as in
``int8_vs_fp32.py``). Kernels with data-dependent shapes are listed as not timed.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count()))

import rangeprof  # noqa: E402, F401, I001  (before onnxruntime.quantization: tests/conftest.py)
import tvm  # noqa: E402
from tvm import relax, tirx  # noqa: E402

from benchmarks.harness import input_shapes  # noqa: E402
from benchmarks.int8_vs_fp32 import model_path  # noqa: E402
from rangeprof.byoc.cpu import integer_rules  # noqa: E402
from rangeprof.byoc.plugin import get_plugin  # noqa: E402
from rangeprof.byoc.x86 import isa as x86_isa  # noqa: E402
from rangeprof.byoc.quantized import qparams_from_profile, quantize_model  # noqa: E402
from rangeprof.profiler.compile.schedules.pipeline import relax_pipeline  # noqa: E402
from rangeprof.profiler.compile.threads import most_threads, use_threads  # noqa: E402
from rangeprof.profiler.ir.bindings import tensor_dtype, tensor_shape  # noqa: E402
from rangeprof.profiler.ir.importer import import_onnx  # noqa: E402
from rangeprof.profiler.ir.onnx_load import load_model, parse_input_shape  # noqa: E402
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model  # noqa: E402


def lowered(path: Path, shapes: dict, int8: bool, target: tvm.target.Target) -> tvm.IRModule:
    """The module ``build`` would hand to code generation for ``target``: ``main`` calling its
    PrimFuncs."""
    if not int8:
        return relax_pipeline(target)(import_onnx(load_model(path, shapes)).mod)
    x86 = get_plugin("x86")
    profile = profile_model(path, "random", input_shapes=shapes, options=ProfileOptions(samples=4))
    qm = quantize_model(path, qparams_from_profile(profile, x86, "percentile", 99.99), x86, shapes)
    rules = integer_rules(x86_isa.ISA)  # the integer kernels, as the x86 plugin's build has them
    return relax_pipeline(target, fold_scales=False, rules=rules)(qm.lower()[0])


def kernel_calls(mod: tvm.IRModule) -> tuple[collections.Counter, dict]:
    """How often ``main`` calls each PrimFunc, and the argument shapes / dtypes of a call."""
    calls, arguments = collections.Counter(), {}
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.GlobalVar)):
                continue
            if not isinstance(mod[call.op], tirx.PrimFunc):
                continue
            calls[call.op.name_hint] += 1
            arguments[call.op.name_hint] = [
                (tensor_shape(arg.ty), tensor_dtype(arg.ty)) for arg in call.args
            ]
    return calls, arguments


def kernel_ms(func: tirx.PrimFunc, arguments: list, repeat: int, target) -> float | None:
    """Median milliseconds of one call on random arguments; None for a dynamic shape."""
    if any(shape is None for shape, _ in arguments):
        return None
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    rng = np.random.default_rng(0)
    device = tvm.cpu()
    tensors = [
        tvm.runtime.tensor(
            rng.random(shape).astype(dtype) if "float" in dtype else np.zeros(shape, dtype), device
        )
        for shape, dtype in arguments
    ]
    timer = kernel.jit().time_evaluator("main", device, number=repeat, repeat=3)
    return timer(*tensors).median * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument(
        "--input-shape", action="append", default=[], type=parse_input_shape, metavar="NAME=DIMS"
    )
    parser.add_argument("--int8", action="store_true", help="the x86 plugin's INT8 program")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    shapes = input_shapes(Path(args.model).stem) | dict(args.input_shape)
    # The x86 plugin's CPU (this host's, or RANGEPROF_X86_MCPU's), for FP32 and INT8 alike.
    target = get_plugin("x86").target()
    mod = lowered(model_path(args.model), shapes, args.int8, target)
    # Profiling ran on whichever count was faster (its AdaptiveThreads may leave one): time
    # every kernel on the pool's threads.
    use_threads(most_threads())
    calls, arguments = kernel_calls(mod)
    rows = []
    for name, count in calls.items():
        ms = kernel_ms(mod[name], arguments[name], args.repeat, target)
        rows.append((None if ms is None else ms * count, ms, count, name))
    timed = sorted((r for r in rows if r[0] is not None), reverse=True)
    total = sum(r[0] for r in timed)
    print(f"target {target}")
    print(f"{len(rows)} kernels, {total:.3f} ms per inference in those timed")
    for share, ms, count, name in timed[: args.top]:
        print(f"{share:8.3f} ms {100 * share / total:5.1f} %  {ms:8.3f} × {count:<3} {name}")
    for share, _, count, name in rows:
        if share is None:
            print(f"not timed (dynamic shape): {name} × {count}")


if __name__ == "__main__":
    main()
