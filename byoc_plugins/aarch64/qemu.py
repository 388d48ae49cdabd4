"""Running an exported aarch64 library under qemu-user, from Python.

:func:`run_under_qemu` hands the inputs to the host program (:mod:`.host`) as ``.npy`` files and
reads its outputs back the same way; qemu-user translates the aarch64 instructions (NEON and the
dot product included) and the Linux system calls, so the library runs as it would on a board.
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .host import ensure_host
from .runtime import ensure_runtime
from .toolchain import QEMU, SYSROOT, require


class QemuRunError(RuntimeError):
    """The host program failed under qemu (a crash, a TVM error, a wrong input)."""


def run_under_qemu(
    library_path: str | Path, inputs: Sequence[np.ndarray], timeout: float = 600
) -> list[np.ndarray]:
    """Runs ``main`` of an aarch64 library written by :func:`~.target.export` on ``inputs``.

    Returns every output tensor, a tuple flattened depth-first. Raises
    :class:`~.toolchain.ToolchainError` when qemu, the compiler or the runtime is missing, and
    :class:`QemuRunError` with the end of the program's stderr when the run fails.
    """
    qemu, sysroot = require(QEMU), require(SYSROOT)
    runtime = ensure_runtime()
    host = ensure_host(runtime)
    with tempfile.TemporaryDirectory(prefix="rangeprof-qemu-") as scratch:
        files = []
        for index, value in enumerate(inputs):
            files.append(Path(scratch) / f"input_{index}.npy")
            # Not ascontiguousarray, which makes a 0-d array 1-d.
            np.save(files[-1], np.asarray(value, order="C"))
        # The library path must hold a slash (dlopen searches the library path for a bare
        # name), hence absolute; the runtime directory is absolute already.
        # -E sets the variable for the aarch64 program only, not for qemu's own (x86) loader.
        command = [qemu, "-L", sysroot, "-E", f"LD_LIBRARY_PATH={runtime}", str(host)]
        command += [str(Path(library_path).absolute()), scratch, *map(str, files)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise QemuRunError(f"{library_path} ran for more than {timeout} s under qemu") from err
        if done.returncode != 0:
            raise QemuRunError(
                f"{library_path} failed under {QEMU} (exit status {done.returncode}): "
                f"{done.stderr.strip()[-3000:]}"
            )
        outputs = sorted(
            Path(scratch).glob("output_*.npy"), key=lambda p: int(p.stem.removeprefix("output_"))
        )
        return [np.load(path) for path in outputs]
