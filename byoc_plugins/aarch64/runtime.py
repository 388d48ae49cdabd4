"""The aarch64 TVM runtime: ``libtvm_runtime.so`` and ``libtvm_ffi.so`` for the installed versions.

They come from the aarch64 wheels of ``apache-tvm`` and ``apache-tvm-ffi`` on PyPI, at exactly
the versions installed here (the exported libraries and the host program's headers must match
the runtime), fetched once with pip and unpacked into :func:`runtime_dir`, which
``RANGEPROF_AARCH64_RUNTIME`` overrides: a directory that already holds both libraries (say,
copied from a board, for a machine without PyPI) is used without downloading.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

from rangeprof.profiler.settings import settings

from .toolchain import ToolchainError

ENV_VAR = "RANGEPROF_AARCH64_RUNTIME"

# Distribution -> the runtime library inside its wheel.
_LIBRARIES = {
    "apache-tvm": "tvm/lib/libtvm_runtime.so",
    "apache-tvm-ffi": "tvm_ffi/lib/libtvm_ffi.so",
}
# tvm's aarch64 wheel is tagged manylinux_2_28, tvm-ffi's also manylinux_2_24 / 2014.
_PLATFORMS = ("manylinux_2_28_aarch64", "manylinux2014_aarch64")


def _versions() -> dict[str, str]:
    return {dist: metadata.version(dist) for dist in _LIBRARIES}


def runtime_dir() -> Path:
    """``$RANGEPROF_AARCH64_RUNTIME``, else ``~/.cache/rangeprof/aarch64-runtime/<versions>``
    (under ``$XDG_CACHE_HOME`` when set). Not under ``$RANGEPROF_CACHE``: tests point that at a
    fresh directory per session, and the runtime is worth keeping across sessions."""
    current = settings()
    if current.aarch64_runtime:
        return current.aarch64_runtime.absolute()
    cache = current.cache_home
    tag = "_".join(f"{dist}-{version}" for dist, version in _versions().items())
    return cache / "rangeprof" / "aarch64-runtime" / tag


def _download(dist: str, version: str, dest: Path) -> Path:
    """The aarch64 wheel of ``dist==version``, downloaded by pip into ``dest``."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    command += ["--no-deps", "--only-binary=:all:", "--dest", str(dest)]
    command += [arg for platform in _PLATFORMS for arg in ("--platform", platform)]
    command += ["--python-version", f"{sys.version_info.major}.{sys.version_info.minor}"]
    done = subprocess.run([*command, f"{dist}=={version}"], capture_output=True, text=True)
    wheels = list(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise ToolchainError(
            f"cannot download the aarch64 wheel of {dist}=={version} for the aarch64 runtime "
            f"(set {ENV_VAR} to a directory holding libtvm_runtime.so and libtvm_ffi.so "
            f"instead): {done.stderr.strip()[-2000:]}"
        )
    return wheels[0]


def ensure_runtime() -> Path:
    """The directory holding the aarch64 runtime libraries, downloading them on first use."""
    directory = runtime_dir()
    wanted = {dist: directory / Path(member).name for dist, member in _LIBRARIES.items()}
    if all(path.exists() for path in wanted.values()):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        for dist, version in _versions().items():
            wheel = _download(dist, version, Path(scratch) / dist)
            with zipfile.ZipFile(wheel) as archive:
                unpacked = archive.extract(_LIBRARIES[dist], Path(scratch) / "unpacked")
            # A rename within the directory is atomic: a concurrent session sees the whole
            # library or none.
            os.replace(unpacked, wanted[dist])
    return directory
