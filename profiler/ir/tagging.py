"""profileIDs: naming the initial IR's bindings, inputs and weights, and the pass that tags them.

The rules (stable across machines and runs because they depend only on the ONNX graph):

* a binding produced by ONNX node ``N`` is ``N`` when the node became one binding, and ``N#k``
  (``k`` = 0, 1, ... in program order) when it expanded into several (Gemm -> permute, matmul,
  add);
* a graph input ``x`` is ``input:x``; a weight (initializer or Constant-node output) ``w`` is
  ``weight:w``; the output tuple of a multi-output model is ``output``.

Node names are unique after :mod:`rangeprof.profiler.ir.onnx_load` normalises them, and the prefixes
keep inputs and weights apart from nodes, so IDs are unique."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import tvm
from tvm import relax

from rangeprof.profiler.ir.spans import with_ids

INPUT_PREFIX = "input:"
WEIGHT_PREFIX = "weight:"
OUTPUT_ID = "output"


@dataclass(frozen=True)
class LayerRecord:
    """What one profileID stands for in the initial IR."""

    profile_id: str
    kind: str  # "activation" | "input" | "weight"
    op: str  # Relax op of the binding ("input" / "constant" for inputs and weights)
    source_node: str | None  # ONNX node name
    source_op: str | None  # ONNX op type
    source_tensor: str | None  # ONNX tensor this binding's value is, if any
    shape: list[int] | None
    dtype: str

    def to_json(self) -> dict:
        return asdict(self)


def node_binding_ids(node_name: str, count: int) -> list[str]:
    """profileIDs of the ``count`` bindings one ONNX node expanded into, in program order."""
    if count == 1:
        return [node_name]
    return [f"{node_name}#{k}" for k in range(count)]


@tvm.transform.module_pass(opt_level=0, name="TagProfileIDs")
class TagProfileIDs:
    """Sets the span of every binding value and weight constant in ``main`` to its profileID.

    ``binding_ids`` maps binding Vars and ``weight_ids`` maps weight constants of the module the
    pass is applied to (the importer computes both while building it) to their profileIDs.
    """

    def __init__(
        self,
        binding_ids: dict[relax.Var, str],
        weight_ids: dict[tvm.ir.GenericConst, str],
    ):
        self.binding_ids = binding_ids
        self.weight_ids = weight_ids

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        func = mod["main"]
        tagged = relax.Function(
            func.params,
            self._seq(func.body),
            func.ret_ty,
            func.is_pure,
            func.attrs,
            func.span,
        )
        out = mod.clone()
        out["main"] = tagged
        return out

    def _seq(self, seq: relax.SeqExpr) -> relax.SeqExpr:
        blocks = []
        for block in seq.blocks:
            bindings = [
                relax.VarBinding(b.var, self._value(b.var, b.value), b.span) for b in block.bindings
            ]
            blocks.append(type(block)(bindings, block.span))
        return relax.SeqExpr(blocks, seq.body, seq.span)

    def _value(self, var: relax.Var, value: relax.Expr) -> relax.Expr:
        if isinstance(value, relax.If):
            value = relax.If(
                value.cond,
                self._seq(value.true_branch),
                self._seq(value.false_branch),
                value.span,
            )
        if isinstance(value, tvm.ir.Call):
            args = [self._weight(a) for a in value.args]
            value = relax.Call(value.op, args, value.attrs, value.ty_args, value.span, value.ty)
        elif isinstance(value, relax.Tuple):
            value = relax.Tuple([self._weight(f) for f in value.fields], value.span)
        profile_id = self.binding_ids.get(var)
        return with_ids(value, [profile_id]) if profile_id is not None else value

    def _weight(self, arg: relax.Expr) -> relax.Expr:
        if isinstance(arg, relax.Tuple):
            return relax.Tuple([self._weight(f) for f in arg.fields], arg.span)
        profile_id = self.weight_ids.get(arg) if isinstance(arg, tvm.ir.GenericConst) else None
        return with_ids(arg, [profile_id]) if profile_id is not None else arg
