"""The ONNX files of a 4-bit weight-only build, beside its library: the model the build compiled
(``ImportedModel.loaded``: its nodes named, its input shapes fixed) with every ``w4`` region's
``MatMul`` on the build's own codes, scales and zero points (``Region.int4``, the codes of
``diag(s)·W``) behind a ``Mul(X, 1/s)`` for the AWQ scales ``s`` of its input, in the two forms
of :mod:`rangeprof.profiler.export.int4_onnx`: ONNX Runtime's ``MatMulNBits`` and opset-21 int4
QDQ. Everything else runs in FP32 there, attention's batch matmuls included.

A region finds its ONNX node through its lineage (the layers of its profileIDs). It stays FP32
in the files, the manifest saying why, where that node is no ``MatMul`` reading a float32
initializer ``[K, N]`` (a ``Gemm``), or where the build's weight is not that initializer times
``s``: a pass folded another constant into it (a ``Mul`` after the layer, folded into its
columns, stays in the ONNX graph after the node).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from rangeprof.profiler.calibrate.weight_only import Int4Weights
from rangeprof.profiler.export.int4_onnx import to_int4_qdq, to_matmul_nbits

from .lowering import W4
from .quantized import QuantizedModel
from .regions import Region

MATMUL_NBITS, INT4_QDQ = "matmulnbits", "int4_qdq"
FILES = {MATMUL_NBITS: "model.matmulnbits.onnx", INT4_QDQ: "model.int4_qdq.onnx"}
# The build's weight against the ONNX one times ``s``: float32 rounding of the scaling only.
_RTOL = 1e-5


@dataclass
class Int4Layers:
    """What the files hold: by ONNX node name the 4-bit weights and the input scales; by region
    name why a ``w4`` region stays FP32."""

    weights: dict[str, Int4Weights] = field(default_factory=dict)
    input_scales: dict[str, np.ndarray] = field(default_factory=dict)
    kept_fp32: dict[str, str] = field(default_factory=dict)


def int4_layers(qm: QuantizedModel, modes: Mapping[str, str]) -> Int4Layers:
    """The ONNX ``MatMul`` node of every region of ``qm`` in mode ``w4`` (``modes`` by region
    name), with its weights and input scales, or why it has none."""
    model = qm.imported.loaded.model
    nodes = {n.name: n for n in model.graph.node}
    initializers = {t.name: t for t in model.graph.initializer}
    sources = {layer.profile_id: layer for layer in qm.imported.layers}
    found = Int4Layers()
    for region in qm.regions:
        if modes.get(region.name) != W4 or region.int4 is None:
            continue
        scaled = qm.smoothing.source(region.input.profile_id) if qm.smoothing else None
        s = None if scaled is None else np.asarray(scaled[1], dtype=np.float64)
        node, why = _node(region, sources, nodes, initializers, s)
        if why is not None:
            found.kept_fp32[region.name] = why
            continue
        found.weights[node] = region.int4
        if s is not None:
            found.input_scales[node] = s
    return found


def _node(
    region: Region,
    sources: Mapping,
    nodes: Mapping[str, onnx.NodeProto],
    initializers: Mapping[str, onnx.TensorProto],
    s: np.ndarray | None,
) -> tuple[str | None, str | None]:
    """The name of ``region``'s ONNX ``MatMul`` node, or why it cannot hold the region's
    4-bit weights."""
    names = sorted({sources[p].source_node for p in region.profile_ids if p in sources} - {None})
    names = [n for n in names if n in nodes]
    matmuls = [n for n in names if nodes[n].op_type == "MatMul"]
    if len(matmuls) != 1:
        ops = ", ".join(f"{n}: {nodes[n].op_type}" for n in names)
        return None, f"not one ONNX MatMul among its nodes ({ops})"
    name = matmuls[0]
    weight = initializers.get(nodes[name].input[1])
    shape = region.int4.shape
    if weight is None or weight.data_type != TensorProto.FLOAT or tuple(weight.dims) != shape:
        return None, f"{name}: its weight is no float32 initializer {list(shape)}"
    b = numpy_helper.to_array(weight).astype(np.float64)
    built = region.float_region.weight.astype(np.float64)
    if s is not None:
        built = built / s[:, None]
    if not np.allclose(built, b, rtol=_RTOL, atol=_RTOL * np.abs(b).max()):
        return None, f"{name}: the build folded other constants into its weight"
    return name, None


def write_int4_exports(
    qm: QuantizedModel, out_dir: Path, modes: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Writes the model with ``qm``'s ``w4`` regions (``modes`` by region name) as
    ``MatMulNBits`` and as int4 QDQ into ``out_dir``; returns the files by format, and the
    ``w4`` regions they keep FP32 with the reason, by region name."""
    layers = int4_layers(qm, modes)
    model = qm.imported.loaded.model
    forms = {MATMUL_NBITS: to_matmul_nbits, INT4_QDQ: to_int4_qdq}
    for form, export in forms.items():
        onnx.save(export(model, layers.weights, layers.input_scales), out_dir / FILES[form])
    return dict(FILES), layers.kept_fp32
