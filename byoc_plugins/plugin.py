"""The plugin interface: what a target declares, and the registry of targets.

A plugin is three things (after the RFC's BYOC split):

* its **pattern table** — which FP32 subgraphs it offloads (:mod:`.patterns`, with constraint
  checks);
* its **quantization policy** (:class:`~rangeprof.byoc.policy.QuantPolicy`);
* its **code generator** — how the lowered module (:mod:`.lowering`) becomes a runnable
  artifact: ``compile(mod) -> tvm.runtime.Executable`` for the plugin's target,
  ``export(executable, path)`` writing the shared library (a cross compiler for other
  architectures), and, for accelerators, the name of the external codegen
  (``relax.ext.<name>``) that receives the integer cores.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import tvm
from tvm import relax

from rangeprof.profiler.errors import RangeprofError

from .policy import TARGETS, QuantPolicy


def _export_library(executable: tvm.runtime.Executable, path: Path) -> None:
    executable.export_library(str(path))


@dataclass(frozen=True)
class Plugin:
    name: str
    policy: QuantPolicy
    patterns: Callable[[], list[relax.transform.FusionPattern]]
    target: Callable[[], tvm.target.Target]
    compile: Callable[[tvm.IRModule], tvm.runtime.Executable]
    export: Callable[[tvm.runtime.Executable, Path], None] = _export_library
    external: str | None = None  # external codegen receiving the integer cores
    # What the target made of each region of a lowered module, by core symbol (e.g. tiling)
    describe: Callable[[tvm.IRModule], dict[str, dict]] | None = None
    runs_here: bool = True  # False: cross-compiled (run elsewhere, or under an emulator)
    # What the plugin was configured with when obtained (npu: its buffer size), for the manifest
    options: dict = field(default_factory=dict)
    # Emits a dense layer on 4-bit weights (:data:`~.lowering.DenseW4`); None: no such kernel
    dense_w4: Callable | None = None
    # The same with its activations quantized to 8 bits per row at run time (W4A8)
    dense_w4a8: Callable | None = None


def get_plugin(name: str, weight_bits: int | None = None) -> Plugin:
    """The plugin of a target name (``x86``, ``aarch64``, ``npu``), its policy's weights in
    ``weight_bits`` (7 or 8) for every layer when given, else as the target chooses (x86: by
    CPU, per layer without VNNI)."""
    if name not in TARGETS:
        raise RangeprofError(f"unknown target {name!r}; expected one of {', '.join(TARGETS)}")
    module = importlib.import_module(f"rangeprof.byoc.{name}")
    # A plugin configured from the environment is made here, once: what its code generation
    # reads is decided when the plugin is obtained, not during the build.
    plugin = module.make_plugin() if hasattr(module, "make_plugin") else module.PLUGIN
    if weight_bits is None or weight_bits == plugin.policy.weight_bits:
        return plugin
    return replace(plugin, policy=replace(plugin.policy, weight_bits=weight_bits))
