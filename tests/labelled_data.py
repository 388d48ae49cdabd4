"""Labelled data for the PyPI zoo's models, made offline from files every machine of ours holds.

``magika_dataset`` labels files by their kind, known from their names: Python's standard library
and the installed distributions that rangeprof (with its ``dev`` and ``ray`` extras) requires,
directly or not, which is what a fresh ``pip install -e '.[dev,ray]'`` brings. Each file becomes
one Magika input the way Magika 1.0.3 makes it (``magika/magika.py``,
``_extract_features_from_seekable``), and its label an index into the model's
``target_labels_space``. Paths are sorted and sampled with the seed, so a machine makes the same
set run to run; another machine, with other versions installed, makes a similar one.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sysconfig
from collections import defaultdict
from pathlib import Path

import numpy as np
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pypi_models import cache_dir, fetch_magika_config

# Magika's label for each suffix that names one kind of file (not .h: C and C++ share it), of
# the kinds we hold enough files of and Magika tells apart from their neighbours (not .txt:
# much of it reads as reStructuredText; license files are taken by name instead).
SUFFIX_LABELS = {
    ".py": "python",
    ".c": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".js": "javascript",
    ".json": "json",
    ".csv": "csv",
    ".md": "markdown",
    ".cmake": "cmake",
    ".f90": "fortran",
    # binary kinds, for inputs over all 256 byte values, not only printable ASCII
    ".so": "elf",
    ".onnx": "onnx",
}
# Smaller files are mostly padding to the model.
MIN_BYTES = 512
# The standard library's own tests hold deliberately malformed files, and Debian ships them
# apart; site-packages is read through the distributions' metadata instead.
SKIPPED_FOLDERS = {"test", "tests", "idle_test", "site-packages", "dist-packages"}


def magika_dataset(calib: int, test: int, seed: int = 0) -> Path:
    """A ``.npz`` in the model cache with ``calib`` [calib, 2048] and ``test`` [test, 2048]
    int32 Magika inputs and ``test_labels`` [test] int64, balanced over the kinds of files
    that have enough distinct inputs for their share (kinds with fewer are left out).

    Raises ``RuntimeError`` when Magika's config cannot be fetched, ``ValueError`` when fewer
    than two kinds have enough files for the sizes asked."""
    config = json.loads(fetch_magika_config().read_text())
    space = config["target_labels_space"]
    rng = np.random.default_rng(seed)
    candidates = {
        label: [paths[i] for i in rng.permutation(len(paths))]
        for label, paths in sorted(_labelled_files().items())
    }
    unknown = set(candidates) - set(space)
    if unknown:
        raise ValueError(f"labels not in Magika's target_labels_space: {sorted(unknown)}")

    def need(kinds: int) -> int:
        return -(-calib // kinds) + -(-test // kinds)

    inputs = {
        label: _distinct_inputs(paths, need(2), config) for label, paths in candidates.items()
    }
    # the most kinds that each have enough files for an equal share: the kinds with the fewest
    # files leave first, as each one that leaves makes the others' shares larger
    labels = sorted(inputs, key=lambda label: len(inputs[label]), reverse=True)
    while len(labels) >= 2 and len(inputs[labels[-1]]) < need(len(labels)):
        labels.pop()
    if len(labels) < 2:
        raise ValueError(f"too few files for {calib} + {test} balanced samples")
    labels.sort()
    calib_rows, test_rows, test_labels = [], [], []
    for i, label in enumerate(labels):
        calib_share = calib // len(labels) + (i < calib % len(labels))
        test_share = test // len(labels) + (i < test % len(labels))
        rows = inputs[label]
        calib_rows += rows[:calib_share]
        test_rows += rows[calib_share : calib_share + test_share]
        test_labels += [space.index(label)] * test_share
    # shuffled, so that the first n test samples (``--samples n``) still cover every kind
    calib_order, test_order = rng.permutation(calib), rng.permutation(test)
    target = cache_dir() / f"magika_labelled_{calib}_{test}_{seed}.npz"
    partial = target.with_suffix(f".{os.getpid()}.partial.npz")
    np.savez(
        partial,
        calib=np.array(calib_rows, np.int32)[calib_order],
        test=np.array(test_rows, np.int32)[test_order],
        test_labels=np.array(test_labels, np.int64)[test_order],
    )
    os.replace(partial, target)
    return target


def _labelled_files() -> dict[str, list[Path]]:
    """Every file of a known kind and at least ``MIN_BYTES``, by Magika label, paths sorted."""
    paths = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [name for name in subfolders if name not in SKIPPED_FOLDERS]
        paths += [Path(folder, name) for name in names]
    for distribution in _required_distributions():
        paths += [Path(distribution.locate_file(file)) for file in distribution.files or ()]
    found = defaultdict(set)
    for path in paths:
        label = _label(path)
        if label is not None and path.is_file() and path.stat().st_size >= MIN_BYTES:
            found[label].add(path)
    return {label: sorted(files) for label, files in found.items()}


def _label(path: Path) -> str | None:
    """Magika's label for a file we know the kind of by its name, else None."""
    if path.name.startswith(("LICENSE", "COPYING")) and path.suffix in ("", ".txt", ".md"):
        return "txt"  # license prose is plain text, even named .md
    if path.name == "RECORD" and path.parent.suffix == ".dist-info":
        return "csv"  # PEP 376
    return SUFFIX_LABELS.get(path.suffix)


def _required_distributions() -> list[metadata.Distribution]:
    """The installed distributions rangeprof[dev,ray] requires, directly or not, by name."""
    found: dict[str, tuple[metadata.Distribution, frozenset[str]]] = {}
    requires = metadata.requires("rangeprof") or []
    pending = [(Requirement(r), frozenset({"dev", "ray"})) for r in requires]
    while pending:
        requirement, extras = pending.pop()
        environments = [{"extra": extra} for extra in extras] or [{"extra": ""}]
        if requirement.marker and not any(map(requirement.marker.evaluate, environments)):
            continue
        key = canonicalize_name(requirement.name)
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # an optional or platform-specific requirement not installed here
        known = found[key][1] if key in found else None
        wanted = (known or frozenset()) | set(requirement.extras)
        if wanted == known:
            continue  # seen with these extras already
        found[key] = (distribution, wanted)
        pending += [(Requirement(r), wanted) for r in distribution.requires or []]
    return [
        distribution for name, (distribution, _) in sorted(found.items()) if name != "rangeprof"
    ]


def _distinct_inputs(paths: list[Path], count: int, config: dict) -> list[list[int]]:
    """The Magika inputs of the first ``count`` files in ``paths`` that Magika gives its model
    and whose inputs differ from those before them (copies of one license or data file would
    repeat a sample)."""
    # Magika labels a file without its model when too few bytes are left once the first block
    # is stripped of whitespace.
    last_needed = config["min_file_size_for_dl"] - 1
    seen, inputs = set(), []
    for path in paths:
        row = magika_input(path, config)
        if row[last_needed] != config["padding_token"] and tuple(row) not in seen:
            seen.add(tuple(row))
            inputs.append(row)
            if len(inputs) == count:
                break
    return inputs


def magika_input(path: Path, config: dict) -> list[int]:
    """The model input for ``path``, as Magika 1.0.3 makes it: the first ``block_size`` bytes
    left-stripped of whitespace, their first ``beg_size`` padded at the end with
    ``padding_token``, then the last ``block_size`` bytes right-stripped, their last
    ``end_size`` padded at the start."""
    block, pad = config["block_size"], config["padding_token"]
    beg_size, end_size = config["beg_size"], config["end_size"]
    with path.open("rb") as file:
        size = file.seek(0, os.SEEK_END)
        read = min(block, size)
        file.seek(0)
        beg = list(file.read(read).lstrip()[:beg_size])
        file.seek(size - read)
        end = list(file.read(read).rstrip()[-end_size:])
    return beg + [pad] * (beg_size - len(beg)) + [pad] * (end_size - len(end)) + end
