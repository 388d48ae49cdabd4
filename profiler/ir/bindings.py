"""Enumerating and describing the bindings of a Relax module.

Every stage report, lineage check and tagging step walks bindings the same way: Relax functions
in name order, blocks in order, bindings in order. Keys are ``<function>/<var name>`` with a
``~k`` suffix when a name repeats inside a function (FuseOps and DecomposeOpsForInference reuse
names), so a key is unique and deterministic within one module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import tvm
from tvm import relax


@dataclass(frozen=True)
class BindingRef:
    """One binding of a Relax function, with its stable key inside the module."""

    key: str
    function: str
    binding: relax.VarBinding

    @property
    def var(self) -> relax.Var:
        return self.binding.var

    @property
    def value(self) -> relax.Expr:
        return self.binding.value


def relax_functions(mod: tvm.IRModule) -> list[tuple[str, relax.Function]]:
    """The module's Relax functions (PrimFuncs and externs excluded), sorted by name."""
    funcs = [(gv.name_hint, f) for gv, f in mod.functions.items() if isinstance(f, relax.Function)]
    return sorted(funcs, key=lambda item: item[0])


def function_bindings(name: str, func: relax.Function) -> Iterator[BindingRef]:
    """Bindings of one function in program order, including nested blocks (If branches, local
    functions such as the composites inside a merged BYOC region)."""
    seen: dict[str, int] = {}

    def walk(expr) -> Iterator[relax.VarBinding]:
        if isinstance(expr, relax.SeqExpr):
            for block in expr.blocks:
                for binding in block.bindings:
                    yield binding
                    value = binding.value
                    if isinstance(value, relax.If):
                        yield from walk(value.true_branch)
                        yield from walk(value.false_branch)
                    elif isinstance(value, relax.Function):
                        yield from walk(value.body)

    for binding in walk(func.body):
        var_name = str(binding.var.name)
        count = seen.get(var_name, 0)
        seen[var_name] = count + 1
        suffix = f"~{count}" if count else ""
        yield BindingRef(f"{name}/{var_name}{suffix}", name, binding)


def module_bindings(mod: tvm.IRModule) -> Iterator[BindingRef]:
    """All bindings of all Relax functions of ``mod``."""
    for name, func in relax_functions(mod):
        yield from function_bindings(name, func)


def used_vars(value: relax.Expr) -> list[relax.Var]:
    """Vars a binding value reads directly (through tuples; not into nested functions)."""
    if isinstance(value, relax.Var):
        return [value]
    if isinstance(value, tvm.ir.Call):
        return [v for a in value.args for v in used_vars(a)]
    if isinstance(value, relax.Tuple):
        return [v for f in value.fields for v in used_vars(f)]
    if isinstance(value, relax.TupleGetItem):
        return used_vars(value.tuple_value)
    if isinstance(value, relax.If):
        return used_vars(value.cond)
    return []


def op_name(value: relax.Expr) -> str:
    """A short, readable name for what a binding computes."""
    if isinstance(value, tvm.ir.Call):
        op = value.op
        if isinstance(op, tvm.ir.Op):
            name = str(op.name)
            if name in ("relax.call_tir", "relax.call_dps_packed") and value.args:
                callee = value.args[0]
                target = getattr(callee, "name_hint", None) or getattr(callee, "global_symbol", "")
                return f"{name}:{target}"
            return name
        if isinstance(op, tvm.ir.GlobalVar):
            return f"call:{op.name_hint}"
        if isinstance(op, relax.Var):
            return f"call:{op.name}"
        return "call"
    return type(value).__name__


def tensor_shape(ty) -> list[int] | None:
    """Static shape of a tensor type (symbolic dims -> -1); ``None`` for tuples, unknown shapes."""
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    values = getattr(ty.shape, "values", None)
    if values is None:
        return None
    return [int(v) if isinstance(v, tvm.tirx.IntImm) else -1 for v in values]


def tensor_dtype(ty) -> str:
    """Element type of a tensor type, ``"tuple"`` for tuples."""
    if isinstance(ty, relax.TensorType):
        return str(ty.dtype)
    if isinstance(ty, tvm.ir.TupleType):
        return "tuple"
    return type(ty).__name__
