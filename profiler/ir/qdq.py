"""QDQ models: the FP32 model beneath their QuantizeLinear / DequantizeLinear pairs, and the
quantization parameters the pairs embed.

A model quantized in the QDQ format (ONNX Runtime's ``quantize_static``, TensorRT's and NNCF's
exports, PyTorch's fake-quant export) is its FP32 model with a pair ``DequantizeLinear(
QuantizeLinear(x, s, z), s, z)`` on every quantized tensor and ``DequantizeLinear`` of an
integer initializer for every quantized weight. :func:`dequantize` takes the pairs out, so the
BYOC plugins quantize the FP32 graph themselves, and keeps each pair's ``(s, z)`` by the tensor
it quantizes:

* an **activation pair** ``x → Q → DQ → …`` is removed: its consumers read ``x`` (the INT8 build
  saturates at the same bounds, as its qparams are the pair's). A pair whose grid starts at 0
  (zero point at the type's minimum) also clamps negatives — ONNX Runtime drops a ``Relu`` or
  ``Clip`` in front of such a pair — so it becomes ``Clip(x, 0, s · (qmax − z))``, named after
  the ``QuantizeLinear``, to keep the FP32 model's meaning;
* a **weight** ``DequantizeLinear`` of an integer initializer (or a pair on a float one) becomes
  the float initializer it computes, named after its output;
* a **dynamic pair** ``x → DynamicQuantizeLinear → DequantizeLinear`` (the form
  :mod:`rangeprof.profiler.ir.operator_quantized` gives ``quantize_dynamic``'s activations) is
  removed too: its consumers read ``x``. Its scale is computed per run, so it embeds no
  parameters (the tensor's qparams come from a profile); its grid spans the tensor's own minimum
  and maximum, so taking it out clamps nothing;
* where a removed ``DequantizeLinear`` output is a graph output, the tensor keeps that name.

Everything else stays as it is: a ``QuantizeLinear`` whose output leaves the graph or feeds an
operator-oriented node that :mod:`~rangeprof.profiler.ir.operator_quantized` left as it is,
blocked quantization, other pairs whose scale is computed. Removed nodes get the fate
``qdq:<tensor>`` (their scale is that tensor's).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

QUANTIZE, DEQUANTIZE, DYNAMIC = "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"
_DOMAINS = ("", "ai.onnx", "com.microsoft")
# Operators that compute on quantized integers themselves (ONNX's operator-oriented format).
INTEGER_OPS = frozenset(
    {
        "QLinearConv", "QLinearMatMul", "QGemm", "QLinearAdd", "QLinearMul", "QLinearConcat",
        "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearLeakyRelu", "QLinearSigmoid",
        "QLinearSoftmax", "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear",
        "DynamicQuantizeLSTM", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
    }
)  # fmt: skip


@dataclass(frozen=True)
class EmbeddedQ:
    """The quantization parameters one pair (or weight ``DequantizeLinear``) applies to a tensor
    of the dequantized model."""

    tensor: str
    kind: str  # "activation" | "weight"
    dtype: str  # numpy name of the integer type
    scale: np.ndarray  # 0-d, or 1-d along ``axis``
    zero_point: np.ndarray  # same shape as ``scale``
    axis: int | None
    node: str  # the QuantizeLinear (weights: the DequantizeLinear) it came from

    @property
    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """``(lo, hi)``: the real values the integer type's ends stand for."""
        info = np.iinfo(self.dtype)
        s, z = self.scale.astype(np.float64), self.zero_point.astype(np.float64)
        return s * (info.min - z), s * (info.max - z)


@dataclass(frozen=True)
class Dequantized:
    model: onnx.ModelProto
    embedded: tuple[EmbeddedQ, ...]
    fates: dict[str, str]  # removed node -> ``qdq:<tensor>``


def _is(node: onnx.NodeProto, op: str) -> bool:
    return node.op_type == op and node.domain in _DOMAINS


class Graph:
    """Producers, consumers and constant values of one graph's tensors."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.initializers = {t.name: t for t in graph.initializer}
        self.constants = {node.output[0]: node for node in graph.node if node.op_type == "Constant"}
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.outputs = {o.name for o in graph.output}
        self.inputs = {i.name for i in graph.input}

    def value(self, name: str) -> np.ndarray | None:
        if name in self.initializers and name not in self.inputs:
            return numpy_helper.to_array(self.initializers[name])
        node = self.constants.get(name)
        if node is not None and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None


def _params(node: onnx.NodeProto, g: Graph) -> tuple[np.ndarray, np.ndarray, int | None] | None:
    """``(scale, zero_point, axis)`` of a Q or DQ node with constant parameters, else None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("block_size", 0):
        return None
    scale = g.value(node.input[1])
    if scale is None:
        return None
    if len(node.input) > 2 and node.input[2]:
        zero = g.value(node.input[2])
        if zero is None:
            return None
    else:
        to = attrs.get("output_dtype", onnx.TensorProto.UINT8) or onnx.TensorProto.UINT8
        zero = np.zeros(scale.shape, helper.tensor_dtype_to_np_dtype(to))
    if zero.dtype.kind not in "iu":
        return None
    axis = None
    if scale.ndim == 1 and scale.size > 1:
        axis = int(attrs.get("axis", 1))
    return scale, np.broadcast_to(zero, scale.shape).copy(), axis


def _same(a, b) -> bool:
    return (
        a[2] == b[2]
        and a[0].shape == b[0].shape
        and np.array_equal(a[0], b[0])
        and a[1].dtype == b[1].dtype
        and np.array_equal(a[1], b[1])
    )


def _along(values: np.ndarray, axis: int | None, ndim: int) -> np.ndarray:
    if axis is None:
        return values.reshape(())
    shape = [1] * ndim
    shape[axis] = -1
    return values.reshape(shape)


def _dequantized_weight(q: np.ndarray, scale, zero, axis) -> np.ndarray:
    s, z = _along(scale, axis, q.ndim), _along(zero, axis, q.ndim)
    return ((q.astype(np.float64) - z) * s).astype(scale.dtype)


def _fake_quantized(x: np.ndarray, scale, zero, axis) -> np.ndarray:
    info = np.iinfo(zero.dtype)
    s, z = _along(scale, axis, x.ndim).astype(np.float64), _along(zero, axis, x.ndim)
    q = np.clip(np.rint(x.astype(np.float64) / s) + z, info.min, info.max)
    return ((q - z) * s).astype(scale.dtype)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.g = Graph(model.graph)
        self.embedded: list[EmbeddedQ] = []
        self.fates: dict[str, str] = {}
        self.removed: set[int] = set()  # id() of removed nodes
        self.replaced: dict[int, onnx.NodeProto] = {}  # id() of a node -> its stand-in
        self.renames: dict[str, str] = {}  # tensor -> the tensor that now holds its value
        self.new_weights: list[onnx.TensorProto] = []

    def run(self) -> Dequantized:
        g = self.g
        pairs: dict[int, list[onnx.NodeProto]] = defaultdict(list)
        for node in g.graph.node:
            if not _is(node, DEQUANTIZE):
                continue
            params = _params(node, g)
            source = node.input[0]
            q = g.producer.get(source)
            if params is None:
                if q is not None and _is(q, DYNAMIC) and list(node.input) == list(q.output):
                    pairs[id(q)].append(node)
                continue
            if q is not None and _is(q, QUANTIZE):
                pairs[id(q)].append(node)
            elif g.value(source) is not None:
                self._weight(node, _dequantized_weight(g.value(source), *params), params)
        for q in g.graph.node:
            dqs = pairs.get(id(q))
            if dqs and _is(q, DYNAMIC):
                self._dynamic_pair(q, dqs)
            elif dqs and self._pairs_whole(q, dqs):
                self._pair(q, dqs)
        return self._finish()

    def _dynamic_pair(self, q: onnx.NodeProto, dqs: list[onnx.NodeProto]) -> None:
        """Take out a dynamic pair whose ``DynamicQuantizeLinear`` nothing else reads."""
        readers = [n for out in q.output for n in self.g.consumers[out]]
        if self.g.outputs & set(q.output) or any(all(n is not dq for dq in dqs) for n in readers):
            return
        x = q.input[0]
        self._remove(q, x)
        for dq in dqs:
            self._remove(dq, x)
            self.renames[dq.output[0]] = x

    def _pairs_whole(self, q: onnx.NodeProto, dqs: list[onnx.NodeProto]) -> bool:
        """Every consumer of ``q`` is a DequantizeLinear with ``q``'s own parameters."""
        params = _params(q, self.g)
        users = self.g.consumers[q.output[0]]
        return (
            params is not None
            and q.output[0] not in self.g.outputs
            and len(users) == len(dqs)
            and all(_same(params, _params(dq, self.g)) for dq in dqs)
        )

    def _weight(self, dq: onnx.NodeProto, value: np.ndarray, params, source=None) -> None:
        tensor = dq.output[0]
        self.new_weights.append(numpy_helper.from_array(value, tensor))
        self._remove(dq, tensor)
        scale, zero, axis = params
        node = source.name if source is not None else dq.name
        self.embedded.append(EmbeddedQ(tensor, "weight", zero.dtype.name, scale, zero, axis, node))

    def _pair(self, q: onnx.NodeProto, dqs: list[onnx.NodeProto]) -> None:
        g = self.g
        scale, zero, axis = params = _params(q, g)
        x = q.input[0]
        constant = g.value(x)
        if constant is not None:
            for dq in dqs:
                self._weight(dq, _fake_quantized(constant, *params), params, source=q)
            self._remove(q, dqs[0].output[0])
            return
        held = x
        if np.all(zero == np.iinfo(zero.dtype).min):
            held = self._clip(q, params, dqs[0].output[0])
        else:
            self._remove(q, x)
        self.embedded.append(EmbeddedQ(x, "activation", zero.dtype.name, scale, zero, axis, q.name))
        if held != x:
            self.embedded.append(
                EmbeddedQ(held, "activation", zero.dtype.name, scale, zero, axis, q.name)
            )
        for dq in dqs:
            self._remove(dq, held)
            if dq.output[0] != held:
                self.renames[dq.output[0]] = held

    def _clip(self, q: onnx.NodeProto, params, out: str) -> str:
        """The pair as the clamp it applies, writing ``out``: ``Clip`` from 0 (per tensor) or
        ``Relu``."""
        scale, zero, axis = params
        if axis is None:
            hi = float(scale.astype(np.float64) * (np.iinfo(zero.dtype).max - int(zero)))
            bounds = [numpy_helper.from_array(np.array(v, scale.dtype), f"{q.name}/{k}")
                      for k, v in (("lo", 0.0), ("hi", hi))]  # fmt: skip
            self.new_weights.extend(bounds)
            node = helper.make_node("Clip", [q.input[0], *(b.name for b in bounds)], [out], q.name)
        else:
            node = helper.make_node("Relu", [q.input[0]], [out], q.name)
        self.replaced[id(q)] = node
        return out

    def _remove(self, node: onnx.NodeProto, tensor: str) -> None:
        self.removed.add(id(node))
        self.fates[node.name] = f"qdq:{tensor}"

    def _held(self, name: str) -> str:
        while name in self.renames:
            name = self.renames[name]
        return name

    def _finish(self) -> Dequantized:
        graph = self.g.graph
        # A graph output held by a removed DequantizeLinear: the tensor that now holds its value
        # takes the output's name, where it is a node's own output; else an Identity keeps it.
        kept = []
        for node in graph.node:
            if id(node) in self.replaced:
                kept.append(self.replaced[id(node)])
            elif id(node) not in self.removed:
                kept.append(node)
        outputs = {o.name for o in graph.output}
        named: dict[str, str] = {}
        for out in [o.name for o in graph.output]:
            held = self._held(out)
            if held == out:
                continue
            producer = next((n for n in kept if held in n.output), None)
            if producer is not None and held not in outputs and held not in named:
                named[held] = out
            else:
                kept.append(helper.make_node("Identity", [held], [out], f"{out}/identity"))
        for node in kept:
            for i, name in enumerate(node.input):
                held = self._held(name)
                node.input[i] = named.get(held, held)
            for i, name in enumerate(node.output):
                node.output[i] = named.get(name, name)
        self.embedded = [replace(e, tensor=named.get(e.tensor, e.tensor)) for e in self.embedded]
        del graph.node[:]
        graph.node.extend(kept)
        graph.initializer.extend(self.new_weights)
        drop_unused(graph)
        return Dequantized(self.model, tuple(self.embedded), self.fates)


def drop_unused(graph: onnx.GraphProto) -> None:
    """Initializers and value infos of tensors no node reads or writes any more."""
    used = {name for node in graph.node for name in node.input}
    used |= {o.name for o in graph.output}
    dropped = {t.name for t in graph.initializer if t.name not in used}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    # Before IR version 4 initializers were listed among the inputs too.
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    live = used | {name for node in graph.node for name in node.output}
    infos = [vi for vi in graph.value_info if vi.name in live]
    del graph.value_info[:]
    graph.value_info.extend(infos)


def dequantize(model: onnx.ModelProto) -> Dequantized:
    """The FP32 model beneath ``model``'s QDQ pairs, rewritten in place (see the module doc)."""
    return _Rewriter(model).run()
