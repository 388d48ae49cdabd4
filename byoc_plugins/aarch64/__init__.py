"""aarch64: INT8 code for ARMv8.2-A with the dot product (``sdot``), cross-compiled by LLVM and
linked by ``aarch64-linux-gnu-g++``; here it runs under qemu-user.

The integer cores are built by the fast CPU path (:mod:`rangeprof.profiler.build.schedules`) for
:data:`AARCH64_TARGET`, with the same quantization policy as x86 so that the two targets'
integer outputs agree bit for bit. Deployment and tests go through:

* :func:`export` — an executable built for :data:`AARCH64_TARGET` → an aarch64 ``.so``;
* :func:`run_under_qemu` — runs that ``.so``'s ``main`` on numpy inputs under
  ``qemu-aarch64`` with TVM's aarch64 runtime (:mod:`.runtime`, downloaded once) and a small C++
  host program (:mod:`.host`, compiled once);
* :func:`toolchain_available` / :func:`unavailable_reason` — whether this machine has the
  Debian packages for all that (``g++-aarch64-linux-gnu``, ``qemu-user``).
"""

from __future__ import annotations

from rangeprof.profiler.build.schedules import build

from ..patterns import pattern_table
from ..plugin import Plugin
from ..policy import POLICIES
from .qemu import QemuRunError, run_under_qemu
from .runtime import ensure_runtime, runtime_dir
from .target import AARCH64_TARGET, export
from .toolchain import ToolchainError, toolchain_available, unavailable_reason

__all__ = [
    "AARCH64_TARGET",
    "PLUGIN",
    "QemuRunError",
    "ToolchainError",
    "ensure_runtime",
    "export",
    "run_under_qemu",
    "runtime_dir",
    "toolchain_available",
    "unavailable_reason",
]


def _compile(mod):
    return build(mod, AARCH64_TARGET, fold_scales=False)


PLUGIN = Plugin(
    name="aarch64",
    description="INT8 conv2d / dense for ARMv8.2-A + dot product, cross-compiled (run: qemu-user)",
    policy=POLICIES["aarch64"],
    patterns=lambda: pattern_table("rangeprof_aarch64"),
    target=lambda: AARCH64_TARGET,
    compile=_compile,
    export=export,
    runs_here=False,
)
