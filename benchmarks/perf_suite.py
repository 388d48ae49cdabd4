"""The performance suite: every real model, FP32 and INT8, ours against onnxruntime, on one and
more threads, on a quiet host and under a competing load; one process, interleaved rounds.

For each model (``--models``: the shared models and the PyPI test zoo, ``tests/pypi_models.py``)
the contenders are our FP32 build (``rangeprof.profiler.compile.schedules.build``), our INT8
build (``rangeprof profile --data random`` then ``rangeprof build``: the x86 plugin's default
options), onnxruntime FP32 and onnxruntime INT8 (``quantize_static``, QDQ, after its recommended
pre-processing: ``ort_prepare.py``, calibrated on the same random samples), each at every count
of ``--threads``. Ours at more than one thread is our runtime as users get it: the count it
chooses while running (``rangeprof.profiler.compile.threads``); at one, pinned to one.
onnxruntime gets ``intra_op_num_threads``. All are timed in rounds of one block each
(``harness.interleaved_blocks_ms``), and ratios are the median over rounds of the ratio within
a round (``harness.round_ratio``). Then, with a busy-loop process on the last core, the same at
one thread and at the most: that ratio shows whether more threads hold up under a load. Our
choice changes at the end of the second slow run on more threads after a load starts (by
design, ``tests/test_threads.py``); the suite times the steady state under the load, after
``2 · RUN`` untimed calls of each chooser there (two runs of a model whose calls take over the
chooser's ``WAKE_S``).

Printed per model and as geometric means over the models: FP32 ours / ORT FP32, INT8 ours /
ORT FP32 and / ORT INT8 at each thread count, and most threads / one thread under the load, ours
and ORT's. The JSON (``--json``) also holds every block median and the host's CPU class. Builds
are cached (``$RANGEPROF_CACHE``, as the profiling programs are), keyed by the model, its input
shapes, the target, TVM's version and our sources. Run::

    python benchmarks/perf_suite.py [--models NAME...] [--threads 1 2] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tvm

from benchmarks import harness
from rangeprof.profiler.compile.threads import RUN
from rangeprof.profiler.ir.onnx_load import load_model
from rangeprof.profiler.profiling.data import model_inputs, open_data, sample_batch

SHARED = ("resnet18", "mobilenet_v2", "tiny_bert", "digits_cnn", "ppocr_cls", "char_gpt")
KINDS = ("ours_fp32", "ours_int8", "ort_fp32", "ort_int8")


def _cli(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rangeprof", *args], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")


def _int8_library(path: Path, name: str, shapes: dict, samples: int) -> tuple[Path, float | None]:
    """Our INT8 build of ``path`` (the CLI's profile on ``samples`` random samples, then its
    build with the x86 defaults) and its seconds (None: cached); returns the library."""
    folder = harness.cache_folder(f"int8-{samples}", path, shapes)
    manifest = folder / "manifest.json"
    if manifest.exists():
        return folder / json.loads(manifest.read_text())["library"], None
    start = time.perf_counter()
    shape_args = [
        a for k, v in shapes.items() for a in ("--input-shape", f"{k}={'x'.join(map(str, v))}")
    ]
    constants = [a for c in harness.constant_inputs(name) for a in ("--constant-input", c)]
    with tempfile.TemporaryDirectory() as tmp:
        profile = str(Path(tmp) / "profile.json")
        _cli("profile", str(path), "--data", "random", "--samples", str(samples), "--out",
             profile, *shape_args, *constants)  # fmt: skip
        # Regions whose tensors the profile has no qparams for stay FP32, as the zoo's builds.
        _cli("build", str(path), "--profile", profile, "--out", str(Path(tmp) / "build"),
             "--fp32-fallback", *shape_args)  # fmt: skip
        built = json.loads((Path(tmp) / "build" / "manifest.json").read_text())
        os.replace(Path(tmp) / "build" / built["library"], folder / built["library"])
    manifest.write_text(json.dumps(built))  # last: the entry is complete
    return folder / built["library"], time.perf_counter() - start


def _data(path: Path, name: str, shapes: dict, samples: int) -> tuple[list[dict], dict, int]:
    """The calibration batches (as the CLI's ``--data random --samples``), one more batch to
    time, and the samples the calibration holds."""
    inputs = model_inputs(load_model(path, shapes).facts, harness.constant_inputs(name))
    batch = sample_batch(inputs)
    count = max(1, samples // batch) * batch
    data = open_data("random", inputs, batch_size=batch, samples=count + batch)
    batches = list(data.batches())
    return batches[:-1], batches[-1], count


def _contenders(prepared: dict, probe: dict, threads: list[int]) -> tuple[dict, dict]:
    """Every contender's call by ``kind@threads``, and our adaptive ones (their final choice
    goes in the report)."""
    fns, adaptive = {}, {}
    for kind in KINDS:
        if kind not in prepared:
            continue
        for t in threads:
            label = f"{kind}@{t}"
            if kind.startswith("ort"):
                session = harness.ort_session(prepared[kind], t)
                fns[label] = lambda s=session: s.run(None, probe)
            else:
                arrays = [np.asarray(probe[n], order="C") for n in prepared["names"]]
                fns[label], chooser = harness.our_call(
                    prepared[kind], [tvm.runtime.tensor(a) for a in arrays], t
                )
                if chooser is not None:
                    adaptive[label] = chooser
    return fns, adaptive


@contextlib.contextmanager
def competing_load():
    """A busy-loop process on the last core of this process, for the duration."""
    core = max(os.sched_getaffinity(0))
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        yield core
    finally:
        process.kill()
        process.wait()


def _prepare(name: str, samples: int) -> tuple[dict, dict, dict]:
    """Every contender's model (what failed is in the errors, by kind), the batch to time and
    the build seconds."""
    path = harness.model_path(name)
    shapes = harness.input_shapes(name)
    calibration, probe, count = _data(path, name, shapes, samples)
    prepared: dict = {"names": list(probe), "ort_fp32": path}
    errors, build_s = {}, {}
    prepared["ours_fp32"], build_s["fp32"] = harness.fp32_library(path, shapes)
    try:
        prepared["ours_int8"], build_s["int8"] = _int8_library(path, name, shapes, count)
    except RuntimeError as err:
        errors["ours_int8"] = str(err)
    folder = Path(tempfile.mkdtemp(prefix="perf-suite-ort-"))
    try:
        prepared["ort_int8"] = harness.ort_int8_model(path, calibration, folder)
    except Exception as err:  # onnxruntime's quantizer fails in many ways
        errors["ort_int8"] = f"{type(err).__name__}: {err}"[:300]
    return prepared, probe, {"build_s": build_s, "errors": errors, "shapes": shapes}


def _ratios(blocks: dict, threads: list[int]) -> dict:
    """Ours over onnxruntime at each count; the most threads over one, each contender."""
    ratios = {}
    pairs = (("fp32", "ours_fp32", "ort_fp32"), ("int8_vs_ort_fp32", "ours_int8", "ort_fp32"),
             ("int8_vs_ort_int8", "ours_int8", "ort_int8"))  # fmt: skip
    for t in threads:
        for label, a, b in pairs:
            if f"{a}@{t}" in blocks and f"{b}@{t}" in blocks:
                ratios[f"{label}@{t}"] = harness.round_ratio(blocks, f"{a}@{t}", f"{b}@{t}")
    most = max(threads)
    for kind in KINDS:
        if most > 1 and f"{kind}@1" in blocks:
            ratios[f"{kind}_{most}_over_1"] = harness.round_ratio(
                blocks, f"{kind}@{most}", f"{kind}@1"
            )
    return ratios


def measure(name: str, threads: list[int], runs: int, samples: int) -> dict:
    prepared, probe, row = _prepare(name, samples)
    fns, adaptive = _contenders(prepared, probe, threads)
    quiet = harness.interleaved_blocks_ms(fns, runs)
    row.update(model=name, ms=harness.median_ms(quiet), ratios=_ratios(quiet, threads))
    row["block_ms"] = quiet
    row["chosen_threads"] = {label: chooser.threads for label, chooser in adaptive.items()}
    most = max(threads)
    loaded_fns = {k: f for k, f in fns.items() if k.endswith(("@1", f"@{most}"))}
    if most > 1 and "@1" in "".join(loaded_fns):
        # Twice the rounds: a ratio near 1 under a load that takes time slices at random.
        with competing_load():
            for label in adaptive:
                for _ in range(2 * RUN):
                    fns[label]()
            loaded = harness.interleaved_blocks_ms(loaded_fns, 2 * runs)
        row["under_load"] = {"ms": harness.median_ms(loaded), "ratios": _ratios(loaded, [1, most])}
        row["block_ms_under_load"] = loaded
        row["chosen_threads_under_load"] = {k: c.threads for k, c in adaptive.items()}
    return row


def geomeans(rows: list[dict]) -> dict:
    """Each ratio's geometric mean over the models that have it (and their count)."""
    found: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row["ratios"].items():
            found.setdefault(key, []).append(value)
        for key, value in row.get("under_load", {}).get("ratios", {}).items():
            found.setdefault(f"under_load:{key}", []).append(value)
    return {
        key: {"geomean": float(np.exp(np.mean(np.log(values)))), "models": len(values)}
        for key, values in found.items()
    }


def _report(row: dict) -> str:
    """One model's line: its times and ratios, then the load's."""
    ms = " ".join(f"{k} {v:.2f}" for k, v in row["ms"].items())
    ratios = " ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
    text = f"{row['model']}: ms {ms}\n  ratios {ratios}"
    if "under_load" in row:
        load = " ".join(f"{k} {v:.2f}" for k, v in row["under_load"]["ratios"].items())
        text += f"\n  under load: {load}"
    if row["errors"]:
        text += f"\n  not measured: {row['errors']}"
    return text


def main() -> None:
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's quantizer warns per weight
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo = list(harness.pypi_zoo().MODELS)
    parser.add_argument("--models", nargs="+", default=[*SHARED, *zoo])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, os.cpu_count() or 1])
    parser.add_argument("--quick", action="store_true", help="15 runs, 8 samples")
    parser.add_argument("--runs", type=int, help="timed runs per contender (default 40)")
    parser.add_argument("--samples", type=int, help="calibration samples (default 16)")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    runs = opts.runs or (15 if opts.quick else 40)
    samples = opts.samples or (8 if opts.quick else 16)
    threads = sorted(set(opts.threads))
    # Our pool has the most threads; each contender sets its count (before any kernel runs).
    os.environ["TVM_NUM_THREADS"] = str(max(threads))
    host = harness.host()
    print(f"{host['cpu']} (family {host['family']} model {host['model']}, {host['isa']})")
    rows = []
    for name in opts.models:
        rows.append(measure(name, threads, runs, samples))
        print(_report(rows[-1]), flush=True)
    means = geomeans(rows)
    print("geometric means:")
    for key, value in means.items():
        print(f"  {key:<36} {value['geomean']:6.2f}  ({value['models']} models)")
    if opts.json:
        document = {"host": host, "threads": threads, "runs": runs, "samples": samples}
        opts.json.write_text(json.dumps({**document, "rows": rows, "geomeans": means}, indent=1))


if __name__ == "__main__":
    main()
