"""Where a tensor's NaN and infinity can come from a constant: attention masks.

A causal mask is a constant holding ``-inf`` (char_gpt's ``weight:blocks.0.mask``); slices of it
are static tensors holding ``-inf`` too, and the scores it is added to hold one ``-inf`` per
masked position, every run. A padding mask is made from the data (Hugging Face's BERT:
``where(attention_mask == 0, -inf, 0)``), and the scores it is added to hold its ``-inf``
too. Those values are no overflow. This module finds, in the tagged initial IR, the
data-dependent tensors that read such values: each one's *non-finite inputs* — the static
tensors (constants, or bindings of constants alone) holding NaN or inf that it reads directly,
and the masked tensors it reshapes, transposes or combines elementwise (an infinity added to a
finite value stays one) — and their *origins*, the constants the values come from. That is
structure, known before any data runs; whether a tensor's NaN and inf are all explained by its
inputs is decided from the counts (:func:`rangeprof.profiler.profiling.document.flag_nonfinite`),
so a merge of shards decides as a single pass does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.ir.bindings import function_bindings
from rangeprof.profiler.ir.spans import ids_of

# Ops whose output holds a non-finite value wherever an operand holds one, broadcast or not:
# the ones that move values, and elementwise arithmetic. The fraction of non-finite values stays
# at most the operands' together, which flag_nonfinite checks.
_CARRY_VALUES = frozenset(
    f"relax.{name}"
    for name in (
        *("reshape", "permute_dims", "expand_dims", "squeeze", "flatten", "broadcast_to"),
        *("add", "subtract", "multiply", "maximum", "minimum", "where"),
    )
)


@dataclass(frozen=True)
class MaskSources:
    """What may put constant NaN / inf into one tensor: its non-finite inputs (profileIDs) and
    the constants they come from."""

    inputs: tuple[str, ...]
    origins: tuple[str, ...]


def _nonfinite_constant(expr) -> bool:
    if not isinstance(expr, tvm.ir.GenericConst) or "float" not in str(expr.ty.dtype):
        return False
    return not bool(np.isfinite(expr.value.numpy()).all())


def _args(value) -> list:
    """A binding's operands, tuples flattened."""
    if isinstance(value, tvm.ir.Call):
        return [f for a in value.args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
    if isinstance(value, relax.Tuple):
        return list(value.fields)
    if isinstance(value, relax.TupleGetItem):
        return [value.tuple_value]
    return [value]


def _op(value) -> str:
    op = getattr(value, "op", None)
    return str(op.name) if isinstance(op, tvm.ir.Op) else ""


def mask_sources(
    func: relax.Function, depends: set[relax.Var], static_nonfinite: set[str]
) -> dict[str, MaskSources]:
    """The :class:`MaskSources` of every data-dependent binding of ``func`` that has some, by
    profileID. ``depends``: the Vars that depend on an input; ``static_nonfinite``: the static
    bindings found holding NaN or inf (observed once, on zeros)."""
    walk = _Walk()
    for ref in function_bindings("main", func):
        value = ref.value
        if isinstance(value, relax.Var):  # a rename: what the named Var is
            walk.rename(ref.var, value)
            continue
        ids = ids_of(value)
        if len(ids) != 1:
            continue  # tuples of several tensors: no entry of their own
        walk.named[ref.var] = next(iter(ids))
        if ref.var not in depends:
            if ids & static_nonfinite:
                above = walk.sources(value, carry=False)
                walk.origins[ref.var] = frozenset(above.origins) or ids
            continue
        sources = walk.sources(value, carry=_op(value) in _CARRY_VALUES)
        if sources.inputs:
            walk.masked[ref.var] = sources
    return {walk.named[var]: sources for var, sources in walk.masked.items()}


class _Walk:
    """What the walk over the bindings has learnt so far."""

    def __init__(self):
        self.named: dict[relax.Var, str] = {}  # the profileID of each Var's value
        self.origins: dict[relax.Var, frozenset[str]] = {}  # static Vars holding NaN / inf
        self.masked: dict[relax.Var, MaskSources] = {}  # data-dependent Vars reading them

    def rename(self, var: relax.Var, named: relax.Var) -> None:
        for table in (self.named, self.origins, self.masked):
            if named in table:
                table[var] = table[named]

    def sources(self, value, carry: bool) -> MaskSources:
        """The non-finite inputs of a binding's value; through masked data-dependent operands
        only where the op carries their non-finite values (``carry``)."""
        inputs: set[str] = set()
        constants: set[str] = set()
        for arg in _args(value):
            if _nonfinite_constant(arg):
                inputs |= ids_of(arg)
                constants |= ids_of(arg)
            elif arg in self.origins:
                inputs.add(self.named[arg])
                constants |= self.origins[arg]
            elif carry and arg in self.masked:
                inputs.add(self.named[arg])
                constants |= set(self.masked[arg].origins)
        return MaskSources(tuple(sorted(inputs)), tuple(sorted(constants)))
