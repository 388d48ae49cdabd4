"""Checking uploads before anything is stored: the ONNX model (loaded and tracked exactly as
``rangeprof inspect`` does) and calibration data (opened and read through as ``rangeprof
profile`` would, against the model's inputs). Every problem is a
:class:`~rangeprof.profiler.errors.RangeprofError` naming the uploaded file, never a server path
(answered 400), except data refused for what it holds — NaN or infinity, a dtype that does not
fit its input, arrays not named like the inputs — which is answered 422.
"""

from __future__ import annotations

import math
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from fastapi import HTTPException, UploadFile, status

from rangeprof.profiler.errors import CalibrationDataError, InputShapeError, RangeprofError
from rangeprof.profiler.profiling.data import RANDOM, DataContentError, InputSpec, open_data

from .limits import Limits, check_unpacked, copy_file

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
    from rangeprof.byoc.plugin import get_plugin
    from rangeprof.profiler.ir.onnx_load import load_model_bytes
    from rangeprof.profiler.ir.tracking import track

    name = file_stem(filename, ".onnx")
    shapes = parse_shapes(shapes_text)
    with _MODEL_LOCK:
        # No base_dir: external data outside the uploaded file is refused. The bytes are read
        # here, under the lock, so that one model at a time is in memory.
        loaded = load_model_bytes(staged.read_bytes(), f"{name}.onnx", shapes)
        # The stages as ``rangeprof inspect`` shows them, partitioned for the default target.
        tracked = track(loaded, get_plugin("x86").patterns()).to_json()
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


def split_spec(spec: str) -> tuple[str, str | None]:
    """The file and key of a :func:`data_spec` (``FILE.npz:KEY`` -> ``(FILE.npz, KEY)``), as
    the profiler splits it: the last colon after a name ending in .npz."""
    head, sep, tail = spec.rpartition(":")
    return (head, tail) if sep and head.lower().endswith(".npz") else (spec, None)


def check_data(
    folder: Path,
    spec: str,
    inputs: list[dict],
    *,
    samples: int | None,
    seed: int,
    max_samples: int,
    allow_nonfinite: bool = False,
    cast: bool = False,
) -> int:
    """Open ``spec`` (a file in ``folder``, or ``random``) for the model's inputs and read it
    through with the profiler's data checks (``allow_nonfinite``, ``cast``), so that a bad file
    fails now and not in the middle of a run; return the number of samples it gives. Asking for
    more samples than the file holds is an error, not a cut; so is a file holding more than
    ``max_samples`` when no count is asked for."""
    specs = [InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in inputs]
    where = str(folder) + "/"
    checks = {"allow_nonfinite": allow_nonfinite, "cast": cast}
    try:
        if spec == RANDOM:
            return open_data(spec, specs, samples=samples, seed=seed).num_samples
        whole = open_data(where + spec, specs, **checks)  # opening reads no array
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
            **checks,
        )
        for _ in source.batches():
            pass
    except DataContentError as err:
        detail = str(err).replace(where, "")
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail) from None
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


@dataclass(frozen=True)
class EvaluationData:
    """Evaluation data and optional labels, uploaded and checked (an evaluation's, or an
    accuracy budget's): their options as the job's folder names them, and the blobs to store."""

    data: str  # FILE.npz[:KEY]
    labels: str | None  # FILE.npz:KEY
    data_sha256: str
    labels_sha256: str | None
    staged: dict[str, Path]  # sha256 -> the checked file


def stage_evaluation_data(
    folder: Path,
    limits: Limits,
    inputs: list[dict],
    data: UploadFile,
    key: str | None,
    labels: UploadFile | None,
    labels_key: str | None,
    samples: int | None,
) -> EvaluationData:
    """Copy ``data`` (and ``labels``) into the scratch ``folder`` and check them: the data
    against the model's ``inputs``, the labels (in ``labels``, or without it an array
    ``labels_key`` of ``data``) 1-D integers, one per sample."""
    limit = limits.max_data_bytes
    data_name = file_stem(data.filename, ".npz") + ".npz"
    data_sha = copy_file(data.file, folder / data_name, "the data file", limit)
    check_unpacked(folder / data_name, "the data file", limits.max_unpacked_bytes)
    spec = data_spec(data_name, key)
    count = check_data(
        folder, spec, inputs, samples=samples, seed=0, max_samples=limits.max_samples
    )
    staged = {data_sha: folder / data_name}
    if labels is not None:
        uploaded = file_stem(labels.filename, ".npz") + ".npz"
        path = folder / "labels" / uploaded  # a folder of its own: the names may be equal
        path.parent.mkdir()
        labels_sha = copy_file(labels.file, path, "the labels file", limit)
        check_unpacked(path, "the labels file", limits.max_unpacked_bytes)
        labels_key = check_labels(path, uploaded, labels_key, count)
        staged.setdefault(labels_sha, path)
        labels_name = _labels_name(uploaded, labels_sha, data_name, data_sha)
    elif labels_key is not None:
        labels_key = check_labels(folder / data_name, data_name, labels_key, count)
        labels_name, labels_sha = data_name, data_sha
    else:
        return EvaluationData(spec, None, data_sha, None, staged)
    return EvaluationData(spec, data_spec(labels_name, labels_key), data_sha, labels_sha, staged)


def _labels_name(uploaded: str, sha256: str, data_name: str, data_sha: str) -> str:
    """The name the job's process sees the labels under, beside the data."""
    if sha256 == data_sha:
        return data_name  # one file for both
    return f"labels-{uploaded}" if uploaded == data_name else uploaded
