"""4-bit weights (:class:`~rangeprof.profiler.calibrate.weight_only.Int4Weights`) written into an
FP32 ONNX model, in the two forms other runtimes read:

* :func:`to_matmul_nbits`: each chosen ``MatMul`` becomes ONNX Runtime's contrib operator
  ``com.microsoft.MatMulNBits`` (``bits=4``; ``B`` uint8 ``[N, n_blocks, block_size / 2]``, the
  codes of column ``n`` along ``K``, two a byte, the even row in the low nibble; ``scales``
  ``[N · n_blocks]``; asymmetric ``zero_points`` uint8 ``[N · ceil(n_blocks / 2)]`` packed the
  same way, absent when symmetric: 8). ONNX Runtime's CPU kernel takes power-of-two blocks of
  at least 16 rows;
* :func:`to_int4_qdq`: the standard form, opset 21: an int4 (symmetric, codes ``q - 8``) or uint4
  (asymmetric, with its zero points) initializer ``[K, N]`` and a blocked ``DequantizeLinear``
  (``axis=0``, ``block_size``) feeding the ``MatMul``; a model below opset 21 is converted
  (``onnx.version_converter``). ONNX Runtime fuses the pair into a ``MatMulNBits`` of
  ``accuracy_level`` 4 (``X`` rounded to int8) unless the session option
  ``session.qdq_matmulnbits_accuracy_level`` says otherwise ("0": float, as written).

An activation-aware scaling (``input_scales``: ``s`` per input channel, the weights then being
the codes of ``diag(s)·W``) puts ``Mul(X, 1/s)`` in front of the layer, one per tensor and scale
vector where layers share them. A layer keeps its node name, so a report names it as before;
an FP32 weight no other node reads is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from rangeprof.profiler.calibrate.weight_only import Int4Weights
from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.export.qdq_model import at_opset, fresh_name

MS_DOMAIN = "com.microsoft"
QDQ_OPSET = 21  # int4 / uint4 and blocked DequantizeLinear
# How one form replaces a chosen node: (node, its weights, the name of its data) -> new nodes.
Replace = Callable[[onnx.NodeProto, Int4Weights, str], list[onnx.NodeProto]]


def _pack(codes: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit codes along the last axis, the first of each pair in the low nibble (an
    odd count padded with 8, what ONNX Runtime pads zero points with)."""
    codes = codes.astype(np.uint8)
    if codes.shape[-1] % 2:
        pad = np.full((*codes.shape[:-1], 1), 8, dtype=np.uint8)
        codes = np.concatenate([codes, pad], axis=-1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _blocks(weights: Int4Weights) -> np.ndarray:
    """The codes ``[N, n_blocks, block_size]``, the last block padded with its zero point."""
    k, n = weights.shape
    padded = np.repeat(weights.zeros(), weights.group_size, axis=0)
    padded[:k] = weights.q
    return padded.T.reshape(n, weights.groups, weights.group_size)


class _Rewrite:
    """The chosen ``MatMul`` nodes of a copy of a model replaced, in place, one form at a time."""

    def __init__(
        self,
        model: onnx.ModelProto,
        layers: Mapping[str, Int4Weights],
        input_scales: Mapping[str, np.ndarray] | None,
    ):
        self.model = model
        self.graph = model.graph
        self.layers = layers
        self.input_scales = dict(input_scales or {})
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.names = _all_names(self.graph)
        self.scaled: dict[tuple[str, bytes], str] = {}
        unknown = sorted(set(self.input_scales) - set(layers))
        if unknown:
            raise RangeprofError(f"input scales for layers without 4-bit weights: {unknown}")

    def run(self, replace: Replace) -> onnx.ModelProto:
        """Every chosen node through ``replace(node, weights, data) -> nodes``."""
        found, nodes = set(), []
        for node in self.graph.node:
            if node.name not in self.layers or not node.name:
                nodes.append(node)
                continue
            weights = self.layers[node.name]
            self._check(node, weights)
            found.add(node.name)
            data = self._scaled_input(node, weights, nodes)
            nodes.extend(replace(node, weights, data))
        missing = sorted(set(self.layers) - found)
        if missing:
            raise RangeprofError(f"no MatMul node of these names in the model: {missing}")
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self._drop_unused()
        return self.model

    def _check(self, node: onnx.NodeProto, weights: Int4Weights) -> None:
        b = self.initializers.get(node.input[1]) if len(node.input) == 2 else None
        if node.op_type != "MatMul" or b is None:
            raise RangeprofError(f"{node.name!r} is no MatMul with a constant weight")
        if b.data_type != TensorProto.FLOAT or tuple(b.dims) != weights.shape:
            raise RangeprofError(
                f"{node.name!r}: a float32 weight {list(b.dims)} does not match 4-bit weights "
                f"{list(weights.shape)}"
            )

    def unique(self, name: str) -> str:
        return fresh_name(name, self.names)

    def add(self, tensor: onnx.TensorProto) -> str:
        tensor.name = self.unique(tensor.name)
        self.graph.initializer.append(tensor)
        return tensor.name

    def _scaled_input(
        self, node: onnx.NodeProto, weights: Int4Weights, nodes: list[onnx.NodeProto]
    ) -> str:
        """The layer's data: ``X / s`` through a Mul (shared by layers of one ``X`` and ``s``)."""
        data = node.input[0]
        if node.name not in self.input_scales:
            return data
        s = np.asarray(self.input_scales[node.name], dtype=np.float64)
        if s.shape != (weights.shape[0],) or not np.all(np.isfinite(s) & (s > 0)):
            raise RangeprofError(
                f"{node.name!r}: input scales must be {weights.shape[0]} finite positive values"
            )
        inverse = (1.0 / s).astype(np.float32)
        key = (data, inverse.tobytes())
        if key not in self.scaled:
            name = self.add(numpy_helper.from_array(inverse, f"{node.name}/input_scale"))
            self.scaled[key] = self.unique(f"{data}/scaled")
            mul = self.unique(f"{node.name}/scale_input")
            nodes.append(helper.make_node("Mul", [data, name], [self.scaled[key]], name=mul))
        return self.scaled[key]

    def _drop_unused(self) -> None:
        used = _read_names(self.graph) | {o.name for o in self.graph.output}
        keep = [t for t in self.graph.initializer if t.name in used]
        del self.graph.initializer[:]
        self.graph.initializer.extend(keep)
        inputs = [i for i in self.graph.input if i.name in used or i.name not in self.initializers]
        del self.graph.input[:]
        self.graph.input.extend(inputs)


def _subgraphs(node: onnx.NodeProto):
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        yield from attr.graphs


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of the graph or of its subgraphs reads."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for sub in _subgraphs(node):
            names |= _read_names(sub)
    return names


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {t.name for t in graph.initializer} | {i.name for i in graph.input}
    names |= {o.name for o in graph.output} | _read_names(graph)
    for node in graph.node:
        names.update(node.output)
        names.add(node.name)
    return names


def _with_matmul_nbits(rewrite: _Rewrite, accuracy_level: int | None) -> Replace:
    def replace(node, weights: Int4Weights, data: str) -> list[onnx.NodeProto]:
        if weights.group_size < 16:
            raise RangeprofError(
                f"{node.name!r}: MatMulNBits needs blocks of at least 16 rows, not "
                f"{weights.group_size}"
            )
        base = node.input[1]
        k, n = weights.shape
        inputs = [
            data,
            rewrite.add(numpy_helper.from_array(_pack(_blocks(weights)), f"{base}_Q4")),
            rewrite.add(
                numpy_helper.from_array(weights.scales.T.reshape(-1).copy(), f"{base}_scales")
            ),
        ]
        if weights.zero_points is not None:
            zeros = _pack(weights.zero_points.T).reshape(-1)
            inputs.append(rewrite.add(numpy_helper.from_array(zeros, f"{base}_zero_points")))
        attrs = {"K": k, "N": n, "bits": 4, "block_size": weights.group_size}
        if accuracy_level is not None:
            attrs["accuracy_level"] = accuracy_level
        return [
            helper.make_node(
                "MatMulNBits", inputs, list(node.output), name=node.name, domain=MS_DOMAIN, **attrs
            )
        ]

    return replace


def to_matmul_nbits(
    model: onnx.ModelProto,
    layers: Mapping[str, Int4Weights],
    input_scales: Mapping[str, np.ndarray] | None = None,
    accuracy_level: int | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` with each ``MatMul`` named in ``layers`` (by node name; its weight an
    initializer ``[K, N]``) an ONNX Runtime ``MatMulNBits`` of those weights; ``input_scales``
    (by node name) a ``Mul(X, 1/s)`` in front. ``accuracy_level`` as ONNX Runtime's attribute
    (None: unset, float arithmetic; 4: ``X`` rounded to int8 per block, faster)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rewrite = _Rewrite(out, layers, input_scales)
    rewrite.run(_with_matmul_nbits(rewrite, accuracy_level))
    if not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return out


def _int4_tensor(name: str, codes: np.ndarray, signed: bool) -> onnx.TensorProto:
    """An int4 (codes ``q - 8``) or uint4 initializer of the shape of ``codes`` (0..15)."""
    nibbles = (codes.astype(np.int16) - 8) & 0xF if signed else codes
    raw = _pack(nibbles.reshape(-1)).tobytes()
    kind = TensorProto.INT4 if signed else TensorProto.UINT4
    return helper.make_tensor(name, kind, codes.shape, raw, raw=True)


def _with_dequantize(rewrite: _Rewrite) -> Replace:
    def replace(node, weights: Int4Weights, data: str) -> list[onnx.NodeProto]:
        base = node.input[1]
        inputs = [
            rewrite.add(_int4_tensor(f"{base}_q4", weights.q, weights.symmetric)),
            rewrite.add(numpy_helper.from_array(weights.scales, f"{base}_scales")),
        ]
        if weights.zero_points is not None:
            inputs.append(
                rewrite.add(_int4_tensor(f"{base}_zero_points", weights.zero_points, False))
            )
        weight = rewrite.unique(f"{base}_dequantized")
        dq = helper.make_node(
            "DequantizeLinear",
            inputs,
            [weight],
            name=rewrite.unique(f"{node.name}/dequantize_weight"),
            axis=0,
            block_size=weights.group_size,
        )
        matmul = helper.make_node("MatMul", [data, weight], list(node.output), name=node.name)
        return [dq, matmul]

    return replace


def to_int4_qdq(
    model: onnx.ModelProto,
    layers: Mapping[str, Int4Weights],
    input_scales: Mapping[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """A copy of ``model`` at opset 21 at least with each ``MatMul`` named in ``layers`` reading
    an int4 / uint4 weight through a blocked ``DequantizeLinear``; ``input_scales`` as
    :func:`to_matmul_nbits`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out = at_opset(out, QDQ_OPSET, what="int4 QDQ", instead="export MatMulNBits instead")
    # int4 tensors need the IR version of opset 21 whether or not the model was converted.
    minimum = helper.find_min_ir_version_for([helper.make_opsetid("", QDQ_OPSET)])
    out.ir_version = max(out.ir_version, minimum)
    rewrite = _Rewrite(out, layers, input_scales)
    return rewrite.run(_with_dequantize(rewrite))
