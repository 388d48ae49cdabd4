"""The Python API: rangeprof from a notebook or a script, on arrays as well as files.

    import numpy as np
    import rangeprof

    model = rangeprof.load("digits_cnn.onnx")
    model.inputs                                   # {'image': ((1, 1, 8, 8), 'float32')}
    calib = np.load("digits.npz")["calib"]         # [N, 1, 8, 8]
    profile = rangeprof.profile(model, {"image": calib})   # or calib, batches, or a path
    profile.tensors["/conv1/Conv"].histogram       # a Histogram: counts, edges()
    qparams = profile.calibrate(method="entropy")  # a QParams, by profileID
    int8 = rangeprof.build(model, profile, target="x86", method="mse")
    logits = int8.run({"image": calib[:1]})        # the INT8 program's outputs

Every result is a typed object over the documents the CLI writes (``.document``, ``.to_json()``,
``.save(path)``), so a notebook and ``rangeprof`` commands exchange files freely.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rangeprof.profiler.profiling.statistics import Histogram, TensorStats

Data = str | Path | np.ndarray | Mapping[str, np.ndarray] | Iterable[Any]


@dataclass(frozen=True)
class Model:
    """An ONNX model loaded and checked (as ``rangeprof inspect`` loads it)."""

    path: Path
    input_shapes: dict[str, tuple[int, ...]]
    inputs: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype), as loaded

    def inspect(self) -> dict:
        """Its layers with their profileIDs and the lineage through every compiler stage (the
        document of ``rangeprof inspect --json``)."""
        from rangeprof.workflows import profiling
        from rangeprof.workflows.requests import InspectRequest

        return profiling.inspect(InspectRequest(model=self.path, input_shapes=self.input_shapes))


def load(path: str | Path, input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Model:
    """Load the ONNX file at ``path``; ``input_shapes`` fixes symbolic input dimensions."""
    from rangeprof.profiler.ir.onnx_load import load_model

    shapes = {name: tuple(dims) for name, dims in (input_shapes or {}).items()}
    loaded = load_model(path, shapes)
    inputs = {
        name: (tuple(shape), loaded.input_dtypes[name])
        for name, shape in loaded.input_shapes.items()
    }
    return Model(Path(path), shapes, inputs)


@dataclass(frozen=True)
class TensorProfile:
    """One profiled tensor: its identity and everything recorded about it."""

    profile_id: str
    kind: str  # input, weight, activation, output
    op: str
    source_node: str | None
    shape: list | None
    dtype: str
    stats: TensorStats

    @property
    def min(self) -> float | None:
        return self.stats.min

    @property
    def max(self) -> float | None:
        return self.stats.max

    @property
    def histogram(self) -> Histogram | None:
        """Counts of the finite values in power-of-two-wide bins (``counts``, ``edges()``)."""
        return self.stats.histogram


@dataclass(frozen=True)
class QParams:
    """Quantization parameters by profileID (the QPARAMS document of ``rangeprof calibrate``)."""

    document: dict

    def __getitem__(self, profile_id: str) -> dict:
        for record in self.document["qparams"]:
            if record["profile_id"] == profile_id:
                return record
        raise KeyError(profile_id)

    def to_json(self) -> str:
        return json.dumps(self.document, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


@dataclass(frozen=True)
class Profile:
    """A profile: every tensor's statistics by profileID, with the model's lineage."""

    document: dict
    tensors: dict[str, TensorProfile] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from rangeprof.profiler.profiling.statistics import TensorStats

        tensors = {
            entry["profile_id"]: TensorProfile(
                entry["profile_id"],
                entry["kind"],
                entry["op"],
                entry["source_node"],
                entry["shape"],
                entry["dtype"],
                TensorStats.from_json(entry),
            )
            for entry in self.document["tensors"]
        }
        object.__setattr__(self, "tensors", tensors)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile JSON file (``rangeprof profile --out``), checked against its schema."""
        from rangeprof.profiler.profiling.document import load_profile

        return cls(load_profile(path))

    def calibrate(self, method: str = "max", **options: Any) -> QParams:
        """Qparams from the stored statistics: ``method`` max, percentile, entropy or mse;
        ``options`` as ``rangeprof calibrate``'s (``percentile``, ``scheme``, ``dtype``,
        ``granularity``, ``power_of_two``)."""
        from rangeprof.profiler.calibrate.methods import CalibrationOptions, calibrate

        return QParams(calibrate(self.document, CalibrationOptions(method=method, **options)))

    def export(
        self,
        fmt: str,
        path: str | Path,
        *,
        model: Model | str | Path | None = None,
        evaluation: dict | str | Path | None = None,
        method: str = "max",
        **options: Any,
    ) -> None:
        """Write the profile in format ``fmt`` to ``path``, as ``rangeprof export`` does: ``aimet``,
        ``ort``, ``ort-json``, ``tensorrt`` (calibration tables), ``qdq`` (the profiled
        ``model`` with QuantizeLinear / DequantizeLinear pairs) or ``model-explorer`` (a folder
        of Model Explorer overlays of the ``model``; SQNR and kept-FP32 figures with an
        ``evaluation``, a report of ``rangeprof evaluate --json`` or its file). ``method`` and
        ``options`` as for :meth:`calibrate`."""
        from rangeprof.profiler.calibrate.methods import CalibrationOptions
        from rangeprof.workflows import profiling

        calibration = CalibrationOptions(method=method, **options)
        source = Path(model.path if isinstance(model, Model) else model) if model else None
        report = None if evaluation is None else profiling.evaluation_report(evaluation)
        exported = profiling.render_export(self.document, fmt, calibration, source, report)
        profiling.write_export(Path(path), exported)

    def to_json(self) -> str:
        return json.dumps(self.document, indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def profile(
    model: Model | str | Path,
    data: Data,
    *,
    bins: int = 2048,
    batch_size: int | None = None,
    samples: int | None = None,
    seed: int = 0,
    equalize: bool = False,
    channel_stats: bool = False,
    progress: Callable[[int, int | None], None] | None = None,
) -> Profile:
    """Run ``data`` through the instrumented FP32 model and record every tensor's statistics.

    ``data`` is a ``--data`` spec or path (``FILE.npz[:KEY]``, ``FILE.npy``, an image folder,
    ``"random"``), a dict of arrays ``{input: [N, *sample_shape]}`` (one array for a
    single-input model), or an iterable of such dicts or arrays: batches of any size, as a
    PyTorch ``DataLoader`` yields them (tensors convert through ``numpy()``), read once.
    ``equalize`` profiles the cross-layer equalized model (builds of the profile equalize too).
    ``channel_stats`` also records every activation's per-channel min, max and mean (what
    ``bias_correction="stored"`` reads). ``progress(done, total)`` gets the samples done
    (``total`` is ``None`` for an iterable of unknown length)."""
    from rangeprof.workflows import profiling
    from rangeprof.workflows.requests import ProfileRequest

    # A path is loaded once, by the profiling run itself.
    path, shapes = (model.path, model.input_shapes) if isinstance(model, Model) else (model, {})
    held = not isinstance(data, str | Path)
    request = ProfileRequest(
        model=path,
        data="arrays" if held else str(data),
        input_shapes=shapes,
        bins=bins,
        batch_size=batch_size,
        samples=samples,
        seed=seed,
        equalize=equalize,
        channel_stats=channel_stats,
    )
    document = profiling.profile(request, progress, arrays=data if held else None)
    return Profile(document)


@dataclass
class Int8Model:
    """A built INT8 program: ``folder`` holds ``model.so`` and ``manifest.json``."""

    folder: Path
    manifest: dict
    input_names: tuple[str, ...]
    _main: Any = field(default=None, init=False, repr=False)  # loaded on the first run

    def run(self, inputs: Mapping[str, np.ndarray] | np.ndarray) -> list[np.ndarray]:
        """The program's outputs for one batch of ``inputs`` (by name, or the one array)."""
        import tvm
        from tvm import relax

        if isinstance(inputs, np.ndarray):
            inputs = dict(zip(self.input_names, [inputs], strict=True))
        missing = sorted(set(self.input_names) - set(inputs))
        if missing:
            raise KeyError(f"no array for input {', '.join(missing)}")
        if self._main is None:
            from rangeprof.byoc.plugin import get_plugin
            from rangeprof.profiler.errors import RangeprofError

            if not get_plugin(self.manifest["target"]).runs_here:
                raise RangeprofError(
                    f"this {self.manifest['target']} build runs on its target, not on this host: "
                    f"deploy {self.folder / self.manifest['library']} there"
                )
            library = tvm.runtime.load_module(str(self.folder / self.manifest["library"]))
            self._main = relax.VirtualMachine(library, tvm.cpu())["main"]
        args = [tvm.runtime.tensor(np.ascontiguousarray(inputs[n])) for n in self.input_names]
        result = self._main(*args)
        if isinstance(result, tvm.runtime.Tensor):
            return [result.numpy()]
        return [item.numpy() for item in result]


def _quantize_fields(model: Model, ranges: Profile | QParams, folder: Path, options: dict) -> dict:
    """What a build and an evaluation request share: the model, the ranges saved in ``folder``
    as the document they are, and the options as given."""
    document = folder / ("profile.json" if isinstance(ranges, Profile) else "qparams.json")
    ranges.save(document)
    return {
        "model": model.path,
        "profile": document if isinstance(ranges, Profile) else None,
        "qparams": document if isinstance(ranges, QParams) else None,
        "input_shapes": model.input_shapes,
        **options,
    }


def build(
    model: Model | str | Path,
    ranges: Profile | QParams,
    *,
    target: str = "x86",
    method: str = "max",
    percentile: float = 99.99,
    weight_bits: int = 8,
    fp32_fallback: bool = False,
    accuracy_budget: float | None = None,
    data: str | None = None,
    labels: str | None = None,
    samples: int | None = None,
    bias_correction: str | None = None,
    out: str | Path | None = None,
) -> Int8Model:
    """Quantize the model with ``ranges`` (a profile, calibrated with the target's policy by
    ``method``, or qparams) and compile it for ``target`` into ``out`` (default: a new
    temporary folder).

    ``accuracy_budget`` (top-1 points; needs ``data``, and ``labels`` for top-1) keeps the most
    sensitive layers FP32 until INT8 loses no more on ``data``; ``bias_correction`` corrects
    each layer's INT8 mean shift: ``"stored"`` derives it from the profile's per-channel means
    (a profile made with ``channel_stats=True``; no data is run), calibration data measures it.
    Data and labels are ``FILE.npz:KEY`` specs."""
    from rangeprof.workflows import quantize
    from rangeprof.workflows.requests import BuildRequest

    model = model if isinstance(model, Model) else load(model)
    folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="rangeprof-int8-"))
    folder.mkdir(parents=True, exist_ok=True)
    options = {
        "target": target,
        "method": method,
        "percentile": percentile,
        "weight_bits": weight_bits,
        "fp32_fallback": fp32_fallback,
        "accuracy_budget": accuracy_budget,
        "data": data,
        "labels": labels,
        "samples": samples,
        "bias_correction": bias_correction,
    }
    request = BuildRequest(out=folder, **_quantize_fields(model, ranges, folder, options))
    manifest = quantize.build(request)
    return Int8Model(folder, manifest, tuple(model.inputs))


def evaluate(
    model: Model | str | Path,
    ranges: Profile | QParams,
    data: str,
    *,
    labels: str | None = None,
    method: str = "max",
    **options: Any,
) -> dict:
    """FP32 against INT8 on ``data`` (``FILE.npz:KEY``; ``labels`` likewise, for top-1): the
    report of ``rangeprof evaluate --json`` — per-layer isolated and accumulated SQNR, output
    SQNR, agreement, top-1. ``method="all"`` (with a profile) tries every calibration method
    and reports the best. ``options`` are :func:`build`'s (``target``, ``percentile``,
    ``weight_bits``, ``fp32_fallback``, ``accuracy_budget``, ``samples``,
    ``bias_correction``); the evaluation request refuses any other."""
    from rangeprof.workflows import quantize
    from rangeprof.workflows.requests import EvaluateRequest

    model = model if isinstance(model, Model) else load(model)
    asked = {"data": data, "labels": labels, "method": method, **options}
    with tempfile.TemporaryDirectory(prefix="rangeprof-evaluate-") as folder:
        fields = _quantize_fields(model, ranges, Path(folder), asked)
        return quantize.evaluate(EvaluateRequest(**fields))
