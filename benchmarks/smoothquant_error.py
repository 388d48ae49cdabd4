"""SmoothQuant from stored statistics: the estimated error of each dense layer against a numpy
simulation of the quantized layer on held-out activations.

The model is profiled on ``--samples`` calibration windows (``rangeprof.profiler.profiling.run``,
a default profile); :func:`rangeprof.profiler.calibrate.smoothing.plan_smoothing` chooses each
dense input's migration strength from the profile alone, for the x86 grid (uint8 asymmetric
activations) and the aarch64 one (int8 symmetric). The check: the FP32 activations every dense
layer reads on ``--windows`` held-out windows (onnxruntime, the model's intermediate tensors
exposed), quantized with numpy as the integer kernels quantize them — the smoothed activations
on the per-tensor range the profile gives (values past it clipped), the smoothed weights per
output channel — and the mean squared output error against the FP32 layer, for every strength.
Per layer it prints the chosen strength, the best one in the simulation, and estimated vs
simulated errors with and without smoothing. Run::

    python benchmarks/smoothquant_error.py [--model ../shared/models/char_gpt.onnx]
        [--data ../shared/data/pycode.npz] [--samples 16] [--windows 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from rangeprof.profiler.calibrate.smoothing import (
    AARCH64,
    ALPHAS,
    X86,
    DenseInput,
    Grid,
    dense_input_stats,
    plan_smoothing,
    smoothing_scales,
)
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.ir.passes.smooth_quant import dense_inputs
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from smoothing_reference import simulated

SHARED = Path(__file__).resolve().parents[2] / "shared"


def activations(model: Path, tensors: list[str], feeds: list[dict]) -> dict[str, np.ndarray]:
    """The FP32 values of ``tensors`` (ONNX names) over ``feeds``, from onnxruntime."""
    proto = onnx.load(model)
    proto.graph.output.extend(onnx.ValueInfoProto(name=name) for name in tensors)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    runs = [session.run(tensors, feed) for feed in feeds]
    return {name: np.concatenate([r[i] for r in runs]) for i, name in enumerate(tensors)}


def layer_rows(profile: dict, weights: dict, values: dict, grid: Grid) -> list[dict]:
    entries = {t["profile_id"]: t for t in profile["tensors"]}
    plan = plan_smoothing(dense_input_stats(profile), weights, grid)
    rows = []
    for profile_id, choice in plan.choices.items():
        stats = DenseInput.from_entry(entries[profile_id])
        w = np.concatenate(weights[profile_id], axis=1).astype(np.float64)
        x = values[entries[profile_id]["source_tensor"]].reshape(-1, w.shape[0]).astype(np.float64)
        absmax_w = np.abs(w).max(axis=1)
        sims = {
            a: simulated(x, w, smoothing_scales(stats.absmax, absmax_w, a), stats, grid)
            for a in ALPHAS
        }
        plain = simulated(x, w, np.ones(w.shape[0]), stats, grid)
        best = min(sims, key=sims.__getitem__)
        rows.append(
            {
                "layer": profile_id,
                "alpha": choice.alpha,
                "best_simulated_alpha": best if sims[best] < plain else None,
                "estimated": choice.error,
                "simulated": sims[choice.alpha] if choice.smoothed else plain,
                "estimated_unsmoothed": choice.unsmoothed,
                "simulated_unsmoothed": plain,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=SHARED / "models" / "char_gpt.onnx")
    parser.add_argument("--data", type=Path, default=SHARED / "data" / "pycode.npz")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    profile = profile_model(
        args.model, f"{args.data}:calib", options=ProfileOptions(samples=args.samples)
    )
    weights = dense_inputs(import_onnx(load_model(args.model)).mod)
    entries = {t["profile_id"]: t for t in profile["tensors"]}
    names = sorted({entries[k]["source_tensor"] for k in weights})
    (input_name,) = [i.name for i in onnx.load(args.model).graph.input]
    held_out = np.load(args.data)["test"][: args.windows]
    values = activations(args.model, names, [{input_name: w[None]} for w in held_out])
    results = {}
    for label, grid in (("x86", X86), ("aarch64", AARCH64)):
        rows = results[label] = layer_rows(profile, weights, values, grid)
        print(f"\n{label}: layer, alpha (chosen / best simulated), error estimated / simulated")
        for r in rows:
            print(
                f"{r['layer']:40s} {r['alpha']!s:>4} / {r['best_simulated_alpha']!s:<4} "
                f"{r['estimated']:.2e} / {r['simulated']:.2e}  unsmoothed "
                f"{r['estimated_unsmoothed']:.2e} / {r['simulated_unsmoothed']:.2e}  "
                f"simulated ratio {r['simulated'] / r['simulated_unsmoothed']:.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
