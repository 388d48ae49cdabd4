"""SmoothQuant's rewrite: per-channel smoothing scales folded into a model, function unchanged.

Given a scale vector ``s`` for a tensor ``X`` that dense layers read (by its profileID; the
scales come from the profile, :mod:`rangeprof.profiler.calibrate.smoothing`), every dense layer
reading ``X`` gets ``W' = diag(s)·W`` and reads ``X' = X·diag(1/s)`` instead, so ``X'·W' =
X·W`` up to float rounding. ``X'`` is made one of two ways:

* **folded**: when ``X`` is a LayerNormalization's output (over the last axis, with constant
  gamma and beta), possibly through transposes and reshapes that keep the last axis, and nothing
  but these dense layers reads it (pre-LN transformers: q/k/v or fc1 read ``ln(x)`` alone),
  ``gamma / s`` and ``beta / s`` give ``X'`` with no extra op;
* **inserted**: otherwise (a residual stream reads it too, or it is no LayerNorm's output) a
  per-channel ``multiply(X, 1/s)`` before the first dense reader, read by the dense layers only.

A *dense layer* is a float ``matmul`` whose right operand is a 2-D constant ``[K, N]``, or the
transpose of one (a Gemm's ``permute_dims(W)``) read by no other op; its data is its left
operand, summed over its last axis.

Identity (:mod:`rangeprof.profiler.ir.spans`): every rewritten binding keeps its Var and span,
rewritten weights (gamma, beta, W) keep their profileIDs, and an inserted multiply carries the
derived profileID ``<profileID of X>#smoothed`` (:func:`smoothed_id`) so that qparams can name
the smoothed tensor. Which tensors hold smoothed values, to calibrate them from the smoothed
ranges, is :func:`smoothing_sites`. The pass runs on the tagged initial IR (as
:mod:`.equalize` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.passes.channel_chains import (
    FLOAT_DTYPES,
    MATMUL,
    Edits,
    Uses,
    is_op,
    tensor_dtype,
)
from rangeprof.profiler.ir.spans import ids_of, with_ids
from rangeprof.profiler.ir.tagging import INPUT_PREFIX

NAME = "smooth_quant"
SMOOTHED = "#smoothed"
_LAYER_NORM = tvm.ir.Op.get("relax.nn.layer_norm")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_RESHAPE = tvm.ir.Op.get("relax.reshape")


def smoothed_id(profile_id: str) -> str:
    """The profileID of the multiply that smooths the tensor ``profile_id``."""
    return profile_id + SMOOTHED


class SmoothingError(RangeprofError):
    """Smoothing scales that do not fit the model."""


@dataclass(frozen=True)
class DenseReader:
    """A dense layer reading a tensor: its matmul binding, its weight ``[K, N]``, and the
    binding transposing the weight constant when it is a Gemm's (None: the matmul reads the
    constant)."""

    binding: relax.VarBinding
    weight: np.ndarray
    transpose: relax.VarBinding | None

    @property
    def constant(self) -> tvm.ir.GenericConst:
        return (self.transpose.value if self.transpose else self.binding.value).args[
            0 if self.transpose else 1
        ]


@dataclass(frozen=True)
class Site:
    """Where one tensor is smoothed: the dense layers reading it, the LayerNorm chain its scales
    fold into (empty: a multiply is inserted), and the profileIDs of the tensors that then hold
    smoothed values (the chain's, or the multiply's derived one)."""

    profile_id: str
    var: relax.Var
    readers: tuple[DenseReader, ...]
    chain: tuple[relax.VarBinding, ...]  # LayerNorm first, then transposes / reshapes
    tensor_ids: tuple[str, ...]

    @property
    def folded(self) -> bool:
        return bool(self.chain)


def _bindings(func: relax.Function) -> dict[relax.Var, relax.VarBinding]:
    return {
        b.var: b
        for block in func.body.blocks
        for b in block.bindings
        if isinstance(b, relax.VarBinding)
    }


def _weight(expr, dtype: str, defs, uses: Uses, matmul) -> tuple[np.ndarray, object] | None:
    """The ``[K, N]`` weight a matmul's right operand holds, and the transposing binding (or
    None), if it is a 2-D float constant of ``dtype``, or the transpose of one nobody else
    reads."""
    transpose = None
    if isinstance(expr, relax.Var) and expr in defs and is_op(defs[expr].value, _PERMUTE):
        transpose = defs[expr]
        reader = uses.sole_reader(expr)
        if reader is None or not reader.same_as(matmul):
            return None
        expr = transpose.value.args[0]
    if not isinstance(expr, tvm.ir.GenericConst) or tensor_dtype(expr.ty) != dtype:
        return None
    value = expr.value.numpy()
    if value.ndim != 2:
        return None
    if transpose is not None:
        axes = transpose.value.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return None
        value = value.T
    return value, transpose


def dense_readers(func: relax.Function) -> dict[relax.Var, list[DenseReader]]:
    """The dense layers of ``func`` by the Var they read as data."""
    defs, uses = _bindings(func), Uses(func)
    found: dict[relax.Var, list[DenseReader]] = {}
    for binding in defs.values():
        call = binding.value
        if not is_op(call, MATMUL) or not isinstance(call.args[0], relax.Var):
            continue
        data = call.args[0]
        dtype = tensor_dtype(data.ty)
        if dtype not in FLOAT_DTYPES or tensor_dtype(call.ty) != dtype:
            continue
        weight = _weight(call.args[1], dtype, defs, uses, binding)
        if weight is not None and weight[0].shape[0] == _last_dim(data.ty):
            found.setdefault(data, []).append(DenseReader(binding, *weight))
    return found


def _last_dim(ty) -> int | None:
    """The static size of a tensor type's last axis (None: unknown or symbolic)."""
    dims = getattr(ty.shape, "values", None) if ty.shape is not None else None
    if not dims or not isinstance(dims[-1], tvm.tirx.IntImm):
        return None
    return int(dims[-1])


def _var_ids(func: relax.Function) -> dict[relax.Var, str]:
    """The profileID of each tensor Var of ``func``: inputs by name, bindings by their span."""
    named = {p: INPUT_PREFIX + str(p.name) for p in func.params}
    for var, binding in _bindings(func).items():
        ids = ids_of(binding.value)
        if len(ids) == 1:
            named[var] = next(iter(ids))
    return named


def dense_inputs(mod: tvm.IRModule) -> dict[str, list[np.ndarray]]:
    """The weights ``[K, N]`` of the dense layers reading each tensor of ``main``, by the
    tensor's profileID: what :func:`~rangeprof.profiler.calibrate.smoothing.plan_smoothing`
    takes with the profile."""
    func = mod["main"]
    named = _var_ids(func)
    return {
        named[var]: [r.weight for r in readers]
        for var, readers in dense_readers(func).items()
        if var in named
    }


def _keeps_last_axis(binding: relax.VarBinding) -> bool:
    """A transpose that leaves the last axis last, or a reshape that keeps its size: channel
    ``j`` of the output is channel ``j`` of the input."""
    value = binding.value
    source = value.args[0].ty
    if is_op(value, _PERMUTE):
        axes = value.attrs.axes
        if axes is None:  # reversed: the last axis stays last in 1-D only
            return source.ndim == 1
        return int(axes[-1]) == source.ndim - 1
    if is_op(value, _RESHAPE):
        last = _last_dim(source)
        return last is not None and last == _last_dim(binding.var.ty)
    return False


def _layer_norm_chain(var, defs, uses: Uses, channels: int) -> tuple[relax.VarBinding, ...]:
    """The LayerNorm and the channel-keeping steps producing ``var``, each read only by the
    next, if there is one whose gamma and beta are constants of ``channels`` values."""
    chain = []
    while var in defs:
        binding = defs[var]
        if is_op(binding.value, _LAYER_NORM):
            chain.append(binding)
            return tuple(reversed(chain)) if _foldable_norm(binding.value, channels) else ()
        if not (is_op(binding.value, _PERMUTE) or is_op(binding.value, _RESHAPE)):
            return ()
        if not _keeps_last_axis(binding):
            return ()
        chain.append(binding)
        var = binding.value.args[0]
        reader = uses.sole_reader(var)
        if reader is None or not reader.same_as(binding):
            return ()
    return ()


def _foldable_norm(call, channels: int) -> bool:
    attrs = call.attrs
    axes = [int(a) for a in attrs.axes]
    ndim = call.ty.ndim
    if axes not in ([ndim - 1], [-1]) or not (attrs.center and attrs.scale):
        return False
    return all(
        isinstance(p, tvm.ir.GenericConst) and tuple(p.value.shape) == (channels,)
        for p in call.args[1:]
    )


def smoothing_sites(mod: tvm.IRModule, scales: Mapping[str, np.ndarray]) -> dict[str, Site]:
    """Where each tensor of ``scales`` (by profileID) is smoothed; a :class:`SmoothingError`
    for a profileID no dense layer reads or scales of another length."""
    func = mod["main"]
    defs, uses = _bindings(func), Uses(func)
    by_id = {pid: var for var, pid in _var_ids(func).items()}
    readers = dense_readers(func)
    sites = {}
    for profile_id, s in scales.items():
        var = by_id.get(profile_id)
        if var not in readers:
            raise SmoothingError(f"smoothing {profile_id}: no dense layer reads it")
        group = tuple(readers[var])
        channels = group[0].weight.shape[0]
        if np.shape(s) != (channels,) or not np.all(np.asarray(s) > 0):
            raise SmoothingError(f"smoothing {profile_id}: needs {channels} positive scales")
        chain = ()
        if len(uses.readers.get(var, [])) == len(group) and var not in uses.returned:
            chain = _layer_norm_chain(var, defs, uses, channels)
        ids = tuple(next(iter(ids_of(b.value))) for b in chain) or (smoothed_id(profile_id),)
        sites[profile_id] = Site(profile_id, var, group, chain, ids)
    return sites


def _const_like(value: np.ndarray, like: tvm.ir.GenericConst) -> tvm.ir.GenericConst:
    """A constant of ``like``'s dtype holding ``value``, carrying ``like``'s profileIDs."""
    return with_ids(relax.const(value, dtype=str(like.ty.dtype)), ids_of(like))


def _with_args(call, args) -> tvm.ir.Call:
    # Shapes and dtypes stay, so the output type does: no re-normalising (it would drop spans).
    return relax.Call(call.op, args, call.attrs, call.ty_args, span=call.span, ret_ty=call.ty)


def _edit_readers(site: Site, s: np.ndarray, data, edits: Edits) -> None:
    """Each dense reader reading ``data`` with its weight rows multiplied by ``s``."""
    for reader in site.readers:
        const = reader.constant
        value = const.value.numpy().astype(np.float64)
        scaled = value * (s[None, :] if reader.transpose else s[:, None])
        new = _const_like(scaled, const)
        call = reader.binding.value
        weight = call.args[1]
        if reader.transpose is not None:
            edits.replace[reader.transpose.var] = [
                relax.VarBinding(reader.transpose.var, _with_args(reader.transpose.value, [new]))
            ]
        else:
            weight = new
        edit = relax.VarBinding(reader.binding.var, _with_args(call, [data, weight]))
        edits.replace.setdefault(reader.binding.var, []).append(edit)


def _fold(site: Site, s: np.ndarray, edits: Edits) -> None:
    """gamma / s and beta / s on the site's LayerNorm; the dense readers read as before."""
    norm = site.chain[0]
    call = norm.value
    data, gamma, beta = call.args
    params = [_const_like(p.value.numpy().astype(np.float64) / s, p) for p in (gamma, beta)]
    edits.replace[norm.var] = [relax.VarBinding(norm.var, _with_args(call, [data, *params]))]
    _edit_readers(site, s, site.var, edits)


def _insert(site: Site, s: np.ndarray, edits: Edits) -> None:
    """``X · (1/s)`` bound right before the first dense reader, which all read it."""
    var = site.var
    inverse = relax.const((1.0 / s).astype(tensor_dtype(var.ty)))
    product = relax.BlockBuilder().normalize(relax.op.multiply(var, inverse))
    product = with_ids(product, [smoothed_id(site.profile_id)])
    first = site.readers[0].binding.var
    # In a dataflow block (as the first reader is) a new Var must be a DataflowVar.
    kind = relax.DataflowVar if isinstance(first, relax.DataflowVar) else relax.Var
    smoothed = kind(f"{var.name}_smoothed", var.ty)
    edits.replace[first] = [relax.VarBinding(smoothed, product)]
    _edit_readers(site, s, smoothed, edits)


def smooth_function(func: relax.Function, mod: tvm.IRModule, scales) -> relax.Function:
    """``main`` of ``mod`` (``func``) with every tensor of ``scales`` smoothed."""
    edits = Edits()
    for profile_id, site in smoothing_sites(mod, scales).items():
        s = np.asarray(scales[profile_id], dtype=np.float64)
        (_fold if site.folded else _insert)(site, s, edits)
    return edits.apply(func)


@tvm.transform.module_pass(opt_level=0, name="SmoothQuant")
class SmoothQuant:
    """Smooths the tensors of ``scales`` (profileID -> ``s`` per channel) in ``main`` (see the
    module docstring); the result computes the same function up to float rounding. Scales that
    do not fit fail inside TVM's pass machinery; :func:`smooth_quant` checks them first."""

    def __init__(self, scales: Mapping[str, np.ndarray]):
        self.scales = dict(scales)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.scales:
            return mod
        out = mod.clone()
        out["main"] = smooth_function(mod["main"], mod, self.scales)
        return out


def smooth_quant(
    mod: tvm.IRModule, scales: Mapping[str, np.ndarray]
) -> tuple[tvm.IRModule, dict[str, Site]]:
    """``mod`` smoothed by :class:`SmoothQuant`, and where (:func:`smoothing_sites`: the
    profileIDs whose tensors now hold smoothed values); a :class:`SmoothingError` for scales
    that do not fit."""
    sites = smoothing_sites(mod, scales)
    return SmoothQuant(scales)(mod), sites
