"""Profiling speed and memory against ONNX Runtime's calibrators, same model and data.

    python benchmarks/profile_vs_ort.py [--models resnet18 mobilenet_v2 tiny_bert digits_cnn]
        [--samples 32] [--rss-samples 32 256] [--json results.json]

Every figure runs in a fresh Python process (so timings include nothing cached in memory and
peak RSS is that figure's own), all from this one invocation. Figures per model (../shared/models;
seeded random data written once to an .npz that both sides read):

* ``fp32_ms``: our FP32 latency (batch 1) vs onnxruntime's (``ort_fp32_ms``): the median over
  ``--latency-processes`` processes of each process's median (single processes of ours vary by
  up to a third on this 2-vCPU machine; every process's figure is kept in ``*_runs``);
* ``profile_minmax_{cold,warm}_s``: ``rangeprof profile`` with ``--bins 0`` on N samples, with an
  empty build cache and then with the cache the cold run filled;
* ``profile_hist_{cold,warm}_s``: the same with 2048-bin histograms;
* ``ort_minmax_s`` / ``ort_entropy_s``: ``onnxruntime.quantization.create_calibrator`` with the
  MinMax and Entropy methods, ``collect_data`` + ``compute_data`` on the same N samples;
* ``rss_mb@N``: peak RSS of a warm histogram profile for each ``--rss-samples`` N, and of the ORT
  Entropy calibrator at the smallest N.

It prints the ratios the targets are stated in and writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODELS = ("resnet18", "mobilenet_v2", "tiny_bert", "digits_cnn")


def _model(name: str) -> Path:
    return SHARED / "models" / f"{name}.onnx"


def _batches(name: str, samples: int, data: str = "random") -> list[dict]:
    from rangeprof.profiler.ir.onnx_load import load_model
    from rangeprof.profiler.profiling.data import model_inputs, open_data

    source = open_data(data, model_inputs(load_model(_model(name))), samples=samples)
    return list(source.batches())


def _write_data(name: str, samples: int, path: Path) -> str:
    """The seeded random samples, one array per model input, as the .npz both sides read: the
    calibrators get the arrays before their clock starts, ours reads the file as it profiles
    (generating the data inside our timing would cost ResNet-18 ~1.7 ms a sample)."""
    import numpy as np

    batches = _batches(name, samples)
    np.savez(path, **{k: np.concatenate([b[k] for b in batches]) for k in batches[0]})
    return str(path)


# --- figures (each runs in its own process) ------------------------------------------------


def fig_fp32(name: str, runs: int = 40) -> dict:
    import numpy as np
    import tvm
    from tvm import relax

    from rangeprof.profiler.compile.schedules import build
    from rangeprof.profiler.ir.importer import import_onnx
    from rangeprof.profiler.ir.onnx_load import load_model

    mod = import_onnx(load_model(_model(name))).mod
    start = time.perf_counter()
    vm = relax.VirtualMachine(build(mod), tvm.cpu())
    build_s = time.perf_counter() - start
    args = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in _batches(name, 1)[0].values()]
    vm["main"](*args)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        vm["main"](*args)
        times.append(time.perf_counter() - t)
    return {"fp32_ms": statistics.median(times) * 1e3, "build_s": build_s}


def fig_ort_fp32(name: str, runs: int = 40) -> dict:
    import onnxruntime as ort

    session = ort.InferenceSession(str(_model(name)), providers=["CPUExecutionProvider"])
    feed = _batches(name, 1)[0]
    session.run(None, feed)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t)
    return {"ort_fp32_ms": statistics.median(times) * 1e3}


def fig_profile(name: str, samples: int, bins: int, cache: str, data: str) -> dict:
    from rangeprof.profiler.compile.cache import BuildCache
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    start = time.perf_counter()
    doc = profile_model(
        _model(name),
        data,
        options=ProfileOptions(bins=bins, samples=samples),
        cache=BuildCache(Path(cache)),
    )
    return {
        "wall_s": time.perf_counter() - start,
        "build_cache": doc["run"]["build_cache"],
        "timings": doc["run"]["timings"],
    }


def fig_ort_calibrator(name: str, samples: int, method: str, data: str) -> dict:
    # Our data first: onnxruntime.quantization puts onnxruntime/transformers on sys.path, whose
    # profiler.py would shadow our `profiler` package.
    batches = _batches(name, samples, data)
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(batches)

        def get_next(self):
            return next(self.items, None)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        calibrator = create_calibrator(
            _model(name),
            augmented_model_path=str(Path(folder) / "augmented.onnx"),
            calibrate_method=getattr(CalibrationMethod, method),
        )
        calibrator.collect_data(Reader())
        calibrator.compute_data()
    return {"wall_s": time.perf_counter() - start}


FIGURES = {
    "fp32": fig_fp32,
    "ort_fp32": fig_ort_fp32,
    "profile": fig_profile,
    "ort_calibrator": fig_ort_calibrator,
}


def _child(spec: str) -> None:
    args = json.loads(spec)
    result = FIGURES[args.pop("figure")](**args)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def figure(**args) -> dict:
    """Runs one figure in a fresh process and returns its JSON result."""
    cmd = [sys.executable, __file__, "--figure", json.dumps(args)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"figure {args} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(name: str, samples: int, rss_samples: list[int], processes: int) -> dict:
    row: dict = {}
    for label in ("fp32", "ort_fp32"):
        runs = [figure(figure=label, name=name) for _ in range(processes)]
        row[f"{label}_ms_runs"] = [r[f"{label}_ms"] for r in runs]
        row[f"{label}_ms"] = statistics.median(row[f"{label}_ms_runs"])
        if label == "fp32":
            row["build_s"] = statistics.median(r["build_s"] for r in runs)
    with tempfile.TemporaryDirectory() as folder:
        data = _write_data(name, max(samples, *rss_samples), Path(folder) / "data.npz")
        for label, bins in (("minmax", 0), ("hist", 2048)):
            with tempfile.TemporaryDirectory() as cache:
                args = dict(figure="profile", name=name, bins=bins, cache=cache, data=data)
                cold, warm = figure(**args, samples=samples), figure(**args, samples=samples)
                row[f"profile_{label}_cold_s"] = cold["wall_s"]
                row[f"profile_{label}_warm_s"] = warm["wall_s"]
                if bins:
                    for n in rss_samples:
                        row[f"rss_mb@{n}"] = figure(**args, samples=n)["peak_rss_mb"]
        for method in ("MinMax", "Entropy"):
            args = dict(figure="ort_calibrator", name=name, method=method, data=data)
            row[f"ort_{method.lower()}_s"] = figure(**args, samples=samples)["wall_s"]
            if method == "Entropy":
                n = min(rss_samples)
                row[f"ort_entropy_rss_mb@{n}"] = figure(**args, samples=n)["peak_rss_mb"]
    row["fp32_vs_ort"] = row["fp32_ms"] / row["ort_fp32_ms"]
    row["hist_warm_vs_ort_minmax"] = row["profile_hist_warm_s"] / row["ort_minmax_s"]
    row["ort_entropy_vs_hist_warm"] = row["ort_entropy_s"] / row["profile_hist_warm_s"]
    lo, hi = min(rss_samples), max(rss_samples)
    row["rss_growth"] = row[f"rss_mb@{hi}"] / row[f"rss_mb@{lo}"] - 1
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figure", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--rss-samples", type=int, nargs=2, default=[32, 256])
    parser.add_argument("--latency-processes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.figure:
        _child(args.figure)
        return
    table = {}
    for name in args.models:
        table[name] = measure(name, args.samples, args.rss_samples, args.latency_processes)
        row = table[name]
        print(
            f"{name:<13} fp32 {row['fp32_ms']:8.2f} ms vs ort {row['ort_fp32_ms']:6.2f} ms "
            f"({row['fp32_vs_ort']:5.2f}x) | profile+hist warm {row['profile_hist_warm_s']:7.2f} s"
            f" (cold {row['profile_hist_cold_s']:7.2f} s) vs ort minmax {row['ort_minmax_s']:6.2f}"
            f" s ({row['hist_warm_vs_ort_minmax']:5.2f}x), ort entropy {row['ort_entropy_s']:6.2f}"
            f" s ({row['ort_entropy_vs_hist_warm']:5.2f}x faster) | rss growth "
            f"{row['rss_growth'] * 100:+.1f}%",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
