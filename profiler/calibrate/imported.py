"""The QPARAMS document of a QDQ model: the scales its pairs embed, keyed by profileID.

``rangeprof import-qparams`` loads the model dequantized (:mod:`rangeprof.profiler.ir.qdq`; a
model in the operator-oriented format, ``QLinearConv``…, in its QDQ form first:
:mod:`rangeprof.profiler.ir.operator_quantized`), imports it, and gives each pair's
``(scale, zero_point)`` to the profileID whose binding *is* the tensor the pair quantizes (its
``source_tensor``): a ``Clip`` the pair became and the tensor in front of it both carry them.
``rangeprof build MODEL --qparams`` then compiles the same dequantized model through a BYOC plugin
with no calibration data. Weights are listed as the model quantized them; the
plugins quantize the weights they multiply (batch norms folded in) by their own policy, which gives
back the same integers for symmetric per-channel max weights (ONNX Runtime's ``per_channel=True``).
Bias pairs (int32, scale ``s_x · s_w``) are left out: the plugins derive the int32 bias from the
same scales."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rangeprof.profiler.calibrate.methods import DTYPES, IMPORTED, SCHEMA_VERSION
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import LoadedModel, load_model
from rangeprof.profiler.ir.qdq import DEQUANTIZE, INTEGER_OPS, QUANTIZE, EmbeddedQ

METHOD = IMPORTED


def import_qparams(
    path: str | Path, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> dict:
    """The QPARAMS document of the QDQ model at ``path``."""
    loaded = load_model(path, input_shapes, dequantize=True)
    _check_quantized(loaded, str(path))
    imported = import_onnx(loaded)
    by_tensor = {}
    for layer in imported.layers:
        if layer.source_tensor is not None:
            by_tensor.setdefault(layer.source_tensor, layer)
    entries: dict[str, dict] = {}
    for embedded in loaded.embedded:
        if embedded.dtype not in DTYPES:
            if embedded.kind == "weight" and embedded.dtype == "int32":
                continue  # a bias: the plugins derive it from s_x · s_w
            raise RangeprofError(
                f"{path}: {embedded.node} quantizes to {embedded.dtype}; "
                f"QPARAMS documents hold {', '.join(DTYPES)}"
            )
        layer = by_tensor.get(embedded.tensor)
        if layer is not None:
            entries.setdefault(layer.profile_id, _entry(layer.profile_id, layer.kind, embedded))
    activations = [e for e in entries.values() if e["kind"] != "weight"]
    if not activations and any(e.kind == "activation" for e in loaded.embedded):
        raise RangeprofError(f"{path}: no tensor of the model is quantized by a QDQ pair")
    if not activations:
        raise RangeprofError(
            f"{path}: only weights carry scales (activations quantized at run time, as "
            "quantize_dynamic writes them): profile and calibrate the model for its qparams"
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {
            "name": loaded.name,
            "sha256": loaded.sha256,
            "opset": loaded.opset,
            "inputs": {k: list(v) for k, v in loaded.input_shapes.items()},
        },
        "options": _options(list(entries.values()), activations),
        "qparams": list(entries.values()),
    }


def _check_quantized(loaded: LoadedModel, source: str) -> None:
    """Refuse a model whose quantization is not (all) in QDQ pairs, naming the first node."""
    nodes = loaded.model.graph.node
    integer = next((n for n in nodes if n.op_type in INTEGER_OPS), None)
    if integer is not None:
        raise RangeprofError(
            f"{source}: node {integer.name!r} ({integer.op_type}) computes on quantized integers "
            "in a form rangeprof does not rewrite into QDQ pairs around a float operator"
        )
    left = next((n for n in nodes if n.op_type in (QUANTIZE, DEQUANTIZE)), None)
    if left is not None:
        raise RangeprofError(
            f"{source}: {left.op_type} {left.name!r} is not part of a QDQ pair on a float "
            "tensor with constant parameters (a quantized graph input or output?)"
        )
    if not loaded.embedded:
        raise RangeprofError(
            f"{source}: no QuantizeLinear / DequantizeLinear pairs: not a QDQ model"
        )


def _entry(profile_id: str, kind: str, embedded: EmbeddedQ) -> dict:
    lo, hi = embedded.grid
    per_channel = embedded.axis is not None
    return {
        "profile_id": profile_id,
        "source_tensor": embedded.tensor,
        "kind": kind,
        "dtype": embedded.dtype,
        "method": METHOD,
        "scale": _numbers(embedded.scale, float, per_channel),
        "zero_point": _numbers(embedded.zero_point, int, per_channel),
        "axis": embedded.axis,
        "range": [_numbers(lo, float, per_channel), _numbers(hi, float, per_channel)],
        "note": f"from {embedded.node}",
    }


def _numbers(values: np.ndarray, kind, listed: bool):
    return [kind(v) for v in values.reshape(-1)] if listed else kind(values.reshape(()))


def _options(entries: list[dict], activations: list[dict]) -> dict:
    """What the model's pairs amount to, in the calibration options' terms."""
    dtypes = [e["dtype"] for e in activations]
    dtype = max(set(dtypes), key=dtypes.count)
    symmetric = all(
        e["zero_point"] == DTYPES[e["dtype"]].sym_zero for e in activations if e["axis"] is None
    )
    per_channel = any(e["axis"] is not None for e in entries)
    scales = np.concatenate([np.ravel(e["scale"]) for e in entries]).astype(np.float64)
    return {
        "method": METHOD,
        "percentile": 100.0,
        "scheme": "sym" if symmetric else "asym",
        "dtype": dtype,
        "granularity": "per-channel" if per_channel else "per-tensor",
        "power_of_two": bool(np.all(np.log2(scales) == np.round(np.log2(scales)))),
    }
