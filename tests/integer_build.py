"""The CPU build with the integer kernels (:mod:`rangeprof.byoc.cpu`), on the instructions the
plugin of the target would choose: aarch64's for an aarch64 triple, else x86's."""

from __future__ import annotations

import tvm

from rangeprof.byoc import cpu
from rangeprof.byoc.aarch64.isa import ISA as AARCH64_ISA
from rangeprof.byoc.x86.isa import ISA as X86_ISA


def build(
    mod: tvm.IRModule, target: tvm.target.Target, fold_scales: bool = True
) -> tvm.runtime.Executable:
    aarch64 = str(target.attrs.get("mtriple", "")).startswith(("aarch64", "arm64"))
    return cpu.build(mod, target, AARCH64_ISA if aarch64 else X86_ISA, fold_scales)
