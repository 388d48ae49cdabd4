"""4-bit weight dense kernels against our FP32 dense and onnxruntime, at char_gpt's matmul
shapes (d = 256, MLP 1024, 128 tokens, batch 1).

For each ``[128, K] × [K, N]``: our W4 kernel with float32 activations (``emit_dense_w4``) and
our W4A8 one (``emit_dense_w4a8``: activations quantized per row, the x86 plugin's dot
instruction), both built by the CPU build with their schedule rules; our FP32 dense
(``rangeprof.profiler.compile.schedules.build``); onnxruntime's FP32 ``MatMul`` and
``com.microsoft.MatMulNBits`` (4 bits, the same codes, scales and zero points in its layout)
with ``accuracy_level`` 0 (FP32 arithmetic) and 4 (int8 activations), on as many threads as
ours. All run in this process, timed in interleaved rounds (:func:`interleaved_blocks_ms`);
ratios are the median over rounds of the ratio within a round (:func:`round_ratio`). Outputs
are checked first: W4 and FP32 against ``MatMulNBits`` at level 0, W4A8 within 3 % of its
largest output. The last line is the model's 17 weight matmuls (4 blocks of qkv, projection,
MLP up and down, and the head): the sum of their medians, and each ratio as the shapes' round
ratios weighted by the other contender's time on them (the shapes are timed apart, so there
is no common round to take a ratio of sums in; the medians alone carry the machine's drift).
``--single-thread`` runs everything on one thread (figures another process on the machine
moves less). Run::

    python benchmarks/dense_w4.py [--runs 30] [--group 32] [--asymmetric] [--single-thread]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SINGLE = "--single-thread" in sys.argv
os.environ["TVM_NUM_THREADS"] = "1" if SINGLE else os.environ.get("TVM_NUM_THREADS", "")
os.environ["TVM_NUM_THREADS"] = os.environ["TVM_NUM_THREADS"] or str(os.cpu_count())

import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from tvm import relax  # noqa: E402

from benchmarks.harness import host, interleaved_blocks_ms, median_ms, round_ratio  # noqa: E402
from rangeprof.byoc.cpu.dense_w4 import emit_dense_w4  # noqa: E402
from rangeprof.byoc.cpu.dense_w4a8 import SCHEDULES, emit_dense_w4a8  # noqa: E402
from rangeprof.byoc.cpu.dot import lower_dot_blocks  # noqa: E402
from rangeprof.byoc.x86.isa import ISA  # noqa: E402
from rangeprof.profiler.compile.schedules import Rules, build  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from matmul_nbits import matmul, matmul_nbits  # noqa: E402

ROWS = 128
# name: (K, N, how many char_gpt has)
SHAPES = {
    "qkv 256x768": (256, 768, 4),
    "proj 256x256": (256, 256, 4),
    "mlp_up 256x1024": (256, 1024, 4),
    "mlp_down 1024x256": (1024, 256, 4),
    "head 256x128": (256, 128, 1),
}
CONTENDERS = ("w4", "w4a8", "fp32", "ort_matmul", "ort_nbits", "ort_nbits_a8")
_OTHERS = ("fp32", "ort_matmul", "ort_nbits", "ort_nbits_a8")
RULES = Rules(schedules=SCHEDULES, lowering_passes=(lower_dot_blocks,))


def _weights(k: int, n: int, group: int, asymmetric: bool):
    """Round-to-nearest 4-bit codes of a random normal weight, per group of ``group`` rows."""
    w = np.random.default_rng(0).normal(0, 0.05, (k, n)).astype(np.float32)
    wg = np.pad(w, ((0, -k % group), (0, 0))).reshape(-1, group, n)
    if asymmetric:
        lo, hi = np.minimum(wg.min(1), 0), np.maximum(wg.max(1), 0)
        scales = np.maximum(hi - lo, 1e-8) / 15
        zeros = np.clip(np.round(-lo / scales), 0, 15).astype(np.uint8)
    else:
        scales, zeros = np.maximum(np.abs(wg).max(1), 1e-8) / 7.5, None
    z = 8 if zeros is None else zeros[:, None, :]
    q = np.clip(np.round(wg / scales[:, None, :]) + z, 0, 15).reshape(-1, n)[:k]
    return q.astype(np.uint8), scales.astype(np.float32), zeros


def _relax(k: int, emit) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, ROWS, k), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(emit(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _tvm_runner(mod: tvm.IRModule, x: np.ndarray):
    vm = relax.VirtualMachine(build(mod, rules=RULES), tvm.cpu())
    arg = tvm.runtime.tensor(x)
    return lambda: vm["main"](arg).numpy()


def _ort_runner(model, x: np.ndarray):
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ["TVM_NUM_THREADS"])
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return lambda: session.run(None, {"x": x})[0]


def runners(k: int, n: int, group: int, asymmetric: bool) -> dict:
    """The contenders for one shape, on one input, the 4-bit ones on the same codes."""
    q, scales, zeros = _weights(k, n, group, asymmetric)
    rows = np.arange(k) // group
    w = (q.astype(np.float32) - (8.0 if zeros is None else zeros[rows])) * scales[rows]
    w = w.astype(np.float32)
    x = np.random.default_rng(1).normal(size=(1, ROWS, k)).astype(np.float32)
    w4 = _relax(k, lambda bb, v: emit_dense_w4(bb, v, q, scales, zeros, group))
    w4a8 = _relax(k, lambda bb, v: emit_dense_w4a8(bb, v, q, scales, zeros, group, isa=ISA))
    return {
        "w4": _tvm_runner(w4, x),
        "w4a8": _tvm_runner(w4a8, x),
        "fp32": _tvm_runner(_relax(k, lambda bb, v: relax.op.matmul(v, relax.const(w))), x),
        "ort_matmul": _ort_runner(matmul(w, x.shape), x),
        "ort_nbits": _ort_runner(matmul_nbits(q, scales, zeros, group, x.shape), x),
        "ort_nbits_a8": _ort_runner(matmul_nbits(q, scales, zeros, group, x.shape, 4), x),
    }


def measure(name: str, runs: int, group: int, asymmetric: bool) -> dict:
    k, n, _ = SHAPES[name]
    fns = runners(k, n, group, asymmetric)
    outputs = {key: fn() for key, fn in fns.items()}
    scale = np.abs(outputs["ort_nbits"]).max()
    for key in ("w4", "fp32", "ort_matmul"):  # the same weights in every contender
        np.testing.assert_allclose(outputs[key], outputs["ort_nbits"], atol=1e-4 * scale)
    for key in ("w4a8", "ort_nbits_a8"):  # and 8-bit activations
        np.testing.assert_allclose(outputs[key], outputs["ort_nbits"], atol=0.03 * scale)
    blocks = interleaved_blocks_ms(fns, runs)
    medians = median_ms(blocks)
    return {
        **{f"{key}_ms": round(medians[key], 4) for key in CONTENDERS},
        **{f"w4/{key}": round(round_ratio(blocks, "w4", key), 3) for key in _OTHERS},
        **{f"w4a8/{key}": round(round_ratio(blocks, "w4a8", key), 3) for key in _OTHERS},
    }


def _weighted(results: dict, ratio: str, other: str) -> float:
    """The model's ``ratio``: each shape's round ratio weighted by ``other``'s time on it."""
    weights = {s: results[s][f"{other}_ms"] * SHAPES[s][2] for s in SHAPES}
    return sum(results[s][ratio] * w for s, w in weights.items()) / sum(weights.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--asymmetric", action="store_true")
    parser.add_argument("--single-thread", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(json.dumps({"host": host(), "threads": int(os.environ["TVM_NUM_THREADS"])}))
    scheme = "asymmetric" if args.asymmetric else "symmetric"
    print(f"4-bit weights: groups of {args.group}, {scheme}; {ROWS} rows")
    results = {}
    for name in SHAPES:
        results[name] = measure(name, args.runs, args.group, args.asymmetric)
        print(f"{name:18s} {json.dumps(results[name])}")
    totals = {
        key: round(sum(results[s][f"{key}_ms"] * SHAPES[s][2] for s in SHAPES), 3)
        for key in CONTENDERS
    }
    ratios = {
        ratio: round(_weighted(results, ratio, ratio.split("/")[1]), 3)
        for ratio in (f"{ours}/{key}" for ours in ("w4", "w4a8") for key in _OTHERS)
    }
    print(f"{'model matmuls':18s} {json.dumps({**totals, **ratios})}")
    if args.json:
        args.json.write_text(
            json.dumps({"results": results, "model": {**totals, **ratios}}, indent=1)
        )


if __name__ == "__main__":
    main()
