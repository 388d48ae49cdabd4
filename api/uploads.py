"""Checking uploads before anything is stored: the ONNX model (loaded and tracked exactly as
``rangeprof inspect`` does) and calibration data (opened and read through as ``rangeprof
profile`` would, against the model's inputs), each in a process of its own under a wall-time and
a memory limit (:mod:`rangeprof.service.sandbox`); labels by their .npy headers alone. Every
problem is a :class:`~rangeprof.profiler.errors.RangeprofError` naming the uploaded file, never a
server path (answered 400), except data refused for what it holds — NaN or infinity, a dtype
that does not fit its input, arrays not named like the inputs — and work over a limit, which are
answered 422, and labels past the sample limit (413).
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from fastapi import HTTPException, UploadFile, status

from rangeprof.profiler.errors import CalibrationDataError, RangeprofError
from rangeprof.profiler.profiling.data import RANDOM, DataContentError

from . import analysis, sandbox
from .limits import Limits, check_unpacked, copy_file
from .memory import MB
from .settings import settings

# The model's bytes held at the peak of its analysis: read, parsed, simplified, imported
# (measured: 7.4 times a model of one 244 MB weight).
_ANALYSIS_COPIES = 8


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
    name = file_stem(filename, ".onnx")
    size, limit = staged.stat().st_size, settings().analysis_mb
    if _ANALYSIS_COPIES * size > limit * MB:
        # Refused before it starts: a parse that runs out of memory says "not ONNX".
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"the model's analysis would need about {_ANALYSIS_COPIES * size / MB:.0f} MB "
            f"({_ANALYSIS_COPIES} times its size), over this server's limit of {limit} MB",
        )
    found = sandbox.run(
        analysis.MODEL, "the model's analysis", path=str(staged), name=name, shapes=shapes_text
    )
    return ModelAnalysis(name=name, staged=staged, sha256=sha256, size=size, **found)


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
    """Open ``spec`` (a file in ``folder``, or ``random``) for the model's ``inputs`` and read
    it through with the profiler's data checks (``allow_nonfinite``, ``cast``), in a process of
    its own, so that a bad file fails now and not in the middle of a run; return the number of
    samples it gives (:func:`rangeprof.service.analysis.read_data`)."""
    where = str(folder) + "/"
    args = {
        "folder": str(folder),
        "spec": spec,
        "inputs": inputs,
        "samples": samples,
        "seed": seed,
        "max_samples": max_samples,
        "allow_nonfinite": allow_nonfinite,
        "cast": cast,
    }
    try:
        if spec == RANDOM:  # counted, not made: nothing to isolate
            return analysis.read_data(**args)
        return sandbox.run(analysis.DATA, "the check of the data", **args)
    except DataContentError as err:
        detail = str(err).replace(where, "")
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail) from None
    except RangeprofError as err:
        raise CalibrationDataError(str(err).replace(where, "")) from None


def _npz_headers(path: Path, name: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The arrays of the .npz at ``path`` (uploaded as ``name``): key -> (shape, dtype), from
    each member's .npy header; no array is read, and a member shorter than its header says, or
    holding Python objects, is refused."""
    arrays = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(f)
                    data = f.tell()
                key = member.filename.removesuffix(".npy")
                if dtype.hasobject:
                    raise UploadError(f"{name}:{key}: holds Python objects, which are not read")
                if member.file_size < data + math.prod(shape) * dtype.itemsize:
                    raise UploadError(f"{name}:{key}: truncated, shorter than its header says")
                arrays[key] = (shape, dtype)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise UploadError(f"{name}: cannot read labels ({err})") from None
    return arrays


def check_labels(
    path: Path, name: str, key: str | None, samples: int, limit: int, tokens: bool = False
) -> str:
    """Check that the .npz at ``path`` (uploaded as ``name``) holds integer labels for
    ``samples`` samples, and no more than ``limit`` (this server's samples per job), in array
    ``key`` (default: its only array), by the arrays' headers: 1-D (a class a sample), or with
    ``tokens`` of any shape (a next token a position); return the key."""
    arrays = _npz_headers(path, name)
    if key is None and len(arrays) != 1:
        raise UploadError(
            f"{name} holds {len(arrays)} arrays ({', '.join(arrays)}): "
            "give the labels' array in field 'labels_key'"
        )
    key = key or next(iter(arrays))
    if key not in arrays:
        raise UploadError(f"{name}: no array {key!r} (has {', '.join(arrays)})")
    shape, dtype = arrays[key]
    if dtype.kind not in "iu" or (len(shape) != 1 and not (tokens and shape)):
        kind = "an integer array" if tokens else "a 1-D integer array"
        raise UploadError(f"{name}:{key}: labels must be {kind}")
    if shape[0] < samples:
        raise UploadError(f"{name}:{key}: {shape[0]} labels for {samples} samples")
    if shape[0] > limit:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"{name}:{key}: {shape[0]} labels, over this server's limit of {limit}",
        )
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
    samples: int  # what the job evaluates


def stage_evaluation_data(
    folder: Path,
    limits: Limits,
    inputs: list[dict],
    data: UploadFile,
    key: str | None,
    labels: UploadFile | None,
    labels_key: str | None,
    samples: int | None,
    tokens: bool = False,
) -> EvaluationData:
    """Copy ``data`` (and ``labels``) into the scratch ``folder`` and check them: the data
    against the model's ``inputs``, the labels (in ``labels``, or without it an array
    ``labels_key`` of ``data``) integers, one per sample (``tokens``: of any shape)."""
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
        labels_key = check_labels(path, uploaded, labels_key, count, limits.max_samples, tokens)
        staged.setdefault(labels_sha, path)
        labels_name = _labels_name(uploaded, labels_sha, data_name, data_sha)
    elif labels_key is not None:
        labels_key = check_labels(
            folder / data_name, data_name, labels_key, count, limits.max_samples, tokens
        )
        labels_name, labels_sha = data_name, data_sha
    else:
        return EvaluationData(spec, None, data_sha, None, staged, count)
    labels_spec = data_spec(labels_name, labels_key)
    return EvaluationData(spec, labels_spec, data_sha, labels_sha, staged, count)


def _labels_name(uploaded: str, sha256: str, data_name: str, data_sha: str) -> str:
    """The name the job's process sees the labels under, beside the data."""
    if sha256 == data_sha:
        return data_name  # one file for both
    return f"labels-{uploaded}" if uploaded == data_name else uploaded
