"""Operator-oriented quantized ONNX models in the QDQ form that :mod:`.qdq` reads.

A model quantized in ONNX's operator-oriented format computes on integers: ``QLinearConv``,
``QLinearMatMul`` and ONNX Runtime's ``QGemm``, ``QLinearAdd``… (``quantize_static`` with
``QuantFormat.QOperator``), or ``ConvInteger`` / ``MatMulInteger`` on activations that
``DynamicQuantizeLinear`` quantizes at run time (``quantize_dynamic``). :func:`as_qdq` rewrites
such nodes, in place, into float operators between ``DequantizeLinear`` and ``QuantizeLinear``
nodes of the same parameters — the model ONNX Runtime's QDQ format gives — so that profiling, the
QDQ import (:func:`rangeprof.profiler.ir.qdq.dequantize`) and the build read it as a QDQ model:

* ``QLinearConv``, ``QLinearMatMul``, ``QGemm``, ``QLinearAdd``, ``QLinearMul``,
  ``QLinearConcat``, ``QLinear(Global)AveragePool``, ``QLinearLeakyRelu``, ``QLinearSigmoid``:
  a ``DequantizeLinear`` of each quantized input with its scale and zero point (a weight's
  per-channel scale along ``Conv``'s axis 0, ``MatMul``'s last axis, ``Gemm``'s by ``transB``),
  one of the int32 bias with scale ``s_x · s_w`` (``QGemm``: ``· alpha``) and zero point 0, the
  float operator with the node's name and attributes, and a ``QuantizeLinear`` of the output's
  scale and zero point writing the node's quantized output. That computes what ONNX Runtime
  computes up to the rounding of the requantization (ONNX Runtime scales the int32 sum by
  ``s_x · s_w / s_y`` in float32): one step of the output grid at most, on a tie.
* An operator that only moves quantized values (``Reshape``, ``Flatten``, ``MaxPool``, ``Concat``
  of one grid…: :data:`_MOVES`) reads the dequantized values and its output is quantized again on
  the same grid: the same integers, with the pairs around it that the QDQ form has.
* ``ConvInteger`` / ``MatMulInteger`` followed by a ``Cast`` to float and a ``Mul`` by the
  product of its inputs' scales (``quantize_dynamic``'s form) become the float ``Conv`` /
  ``MatMul`` of the dequantized inputs, writing the ``Mul``'s output; the ``Cast``, that ``Mul``
  and the scales' ``Mul`` get the fate ``folded_into:<node>``. An activation quantized by
  ``DynamicQuantizeLinear`` is read through a ``DequantizeLinear`` of its three outputs (a
  dynamic pair): the same integers, scaled before the sum rather than after it, so the model
  computes what ONNX Runtime computes up to float32 rounding. A dynamic scale has no static range:
  a build takes the dynamic pairs out (:mod:`.qdq`) and those tensors' qparams come from a
  profile of the model, as for an FP32 one.
* ``DynamicQuantizeLSTM`` becomes an ``LSTM`` whose weights are its integer weights dequantized
  with their stored scales and zero points (transposed back to ``LSTM``'s layout). ONNX Runtime
  also quantizes the input and the hidden state dynamically at every step, which has no QDQ form:
  the FP32 ``LSTM`` is that much more precise.

The float operator keeps the integer node's name, so profileIDs name the model's own nodes; the
float tensor a quantized one holds is named after it without ONNX Runtime's ``_quantized`` suffix
(``w1_quantized`` dequantizes to ``w1``), and the new nodes after their tensor
(``c1_QuantizeLinear``, ``c1_DequantizeLinear``, as ONNX Runtime names its QDQ nodes). A node of
another form (a per-channel scale along no channel axis of the float operator, a bias whose scales
the graph computes, a ``ConvInteger`` without the ``Mul`` that gives its scales) stays as it is:
the importer then names its operator as unsupported, or converts it as it stands
(``MatMulInteger``, ``DynamicQuantizeLinear``). Only the main graph is rewritten. A per-channel
``DequantizeLinear`` carries its ``axis`` as opset 13 defines it, whatever the model's opset (the
loader checked the model before; TVM and :mod:`.qdq` read the axis at any opset).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from rangeprof.profiler.ir.fates import FOLDED_INTO, Fate
from rangeprof.profiler.ir.qdq import DEQUANTIZE, DYNAMIC, QUANTIZE, Graph, drop_unused

_MS = "com.microsoft"
_SUFFIX = "_quantized"  # ONNX Runtime names a quantized tensor <float tensor>_quantized


@dataclass(frozen=True)
class _QLinear:
    """An operator-oriented node's float operator and where its quantization sits: input
    positions of ``(value, scale, zero point)`` per operand (empty: ``QLinearConcat``'s triples
    from input 2 on), of its output's ``(scale, zero point)`` (optional for ``QGemm``), of its
    int32 bias."""

    op: str
    operands: tuple[tuple[int, int, int], ...]
    output: tuple[int, int]
    bias: int | None = None


_BINARY, _UNARY = ((0, 1, 2), (3, 4, 5)), ((0, 1, 2),)
_QLINEAR = {
    ("", "QLinearConv"): _QLinear("Conv", _BINARY, (6, 7), bias=8),
    ("", "QLinearMatMul"): _QLinear("MatMul", _BINARY, (6, 7)),
    (_MS, "QGemm"): _QLinear("Gemm", _BINARY, (7, 8), bias=6),
    (_MS, "QLinearAdd"): _QLinear("Add", _BINARY, (6, 7)),
    (_MS, "QLinearMul"): _QLinear("Mul", _BINARY, (6, 7)),
    (_MS, "QLinearConcat"): _QLinear("Concat", (), (0, 1)),
    (_MS, "QLinearGlobalAveragePool"): _QLinear("GlobalAveragePool", _UNARY, (3, 4)),
    (_MS, "QLinearAveragePool"): _QLinear("AveragePool", _UNARY, (3, 4)),
    (_MS, "QLinearLeakyRelu"): _QLinear("LeakyRelu", _UNARY, (3, 4)),
    (_MS, "QLinearSigmoid"): _QLinear("Sigmoid", _UNARY, (3, 4)),
}
_INTEGER = {"ConvInteger": "Conv", "MatMulInteger": "MatMul"}
# Operators whose output values are some of their input values (or, for Resize, between them):
# on quantized data they compute on the integers of the input's grid, which the output keeps.
_MOVES = frozenset(
    {
        "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "GlobalMaxPool",
        "Gather", "Slice", "Split", "Resize", "Identity", "Expand", "Tile", "DepthToSpace",
        "SpaceToDepth", "Concat",
    }
)  # fmt: skip


class _Unmatched(Exception):
    """The node is not of a form this module rewrites: it stays as it is."""


def _at(node: onnx.NodeProto, k: int) -> str:
    """Input ``k`` of ``node``; ``""`` where it is omitted."""
    return node.input[k] if k < len(node.input) else ""


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _base(tensor: str) -> str:
    """The float tensor's name of a quantized tensor's (``w1_quantized`` → ``w1``)."""
    return tensor.removesuffix(_SUFFIX) or tensor


def _domain(node: onnx.NodeProto) -> str | None:
    if node.domain in ("", "ai.onnx"):
        return ""
    return _MS if node.domain == _MS else None


def _lstm_weight(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """A ``DynamicQuantizeLSTM`` weight ``[directions, inputs, 4·hidden]`` (scale and zero point
    per direction, or per direction and column) as ``LSTM``'s float ``[directions, 4·hidden,
    inputs]``."""
    shape = (q.shape[0], 1, -1)
    s, z = scale.astype(np.float64).reshape(shape), zero.astype(np.float64).reshape(shape)
    return ((q.astype(np.float64) - z) * s).astype(np.float32).transpose(0, 2, 1).copy()


class _Rewriter:
    def __init__(self, model: onnx.ModelProto):
        self.g = Graph(model.graph)
        graph = model.graph
        self.taken = {n.name for n in graph.node} | {t.name for t in graph.initializer}
        self.taken |= {name for n in graph.node for name in [*n.input, *n.output]}
        # Not the value infos: ONNX Runtime leaves those of the float model's tensors behind.
        self.taken |= {vi.name for vi in [*graph.input, *graph.output]}
        self.created: set[str] = set()
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.fates: dict[str, str] = {}
        self.absorbed: set[int] = set()  # id() of nodes a rewritten node took in
        self.scale_products: list[tuple[onnx.NodeProto, str]] = []  # (Mul, node it serves)
        self.grids: dict[str, tuple[str, str]] = {}  # quantized tensor -> (scale, zero point)
        self.dequantized: dict[tuple, str] = {}  # (tensor, scale, zero, axis) -> float tensor
        self.rewritten = 0

    def run(self) -> dict[str, str]:
        for node in list(self.g.graph.node):
            if id(node) in self.absorbed:
                continue
            try:
                self._rewrite(node)
                self.rewritten += 1
            except _Unmatched:
                self.nodes.append(node)
                self._note_grid(node)
        return self._finish()

    def _rewrite(self, node: onnx.NodeProto) -> None:
        domain = _domain(node)
        spec = _QLINEAR.get((domain, node.op_type))
        if spec is not None:
            self._qlinear(node, spec)
        elif domain == "" and node.op_type in _INTEGER:
            self._integer(node)
        elif domain == _MS and node.op_type == "DynamicQuantizeLSTM":
            self._lstm(node)
        elif domain == "" and node.op_type in _MOVES:
            self._moved(node)
        else:
            raise _Unmatched

    def _note_grid(self, node: onnx.NodeProto) -> None:
        """The grid of a per-tensor quantizer's output, for the moving operators it feeds."""
        if node.op_type == DYNAMIC and _domain(node) == "":
            self.grids[node.output[0]] = (node.output[1], node.output[2])
        elif node.op_type == QUANTIZE and _domain(node) == "":
            scale = self.g.value(node.input[1])
            if scale is not None and scale.size == 1:
                self.grids[node.output[0]] = (node.input[1], _at(node, 2))

    def _fresh(self, base: str) -> str:
        name, n = base, 0
        while name in self.taken:
            n += 1
            name = f"{base}_{n}"
        self.taken.add(name)
        self.created.add(name)
        return name

    def _dequantize(self, tensor: str, scale: str, zero: str, axis: int | None = None) -> str:
        """The float tensor of ``tensor`` (one ``DequantizeLinear`` for all its readers)."""
        key = (tensor, scale, zero, axis)
        if key not in self.dequantized:
            base = _base(tensor)
            out = self._fresh(base if self.g.value(tensor) is not None else f"{base}_dequantized")
            inputs = [tensor, scale, *([zero] if zero else [])]
            attrs = {} if axis is None else {"axis": axis}
            name = self._fresh(f"{base}_{DEQUANTIZE}")
            self.nodes.append(helper.make_node(DEQUANTIZE, inputs, [out], name, **attrs))
            self.dequantized[key] = out
        return self.dequantized[key]

    def _quantize(self, value: str, out: str, scale: str, zero: str) -> None:
        """``QuantizeLinear`` of the float ``value`` writing the quantized tensor ``out``."""
        inputs = [value, scale, *([zero] if zero else [])]
        name = self._fresh(f"{_base(out)}_{QUANTIZE}")
        self.nodes.append(helper.make_node(QUANTIZE, inputs, [out], name))
        self.grids[out] = (scale, zero)

    def _axis(self, op: str, k: int, attrs: dict, tensor: str, scale: str) -> int | None:
        """The axis along which operand ``k``'s scale runs: None for one scale (or a computed
        one, which DequantizeLinear reads as it is), else the float operator's channel axis."""
        value = self.g.value(scale)
        if value is None or value.size == 1:
            return None
        rank = getattr(self.g.value(tensor), "ndim", None)
        if op == "Conv" and k == 1:
            return 0
        if op == "Gemm" and k == 1:
            return 0 if attrs.get("transB", 0) else 1
        if op == "MatMul" and rank is not None:
            return rank - 2 + k  # A's rows, B's columns
        raise _Unmatched

    def _qlinear(self, node: onnx.NodeProto, spec: _QLinear) -> None:
        attrs = _attributes(node)
        if attrs.pop("channels_last", 0):
            raise _Unmatched
        triples = spec.operands or [(k, k + 1, k + 2) for k in range(2, len(node.input), 3)]
        operands = [tuple(_at(node, k) for k in triple) for triple in triples]
        axes = [self._axis(spec.op, k, attrs, t, s) for k, (t, s, _) in enumerate(operands)]
        bias = None
        if spec.bias is not None and _at(node, spec.bias):
            bias = self._bias(_at(node, spec.bias), attrs, operands[0][1], operands[1][1])
        floats = [self._dequantize(*o, axis) for o, axis in zip(operands, axes, strict=True)]
        if bias is not None:
            floats.append(self._dequantize(*bias))
        out = node.output[0]
        scale, zero = (_at(node, k) for k in spec.output)
        value = self._fresh(_base(out)) if scale else out  # QGemm without a scale: float out
        self.nodes.append(helper.make_node(spec.op, floats, [value], node.name, **attrs))
        if scale:
            self._quantize(value, out, scale, zero)

    def _bias(self, bias: str, attrs: dict, x_scale: str, w_scale: str) -> tuple:
        """``(bias, scale, zero point, axis)`` of an int32 bias: scale ``alpha · s_x · s_w``
        (new initializers), per channel along its last axis where ``s_w`` is."""
        sx, sw = self.g.value(x_scale), self.g.value(w_scale)
        if sx is None or sw is None:
            raise _Unmatched
        scale = np.float32(attrs.get("alpha", 1.0)) * sx.reshape(()) * sw  # as ORT, in float32
        axis = None
        if scale.size == 1:
            scale = scale.reshape(())
        else:
            value = self.g.value(bias)
            if value is None or value.ndim == 0 or value.shape[-1] != scale.size:
                raise _Unmatched
            scale, axis = scale.reshape(-1), value.ndim - 1
        names = self._fresh(f"{_base(bias)}_scale"), self._fresh(f"{_base(bias)}_zero_point")
        self.initializers += [
            numpy_helper.from_array(scale.astype(np.float32), names[0]),
            numpy_helper.from_array(np.zeros(scale.shape, np.int32), names[1]),
        ]
        return bias, *names, axis

    def _only_reader(self, tensor: str, op: str) -> onnx.NodeProto:
        readers = self.g.consumers[tensor]
        if tensor in self.g.outputs or len(readers) != 1 or readers[0].op_type != op:
            raise _Unmatched
        return readers[0]

    def _scale_of(self, tensor: str) -> str | None:
        """The scale of a tensor its producer quantized, if a quantizer produced it."""
        producer = self.g.producer.get(tensor)
        if producer is not None and producer.op_type == DYNAMIC:
            return producer.output[1]
        if producer is not None and producer.op_type == QUANTIZE:
            return producer.input[1]
        return None

    def _scales(self, a: str, b: str, factors: list[str]) -> tuple[str, str]:
        """The scales of ``a`` and ``b`` among the two ``factors`` of their product: a
        quantizer's output its own, the other (a weight) the remaining factor."""
        found = [self._scale_of(a), self._scale_of(b)]
        rest = list(factors)
        for scale in filter(None, found):
            if scale not in rest:
                raise _Unmatched
            rest.remove(scale)
        if found.count(None) > 1 or len(rest) != found.count(None):
            raise _Unmatched
        sa, sb = (s if s is not None else rest.pop() for s in found)
        return sa, sb

    def _integer(self, node: onnx.NodeProto) -> None:
        """``quantize_dynamic``'s ``ConvInteger`` / ``MatMulInteger`` → ``Cast`` → ``Mul`` by
        ``Mul(s_a, s_b)``, as the float operator of the dequantized inputs."""
        cast = self._only_reader(node.output[0], "Cast")
        if _attributes(cast).get("to") != onnx.TensorProto.FLOAT:
            raise _Unmatched
        mul = self._only_reader(cast.output[0], "Mul")
        product = [i for i in mul.input if i != cast.output[0]]
        scales = self.g.producer.get(product[0]) if len(product) == 1 else None
        if scales is None or scales.op_type != "Mul":
            raise _Unmatched
        op, attrs = _INTEGER[node.op_type], _attributes(node)
        a, b = _at(node, 0), _at(node, 1)
        sa, sb = self._scales(a, b, list(scales.input))
        scale_b = self.g.value(sb)
        if op == "Conv" and (scale_b is None or scale_b.size != 1):
            raise _Unmatched  # the Mul would scale the last axis, not the channels
        axes = self._axis(op, 0, attrs, a, sa), self._axis(op, 1, attrs, b, sb)
        fa = self._dequantize(a, sa, _at(node, 2), axes[0])
        fb = self._dequantize(b, sb, _at(node, 3), axes[1])
        self.nodes.append(helper.make_node(op, [fa, fb], [mul.output[0]], node.name, **attrs))
        for absorbed in (cast, mul):
            self.absorbed.add(id(absorbed))
            self.fates[absorbed.name] = str(Fate(kind=FOLDED_INTO, target=node.name))
        self.scale_products.append((scales, node.name))

    def _lstm(self, node: onnx.NodeProto) -> None:
        """``DynamicQuantizeLSTM`` as the ``LSTM`` of its dequantized weights."""
        values = [self.g.value(_at(node, k)) for k in (1, 8, 9, 2, 10, 11)]
        if any(v is None for v in values):
            raise _Unmatched
        weights = []
        for k, at in ((1, 0), (2, 3)):
            name = self._fresh(_base(node.input[k]))
            weight = _lstm_weight(*values[at : at + 3])
            self.initializers.append(numpy_helper.from_array(weight, name))
            weights.append(name)
        inputs = [node.input[0], *weights, *(_at(node, k) for k in range(3, 8))]
        while not inputs[-1]:
            inputs.pop()
        attrs = _attributes(node)
        self.nodes.append(helper.make_node("LSTM", inputs, list(node.output), node.name, **attrs))

    def _moved(self, node: onnx.NodeProto) -> None:
        """A moving operator on one grid's integers, on their float values between a pair."""
        data = range(len(node.input)) if node.op_type == "Concat" else [0]
        grids = {self.grids.get(node.input[k]) for k in data}
        if len(grids) != 1 or None in grids:
            raise _Unmatched
        ((scale, zero),) = grids
        moved = onnx.NodeProto()
        moved.CopyFrom(node)
        for k in data:
            moved.input[k] = self._dequantize(node.input[k], scale, zero)
        # MaxPool's second output holds indices, not values.
        quantized = [o for o in node.output[: 1 if node.op_type == "MaxPool" else None] if o]
        for k, out in enumerate(node.output):
            if out in quantized:
                moved.output[k] = self._fresh(_base(out))
        self.nodes.append(moved)
        for value, out in zip(moved.output, node.output, strict=True):
            if out in quantized:
                self._quantize(value, out, scale, zero)

    def _finish(self) -> dict[str, str]:
        if not self.rewritten:
            return {}
        read = {name for node in self.nodes for name in node.input}
        for scales, into in self.scale_products:
            if scales.output[0] not in read and scales.output[0] not in self.g.outputs:
                self.nodes = [n for n in self.nodes if n is not scales]
                self.fates[scales.name] = str(Fate(kind=FOLDED_INTO, target=into))
        graph = self.g.graph
        del graph.node[:]
        graph.node.extend(self.nodes)
        graph.initializer.extend(self.initializers)
        infos = [vi for vi in graph.value_info if vi.name not in self.created]
        del graph.value_info[:]
        graph.value_info.extend(infos)
        drop_unused(graph)
        return self.fates


def as_qdq(model: onnx.ModelProto) -> dict[str, str]:
    """Rewrite ``model``'s operator-oriented quantized nodes in place into their QDQ form (see
    the module doc); the fates of the nodes the rewritten ones took in, by name."""
    return _Rewriter(model).run()
