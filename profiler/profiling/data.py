"""Calibration data for profiling: the samples fed to the model while its ranges are recorded.

Sources (the ``--data`` value)
    ``FILE.npz``
        One array per model input, each ``[N, *sample_shape]`` where ``sample_shape`` is the
        input's shape without its batch dim. Without keys, the arrays named like the model's
        inputs are used; arrays named otherwise are refused, naming the arrays and the inputs
        (a single array is not guessed to be a single input's: ``FILE.npz:KEY`` says so).
    ``FILE.npz:KEY`` / ``FILE.npz:KEY1,KEY2``
        The named arrays, one per model input in input order.
    ``FILE.npy``
        The one array of a single-input model, memory-mapped.
    ``FOLDER``
        The ``.bmp``, ``.jpeg``, ``.jpg`` and ``.png`` files in it (not its subfolders), sorted by
        name, for a single image input; see :class:`Preprocess`. Only here does a preprocessing
        spec apply.
    ``random``
        Seeded standard-normal data for float inputs, uniform integers in ``[0, 100)`` for integer
        inputs (below ``n`` for one that indexes an axis of ``n``), 0/1 for bool inputs; 8
        samples unless told otherwise.

Per-sample and constant inputs
    An input is per-sample by default: its array holds samples along axis 0, batched to the
    model's batch dim. A *constant* input (``constant`` of :func:`model_inputs`; the CLI's
    ``--constant-input NAME``) is fed whole, the same array in every run: its array has the
    input's full shape. Scalar inputs are always constant (they have no sample axis), and so are
    state tensors, masks or lengths a model takes once per run. The sample count comes from the
    per-sample inputs; when every input is constant the data is one run.

Checks (before any work: :meth:`CalibrationData.verify` reads a file's samples through once,
a few MB at a time; an iterable's batches are checked as they arrive, before they run)
    * Data must fit its input's kind: floats for a float input (float64 -> float32 casts),
      integers for an integer input (int32 -> int64 casts; so does bool), bools for a bool
      input. Integers for a float input or floats for an integer one are refused, naming the
      array's dtype and the input's, unless ``cast`` (``--cast``) converts them.
    * NaN and infinity in data for a float input are refused, naming the array and its first
      such sample, unless ``allow_nonfinite`` (``--allow-nonfinite``) lets them through: the
      profile then counts them per tensor (``nan_count``, ``inf_count``). A finite value past
      the input dtype's range (float64 1e39 for float32) counts as infinity. Integer inputs
      never take NaN or infinity, cast or not.
    * An integer input that a Gather reads as indices (token ids; ``index`` of
      :class:`InputSpec`, :mod:`rangeprof.profiler.ir.index_inputs`) takes values in ``[-n, n)``
      only, ``n`` the gathered axis' extent: another is refused by its sample and position.
    * Refusals of what the data holds are :class:`DataContentError`: the service answers them
      with 422, other problems of a data source with 400.

Choices
    * Pickles are never loaded: arrays of Python objects are rejected.
    * ``samples`` takes the first samples of the source; more than it holds is clamped, and
      ``num_samples`` says how many there are.
    * ``batches()`` yields full batches and, when the batch size does not divide the sample
      count, a smaller last one: the caller compiles for that size too, or pads.
    * Streaming: ``batches()`` reads one batch at a time (an ``.npy`` through a memory map, an
      ``.npz`` member through the zip stream, images file by file), so only one batch is ever
      held in memory. For that, ``.npz`` arrays must be stored in C order (``np.savez``'s
      default).
    * The same spec, options and seed give the same batches, and the samples do not depend on
      the batch size.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal, get_args

import numpy as np
from PIL import Image

from rangeprof.profiler.errors import CalibrationDataError
from rangeprof.profiler.ir.index_inputs import IndexUse

if TYPE_CHECKING:
    from rangeprof.profiler.ir.onnx_load import ModelFacts

RANDOM = "random"
RANDOM_SAMPLES = 8
IMAGE_SUFFIXES = (".bmp", ".jpeg", ".jpg", ".png")

Layout = Literal["NCHW", "NHWC"]
Channels = Literal["RGB", "BGR", "L"]

# What reading a broken .npy header or a broken zip member can raise.
_READ_ERRORS = (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error)
_SCAN_BYTES = 8 << 20  # read at a time by CalibrationData.verify
# dtype kinds and the kinds of data that fit them without a cast
_FITS = {"f": "f", "i": "iub", "u": "iub", "b": "b"}


class DataContentError(CalibrationDataError):
    """Data refused for what it holds (NaN or infinity, a dtype that does not fit its input,
    arrays not named like the inputs), not for how it is stored."""


@dataclass(frozen=True)
class Checks:
    """What the data checks let through (see "Checks" in the module docstring)."""

    allow_nonfinite: bool = False
    cast: bool = False


@dataclass(frozen=True)
class InputSpec:
    """A model input as loaded: dim 0 of ``shape`` is the batch."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    constant: bool = False  # fed whole in every run (see the module docstring)
    index: IndexUse | None = None  # the axis an integer input indexes: its values' range

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return self.shape if self.constant else self.shape[1:]

    def as_one_sample(self) -> InputSpec:
        """A per-sample input whose one sample is this input's whole array."""
        return InputSpec(self.name, (1, *self.shape), self.dtype, index=self.index)


def model_inputs(model: ModelFacts, constant: Iterable[str] = ()) -> list[InputSpec]:
    """The inputs of a loaded model, in the model's order; ``constant`` names the inputs fed
    whole in every run (scalars and value inputs always are)."""
    constant = set(constant)
    unknown = sorted(constant - set(model.input_shapes))
    if unknown:
        raise CalibrationDataError(
            f"no input named {', '.join(map(repr, unknown))} to feed as a constant; the model's "
            f"inputs are {', '.join(map(repr, model.input_shapes))}"
        )
    constant |= set(model.value_inputs)
    return [
        InputSpec(
            name,
            shape,
            model.input_dtypes[name],
            name in constant or not shape,
            model.index_uses.get(name),
        )
        for name, shape in model.input_shapes.items()
    ]


def sample_batch(inputs: Sequence[InputSpec]) -> int:
    """The model's batch: dim 0 of its first per-sample input (1 when every input is
    constant)."""
    return next((inp.shape[0] for inp in inputs if not inp.constant), 1)


@dataclass(frozen=True)
class Preprocess:
    """How an image becomes a sample: resized to ``size`` (bilinear, aspect ratio not kept),
    converted to ``channels``, then ``(pixel * scale - mean) / std`` per channel, laid out as
    ``layout``."""

    size: tuple[int, int] | None = None  # (H, W); None: the model input's
    mean: tuple[float, ...] = (0.0,)  # one value for all channels, or one per channel
    std: tuple[float, ...] = (1.0,)
    scale: float = 1 / 255
    layout: Layout = "NCHW"
    channels: Channels | None = None  # None: L for a 1-channel input, RGB for a 3-channel one

    def __post_init__(self) -> None:
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise CalibrationDataError(
                f"preprocessing size {self.size} is not two positive dims (H, W)"
            )
        if not self.mean or not self.std:
            raise CalibrationDataError("preprocessing mean and std need at least one value")
        if 0 in self.std:
            raise CalibrationDataError(f"preprocessing std {self.std} contains zero")
        if self.layout not in get_args(Layout):
            raise CalibrationDataError(
                f"preprocessing layout {self.layout!r} is not one of {', '.join(get_args(Layout))}"
            )
        if self.channels not in (None, *get_args(Channels)):
            raise CalibrationDataError(
                f"preprocessing channels {self.channels!r} is not one of "
                f"{', '.join(get_args(Channels))}"
            )


def parse_preprocess(text: str) -> Preprocess:
    """Parse a CLI value such as ``size=48x192,mean=0.5,0.5,0.5,std=0.5,0.5,0.5,layout=NCHW``.

    Keys are the fields of :class:`Preprocess`; ``scale`` may be a fraction (``1/255``). An item
    without ``=`` continues the list of the key before it, as mean and std take several values.
    """
    keys = [f.name for f in fields(Preprocess)]

    def fail(problem: str) -> CalibrationDataError:
        return CalibrationDataError(f"malformed preprocessing spec {text!r}: {problem}")

    items: dict[str, list[str]] = {}
    key = None
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if sep:
            key = name.strip()
            if key not in keys:
                raise fail(f"unknown key {key!r}; keys are {', '.join(keys)}")
            if key in items:
                raise fail(f"{key} given twice")
            items[key] = [value.strip()]
        elif key is None:
            raise fail("expected KEY=VALUE items separated by ','")
        else:
            items[key].append(item.strip())

    values: dict[str, object] = {}
    for key, parts in items.items():
        if key not in ("mean", "std") and len(parts) > 1:
            raise fail(f"{key} takes one value, got {','.join(parts)!r}")
        try:
            if key == "size":
                height, width = (int(d) for d in parts[0].split("x"))
                values[key] = (height, width)
            elif key in ("mean", "std"):
                values[key] = tuple(float(p) for p in parts)
            elif key == "scale":
                values[key] = float(Fraction(parts[0]))
            else:
                values[key] = parts[0].upper()
        except (ValueError, ZeroDivisionError):
            hint = "HxW, e.g. 48x192" if key == "size" else "numbers"
            raise fail(f"{key}={','.join(parts)!r} is not {hint}") from None
    return Preprocess(**values)


# A reader yields an input's batches for (sample count, batch size), already cast.
Reader = Callable[[int, int], Iterator[np.ndarray]]


@dataclass(frozen=True)
class CalibrationData:
    """Calibration samples ready to be fed batch by batch (see the module docstring)."""

    num_samples: int
    batch_size: int
    readers: dict[str, Reader] = field(repr=False)  # by input name, in input order
    # The model's value inputs (rangeprof.profiler.ir.onnx_load): bound, not fed.
    value_inputs: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()  # inputs whose data the checks may refuse (files, arrays)
    scan_batch: int = 1  # samples per read of verify()

    @property
    def num_batches(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def bound_values(self) -> dict[str, np.ndarray]:
        """The value inputs' arrays, which the model is loaded with."""
        return {name: next(self.readers[name](1, 1)) for name in self.value_inputs}

    def verify(self) -> None:
        """Reads the samples of the checked inputs through once, a few MB at a time, so that
        data the checks refuse fails before any work (a compile, a stored run)."""
        for name in self.checked:
            for _ in self.readers[name](self.num_samples, self.scan_batch):
                pass

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        """One ``{input name: array}`` per batch; arrays are C-contiguous, of the input's dtype,
        with ``batch_size`` rows (the last batch may have fewer)."""
        streams = [read(self.num_samples, self.batch_size) for read in self.readers.values()]
        for arrays in zip(*streams, strict=True):
            yield dict(zip(self.readers, arrays, strict=True))


def open_data(
    spec: str,
    inputs: Sequence[InputSpec],
    *,
    batch_size: int = 1,
    samples: int | None = None,
    seed: int = 0,
    preprocess: Preprocess | None = None,
    allow_nonfinite: bool = False,
    cast: bool = False,
) -> CalibrationData:
    """Open the calibration source ``spec`` (see the module docstring) for a model's inputs;
    :meth:`CalibrationData.verify` checks the samples before any work."""
    _check_counts(batch_size, samples)
    if seed < 0:
        raise CalibrationDataError(f"seed {seed} is negative")
    checks = Checks(allow_nonfinite, cast)
    checked = False  # generated data and images hold nothing the checks refuse
    if spec == RANDOM:
        _no_preprocess(spec, preprocess)
        available, readers = samples or RANDOM_SAMPLES, _random(inputs, seed)
    else:
        path, keys = _split_spec(spec)
        if not path.exists():
            raise CalibrationDataError(f"{path}: no such file or folder")
        if path.is_dir() and keys is None:
            available, readers = _images(path, inputs, preprocess or Preprocess(), checks)
        elif path.suffix.lower() == ".npz":
            _no_preprocess(spec, preprocess)
            available, readers = _npz(path, keys, inputs, checks)
            checked = True
        elif path.suffix.lower() == ".npy":
            _no_preprocess(spec, preprocess)
            available, readers = _npy(path, inputs, checks)
            checked = True
        else:
            raise CalibrationDataError(
                f"{path}: unknown data source; expected an .npz or .npy file, a folder of "
                f"images or {RANDOM!r}"
            )
    if all(inp.constant for inp in inputs):
        available, batch_size = 1, 1  # one run of the constant arrays
    count = available if samples is None else min(samples, available)
    names = tuple(readers) if checked else ()
    return CalibrationData(count, batch_size, readers, checked=names, scan_batch=_scan(inputs))


def _scan(inputs: Sequence[InputSpec]) -> int:
    """Samples per read of :meth:`CalibrationData.verify`: a few MB of the largest input."""
    largest = max(
        (np.dtype(i.dtype).itemsize * math.prod(i.sample_shape) for i in inputs), default=1
    )
    return max(1, _SCAN_BYTES // max(1, largest))


def open_arrays(
    source: Mapping[str, np.ndarray] | np.ndarray | Iterable,
    inputs: Sequence[InputSpec],
    *,
    batch_size: int = 1,
    samples: int | None = None,
    allow_nonfinite: bool = False,
    cast: bool = False,
) -> CalibrationData | StreamedData:
    """Calibration data the caller holds in memory (the Python API's ``data``), checked as
    files are (see "Checks" in the module docstring).

    ``source`` is ``{input name: array [N, *sample_shape]}``, the one array of a single-input
    model, or an iterable of such batches, of any sizes (a PyTorch ``DataLoader``: anything
    ``np.asarray`` takes is an array; a tuple or list gives the inputs in order, and items past
    them, labels say, are ignored). An iterable is read once, as it yields, regrouped into
    ``batch_size`` batches. Inputs fed whole (constants, value inputs) need a file source."""
    fed = [i for i in inputs if not i.constant]
    if len(fed) != len(inputs):
        whole = ", ".join(repr(i.name) for i in inputs if i.constant)
        raise CalibrationDataError(
            f"inputs {whole} are fed whole in every run: give the data as an .npz file"
        )
    _check_counts(batch_size, samples)
    checks = Checks(allow_nonfinite, cast)
    if isinstance(source, Mapping | np.ndarray):
        arrays = _named(source, fed, "the data")
        counts = {_check_array(f"array {i.name!r}", arrays[i.name].shape,
                               arrays[i.name].dtype, i, checks) for i in fed}  # fmt: skip
        if len(counts) != 1:
            raise CalibrationDataError(f"the arrays hold different sample counts: {sorted(counts)}")
        (available,) = counts
        readers = {i.name: _array_reader(arrays[i.name], i, checks) for i in fed}
        count = available if samples is None else min(samples, available)
        return CalibrationData(
            count, batch_size, readers, checked=tuple(readers), scan_batch=_scan(fed)
        )
    if not isinstance(source, Iterable) or isinstance(source, str | bytes):
        raise CalibrationDataError(
            f"data of type {type(source).__name__}: give a dict of arrays, an array, an "
            "iterable of batches, or a file"
        )
    return StreamedData(source, tuple(fed), batch_size, samples, checks=checks)


@dataclass(frozen=True)
class StreamedData:
    """Batches from an iterable the caller holds: their number is known once it is read."""

    source: Iterable = field(repr=False)
    inputs: tuple[InputSpec, ...]
    batch_size: int
    limit: int | None  # samples to read at most
    value_inputs: tuple[str, ...] = ()
    num_samples: None = None  # unknown until read
    checks: Checks = Checks()

    def bound_values(self) -> dict[str, np.ndarray]:
        return {}

    def verify(self) -> None:
        """Nothing to read ahead: each batch is checked as it arrives, before it runs."""

    def batches(self) -> Iterator[dict[str, np.ndarray]]:
        """``batch_size`` samples at a time (the last batch may have fewer), each source batch
        checked and cast to the inputs' dtypes as it arrives; at most ``limit`` in all."""
        held: list[dict[str, np.ndarray]] = []
        count = sent = 0
        for k, item in enumerate(self.source):
            arrays = _named(item, self.inputs, f"batch {k}")
            rows = {_check_array(f"batch {k}, input {i.name!r}", arrays[i.name].shape,
                                 arrays[i.name].dtype, i, self.checks)
                    for i in self.inputs}  # fmt: skip
            if len(rows) != 1:
                raise CalibrationDataError(f"batch {k}: inputs of different sample counts")
            arrays = {
                i.name: _fed(arrays[i.name], i, f"batch {k}", 0, self.checks) for i in self.inputs
            }
            held.append(arrays)
            count += rows.pop()
            while count >= self.batch_size:
                batch, held, count = _split(held, self.batch_size, self.inputs)
                if self.limit is not None and sent + self.batch_size >= self.limit:
                    yield _first(batch, self.limit - sent, self.inputs)
                    return
                sent += self.batch_size
                yield batch
        if count:
            batch, _, _ = _split(held, count, self.inputs)
            yield _first(batch, count if self.limit is None else self.limit - sent, self.inputs)


def _named(item, inputs: Sequence[InputSpec], what: str) -> dict[str, np.ndarray]:
    """``item`` (a dict, an array, or a tuple / list in input order) as arrays by input name."""
    if isinstance(item, Mapping):
        missing = [i.name for i in inputs if i.name not in item]
        if missing:
            raise CalibrationDataError(
                f"{what}: no array for input {', '.join(map(repr, missing))} (has "
                f"{', '.join(map(repr, item))})"
            )
        return {i.name: np.asarray(item[i.name]) for i in inputs}
    if isinstance(item, tuple | list):
        if len(item) < len(inputs):
            raise CalibrationDataError(
                f"{what}: {len(item)} arrays for {len(inputs)} inputs "
                f"({', '.join(repr(i.name) for i in inputs)})"
            )
        return {i.name: np.asarray(value) for i, value in zip(inputs, item, strict=False)}
    return {_only_input(what, inputs).name: np.asarray(item)}


def _split(held: list[dict], size: int, inputs: Sequence[InputSpec]):
    """The first ``size`` samples of the held chunks, and what is left of them (views: only the
    batch is copied, so a big chunk fed in small batches is not copied again for each)."""
    name = inputs[0].name
    taken, left, need = [], [], size
    for chunk in held:
        rows = len(chunk[name])
        if need >= rows:
            taken.append(chunk)
        elif need:
            taken.append({k: v[:need] for k, v in chunk.items()})
            left.append({k: v[need:] for k, v in chunk.items()})
        else:
            left.append(chunk)
        need = max(need - rows, 0)
    batch = {i.name: _cast(np.concatenate([t[i.name] for t in taken]), i) for i in inputs}
    return batch, left, sum(len(chunk[name]) for chunk in left)


def _first(batch: dict[str, np.ndarray], count: int, inputs) -> dict[str, np.ndarray]:
    return {i.name: batch[i.name][:count] for i in inputs}


def _array_reader(array: np.ndarray, inp: InputSpec, checks: Checks) -> Reader:
    def read(count: int, batch_size: int) -> Iterator[np.ndarray]:
        for start, stop in _spans(count, batch_size):
            yield _fed(array[start:stop], inp, f"array {inp.name!r}", start, checks)

    return read


def _check_counts(batch_size: int, samples: int | None) -> None:
    if batch_size < 1:
        raise CalibrationDataError(f"batch size {batch_size} is not positive")
    if samples is not None and samples < 1:
        raise CalibrationDataError(f"sample count {samples} is not positive")


def _no_preprocess(spec: str, preprocess: Preprocess | None) -> None:
    if preprocess is not None:
        raise CalibrationDataError(f"{spec}: preprocessing applies to a folder of images only")


def _split_spec(spec: str) -> tuple[Path, list[str] | None]:
    """Split ``FILE.npz:KEY1,KEY2``; any other spec is a path."""
    head, sep, tail = spec.rpartition(":")
    if not (sep and head.lower().endswith(".npz")):
        return Path(spec), None
    keys = tail.split(",")
    if "" in keys:
        raise CalibrationDataError(f"{spec}: empty array key; expected FILE.npz:KEY1,KEY2,...")
    return Path(head), keys


def _spans(count: int, batch_size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, count, batch_size):
        yield start, min(start + batch_size, count)


def _cast(batch: np.ndarray, inp: InputSpec) -> np.ndarray:
    # np.array copies, so no batch keeps a memory map or a read buffer alive. Values a cast
    # makes infinite or invalid are what _fed checks.
    with np.errstate(over="ignore", invalid="ignore"):
        return np.array(batch, dtype=inp.dtype, order="C")


def _fed(raw: np.ndarray, inp: InputSpec, what: str, first: int, checks: Checks) -> np.ndarray:
    """``raw`` (samples ``first``, ``first + 1``, ... of ``what``) cast to the input's dtype,
    refused if it holds what the checks do not let through (see the module docstring)."""
    fed = _cast(raw, inp)
    to_float = fed.dtype.kind == "f"
    if inp.index is not None and not to_float:
        _check_indices(fed, inp, what, first)
    if raw.dtype.kind != "f" or (to_float and checks.allow_nonfinite):
        return fed
    values = fed if to_float else raw  # an integer input's data is checked before the cast
    rows = values.reshape(1 if inp.constant or not values.ndim else len(values), -1)
    finite = np.isfinite(rows)
    if finite.all():
        return fed
    row = int(np.argmin(finite.all(axis=1)))
    col = int(np.argmin(finite[row]))
    value = float(raw.reshape(rows.shape)[row, col])
    held = "NaN" if math.isnan(value) else f"{value:g}"
    if math.isfinite(value):
        held += f", past the range of {inp.dtype}"
    where = f"{what}: " if inp.constant else f"{what}: sample {first + row} "
    if not to_float:
        raise DataContentError(
            f"{where}holds {held}, which integer input {inp.name!r} ({inp.dtype}) cannot take"
        )
    raise DataContentError(
        f"{where}holds {held} (input {inp.name!r}); pass --allow-nonfinite to profile it anyway"
    )


def _check_indices(fed: np.ndarray, inp: InputSpec, what: str, first: int) -> None:
    """Refuses an index input's value outside ``[-n, n)`` (ONNX's range for a Gather) by its
    sample and position: the compiled program would clip it to the table, a wrong value
    profiled without a word."""
    rows = fed.reshape(1 if inp.constant or not fed.ndim else len(fed), -1)
    found = inp.index.refusal(inp.name, rows)
    if found is not None:
        where = f"{what}: " if inp.constant else f"{what}: sample {first + found[0]} "
        raise DataContentError(where + found[1])


def _check_dtype(what: str, dtype: np.dtype, inp: InputSpec, checks: Checks) -> None:
    if dtype.hasobject:
        raise CalibrationDataError(f"{what}: Python objects (pickled data) are never loaded")
    want = np.dtype(inp.dtype)
    numbers = dtype.kind in _FITS and want.kind in _FITS
    if dtype.kind in _FITS.get(want.kind, want.kind) or (numbers and checks.cast):
        return
    hint = ": pass --cast to convert" if numbers else ""
    raise DataContentError(f"{what}: holds {dtype}, input {inp.name!r} is {want}{hint}")


def _check_array(
    what: str, shape: tuple[int, ...], dtype: np.dtype, inp: InputSpec, checks: Checks
) -> int | None:
    """Check an array against an input; return its sample count (None for a constant)."""
    _check_dtype(what, dtype, inp, checks)
    expected = inp.sample_shape
    if inp.constant:
        if shape != expected:
            raise CalibrationDataError(
                f"{what}: shape {list(shape)} does not fit constant input {inp.name!r}, which "
                f"takes its whole shape {list(expected)}"
            )
        return None
    if not shape or shape[1:] != expected:
        hint = (
            "; it looks like a single sample: add a leading sample axis (array[None])"
            if shape == expected
            else ""
        )
        raise CalibrationDataError(
            f"{what}: shape {list(shape)} does not fit input {inp.name!r}, which takes "
            f"[N, {', '.join(map(str, expected))}] (N samples of shape {list(expected)}){hint}"
        )
    if shape[0] == 0:
        raise CalibrationDataError(f"{what}: no samples (shape {list(shape)})")
    return shape[0]


def _read_header(f: IO[bytes], what: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Read an .npy header: (shape, fortran order, dtype); leaves ``f`` at the data."""
    try:
        version = np.lib.format.read_magic(f)
        # 3.0 differs from 2.0 only by UTF-8 field names of structured dtypes.
        read = {
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
            (3, 0): np.lib.format.read_array_header_2_0,
        }.get(version)
        if read is None:
            raise ValueError(f"unsupported format version {version}")
        return read(f)
    except _READ_ERRORS as err:
        raise CalibrationDataError(f"{what}: not a valid .npy array: {_line(err)}") from err


def _line(err: BaseException) -> str:
    return next(iter(str(err).strip().splitlines()), type(err).__name__)


def _only_input(source: str, inputs: Sequence[InputSpec]) -> InputSpec:
    if len(inputs) != 1:
        raise CalibrationDataError(
            f"{source}: feeds a single input, but the model has {len(inputs)} inputs "
            f"({', '.join(repr(i.name) for i in inputs)}); use an .npz with one array per input"
        )
    return inputs[0]


def _npy(path: Path, inputs: Sequence[InputSpec], checks: Checks) -> tuple[int, dict[str, Reader]]:
    inp = _only_input(str(path), inputs)
    # The header first, to reject object arrays and non-.npy files with a clear message.
    try:
        with path.open("rb") as f:
            shape, _, dtype = _read_header(f, str(path))
    except OSError as err:
        raise CalibrationDataError(f"{path}: cannot read the file: {err.strerror}") from err
    count = _check_array(str(path), shape, dtype, inp, checks)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except _READ_ERRORS as err:  # say, data shorter than the header promises
        raise CalibrationDataError(f"{path}: not a valid .npy array: {_line(err)}") from err

    if inp.constant:
        return 1, {inp.name: _constant_reader(lambda: _fed(array, inp, str(path), 0, checks))}

    def read(count: int, batch_size: int) -> Iterator[np.ndarray]:
        for start, stop in _spans(count, batch_size):
            yield _fed(array[start:stop], inp, str(path), start, checks)

    return count, {inp.name: read}


def _whole(one_sample: Reader) -> Reader:
    """A constant input's reader from the reader of its per-sample view
    (:meth:`InputSpec.as_one_sample`): the one sample is the whole array."""
    return _constant_reader(lambda: np.asarray(next(one_sample(1, 1))[0]))


def _constant_reader(load: Callable[[], np.ndarray]) -> Reader:
    """A constant input's reader: the array ``load`` reads, once, for every batch."""

    def read(count: int, batch_size: int) -> Iterator[np.ndarray]:
        array = load()
        for _ in _spans(count, batch_size):
            yield array

    return read


def _npz(
    path: Path, keys: list[str] | None, inputs: Sequence[InputSpec], checks: Checks
) -> tuple[int, dict[str, Reader]]:
    try:
        with zipfile.ZipFile(path) as archive:
            # np.savez stores array KEY as member KEY.npy.
            members = {n.removesuffix(".npy"): n for n in archive.namelist() if n.endswith(".npy")}
            chosen = _choose_keys(path, list(members), keys, inputs)
            headers = []
            for key in chosen:
                with archive.open(members[key]) as f:
                    headers.append(_read_header(f, f"array {key!r} in {path}"))
    except (zipfile.BadZipFile, OSError) as err:
        raise CalibrationDataError(f"{path}: not an .npz file: {_line(err)}") from err

    counts, readers = [], {}
    for key, inp, (shape, fortran, dtype) in zip(chosen, inputs, headers, strict=True):
        what = f"array {key!r} in {path}"
        counts.append(_check_array(what, shape, dtype, inp, checks))
        if fortran:
            raise CalibrationDataError(
                f"{what}: stored in Fortran order, which cannot be read batch by batch; save "
                "np.ascontiguousarray(array) instead"
            )
        readers[inp.name] = _npz_reader(path, members[key], what, dtype, inp, checks)
    sizes = {k: n for k, n in zip(chosen, counts, strict=True) if n is not None}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k!r}: {n}" for k, n in sizes.items())
        raise CalibrationDataError(
            f"{path}: the arrays hold different sample counts ({listed}); an input fed whole in "
            "every run is a constant input (--constant-input NAME)"
        )
    return next(iter(sizes.values()), 1), readers


def _choose_keys(
    path: Path, available: list[str], keys: list[str] | None, inputs: Sequence[InputSpec]
) -> list[str]:
    names = [i.name for i in inputs]
    listed = ", ".join(map(repr, available))
    if not available:
        raise CalibrationDataError(f"{path}: holds no arrays")
    if keys is not None:
        if len(keys) != len(inputs):
            raise CalibrationDataError(
                f"{path}: {len(keys)} key(s) ({', '.join(map(repr, keys))}) for the model's "
                f"{len(inputs)} input(s) ({', '.join(map(repr, names))}); give one key per input"
            )
        for key in keys:
            if key not in available:
                raise CalibrationDataError(f"{path}: no array {key!r}; the file holds {listed}")
        return keys
    if set(names) <= set(available):
        return names
    if len(inputs) == 1:
        # Even a single array is not guessed to be the input's: its name says otherwise.
        raise DataContentError(
            f"{path}: holds arrays {listed}, none named like the model's input {names[0]!r}; "
            f"choose one with {path}:KEY"
        )
    raise DataContentError(
        f"{path}: holds arrays {listed}, not all named like the model's inputs "
        f"({', '.join(map(repr, names))}); choose them in input order with {path}:KEY1,KEY2,..."
    )


def _npz_reader(
    path: Path, member: str, what: str, dtype: np.dtype, inp: InputSpec, checks: Checks
) -> Reader:
    sample_bytes = dtype.itemsize * math.prod(inp.sample_shape)
    if inp.constant:
        return _whole(_npz_reader(path, member, what, dtype, inp.as_one_sample(), checks))
    # Refusals name the array as --data does (FILE.npz:KEY).
    spec = f"{path}:{member.removesuffix('.npy')}"

    def read(count: int, batch_size: int) -> Iterator[np.ndarray]:
        with zipfile.ZipFile(path) as archive, archive.open(member) as f:
            _read_header(f, what)
            for start, stop in _spans(count, batch_size):
                try:
                    data = f.read((stop - start) * sample_bytes)
                except _READ_ERRORS as err:
                    raise CalibrationDataError(f"{what}: cannot read: {_line(err)}") from err
                if len(data) < (stop - start) * sample_bytes:
                    raise CalibrationDataError(
                        f"{what}: truncated, samples from {start} on are missing"
                    )
                batch = np.frombuffer(data, dtype).reshape(stop - start, *inp.sample_shape)
                yield _fed(batch, inp, spec, start, checks)

    return read


def _random(inputs: Sequence[InputSpec], seed: int) -> dict[str, Reader]:
    # One stream per input, so an input's data depends only on the seed and its position.
    seeds = np.random.SeedSequence(seed).spawn(len(inputs))
    readers = {}
    for inp, input_seed in zip(inputs, seeds, strict=True):
        kind = np.dtype(inp.dtype).kind
        if kind not in "fiub":
            raise CalibrationDataError(
                f"random: cannot generate data for input {inp.name!r} of dtype {inp.dtype}"
            )
        readers[inp.name] = _random_reader(inp, kind, input_seed)
    return readers


def _random_reader(inp: InputSpec, kind: str, seed: np.random.SeedSequence) -> Reader:
    if inp.constant:
        return _whole(_random_reader(inp.as_one_sample(), kind, seed))

    def read(count: int, batch_size: int) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(seed)
        for start, stop in _spans(count, batch_size):
            size = (stop - start, *inp.sample_shape)
            if kind == "f":
                batch = rng.standard_normal(size, dtype=np.float32)
            else:
                batch = rng.integers(0, 2 if kind == "b" else _random_integers(inp), size)
            yield _cast(batch, inp)

    return read


def _random_integers(inp: InputSpec) -> int:
    """Random integers are drawn below this: 100, or the extent of the axis the input
    indexes."""
    return min(100, inp.index.extent) if inp.index else 100


def _images(
    folder: Path, inputs: Sequence[InputSpec], preprocess: Preprocess, checks: Checks
) -> tuple[int, dict[str, Reader]]:
    inp = _only_input(str(folder), inputs)
    what = f"images in {folder}"
    if inp.constant:
        raise CalibrationDataError(f"{what}: images are samples; input {inp.name!r} is constant")
    files = sorted(
        (p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()),
        key=lambda p: p.name,
    )
    if not files:
        raise CalibrationDataError(
            f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in the folder"
        )
    height, width, channels = _image_format(what, preprocess, inp)
    _check_dtype(what, np.dtype(np.float32), inp, checks)
    for path in files:  # fail now rather than hours into profiling: headers are cheap to read
        _open_image(path).close()
    mean, std = (np.asarray(v, dtype=np.float32) for v in (preprocess.mean, preprocess.std))

    def sample(path: Path) -> np.ndarray:
        with _open_image(path) as raw:
            try:
                image = raw.convert("L" if channels == "L" else "RGB").resize(
                    (width, height), Image.Resampling.BILINEAR
                )
            except (OSError, Image.DecompressionBombError) as err:
                raise CalibrationDataError(f"{path}: cannot read the image: {_line(err)}") from err
        pixels = np.asarray(image, dtype=np.float32).reshape(height, width, -1)
        if channels == "BGR":
            pixels = pixels[:, :, ::-1]
        pixels = (pixels * np.float32(preprocess.scale) - mean) / std
        return pixels.transpose(2, 0, 1) if preprocess.layout == "NCHW" else pixels

    def read(count: int, batch_size: int) -> Iterator[np.ndarray]:
        for start, stop in _spans(count, batch_size):
            yield _cast(np.stack([sample(p) for p in files[start:stop]]), inp)

    return len(files), {inp.name: read}


def _open_image(path: Path) -> Image.Image:
    try:
        return Image.open(path)
    except (OSError, Image.DecompressionBombError) as err:
        raise CalibrationDataError(f"{path}: cannot read the image: {_line(err)}") from err


def _image_format(what: str, prep: Preprocess, inp: InputSpec) -> tuple[int, int, Channels]:
    """Check ``prep`` against the input; return the image height, width and channels."""
    if len(inp.sample_shape) != 3:
        raise CalibrationDataError(
            f"{what}: input {inp.name!r} of shape {list(inp.shape)} is not an image input "
            "([N, C, H, W] or [N, H, W, C])"
        )
    if prep.layout == "NCHW":
        depth, height, width = inp.sample_shape
    else:
        height, width, depth = inp.sample_shape
    fit = f"input {inp.name!r} of shape {list(inp.shape)} read as {prep.layout}"
    channels = prep.channels or {1: "L", 3: "RGB"}.get(depth)
    if channels is None:
        raise CalibrationDataError(
            f"{what}: {fit} has {depth} channels, but images have 1 or 3; is the layout right?"
        )
    if depth != (1 if channels == "L" else 3):
        raise CalibrationDataError(
            f"{what}: channels={channels} does not fit {fit} ({depth} channels)"
        )
    if prep.size not in (None, (height, width)):
        raise CalibrationDataError(
            f"{what}: size={prep.size[0]}x{prep.size[1]} does not fit {fit} ({height}x{width})"
        )
    for name in ("mean", "std"):
        values = getattr(prep, name)
        if len(values) not in (1, depth):
            raise CalibrationDataError(
                f"{what}: {name} has {len(values)} values, but {fit} has {depth} channels; "
                "give one value or one per channel"
            )
    return height, width, channels
