"""The aarch64 host program (``vm_host.cc``) that runs an exported Relax VM library.

Compiled once per source, compiler flags and runtime versions, next to the runtime it links
(:func:`~.runtime.ensure_runtime`), against the tvm-ffi headers of the x86 wheel installed here:
the same version as the runtime, and headers do not depend on the architecture.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import tvm_ffi.libinfo

from .toolchain import CXX, ToolchainError, require

SOURCE = Path(__file__).with_name("vm_host.cc")


def _command(compiler: str, runtime: Path, output: Path) -> list[str]:
    includes = [f"-I{path}" for path in tvm_ffi.libinfo.include_paths()]
    # --no-as-needed: the program calls into libtvm_ffi only, but libtvm_runtime must be loaded
    # to register the Relax VM (its executable loader and the VM functions).
    libraries = [f"-L{runtime}", "-Wl,--no-as-needed", "-ltvm_runtime", "-ltvm_ffi"]
    return [compiler, "-std=c++17", "-O2", *includes, str(SOURCE), "-o", str(output), *libraries]


def ensure_host(runtime: Path) -> Path:
    """The host program linked to the runtime in ``runtime``, compiled on first use."""
    compiler = require(CXX)
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join(_command(compiler, runtime, Path("vm_host"))).encode())
    binary = runtime / f"vm_host-{key.hexdigest()[:16]}"
    if binary.exists():
        return binary
    with tempfile.TemporaryDirectory(dir=runtime) as scratch:
        output = Path(scratch) / "vm_host"
        done = subprocess.run(_command(compiler, runtime, output), capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolchainError(f"{CXX} failed on {SOURCE}: {done.stderr.strip()[-2000:]}")
        # Atomic within the directory: a concurrent session finds the whole program or none.
        os.replace(output, binary)
    return binary
