"""A cache of compiled programs, so that a second profiling run of a model pays no compile.

Entries are keyed by everything the compiled code depends on: the ONNX file's sha256, the input
shapes, the target, the TVM and rangeprof versions and the program kind. Each entry is a shared
library (``<key>.so``, TVM's exported executable) plus a JSON sidecar holding what was learnt while
building it (the observed tensors, layers and lineage), written last so that a half-written entry
is never read. The directory is ``$RANGEPROF_CACHE``, else ``$XDG_CACHE_HOME/rangeprof``, else
``~/.cache/rangeprof``; ``RANGEPROF_CACHE=off`` disables caching.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import tvm
from tvm import relax

from rangeprof.profiler.settings import settings

# Bump when the instrumented program, its sidecar or its statistics kernels change.
PROGRAM_FORMAT = 9


@contextlib.contextmanager
def _quiet_native_stderr():
    """TVM's C++ runtime logs a warning line per constant when saving or loading an executable;
    those lines would bury the CLI's output, so file descriptor 2 is muted meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _load_vm(library: Path) -> relax.VirtualMachine:
    with _quiet_native_stderr():
        return relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())


def cache_root() -> Path | None:
    current = settings()
    if current.cache == "off":
        return None
    if current.cache:
        return Path(current.cache)
    return current.cache_home / "rangeprof"


def cache_key(
    kind: str, sha256: str, input_shapes: dict, target: tvm.target.Target, **options
) -> str:
    parts = {
        "kind": kind,
        "options": options,
        "format": PROGRAM_FORMAT,
        "model": sha256,
        "inputs": {k: list(v) for k, v in sorted(input_shapes.items())},
        "target": str(target),
        "tvm": tvm.__version__,
        "rangeprof": metadata.version("rangeprof"),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class BuildCache:
    """Compiled executables with JSON sidecars under one directory."""

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else cache_root()

    def load(self, key: str) -> tuple[relax.VirtualMachine, dict] | None:
        """The cached VM and sidecar for ``key``, or ``None`` on a miss."""
        if self.root is None:
            return None
        library, sidecar = self.root / f"{key}.so", self.root / f"{key}.json"
        if not (library.exists() and sidecar.exists()):
            return None
        return _load_vm(library), json.loads(sidecar.read_text())

    def store_library(self, key: str, executable) -> relax.VirtualMachine:
        """Exports ``key``'s library and returns a VM on it, loaded from the file: LLVM emits the
        machine code once, for the file (a VM on the executable itself would JIT it again, 2 s
        on ResNet-18, 6 s on PP-OCR). The entry is readable once :meth:`store_sidecar` ran."""
        if self.root is None:
            return relax.VirtualMachine(executable, tvm.cpu())
        self.root.mkdir(parents=True, exist_ok=True)
        library = self.root / f"{key}.so"
        partial = self.root / f"{key}.{os.getpid()}.partial.so"  # the suffix picks the format
        with _quiet_native_stderr():
            executable.export_library(str(partial))
        os.replace(partial, library)
        return _load_vm(library)

    def store_sidecar(self, key: str, sidecar: dict) -> None:
        """Completes ``key``'s entry (after :meth:`store_library`)."""
        if self.root is None:
            return
        text = self.root / f"{key}.{os.getpid()}.partial.json"
        text.write_text(json.dumps(sidecar))
        os.replace(text, self.root / f"{key}.json")
