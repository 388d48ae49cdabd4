"""Lineage: which initial-IR profileIDs each binding of a later IR derives from.

A binding's lineage is the set of profileIDs on its value's span
(:mod:`rangeprof.profiler.ir.spans`); an alias binding (``y = x``) has the lineage of ``x``. Passes
that keep spans (FoldConstant, CanonicalizeBindings, our FoldScaleAxis) need nothing more. For
passes that drop them (DecomposeOpsForInference on the nodes it creates, LegalizeOps, FuseOps,
FuseTIR, the call sites of FuseOpsByPattern) :class:`Tracked` wraps the pass and
:func:`carry_lineage` restores the lineage by comparing the module before and after, in this order
of evidence:

1. the value still carries IDs;
2. the binding's Var existed before (LegalizeOps and DecomposeOpsForInference keep the Var of
   the binding they rewrite);
3. the value calls a function of the module (a fused or composite function, or after FuseTIR a
   PrimFunc named like the fused Relax function it replaced): the union of that function's IDs
   (a function the pass made once for several call sites is first split per call site by
   :func:`split_shared_functions`, each copy carrying the IDs of what its call replaced);
4. a new binding feeding tracked bindings (a decomposition's intermediate values) takes the union
   of its consumers' lineage; one that feeds nothing tracked takes its producers' lineage.

An ID that no binding carries any more is not lost silently: :func:`stage_report` records its
fate — ``folded_into:<binding key>`` when what carried it now lives inside a later binding (a
weight transposed at compile time, a folded batch-norm statistic), ``eliminated:constant`` when
it became a constant nobody consumes and ``eliminated:dead`` when it was dead code.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import tvm
import tvm_ffi
from tvm import relax

from rangeprof.profiler.ir.bindings import (
    BindingRef,
    function_bindings,
    module_bindings,
    op_name,
    relax_functions,
    used_vars,
)
from rangeprof.profiler.ir.fates import ELIMINATED, FOLDED_INTO, Fate
from rangeprof.profiler.ir.spans import ids_of, with_ids
from rangeprof.profiler.ir.tagging import INPUT_PREFIX, WEIGHT_PREFIX

Lineage = frozenset[str]


def _constants(value) -> list[tvm.ir.GenericConst]:
    found = []
    if isinstance(value, tvm.ir.Call):
        for arg in value.args:
            if isinstance(arg, tvm.ir.GenericConst):
                found.append(arg)
            elif isinstance(arg, relax.Tuple):
                found += [f for f in arg.fields if isinstance(f, tvm.ir.GenericConst)]
    return found


def binding_lineages(mod: tvm.IRModule) -> dict[str, Lineage]:
    """Lineage of every binding, keyed by binding key (aliases resolved)."""
    return {key: lin for key, (_, lin) in _lineage_table(mod).items()}


def _lineage_table(mod: tvm.IRModule) -> dict[str, tuple[BindingRef, Lineage]]:
    table: dict[str, tuple[BindingRef, Lineage]] = {}
    # A graph input returned as it is (``gv = x``: an Identity model) has the input's lineage.
    params = next((f.params for name, f in relax_functions(mod) if name == "main"), [])
    by_var: dict[relax.Var, Lineage] = {p: frozenset([INPUT_PREFIX + str(p.name)]) for p in params}
    for ref in module_bindings(mod):
        value = ref.value
        if isinstance(value, relax.Var):
            lin = by_var.get(value, frozenset())
        elif isinstance(value, relax.Function):
            lin = function_lineage(value)
        else:
            lin = ids_of(value)
        by_var[ref.var] = lin
        table[ref.key] = (ref, lin)
    return table


def function_lineage(func: relax.Function) -> Lineage:
    """Union of the lineage of every expression inside ``func`` (weights excluded)."""
    ids: set[str] = set()

    def visit(expr):
        if isinstance(expr, tvm.ir.Call | relax.Tuple | relax.TupleGetItem):
            ids.update(ids_of(expr))

    relax.analysis.post_order_visit(func.body, visit)
    return frozenset(ids)


def _callee_name(value) -> str | None:
    if not isinstance(value, tvm.ir.Call):
        return None
    if isinstance(value.op, tvm.ir.GlobalVar):
        return value.op.name_hint
    if isinstance(value.op, tvm.ir.Op) and value.args:
        target = value.args[0]
        if isinstance(target, tvm.ir.GlobalVar) and str(value.op.name).startswith("relax.call_"):
            return target.name_hint
    return None


def carry_lineage(before: tvm.IRModule, after: tvm.IRModule) -> tvm.IRModule:
    """``after`` with lineage restored on every binding that lost it (rules in the module doc)."""
    table = _lineage_table(before)
    known: dict[relax.Var, Lineage] = {}
    for ref, lin in table.values():
        if lin:
            known[ref.var] = lin
    func_ids = {name: function_lineage(f) for name, f in relax_functions(before)}

    # A removed alias or tuple projection (``y = x``, ``y = (a, b)[0]``) *is* the value it
    # names: its IDs move to the binding that still computes that value.
    after_vars = {ref.var for ref in module_bindings(after)}
    values = {ref.var: ref.value for ref, _ in table.values()}
    merged: dict[relax.Var, set[str]] = {}
    for ref, lin in table.values():
        if ref.var not in after_vars and lin:
            target = _aliased(ref.value, values)
            if target is not None and target in after_vars:
                merged.setdefault(target, set()).update(lin)

    out = after.clone()
    # Callees first so that their lineage is complete when their call sites are restored.
    order = sorted(relax_functions(after), key=lambda item: item[0] == "main")
    for name, func in order:
        restored = _restore_function(func, known, func_ids, merged)
        out[name] = restored
        func_ids[name] = function_lineage(restored)
    return out


def _aliased(value, values: dict) -> relax.Var | None:
    """The Var whose value ``value`` is, following aliases and projections of tuple literals."""
    while True:
        if isinstance(value, relax.Var):
            inner = values.get(value)
            if not isinstance(inner, relax.Var | relax.TupleGetItem):
                return value
            value = inner
        elif isinstance(value, relax.TupleGetItem):
            tup = value.tuple_value
            tup = values.get(tup, tup) if isinstance(tup, relax.Var) else tup
            if not isinstance(tup, relax.Tuple):
                return None
            value = tup.fields[value.index]
        else:
            return None


def _restore_function(func, known, func_ids, merged) -> relax.Function:
    refs = list(function_bindings("_", func))
    lineage: dict[relax.Var, Lineage] = {}
    pending: list[BindingRef] = []
    for ref in refs:
        value = ref.value
        lin = ids_of(value) if not isinstance(value, relax.Var) else frozenset()
        if isinstance(value, relax.Var):
            lin = lineage.get(value, known.get(value, frozenset()))
        if not lin:
            lin = known.get(ref.var, frozenset())
        if not lin:
            lin = func_ids.get(_callee_name(value), frozenset())
        if not lin and isinstance(value, tvm.ir.Call) and isinstance(value.op, relax.Var):
            lin = lineage.get(value.op, frozenset())  # a call to a local (composite) function
        if isinstance(value, relax.Function):
            lin = function_lineage(value)
        lin = lin | merged.get(ref.var, frozenset())
        lineage[ref.var] = lin
        if not lin:
            pending.append(ref)

    if pending:
        consumers: dict[relax.Var, list[relax.Var]] = {}
        for ref in refs:
            for used in used_vars(ref.value):
                consumers.setdefault(used, []).append(ref.var)
        for ref in reversed(pending):
            lineage[ref.var] = frozenset().union(
                *(lineage.get(c, frozenset()) for c in consumers.get(ref.var, []))
            )
        for ref in pending:
            if not lineage[ref.var]:
                lineage[ref.var] = frozenset().union(
                    *(lineage.get(u, known.get(u, frozenset())) for u in used_vars(ref.value))
                )

    def restored(b) -> relax.Expr:
        value = b.value
        if isinstance(value, relax.Function):
            value = _with_body(value, rewrite_seq(value.body))
        elif isinstance(value, relax.If):
            value = relax.If(
                value.cond,
                rewrite_seq(value.true_branch),
                rewrite_seq(value.false_branch),
                value.span,
            )
        lin = lineage.get(b.var, frozenset())
        if lin and not isinstance(value, relax.Var) and ids_of(value) != lin:
            value = with_ids(value, lin)
        return value

    def rewrite_seq(seq: relax.SeqExpr) -> relax.SeqExpr:
        return _rebuilt(seq, restored)

    return _with_body(func, rewrite_seq(func.body))


def _rebuilt(seq: relax.SeqExpr, value_of) -> relax.SeqExpr:
    """``seq`` with each binding's value replaced by ``value_of(binding)`` (its Var, kind and
    span kept)."""
    blocks = []
    for block in seq.blocks:
        bindings = []
        for b in block.bindings:
            value = value_of(b)
            if isinstance(b, relax.MatchCast):
                bindings.append(relax.MatchCast(b.var, value, b.ty, b.span))
            else:
                bindings.append(relax.VarBinding(b.var, value, b.span))
        blocks.append(type(block)(bindings, block.span))
    return relax.SeqExpr(blocks, seq.body, seq.span)


def _with_body(func: relax.Function, body: relax.SeqExpr) -> relax.Function:
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


def _same_call(value, op, args) -> bool:
    """``value`` is ``op`` applied to ``args`` (Vars by identity, constants by structure)."""
    return (
        isinstance(value, relax.Call)
        and value.op.same_as(op)
        and len(value.args) == len(args)
        and all(
            a.same_as(w) if isinstance(w, relax.Var) else tvm_ffi.structural_equal(a, w)
            for a, w in zip(value.args, args, strict=True)
        )
    )


def _replaced(func: relax.Function, args, renamed: dict, users: dict) -> list | None:
    """The ``before`` bindings a call of ``func`` on ``args`` replaced, one per binding of
    ``func``: its first operator applied to the arguments, each next one to what the previous
    ones computed; None when some binding has no such counterpart."""
    env = {param: renamed.get(arg, arg) for param, arg in zip(func.params, args, strict=True)}
    found = []
    for ref in function_bindings("_", func):
        call = ref.value
        if not isinstance(call, relax.Call):
            return None
        wanted = [env.get(a, a) for a in call.args]
        anchor = next((w for w in wanted if isinstance(w, relax.Var)), None)
        match = next(
            (b for b in users.get(anchor, []) if _same_call(b.value, call.op, wanted)), None
        )
        if match is None:
            return None
        env[ref.var] = match.var
        found.append(match)
    return found


def split_shared_functions(before: tvm.IRModule, after: tvm.IRModule) -> tvm.IRModule:
    """``after`` (``before`` with subgraphs of ``main`` outlined into functions) with one
    function per call site, each carrying the IDs of the bindings its call replaced.

    FuseOpsByPattern adds its composite functions through a BlockBuilder, which reuses a
    structurally equal function, spans ignored: an encoder's four attention matmuls become one
    function called four times, whose body holds the first layer's IDs only. Each call is
    matched to the chain of ``before`` bindings it replaced (:func:`_replaced`); a call of a
    shared function gets a copy, its bindings tagged one by one and the call with their union.
    (FuseOps' functions stay shared: compiled once, and their lineage is only reported.)"""
    main = after["main"]
    refs = list(function_bindings("main", main))
    counts = Counter(
        r.value.op
        for r in refs
        if isinstance(r.value, relax.Call) and isinstance(r.value.op, tvm.ir.GlobalVar)
    )
    if all(n == 1 for n in counts.values()):
        return after
    users: dict[relax.Var, list[relax.VarBinding]] = {}
    for ref in function_bindings("main", before["main"]):
        for var in used_vars(ref.value):
            users.setdefault(var, []).append(ref)
    renamed: dict[relax.Var, relax.Var] = {}  # an outlined call's Var -> the Var it replaced
    retagged: dict[relax.Var, relax.Call] = {}
    out = after.clone()
    copies = Counter()
    for ref in refs:
        call = ref.value
        if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.GlobalVar)):
            continue
        func = after[call.op]
        if not (isinstance(func, relax.Function) and "Composite" in func.attrs):
            continue
        found = _replaced(func, call.args, renamed, users)
        if found is None:
            continue
        renamed[ref.var] = found[-1].var
        if counts[call.op] == 1:
            continue
        tags = {
            r.var: ids_of(m.value) for r, m in zip(function_bindings("_", func), found, strict=True)
        }
        copies[call.op] += 1
        name = f"{call.op.name_hint}_site{copies[call.op]}"
        gvar = tvm.ir.GlobalVar(name)
        out[gvar] = _retagged(func, tags)
        ids = frozenset().union(*tags.values())
        retagged[ref.var] = with_ids(relax.Call(gvar, call.args, call.attrs, call.ty_args), ids)
    if not retagged:
        return after
    for gvar in [g for g in counts if copies[g] == counts[g]]:
        del out[gvar]  # every call now has its own copy
    out["main"] = _retagged(main, {}, retagged)
    return out


def _retagged(func: relax.Function, tags: dict, values: dict | None = None) -> relax.Function:
    """``func`` with the values of the bindings in ``tags`` carrying those IDs, and those in
    ``values`` replaced."""
    values = values or {}

    def value_of(b) -> relax.Expr:
        value = values.get(b.var, b.value)
        return with_ids(value, tags[b.var]) if b.var in tags else value

    return _with_body(func, _rebuilt(func.body, value_of))


@tvm.transform.module_pass(opt_level=0, name="Tracked")
class Tracked:
    """Runs ``inner`` and restores the lineage it dropped (see :func:`carry_lineage`)."""

    def __init__(self, inner: tvm.transform.Pass):
        self.inner = inner

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return carry_lineage(mod, split_shared_functions(mod, self.inner(mod)))


# ---------------------------------------------------------------------------------------------
# Stage reports and verification


@dataclass
class StageReport:
    """One stage of the pipeline as ``rangeprof inspect --json`` shows it."""

    name: str
    bindings: int
    tracked: int
    ops: dict[str, int]
    lineage: dict[str, list[str]]
    fates: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def alive_ids(mod: tvm.IRModule) -> Lineage:
    """IDs carried by some binding or weight constant of ``mod`` (graph inputs always live)."""
    ids: set[str] = set()
    for lin in binding_lineages(mod).values():
        ids.update(lin)

    def visit(expr):
        if isinstance(expr, tvm.ir.GenericConst):
            ids.update(ids_of(expr))

    for _, func in relax_functions(mod):
        relax.analysis.post_order_visit(func.body, visit)
        ids.update(INPUT_PREFIX + str(p.name) for p in func.params)
    return frozenset(ids)


def stage_report(
    name: str,
    mod: tvm.IRModule,
    all_ids: set[str],
    previous: tvm.IRModule | None = None,
    previous_fates: dict[str, str] | None = None,
) -> StageReport:
    """Counts, op histogram, lineage and fates of one stage.

    ``all_ids`` are the initial profileIDs; fates accumulate: an ID keeps the fate of the stage
    where it disappeared.
    """
    table = _lineage_table(mod)
    lineage = {key: sorted(lin) for key, (_, lin) in table.items()}
    ops = Counter(op_name(ref.value) for ref, _ in table.values())
    fates = dict(previous_fates or {})
    # A computed value lives in a binding; one left only as a constant (a folded shape, say)
    # has become that constant and gets a fate. Inputs and weights live outside bindings.
    in_bindings = {i for _, lin in table.values() for i in lin}
    alive = {i for i in alive_ids(mod) if i in in_bindings or _is_leaf(i)}
    lost = sorted(i for i in all_ids if i not in alive and i not in fates)
    if lost:
        if previous is None:
            fates.update({i: str(Fate(kind=ELIMINATED, target="dead")) for i in lost})
        else:
            fates.update(_fates(lost, previous, mod, table))
    for i in alive:
        fates.pop(i, None)
    return StageReport(
        name=name,
        bindings=len(table),
        tracked=sum(1 for _, lin in table.values() if lin),
        ops=dict(sorted(ops.items())),
        lineage=lineage,
        fates=dict(sorted(fates.items())),
    )


def _fates(lost, previous, current, cur_table) -> dict[str, str]:
    """Where each ID that ``current`` no longer carries went, judged from ``previous``."""
    prev_table = _lineage_table(previous)
    cur_key_of_var = {ref.var: key for key, (ref, _) in cur_table.items()}
    cur_by_id: dict[str, str] = {}
    for key, (_, lin) in cur_table.items():
        for i in lin:
            cur_by_id.setdefault(i, key)

    consumers: dict[relax.Var, list[BindingRef]] = {}
    const_consumers: dict[str, list[BindingRef]] = {}
    for ref, _ in prev_table.values():
        for used in used_vars(ref.value):
            consumers.setdefault(used, []).append(ref)
        for const in _constants(ref.value):
            for i in ids_of(const):
                const_consumers.setdefault(i, []).append(ref)
    prev_lin = {ref.var: lin for ref, lin in prev_table.values()}

    def surviving(ref: BindingRef) -> str | None:
        """The current binding that ``ref`` became, or that absorbed what it computed."""
        seen, frontier = set(), [ref]
        while frontier:
            nxt = []
            for r in frontier:
                if r.var in seen:
                    continue
                seen.add(r.var)
                if r.var in cur_key_of_var:
                    return cur_key_of_var[r.var]
                for i in sorted(prev_lin.get(r.var, ())):
                    if i in cur_by_id:
                        return cur_by_id[i]
                nxt += consumers.get(r.var, [])
            frontier = nxt
        return None

    # Constants of the current module by the IDs on their spans, and the bindings using them.
    cur_const_users: dict[str, str | None] = {}
    for key, (ref, _) in cur_table.items():
        for const in _constants(ref.value):
            for i in ids_of(const):
                cur_const_users.setdefault(i, key)
    for _, func in relax_functions(current):
        for i in ids_of(func.body.body):  # a constant returned as it is
            cur_const_users.setdefault(i, None)

    fates = {}
    for lost_id in lost:
        if lost_id in cur_const_users:
            user = cur_const_users[lost_id]
            fates[lost_id] = str(
                Fate(kind=ELIMINATED, target="constant")
                if user is None
                else Fate(kind=FOLDED_INTO, target=user)
            )
            continue
        holders = [ref for ref, lin in prev_table.values() if lost_id in lin]
        holders += const_consumers.get(lost_id, [])
        target = next((t for t in map(surviving, holders) if t), None)
        if target is not None:
            fates[lost_id] = str(Fate(kind=FOLDED_INTO, target=target))
        elif holders and all(not used_vars(h.value) for h in holders):
            fates[lost_id] = str(Fate(kind=ELIMINATED, target="constant"))
        else:
            fates[lost_id] = str(Fate(kind=ELIMINATED, target="dead"))
    return fates


def _is_leaf(profile_id: str) -> bool:
    """Inputs and weights: values that live outside bindings."""
    return profile_id.startswith((INPUT_PREFIX, WEIGHT_PREFIX))


def untracked_bindings(mod: tvm.IRModule) -> list[str]:
    """Keys of bindings without lineage: each one is a bug in a pass wrapper or in tagging."""
    return [key for key, lin in binding_lineages(mod).items() if not lin]


def verify_lineage(reports: list[StageReport], all_ids: set[str]) -> list[str]:
    """Problems with a tracked pipeline: untracked bindings and IDs neither alive nor fated."""
    problems = []
    for report in reports:
        for key, lin in report.lineage.items():
            if not lin:
                problems.append(f"{report.name}: binding {key} has no lineage")
        alive = {i for lin in report.lineage.values() for i in lin}
        for i in sorted(all_ids):
            # Inputs and weights live outside bindings; stage_report fated the lost ones.
            if i not in report.fates and i not in alive and not _is_leaf(i):
                problems.append(f"{report.name}: profileID {i} vanished without a fate")
    return problems
