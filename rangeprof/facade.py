"""The Python API: rangeprof from a notebook or a script, on arrays as well as files.

    import numpy as np
    import rangeprof

    model = rangeprof.load("digits_cnn.onnx")
    model.inputs                                   # {'image': ((1, 1, 8, 8), 'float32')}
    calib = np.load("digits.npz")["calib"]         # [N, 1, 8, 8]
    profile = rangeprof.profile(model, {"image": calib})   # or calib, batches, or a path
    profile.tensors["/conv1/Conv"].histogram       # a Histogram: counts, edges()
    qparams = profile.calibrate(method="entropy")  # a QParams, by profileID
    int8 = rangeprof.build(model, profile, target="x86", exclude=("/fc2/*",))
    logits = int8.run({"image": calib[:5]})        # the INT8 program's outputs
    int8 = rangeprof.quantize(model, calib, target="x86")  # profile, calibrate, build

Every result is a typed object over the documents the CLI writes (``.document``, ``.to_json()``,
``.save(path)``), so a notebook and ``rangeprof`` commands exchange files freely. Options are
keywords of the groups every face shares (:mod:`rangeprof.workflows.options`: their defaults,
bounds and help): an unknown or invalid one is a :class:`RangeprofError` naming it.
"""

from __future__ import annotations

import collections
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rangeprof.profiler.calibrate.records import QParamsDocument
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.records import ProfileDocument

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rangeprof.byoc.manifest import Manifest
    from rangeprof.byoc.reports import EvaluationReport
    from rangeprof.profiler.profiling.statistics import Histogram, TensorStats

Data = str | Path | np.ndarray | Mapping[str, np.ndarray] | Iterable[Any]
# What a request records as its data when the arrays are held in memory.
ARRAYS = "arrays"


def _validated(kind: type[BaseModel], fields: Mapping[str, Any]):
    """``kind`` (an option group or a request) from ``fields``; a refused value or an unknown
    name is one line naming the keyword."""
    from pydantic import ValidationError

    from rangeprof.workflows.options import refusal

    try:
        return kind.model_validate(fields)
    except ValidationError as err:
        raise refusal(err, flags=False) from None


@dataclass(frozen=True)
class Model:
    """An ONNX model loaded and checked (as ``rangeprof inspect`` loads it)."""

    path: Path
    input_shapes: dict[str, tuple[int, ...]]
    inputs: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype), as loaded

    def __repr__(self) -> str:
        inputs = ", ".join(
            f"{n} {list(shape)} {dtype}" for n, (shape, dtype) in self.inputs.items()
        )
        return f"<Model {self.path.name}: {inputs}>"

    def inspect(self) -> dict:
        """Its layers with their profileIDs and the lineage through every compiler stage (the
        document of ``rangeprof inspect --json``)."""
        from rangeprof.workflows import profiling
        from rangeprof.workflows.requests import InspectRequest

        return profiling.inspect(InspectRequest(model=self.path, input_shapes=self.input_shapes))


def load(path: str | Path, input_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Model:
    """Load the ONNX file at ``path``; ``input_shapes`` fixes symbolic input dimensions (the
    batch of a symbolic batch dimension: 1 unless given)."""
    from rangeprof.profiler.ir.onnx_load import load_model

    shapes = {name: tuple(dims) for name, dims in (input_shapes or {}).items()}
    loaded = load_model(path, shapes)
    inputs = {
        name: (tuple(shape), loaded.input_dtypes[name])
        for name, shape in loaded.input_shapes.items()
    }
    return Model(Path(path), shapes, inputs)


def _model(model: Model | str | Path) -> Model:
    return model if isinstance(model, Model) else load(model)


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
    """Quantization parameters by profileID (the QPARAMS document of ``rangeprof calibrate``):
    ``record`` is the typed document (a dict given is read into one)."""

    record: QParamsDocument

    def __post_init__(self) -> None:
        if not isinstance(self.record, QParamsDocument):
            object.__setattr__(self, "record", QParamsDocument.from_json(self.record))

    @property
    def document(self) -> dict:
        """The QPARAMS document (a new dict each time)."""
        return self.record.to_json()

    def __repr__(self) -> str:
        options = self.record.options
        made = ", ".join(str(v) for v in (options.method, options.target) if v)
        return (
            f"<QParams {made}, {options.scheme} {options.dtype}: "
            f"{len(self.record.qparams)} tensors>"
        )

    def __getitem__(self, profile_id: str) -> dict:
        return self.record[profile_id].to_json()

    def to_json(self) -> str:
        return self.record.dumps()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


@dataclass(frozen=True)
class Profile:
    """A profile: every tensor's statistics by profileID, with the model's lineage. ``record``
    is the typed document (a dict given is read into one)."""

    record: ProfileDocument
    tensors: dict[str, TensorProfile] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from rangeprof.profiler.profiling.statistics import TensorStats

        if not isinstance(self.record, ProfileDocument):
            object.__setattr__(self, "record", ProfileDocument.from_json(self.record))
        tensors = {
            entry.profile_id: TensorProfile(
                entry.profile_id,
                entry.kind,
                entry.op,
                entry.source_node,
                entry.shape,
                entry.dtype,
                TensorStats.from_json(entry.to_json()),
            )
            for entry in self.record.tensors
        }
        object.__setattr__(self, "tensors", tensors)

    @property
    def document(self) -> dict:
        """The profile document (a new dict each time)."""
        return self.record.to_json()

    def __repr__(self) -> str:
        name, samples = self.record.model.name, self.record.run.samples
        return f"<Profile {name}: {len(self.tensors)} tensors, {samples} samples>"

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile JSON file (``rangeprof profile --out``), checked against its schema."""
        return cls(ProfileDocument.from_json(Path(path)))

    def calibrate(self, **options: Any) -> QParams:
        """Qparams from the stored statistics, the document ``rangeprof calibrate`` writes and a
        build on the same target derives: ``options`` are
        :class:`~rangeprof.workflows.options.CalibrationOptions` (``target``, ``method``,
        ``percentile``; ``scheme``, ``dtype``, ``granularity``, ``power_of_two`` the target's
        unless given)."""
        from rangeprof.workflows.options import CalibrationOptions
        from rangeprof.workflows.profiling import calibrate_profile

        chosen = _validated(CalibrationOptions, options)
        return QParams(QParamsDocument.model_validate(calibrate_profile(self.record, chosen)))

    def export(
        self,
        fmt: str,
        path: str | Path,
        *,
        model: Model | str | Path | None = None,
        evaluation: EvaluationReport | dict | str | Path | None = None,
        **options: Any,
    ) -> None:
        """Write the profile in format ``fmt`` to ``path``, as ``rangeprof export`` does: ``aimet``,
        ``ort``, ``ort-json``, ``tensorrt`` (calibration tables), ``qdq`` (the profiled
        ``model`` with QuantizeLinear / DequantizeLinear pairs) or ``model-explorer`` (a folder
        of Model Explorer overlays of the ``model``; SQNR and kept-FP32 figures with an
        ``evaluation``, a report of ``rangeprof evaluate --json`` or its file). ``options`` are
        :class:`~rangeprof.workflows.options.CalibrationOptions`, as for :meth:`calibrate`."""
        from rangeprof.workflows import profiling
        from rangeprof.workflows.options import CalibrationOptions

        activations, _ = profiling.calibration_options(_validated(CalibrationOptions, options))
        source = Path(model.path if isinstance(model, Model) else model) if model else None
        report = None if evaluation is None else profiling.evaluation_report(evaluation)
        exported = profiling.render_export(self.record, fmt, activations, source, report)
        profiling.write_export(Path(path), exported)

    def to_json(self) -> str:
        return self.record.dumps()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def profile(
    model: Model | str | Path,
    data: Data,
    *,
    progress: Callable[[int, int | None], None] | None = None,
    **options: Any,
) -> Profile:
    """Run ``data`` through the instrumented FP32 model and record every tensor's statistics.

    ``data`` is a ``--data`` spec or path (``FILE.npz[:KEY]``, ``FILE.npy``, an image folder,
    ``"random"``), a dict of arrays ``{input: [N, *sample_shape]}`` (one array for a
    single-input model), or an iterable of such dicts or arrays: batches of any size, as a
    PyTorch ``DataLoader`` yields them (tensors convert through ``numpy()``), read once.
    ``options`` are :class:`~rangeprof.workflows.options.ProfileOptions` (``bins``,
    ``batch_size``, ``samples``, ``seed``, ``equalize``, ``channel_stats``, ...).
    ``progress(done, total)`` gets the samples done (``total`` is ``None`` for an iterable of
    unknown length)."""
    from rangeprof.workflows import profiling
    from rangeprof.workflows.options import ProfileOptions
    from rangeprof.workflows.requests import ProfileRequest

    chosen = _validated(ProfileOptions, options)
    # A path is loaded once, by the profiling run itself.
    path, shapes = (model.path, model.input_shapes) if isinstance(model, Model) else (model, {})
    held = not isinstance(data, str | Path)
    fields = {"model": path, "data": ARRAYS if held else str(data), "input_shapes": shapes}
    request = _validated(ProfileRequest, {**fields, **chosen.model_dump()})
    return Profile(profiling.profile(request, progress, arrays=data if held else None))


@dataclass(eq=False)
class Int8Model:
    """A built INT8 program: ``folder`` holds ``model.so`` and ``manifest.json``; ``inputs`` are
    the built ones, ``{name: (shape, dtype)}``."""

    folder: Path
    manifest: Manifest
    inputs: dict[str, tuple[tuple[int, ...], str]]
    _main: Any = field(default=None, init=False, repr=False)  # loaded on the first run

    @classmethod
    def load(cls, folder: str | Path) -> Int8Model:
        """The build in ``folder`` (``rangeprof build --out``): its ``manifest.json`` read and
        checked, its ``model.so`` loaded on the first run."""
        from rangeprof.byoc.manifest import Manifest

        return cls.of(Path(folder), Manifest.from_json(Path(folder) / "manifest.json"))

    @classmethod
    def of(cls, folder: Path, manifest: Manifest) -> Int8Model:
        """The build in ``folder`` whose manifest is ``manifest``."""
        inputs = {n: (tuple(spec.shape), spec.dtype) for n, spec in manifest.inputs.items()}
        return cls(folder, manifest, inputs)

    def __repr__(self) -> str:
        regions = self.manifest.regions
        # By mode, most first: a 4-bit build's dense layers are w4, not "not INT8".
        modes = collections.Counter(r.mode for r in regions).most_common()
        held = ", ".join(f"{count} {mode}" for mode, count in modes)
        target = self.manifest.target
        return f"<Int8Model {target} in {self.folder}: {len(regions)} regions, {held}>"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self.inputs)

    @property
    def batch(self) -> int | None:
        """The built batch: dim 0 of the first input (``None`` for a scalar one)."""
        shape, _ = next(iter(self.inputs.values()), ((), None))
        return shape[0] if shape else None

    def run(self, inputs: Mapping[str, Any] | Any) -> list[np.ndarray]:
        """The program's outputs for ``inputs`` (arrays by name, or the one array of a
        one-input model) of any number of samples: fewer than the built batch are padded (with
        the last sample) and the outputs cut back to them, more run a batch at a time. Arrays
        of another dtype cast to the input's when numpy casts them within their kind or up
        (float64, integers to float32); anything else is a :class:`RangeprofError`."""
        arrays = self._arrays(inputs)
        count, batch = self._samples(arrays), self.batch
        if count is None or count == batch:
            return self._call(arrays)
        runs = []
        for start in range(0, count, batch):
            part = {
                name: _rows(array, start, batch) if self._batched(name) else array
                for name, array in arrays.items()
            }
            runs.append(self._call(part))
        return _joined(runs, count, batch)

    def _batched(self, name: str) -> bool:
        shape, _ = self.inputs[name]
        return bool(shape) and shape[0] == self.batch

    def _arrays(self, inputs) -> dict[str, np.ndarray]:
        """``inputs`` by name, checked for names and dtypes and cast to the inputs'."""
        names = ", ".join(map(repr, self.inputs))
        if not isinstance(inputs, Mapping):
            if len(self.inputs) != 1:
                raise RangeprofError(f"the model has inputs {names}: give arrays by name")
            inputs = {self.input_names[0]: inputs}
        missing = [n for n in self.inputs if n not in inputs]
        unknown = [n for n in inputs if n not in self.inputs]
        if missing or unknown:
            problem = (
                f"no array for input {missing[0]!r}" if missing else f"no input {unknown[0]!r}"
            )
            raise RangeprofError(f"{problem} (the model's inputs: {names})")
        arrays = {}
        for name, (shape, dtype) in self.inputs.items():
            array = np.asarray(inputs[name])
            if not np.can_cast(array.dtype, dtype, "same_kind"):
                raise RangeprofError(
                    f"input {name!r}: dtype {array.dtype} does not cast safely to the built "
                    f"{dtype} (shape {list(shape)})"
                )
            arrays[name] = array.astype(dtype, copy=False)
            self._check_indices(name, arrays[name])
        return arrays

    def _check_indices(self, name: str, array: np.ndarray) -> None:
        """Refuses token ids outside the table the input indexes (the build would clip them)."""
        from rangeprof.profiler.ir.index_inputs import IndexUse

        index = self.manifest.inputs[name].index
        if index is None:
            return
        rows = array.reshape(len(array) if array.ndim else 1, -1)
        found = IndexUse(index.extent, index.node).refusal(name, rows)
        if found is not None:
            raise RangeprofError(f"sample {found[0]} {found[1]}")

    def _samples(self, arrays: dict[str, np.ndarray]) -> int | None:
        """How many samples ``arrays`` hold along the built batch (``None``: no batch)."""
        counts = set()
        for name, (shape, _) in self.inputs.items():
            got = arrays[name].shape
            if self._batched(name):
                if len(got) == len(shape) and got[1:] == shape[1:] and got[0] > 0:
                    counts.add(got[0])
                    continue
                takes = f"[N, {', '.join(map(str, shape[1:]))}] (built {list(shape)})"
            elif got == shape:
                continue
            else:
                takes = f"its built shape {list(shape)}"
            raise RangeprofError(
                f"input {name!r}: shape {list(got)} does not fit: it takes {takes}"
            )
        if len(counts) > 1:
            raise RangeprofError(f"the inputs hold different sample counts: {sorted(counts)}")
        return counts.pop() if counts else None

    def _call(self, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One run of the program on arrays of exactly the built shapes."""
        import tvm

        args = [tvm.runtime.tensor(np.ascontiguousarray(arrays[n])) for n in self.inputs]
        result = self._program()(*args)
        if isinstance(result, tvm.runtime.Tensor):
            return [result.numpy()]
        return [item.numpy() for item in result]

    def _program(self):
        if self._main is None:
            import tvm
            from tvm import relax

            from rangeprof.byoc.plugin import get_plugin
            from rangeprof.profiler.compile.threads import vm_function

            if not get_plugin(self.manifest.target).runs_here:
                raise RangeprofError(
                    f"this {self.manifest.target} build runs on its target, not on this host: "
                    f"deploy {self.folder / self.manifest.library} there"
                )
            library = tvm.runtime.load_module(str(self.folder / self.manifest.library))
            self._main = vm_function(relax.VirtualMachine(library, tvm.cpu()))
        return self._main


def _rows(array: np.ndarray, start: int, batch: int) -> np.ndarray:
    """Rows ``start`` to ``start + batch`` of ``array``, padded with copies of its last row."""
    rows = array[start : start + batch]
    if len(rows) == batch:
        return rows
    return np.concatenate([rows, np.repeat(rows[-1:], batch - len(rows), axis=0)])


def _joined(runs: list[list[np.ndarray]], count: int, batch: int) -> list[np.ndarray]:
    """The outputs of runs of ``batch`` samples each, as one run of ``count`` samples."""
    joined = []
    for k, parts in enumerate(zip(*runs, strict=True)):
        if any(not p.shape or p.shape[0] != batch for p in parts):
            raise RangeprofError(
                f"output {k} has no batch axis: run at most {batch} samples at a time"
            )
        joined.append(np.concatenate(parts)[:count])
    return joined


def _held(value):
    """A data argument as the request records it (a file spec, or ``ARRAYS``) and the data held
    in memory (``None`` for a file): an iterable of batches is read once, into a list, since
    an evaluation reads its data more than once."""
    if value is None or isinstance(value, str | Path):
        return (None if value is None else str(value)), None
    if isinstance(value, Mapping | np.ndarray) or not isinstance(value, Iterable):
        return ARRAYS, value
    return ARRAYS, list(value)


def _labels(labels, any_shape: bool) -> tuple[str | None, np.ndarray | None]:
    """Labels as the request records them (a file spec) or held: 1-D integers for top-1;
    with another metric (``any_shape``), anything it reads with a sample axis."""
    if labels is None or isinstance(labels, str | Path):
        return (None if labels is None else str(labels)), None
    array = np.asarray(labels)
    if not any_shape and (array.ndim != 1 or array.dtype.kind not in "iu"):
        raise RangeprofError(
            f"labels of shape {list(array.shape)} and dtype {array.dtype}: top-1 takes a 1-D "
            "integer array (a metric takes any)"
        )
    if array.ndim == 0:
        raise RangeprofError("labels: an array with a sample axis, not a scalar")
    return None, array


def _quantize_request(
    kind: type[BaseModel], model: Model, ranges: Profile | QParams, options: BaseModel, **fields
):
    """The build or evaluation request of ``model`` with ``ranges`` (held in memory: the
    request names them :data:`~rangeprof.workflows.quantize.HELD`) and the validated
    ``options``."""
    from rangeprof.workflows.quantize import HELD

    source = "profile" if isinstance(ranges, Profile) else "qparams"
    common = {"model": model.path, source: HELD, "input_shapes": model.input_shapes}
    return _validated(kind, {**common, **options.model_dump(), **fields})


def _named_metric(metric, options: dict) -> tuple[Callable | None, dict]:
    """A metric given by name (``"bpc"``, ``"top1"``) is the ``metric`` option; a callable
    stays the caller's own."""
    if isinstance(metric, str):
        return None, {**options, "metric": metric}
    return metric, options


def _held_data(ranges: Profile | QParams, data, labels, calibration_data, metric, chosen):
    """The request's data fields and what the Python API holds in memory instead of files:
    the data and the ``ranges`` (``chosen``: the options, whose metric says what labels are)."""
    from rangeprof.workflows.quantize import Held

    if not isinstance(ranges, Profile | QParams):
        raise RangeprofError(f"ranges of type {type(ranges).__name__}: give a Profile or QParams")
    if metric is not None and not callable(metric):
        raise RangeprofError(f"metric: {type(metric).__name__} is not callable")
    any_labels = metric is not None or chosen.metric == "bpc"
    (data_spec, data), (labels_spec, labels) = _held(data), _labels(labels, any_labels)
    calibration_spec, calibration = _held(calibration_data)
    fields = {"data": data_spec, "labels": labels_spec, "calibration_data": calibration_spec}
    profile = ranges.record if isinstance(ranges, Profile) else None
    qparams = ranges.record if isinstance(ranges, QParams) else None
    return fields, Held(data, labels, calibration, metric, profile, qparams)


def build(
    model: Model | str | Path,
    ranges: Profile | QParams,
    *,
    out: str | Path | None = None,
    data: Data | None = None,
    labels: str | Path | np.ndarray | None = None,
    calibration_data: Data | None = None,
    metric: Callable[[np.ndarray, np.ndarray | None], float] | str | None = None,
    **options: Any,
) -> Int8Model:
    """Quantize the model with ``ranges`` (a profile, calibrated with the target's policy, or
    qparams) and compile it into ``out`` (by default a temporary folder, removed with the
    returned model or at exit). ``options`` are
    :class:`~rangeprof.workflows.options.QuantizeOptions` (``target``, ``method``, ``exclude``,
    ``accuracy_budget``, ``bias_correction``, ...).

    ``accuracy_budget`` is measured on ``data`` (with ``labels``: top-1 points), or with a
    ``metric(outputs, labels) -> float`` (points, higher is better; ``outputs`` the first output
    of every sample) in its points, or a built-in one by name (``"bpc"``: bits per character
    of a language model's logits at the next tokens, in % of FP32's).
    ``bias_correction="measured"`` runs ``calibration_data``. Data are files (``FILE.npz:KEY``)
    or arrays as :func:`profile` takes them, labels a file or an array."""
    from rangeprof.workflows import quantize
    from rangeprof.workflows.options import QuantizeOptions
    from rangeprof.workflows.requests import BuildRequest

    metric, options = _named_metric(metric, options)
    chosen = _validated(QuantizeOptions, options)
    if metric is not None and chosen.accuracy_budget is None:
        raise RangeprofError("metric: a build measures it for an accuracy_budget alone")
    model = _model(model)
    fields, held = _held_data(ranges, data, labels, calibration_data, metric, chosen)
    temporary = out is None
    folder = Path(tempfile.mkdtemp(prefix="rangeprof-int8-")) if temporary else Path(out)
    try:
        request = _quantize_request(BuildRequest, model, ranges, chosen, out=folder, **fields)
        manifest = quantize.build(request, held=held)
    except BaseException:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    int8 = Int8Model.of(folder, manifest)
    if temporary:
        weakref.finalize(int8, shutil.rmtree, folder, ignore_errors=True)
    return int8


def evaluate(
    model: Model | str | Path,
    ranges: Profile | QParams,
    data: Data,
    *,
    labels: str | Path | np.ndarray | None = None,
    calibration_data: Data | None = None,
    metric: Callable[[np.ndarray, np.ndarray | None], float] | str | None = None,
    **options: Any,
) -> EvaluationReport:
    """FP32 against INT8 on ``data`` (a file, ``FILE.npz:KEY``, or arrays as :func:`profile`
    takes them; ``labels`` a file or an array, for top-1): the report of ``rangeprof evaluate
    --json`` — per-layer isolated and accumulated SQNR, output SQNR, agreement, top-1, and
    ``fp32_metric`` / ``int8_metric`` with a ``metric(outputs, labels) -> float`` (points,
    higher is better; ``outputs`` the first output of every sample) or a built-in one by name
    (``"bpc"``), which an ``accuracy_budget`` then reads. ``options`` are
    :class:`~rangeprof.workflows.options.QuantizeOptions`; ``method="all"`` (with a profile)
    tries every calibration method and reports the best."""
    from rangeprof.workflows import quantize
    from rangeprof.workflows.options import QuantizeOptions
    from rangeprof.workflows.requests import EvaluateRequest

    metric, options = _named_metric(metric, options)
    chosen = _validated(QuantizeOptions, options)
    model = _model(model)
    if data is None:
        raise RangeprofError("data: an evaluation runs data")
    fields, held = _held_data(ranges, data, labels, calibration_data, metric, chosen)
    request = _quantize_request(EvaluateRequest, model, ranges, chosen, **fields)
    return quantize.evaluate(request, held=held)


def quantize(
    model: Model | str | Path,
    data: Data,
    *,
    out: str | Path | None = None,
    evaluation_data: Data | None = None,
    labels: str | Path | np.ndarray | None = None,
    metric: Callable[[np.ndarray, np.ndarray | None], float] | str | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    **options: Any,
) -> Int8Model:
    """The INT8 model in one call: :func:`profile` on ``data``, then :func:`build` of that
    profile (its calibration by the target's policy). ``options`` are those of both groups,
    :class:`~rangeprof.workflows.options.ProfileOptions` and
    :class:`~rangeprof.workflows.options.QuantizeOptions` (``samples`` is the profile's);
    ``bias_correction="stored"`` profiles per-channel statistics unless ``channel_stats`` says
    otherwise, ``"measured"`` runs ``data`` again. An ``accuracy_budget`` is measured on
    ``evaluation_data`` with ``labels`` or a ``metric``, as :func:`build` does."""
    from rangeprof.workflows.options import MEASURED, STORED, ProfileOptions, QuantizeOptions

    profiling = {k: v for k, v in options.items() if k in ProfileOptions.model_fields}
    building = {k: v for k, v in options.items() if k not in profiling}
    chosen = _validated(QuantizeOptions, building)  # refused before the profiling run
    if chosen.bias_correction == STORED:
        profiling.setdefault("channel_stats", True)
    model = _model(model)
    measured = chosen.bias_correction == MEASURED
    if measured:
        _, held = _held(data)
        data = data if held is None else held  # read twice: an iterable is held
    profiled = profile(model, data, progress=progress, **profiling)
    return build(
        model,
        profiled,
        out=out,
        data=evaluation_data,
        labels=labels,
        calibration_data=data if measured else None,
        metric=metric,
        **building,
    )
