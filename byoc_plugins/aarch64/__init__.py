"""aarch64: INT8 code for ARMv8.2-A with the dot product (``sdot``), cross-compiled by LLVM and
linked by ``aarch64-linux-gnu-g++``; here it runs under qemu-user.

The integer cores are built by the CPU build of the pipeline with the integer kernels of
:mod:`rangeprof.byoc.cpu` for :data:`AARCH64_TARGET` (``sdot``: :mod:`.isa`), with the same
quantization policy as x86 so that the two targets' integer outputs agree bit for bit.
Deployment and tests go through:

* :func:`export` — an executable built for :data:`AARCH64_TARGET` → an aarch64 ``.so``;
* :func:`run_under_qemu` — runs that ``.so``'s ``main`` on numpy inputs under
  ``qemu-aarch64`` with TVM's aarch64 runtime (:mod:`.runtime`, downloaded once) and a small C++
  host program (:mod:`.host`, compiled once);
* :func:`toolchain_available` / :func:`unavailable_reason` — whether this machine has the
  Debian packages for all that (``g++-aarch64-linux-gnu``, ``qemu-user``).
"""

from __future__ import annotations

from .. import cpu
from ..patterns import pattern_table
from ..plugin import Plugin
from ..policy import POLICIES
from .isa import ISA
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
    return cpu.build(mod, AARCH64_TARGET, ISA, fold_scales=False)


PLUGIN = Plugin(
    name="aarch64",
    policy=POLICIES["aarch64"],
    patterns=lambda: pattern_table("rangeprof_aarch64"),
    target=lambda: AARCH64_TARGET,
    compile=_compile,
    export=export,
    runs_here=False,
)
