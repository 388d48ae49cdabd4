"""char_gpt quantized, ours against onnxruntime's quantizers: bpc, batch-1 latency, file sizes.

Bits per character on held-out Python and on C headers, latency at batch 1 and the size of each
weight file, measured in one process, one run.

The model (``../shared/models/char_gpt.onnx``, a byte-level GPT: ``input_ids`` [N, 128] in,
``logits`` [N, 128, vocab] out) and its data (``../shared/data/pycode.npz``). Contenders:

* onnxruntime: FP32; ``quantize_dynamic`` (int8 weights; activations quantized at run time,
  ``DynamicQuantizeLinear``: one scale per tensor per run); ``quantize_static`` (QDQ, MinMax on
  the calibration windows, after its recommended pre-processing: ``harness.ort_int8_model``);
  ``MatMulNBits`` 4-bit, round to nearest per group of 32 and of 64, symmetric
  (``matmul_nbits_quantizer``'s default algorithm);
* ours: FP32 (``rangeprof.profiler.compile.schedules.build``, as ``perf_suite.py`` builds it);
  INT8 with the x86 defaults (``rangeprof.profile`` on ``--samples`` calibration windows, then
  ``rangeprof.build``); and each ``--variant NAME:key=value,...``, the same with options of
  ``rangeprof.quantize`` (profile options profile again). A variant whose options are refused
  prints our one-line error and the run goes on.

Bits per character: the mean over every position of ``-log2 softmax(logits)[target]``;
``test_next[i, t]`` is the byte that follows position ``t`` of window ``i`` (``test[i, t + 1]``
inside the window). Every contender runs one window at a time, at batch 1 as timed: the dynamic
model's activation scale spans the whole batch, so its figures would change with the batch.
Code of another kind: ``--header-windows`` windows of C headers (``/usr/include/**/*.h``), one
random file each and a random offset in it (``--seed``), bytes clipped below the vocabulary
(printed with the number of files and a digest of the windows: another host has other headers).

Latency: one window, every contender at each count of ``--threads``, in interleaved rounds
(``harness.interleaved_blocks_ms``); ratios are medians over rounds of the ratio within a round
(``harness.round_ratio``). onnxruntime gets ``intra_op_num_threads``; ours at one is pinned to
one, at more is our runtime's choice, as in ``perf_suite.py``. Builds and profiles are cached
(``$RANGEPROF_CACHE``, else a temporary folder). Run::

    python benchmarks/llm_quant.py [--samples 256] [--test-windows N] [--header-windows 256]
        [--variant NAME:key=value,...]... [--threads 1 2] [--runs 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import onnx
import tvm
from onnxruntime import quantization as ortq
from onnxruntime.quantization.matmul_nbits_quantizer import (
    DefaultWeightOnlyQuantConfig,
    MatMulNBitsQuantizer,
)
from tvm import relax

import rangeprof
from benchmarks import harness
from rangeprof.workflows.options import ProfileOptions

MODEL = harness.MODELS / "char_gpt.onnx"
DATA = harness.REPO.parent / "shared" / "data" / "pycode.npz"
HEADERS = Path("/usr/include")
INPUT, WINDOW = "input_ids", 128
SHAPES = {INPUT: (1, WINDOW)}
GROUPS = (32, 64)
# The options the issue compares (SmoothQuant off, 4-bit weights, W4A8), run when no --variant
# is given.
DEFAULT_VARIANTS = (
    "nosmooth:smooth_quant=false",
    "w4g32:weight_bits=4,group_size=32",
    "w4g64:weight_bits=4,group_size=64",
    "w4a8g32:weight_bits=4,group_size=32,int4_activations=int8",
)


def variant(text: str) -> tuple[str, dict]:
    """``NAME:key=value,...`` as a name and options; values read as JSON (``false``, ``4``,
    ``0.5``), else as text."""
    name, _, spec = text.partition(":")
    options = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r}: give key=value")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME:key=value,...")
    return name, options


def header_windows(count: int, seed: int, vocab: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """``count`` windows of C headers and their next bytes: a random header each (without
    replacement while there are enough), at a random offset, bytes clipped to ``vocab - 1``."""
    files = sorted(p for p in HEADERS.rglob("*.h") if p.is_file() and p.stat().st_size > WINDOW + 1)
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(files), size=count, replace=count > len(files))
    rows = []
    for index in picks:
        data = np.frombuffer(files[index].read_bytes(), dtype=np.uint8)
        start = rng.integers(0, len(data) - WINDOW)
        rows.append(data[start : start + WINDOW + 1])
    raw = np.stack(rows)
    clipped = np.minimum(raw, vocab - 1).astype(np.int64)
    info = {
        "files": len(files),
        "clipped_fraction": float((raw >= vocab).mean()),
        "sha256": hashlib.sha256(clipped.tobytes()).hexdigest()[:16],
    }
    return clipped[:, :WINDOW], clipped[:, 1:], info


def bits_per_char(run, windows: np.ndarray, targets: np.ndarray) -> float:
    """The mean of ``-log2 softmax(logits)[target]`` over every position, ``run`` called on one
    window at a time."""
    total = 0.0
    for window, target in zip(windows, targets, strict=True):
        logits = np.asarray(run(window[None]), dtype=np.float64)[0]
        top = logits.max(axis=-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
        total += float((log_z - np.take_along_axis(logits, target[:, None], -1)[:, 0]).sum())
    return total / targets.size / np.log(2)


class _Reader(ortq.CalibrationDataReader):
    def __init__(self, windows: np.ndarray):
        self.feeds = iter([{INPUT: w[None]} for w in windows])

    def get_next(self):
        return next(self.feeds, None)


def _dynamic(folder: Path) -> Path:
    path = folder / "dynamic.onnx"
    ortq.quantize_dynamic(MODEL, path, weight_type=ortq.QuantType.QInt8)
    return path


def _nbits(folder: Path, group: int) -> Path:
    quantizer = MatMulNBitsQuantizer(
        onnx.load(MODEL),
        algo_config=DefaultWeightOnlyQuantConfig(block_size=group, is_symmetric=True, bits=4),
    )
    quantizer.process()
    path = folder / f"w4g{group}.onnx"
    quantizer.model.save_model_to_file(str(path))
    return path


def ort_models(folder: Path, calib: np.ndarray) -> tuple[dict[str, Path], dict[str, str]]:
    """onnxruntime's models by contender, and the errors of those its quantizers refused."""
    makers = {
        "ort_dynamic": lambda: _dynamic(folder),
        # MinMax of the windows one at a time: batch 1, as everything here runs.
        "ort_static": lambda: harness.ort_int8_model(
            MODEL, [{INPUT: w[None]} for w in calib], folder
        ),
        **{f"ort_w4g{g}": lambda g=g: _nbits(folder, g) for g in GROUPS},
    }
    models, errors = {"ort_fp32": MODEL}, {}
    for name, make in makers.items():
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")  # the mask's -inf: divisions by infinity
                models[name] = make()
        except Exception as err:  # onnxruntime's quantizers fail in many ways
            errors[name] = f"{type(err).__name__}: {err}"[:300]
    return models, errors


def _profile(model, calib: np.ndarray, options: dict) -> rangeprof.Profile:
    """The profile of ``calib`` with ``options``, cached."""
    kind = f"llm-profile-{len(calib)}-{json.dumps(options, sort_keys=True)}"
    path = harness.cache_folder(kind, MODEL, SHAPES) / "profile.json"
    if path.exists():
        return rangeprof.Profile.load(path)
    profile = rangeprof.profile(model, {INPUT: calib}, **options)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    profile.save(partial)
    os.replace(partial, path)
    return profile


def our_int8(model, calib: np.ndarray, options: dict) -> tuple[rangeprof.Int8Model, float | None]:
    """Our INT8 build with ``options`` (those of :func:`rangeprof.quantize`) and its seconds
    (None: cached); a refused option raises :class:`rangeprof.RangeprofError`."""
    building = {k: v for k, v in options.items() if k not in ProfileOptions.model_fields}
    kind = f"llm-int8-{len(calib)}-{json.dumps(options, sort_keys=True)}"
    folder = harness.cache_folder(kind, MODEL, SHAPES) / "build"
    if (folder / "manifest.json").exists():
        return rangeprof.Int8Model.load(folder), None
    start = time.perf_counter()
    profile = _profile(model, calib, {k: options[k] for k in options.keys() - building.keys()})
    partial = folder.with_name(f"build.{os.getpid()}.partial")
    try:
        rangeprof.build(model, profile, out=partial, **building)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.replace(partial, folder)  # last: the entry is complete
    return rangeprof.Int8Model.load(folder), time.perf_counter() - start


def our_models(calib: np.ndarray, variants: list[tuple[str, dict]]) -> tuple[dict, dict, dict]:
    """Our builds: the FP32 library and the INT8 programs by contender, the refused variants'
    errors, and the build seconds (None: cached)."""
    model = rangeprof.load(MODEL, input_shapes=SHAPES)
    library, seconds = harness.fp32_library(MODEL, SHAPES)
    libraries, refused, build_s = {"ours_fp32": library}, {}, {"ours_fp32": seconds}
    for name, options in [("ours_int8", {}), *((f"ours_{n}", o) for n, o in variants)]:
        try:
            int8, build_s[name] = our_int8(model, calib, options)
        except rangeprof.RangeprofError as err:
            refused[name] = str(err)
            continue
        libraries[name] = int8.folder / int8.manifest.library
    return libraries, refused, build_s


def _runner(kind: str, model: Path):
    """One window's logits, on this process' default threads."""
    if kind.startswith("ort"):
        session = harness.ort_session(model, 0)  # onnxruntime's default threads
        return lambda w: session.run(None, {INPUT: w})[0]
    main = relax.VirtualMachine(tvm.runtime.load_module(str(model)), tvm.cpu())["main"]
    return lambda w: main(tvm.runtime.tensor(np.ascontiguousarray(w))).numpy()


def quality(models: dict[str, Path], sets: dict[str, tuple]) -> dict[str, dict]:
    """Each contender's bits per character on each set, and its change in % from ORT FP32."""
    rows = {}
    for kind, model in models.items():
        run = _runner(kind, model)
        rows[kind] = {name: bits_per_char(run, *data) for name, data in sets.items()}
    for row in rows.values():
        for name in sets:
            row[f"{name}_pct"] = 100 * (row[name] / rows["ort_fp32"][name] - 1)
    return rows


def latency(models: dict[str, Path], threads: list[int], runs: int, window) -> dict:
    """Every contender's block medians at each thread count (``kind@threads``)."""
    fns = {}
    for t in threads:
        for kind, model in models.items():
            if kind.startswith("ort"):
                session = harness.ort_session(model, t)
                fns[f"{kind}@{t}"] = lambda s=session: s.run(None, {INPUT: window})
            else:
                fns[f"{kind}@{t}"], _ = harness.our_call(model, [tvm.runtime.tensor(window)], t)
    return harness.interleaved_blocks_ms(fns, runs)


def ratios(blocks: dict, kinds: list[str], threads: list[int]) -> dict[str, float]:
    """The issue's ratios at each thread count: our INT8 over our FP32 and over ORT's dynamic
    model, our FP32 over ORT FP32, and each variant over ORT's dynamic model and our FP32."""
    pairs = [("ours_int8", "ours_fp32"), ("ours_int8", "ort_dynamic"), ("ours_fp32", "ort_fp32")]
    variants = [k for k in kinds if k.startswith("ours_") and k not in ("ours_fp32", "ours_int8")]
    pairs += [(v, b) for v in variants for b in ("ort_dynamic", "ours_fp32")]
    found = {}
    for t in threads:
        for a, b in pairs:
            if f"{a}@{t}" in blocks and f"{b}@{t}" in blocks:
                found[f"{a}/{b}@{t}"] = harness.round_ratio(blocks, f"{a}@{t}", f"{b}@{t}")
    return found


def _print(result: dict) -> None:
    sets = list(result["data"])
    head = f"\n{'contender':<16}" + "".join(f"{s + ' bpc':>14}{'Δ%':>9}" for s in sets)
    print(head + f"{'MB':>8}{'×FP32':>7}" + "".join(f"{f'ms@{t}':>9}" for t in result["threads"]))
    fp32_mb = result["sizes_mb"]["ort_fp32"]
    for kind, row in result["bpc"].items():
        line = f"{kind:<16}" + "".join(f"{row[s]:14.4f}{row[f'{s}_pct']:+9.2f}" for s in sets)
        mb = result["sizes_mb"][kind]
        line += f"{mb:8.2f}{mb / fp32_mb:7.2f}"
        print(line + "".join(f"{result['ms'][f'{kind}@{t}']:9.2f}" for t in result["threads"]))
    for kind, error in {**result["ort_errors"], **result["refused"]}.items():
        print(f"{kind:<16}refused: {error}")
    print("\nlatency ratios (median over rounds of the ratio within a round):")
    for key, value in result["ratios"].items():
        print(f"  {key:<36} {value:6.2f}")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256, help="calibration windows")
    parser.add_argument("--test-windows", type=int, help="evaluate at most this many (all)")
    parser.add_argument("--header-windows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="of the header windows")
    parser.add_argument("--variant", type=variant, action="append", metavar="NAME:k=v,...")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, os.cpu_count() or 1])
    parser.add_argument("--runs", type=int, default=40, help="timed runs per contender")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def main() -> None:
    logging.getLogger().setLevel(logging.ERROR)  # onnxruntime's quantizers log per weight
    opts = _arguments()
    threads = sorted(set(opts.threads))
    os.environ["TVM_NUM_THREADS"] = str(max(threads))  # our pool: the most any contender uses
    host = harness.host()
    print(f"{host['cpu']} (family {host['family']} model {host['model']}, {host['isa']})")
    data = np.load(DATA)
    calib = data["calib"][: opts.samples]
    vocab = harness.ort_session(MODEL, 0).get_outputs()[0].shape[-1]
    headers, header_next, header_info = header_windows(opts.header_windows, opts.seed, vocab)
    sets = {
        "test": (data["test"][: opts.test_windows], data["test_next"][: opts.test_windows]),
        "headers": (headers, header_next),
    }
    print(f"vocabulary {vocab}; {len(sets['test'][0])} test windows; headers: {header_info}")
    models, ort_errors = ort_models(Path(tempfile.mkdtemp(prefix="llm-quant-ort-")), calib)
    ours, refused, build_s = our_models(calib, opts.variant or list(map(variant, DEFAULT_VARIANTS)))
    models.update(ours)
    bpc = quality(models, sets)  # before the timing pins our pool's threads
    blocks = latency(models, threads, opts.runs, np.ascontiguousarray(sets["test"][0][:1]))
    result = {
        "host": host, "threads": threads, "runs": opts.runs, "samples": len(calib),
        "data": {name: len(windows) for name, (windows, _) in sets.items()},
        "headers": header_info, "bpc": bpc,
        "sizes_mb": {k: Path(m).stat().st_size / 2**20 for k, m in models.items()},
        "ms": harness.median_ms(blocks), "ratios": ratios(blocks, list(models), threads),
        "ort_errors": ort_errors, "refused": refused, "build_s": build_s, "block_ms": blocks,
    }  # fmt: skip
    _print(result)
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
