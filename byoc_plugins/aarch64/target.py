"""The aarch64 build target, and export of an executable built for it as an aarch64 library."""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm.support import cc

from .toolchain import CXX, require

# NEON plus the dot-product extension (ARMv8.2-A's sdot / udot, on every core since Cortex-A55),
# for a small two-core board. The schedules read the vector unit from the triple.
AARCH64_TARGET = tvm.target.Target(
    {
        "kind": "llvm",
        "mtriple": "aarch64-linux-gnu",
        "mattr": ["+neon", "+dotprod"],
        "num-cores": 2,
    }
)


def export(executable: tvm.runtime.Executable, path: str | Path) -> None:
    """Writes ``executable`` (built for :data:`AARCH64_TARGET`) as an aarch64 shared library,
    linked by the cross compiler; :class:`~.toolchain.ToolchainError` when it is missing."""
    executable.export_library(str(path), fcompile=cc.cross_compiler(require(CXX)))
