"""Checking uploads before anything is stored: the ONNX model (loaded and tracked exactly as
``rangeprof inspect`` does) and calibration data (opened and read through as ``rangeprof
profile`` would, against the model's inputs). Every problem is a
:class:`~rangeprof.profiler.errors.RangeprofError` naming the uploaded file, never a server path.
"""

from __future__ import annotations

import math
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from rangeprof.profiler.errors import CalibrationDataError, InputShapeError, RangeprofError
from rangeprof.profiler.profiling.data import RANDOM, InputSpec, open_data

# onnxsim, inside load_model_bytes, is not thread-safe (it sets environment variables), and
# TVM's pass context is global: one model is loaded and tracked at a time per process.
_MODEL_LOCK = threading.Lock()
_CHECK_BYTES = 8 << 20  # read per batch while checking data


class UploadError(RangeprofError):
    """An upload is unusable as sent (a missing field, a bad file name)."""


def file_stem(filename: str | None, suffix: str) -> str:
    """The upload's file name without ``suffix`` (any name will do: the content is checked),
    safe as a single path component."""
    name = PurePosixPath((filename or "").replace("\\", "/")).name
    if len(name) > 255 or not name.isprintable():
        raise UploadError(f"file name {filename!r} is too long or has control characters")
    if name.lower().endswith(suffix):
        name = name[: -len(suffix)]
    return name or "upload"


def parse_shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """``"x=1x3x48x192;y=1x10"`` -> ``{"x": (1, 3, 48, 192), "y": (1, 10)}``."""
    from rangeprof.profiler.ir.onnx_load import parse_input_shape

    shapes: dict[str, tuple[int, ...]] = {}
    for part in (text or "").split(";"):
        if part.strip():
            name, dims = parse_input_shape(part.strip())
            if name in shapes:
                raise InputShapeError(f"input {name!r} has two shapes in {text!r}")
            shapes[name] = dims
    return shapes


@dataclass(frozen=True)
class ModelAnalysis:
    """What the service keeps of an uploaded model."""

    name: str
    staged: Path  # the checked file, in a scratch folder, for the store to adopt
    sha256: str
    size: int
    opset: int
    input_shapes: dict[str, list[int]]  # as given
    inputs: list[dict]  # as loaded: {name, shape, dtype}
    layers: list[dict]
    stages: list[dict]


def analyse_model(
    staged: Path, sha256: str, filename: str | None, shapes_text: str | None
) -> ModelAnalysis:
    """Load and track the uploaded model streamed to ``staged`` (its hash ``sha256``)."""
    # Imported here: TVM takes seconds to import, and a server or worker that receives no
    # upload need not pay for it.
    from rangeprof.profiler.ir.onnx_load import load_model_bytes
    from rangeprof.profiler.ir.tracking import track

    name = file_stem(filename, ".onnx")
    shapes = parse_shapes(shapes_text)
    with _MODEL_LOCK:
        # No base_dir: external data outside the uploaded file is refused. The bytes are read
        # here, under the lock, so that one model at a time is in memory.
        loaded = load_model_bytes(staged.read_bytes(), f"{name}.onnx", shapes)
        tracked = track(loaded).to_json()
    return ModelAnalysis(
        name=name,
        staged=staged,
        sha256=sha256,
        size=staged.stat().st_size,
        opset=loaded.opset,
        input_shapes={k: list(v) for k, v in shapes.items()},
        inputs=[
            {"name": k, "shape": list(v), "dtype": loaded.input_dtypes[k]}
            for k, v in loaded.input_shapes.items()
        ],
        layers=tracked["layers"],
        stages=tracked["stages"],
    )


def data_spec(filename: str | None, key: str | None) -> str:
    """The ``--data`` value for an uploaded .npz, relative to the folder holding it."""
    if filename is None:
        return RANDOM
    return f"{filename}:{key}" if key else filename


def check_data(
    folder: Path,
    spec: str,
    inputs: list[dict],
    *,
    samples: int | None,
    seed: int,
    max_samples: int,
) -> int:
    """Open ``spec`` (a file in ``folder``, or ``random``) for the model's inputs and read it
    through, so that a bad file fails now and not in the middle of a run; return the number of
    samples it gives. Asking for more samples than the file holds is an error, not a cut; so is
    a file holding more than ``max_samples`` when no count is asked for."""
    specs = [InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in inputs]
    where = str(folder) + "/"
    try:
        if spec == RANDOM:
            return open_data(spec, specs, samples=samples, seed=seed).num_samples
        whole = open_data(where + spec, specs)  # opening reads no array
        available = whole.num_samples
        if samples is not None and samples > available:
            raise CalibrationDataError(f"{samples} samples asked for, but {spec} holds {available}")
        if samples is None and available > max_samples:
            raise CalibrationDataError(
                f"{spec} holds {available} samples, over this server's limit of {max_samples} "
                "per run: give a count in field 'samples'"
            )
        # Read in batches of a few MB whatever the sample size: checking holds no more.
        sample_bytes = sum(np.dtype(i.dtype).itemsize * math.prod(i.sample_shape) for i in specs)
        source = open_data(
            where + spec,
            specs,
            batch_size=max(1, _CHECK_BYTES // max(1, sample_bytes)),
            samples=samples,
        )
        for _ in source.batches():
            pass
    except CalibrationDataError as err:
        raise CalibrationDataError(str(err).replace(where, "")) from None
    return source.num_samples


def check_labels(path: Path, name: str, key: str | None, samples: int) -> str:
    """Check that the .npz at ``path`` (uploaded as ``name``) holds 1-D integer labels for
    ``samples`` samples in array ``key`` (default: its only array); return the key."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            if key is None and len(arrays.files) != 1:
                raise UploadError(
                    f"{name} holds {len(arrays.files)} arrays ({', '.join(arrays.files)}): "
                    "give the labels' array in field 'labels_key'"
                )
            key = key or arrays.files[0]
            if key not in arrays.files:
                raise UploadError(f"{name}: no array {key!r} (has {', '.join(arrays.files)})")
            labels = arrays[key]
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise UploadError(f"{name}: cannot read labels ({err})") from None
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise UploadError(f"{name}:{key}: labels must be a 1-D integer array")
    if len(labels) < samples:
        raise UploadError(f"{name}:{key}: {len(labels)} labels for {samples} samples")
    return key
