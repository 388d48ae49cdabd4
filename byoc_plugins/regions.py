"""Regions: the offloaded subgraphs of a model, found by a plugin's patterns, and their qparams
found through the lineage.

:func:`~rangeprof.profiler.ir.stages.partition` runs ``FuseOpsByPattern`` on the model after
``fold_scale_axis`` (batch norms and channel scales folded into the weights): every match becomes
a composite function called from ``main``. A composite carries the profileIDs of the initial
nodes it covers (its lineage), and the tensors at its boundaries are named by them:

* the **output** is the value of the region's last initial node: of the tensor IDs in its
  lineage, the latest in the initial program order — a conv that absorbed a batch norm, a ReLU
  and a backward-folded channel scale computes the scale's output;
* the **input** is the output of the binding that feeds it, by the same rule, or the graph
  input ``input:<name>``; a ``batch_matmul``'s second **operand** is named the same way, and
  takes its range on a symmetric int8 grid (:meth:`~.policy.ActivationQ.symmetric`): a zero
  point there would cost a row sum of the first operand per output, and the kernels multiply
  unsigned by signed.

A region whose boundary has no qparams is an error naming the region, unless the user asked for
FP32 fallback: then it stays FP32, and :class:`Region` says why. Its output needs none where the
target's policy leaves outputs that FP32 operators read in FP32 (``integer_outputs`` off): no
region reads that output in 8 bits (it would need the same qparams as its input), so it leaves
as a scaled accumulator — a QDQ model pairs only what integer operators read.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import tvm
from tvm import relax

from rangeprof.profiler.calibrate.weight_only import Int4Weights
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.lineage import function_lineage
from rangeprof.profiler.ir.spans import ids_of
from rangeprof.profiler.ir.tagging import INPUT_PREFIX, LayerRecord

from .patterns import BATCH_MATMUL, FloatRegion, read_region
from .policy import ActivationQ


@dataclass(frozen=True)
class Region:
    """One composite call of ``main``: what it computes, its identity and its qparams."""

    name: str  # the composite function
    pattern: str
    float_region: FloatRegion
    profile_ids: tuple[str, ...]  # its lineage, sorted
    input: ActivationQ | None  # None: stays FP32 (see ``fallback``)
    output: ActivationQ | None  # None: FP32 (no qparams, or the region stays FP32)
    output_id: str | None  # the tensor the region computes (None: none of the initial IR)
    fallback: str | None = None  # why the region stays FP32
    operand: ActivationQ | None = None  # a batch_matmul's second (activation) operand
    # Its weights' bits where the policy chooses them per layer (set by the quantized model)
    weight_bits: int | None = None
    int4: Int4Weights | None = None  # its weights in 4 bits, activations FP32 (weight-only)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "pattern": self.pattern,
            "op": self.float_region.kind,
            "profile_ids": list(self.profile_ids),
            "weight_id": self.float_region.weight_id,
            "input": self.input and self.input.to_json(),
            "output_id": self.output_id,
            "output": self.output and self.output.to_json(),
            **({"operand": self.operand.to_json()} if self.operand else {}),
            "fallback": self.fallback,
        }


def composite_calls(mod: tvm.IRModule) -> list[tuple[relax.VarBinding, relax.Function]]:
    """``main``'s bindings that call a composite function, in program order."""
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
                func = mod[value.op]
                if isinstance(func, relax.Function) and "Composite" in func.attrs:
                    found.append((binding, func))
    return found


class _Namer:
    """The profileID of the tensor a Var of ``main`` holds."""

    def __init__(self, mod: tvm.IRModule, layers: list[LayerRecord]):
        # Tensors only: tuple values (a batch norm's call) have no shape.
        self.order = {
            layer.profile_id: i
            for i, layer in enumerate(layers)
            if layer.shape is not None and layer.kind != "weight"
        }
        self.values: dict[relax.Var, frozenset[str]] = {}
        main = mod["main"]
        inputs = {layer.profile_id for layer in layers if layer.kind == "input"}
        for param in main.params:
            if INPUT_PREFIX + str(param.name) in inputs:
                self.values[param] = frozenset([INPUT_PREFIX + str(param.name)])
        for block in main.body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Var):
                    self.values[binding.var] = self.values.get(value, frozenset())
                elif isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.GlobalVar):
                    self.values[binding.var] = function_lineage(mod[value.op]) | ids_of(value)
                else:
                    self.values[binding.var] = ids_of(value)

    def tensor_id(self, lineage: frozenset[str]) -> str | None:
        """The latest tensor ID of ``lineage`` in the initial program order."""
        known = [i for i in lineage if i in self.order]
        return max(known, key=self.order.__getitem__, default=None)


def plan_regions(
    mod: tvm.IRModule,
    layers: list[LayerRecord],
    qparams: dict[str, dict],
    fp32_fallback: bool = False,
    float_outputs: bool = True,
    exclude: tuple[str, ...] = (),
) -> list[Region]:
    """A :class:`Region` per composite call of a partitioned module, with its qparams
    (``float_outputs``: the target leaves outputs FP32 operators read in FP32). A region
    holding a layer that a pattern of ``exclude`` matches (a profileID or a shell pattern of
    one) stays FP32; a pattern that matches no region's layer is an error (a typo)."""
    namer = _Namer(mod, layers)
    regions = []
    unmatched = set(exclude)
    for binding, func in composite_calls(mod):
        name = binding.value.op.name_hint
        lineage = function_lineage(func) | ids_of(binding.value)
        float_region = read_region(func)
        tensors = [("input", binding.value.args[0])]
        if float_region.kind == BATCH_MATMUL:
            tensors.append(("operand", binding.value.args[1]))
        boundary = {
            what: (namer.tensor_id(ids), ids)
            for what, ids in [(w, namer.values.get(v, frozenset())) for w, v in tensors]
        }
        output_id = namer.tensor_id(lineage)
        if output_id in qparams or not float_outputs:
            boundary["output"] = (output_id, lineage)
        pattern = str(func.attrs["Composite"])
        common = {
            "name": name,
            "pattern": pattern,
            "float_region": float_region,
            "profile_ids": tuple(sorted(lineage)),
            "output_id": output_id,
        }
        excluded = [p for p in exclude if any(fnmatchcase(i, p) for i in lineage)]
        if excluded:
            unmatched -= set(excluded)
            reason = f"excluded by {', '.join(map(repr, excluded))}"
            regions.append(Region(**common, input=None, output=None, fallback=reason))
            continue
        missing = [
            f"{what} {found!r}" if found else f"{what} (no tensor in {sorted(ids)})"
            for what, (found, ids) in boundary.items()
            if found not in qparams
        ]
        if missing:
            reason = f"region {name} ({pattern}): no qparams for its " + " and ".join(missing)
            if not fp32_fallback:
                raise RangeprofError(reason + " (profile it, or ask for FP32 fallback)")
            regions.append(Region(**common, input=None, output=None, fallback=reason))
            continue
        q = {what: ActivationQ.from_entry(qparams[found]) for what, (found, _) in boundary.items()}
        q.setdefault("output", None)
        if "operand" in q:
            q["operand"] = q["operand"].symmetric()
        regions.append(Region(**common, **q))
    if unmatched:
        raise RangeprofError(
            f"--exclude {', '.join(sorted(unmatched))}: matches no layer of a quantizable "
            "region (a profileID, or a shell pattern of one, as `rangeprof inspect` lists them)"
        )
    return regions
