"""The host tools the aarch64 target needs: a cross compiler, an emulator and the aarch64 libc.

All three come from Debian packages (``.ci/run`` installs them); :func:`require` turns a missing
one into an error that names it and the package to install, and :func:`unavailable_reason` lets
tests skip with the same words.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rangeprof.profiler.errors import RangeprofError

CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
# The aarch64 libc and dynamic loader that qemu-user runs programs against (`qemu-aarch64 -L`).
SYSROOT = "/usr/aarch64-linux-gnu"

_PACKAGES = {CXX: "g++-aarch64-linux-gnu", QEMU: "qemu-user", SYSROOT: "libc6-arm64-cross"}


class ToolchainError(RangeprofError):
    """A tool or library the aarch64 target needs is missing from this machine."""


def _find(name: str) -> str | None:
    if name == SYSROOT:
        return SYSROOT if (Path(SYSROOT) / "lib" / "ld-linux-aarch64.so.1").exists() else None
    return shutil.which(name)


def require(name: str) -> str:
    """The path of :data:`CXX`, :data:`QEMU` or :data:`SYSROOT`; :class:`ToolchainError` if
    it is missing."""
    found = _find(name)
    if found is None:
        raise ToolchainError(f"{name} not found (apt-get install {_PACKAGES[name]})")
    return found


def unavailable_reason() -> str | None:
    """Why the aarch64 toolchain cannot be used here, or None when it can."""
    missing = [name for name in _PACKAGES if _find(name) is None]
    if not missing:
        return None
    packages = " ".join(_PACKAGES[name] for name in missing)
    return (
        f"aarch64 toolchain incomplete: {', '.join(missing)} not found (apt-get install {packages})"
    )


def toolchain_available() -> bool:
    return unavailable_reason() is None
