"""A profile's quantization parameters as a QDQ model: the FP32 ONNX model with
``QuantizeLinear`` / ``DequantizeLinear`` where rangeprof's INT8 build quantizes.

The placement is that of ONNX Runtime's ``quantize_static`` (QDQ format) and TensorRT's explicit
quantization, restricted to the operators rangeprof's x86 target computes in integers: ``Conv``,
``Gemm`` and ``MatMul`` with a constant weight (ORT's ``QLinearConv`` / ``QGemm`` /
``QLinearMatMul`` node units), and ``MatMul`` of two activations (attention), whose second
operand is paired **symmetric int8**, on the grid the x86 build multiplies it on. (On AVX2,
ONNX Runtime's fused u8 × s8 kernels add pairs of products in int16 with saturation,
``vpmaddubsw``: with full-range int8 weights its outputs leave the QDQ semantics — ORT's
``reduce_range`` — which its unfused execution and our build keep.) ORT's registry also quantizes
``Add``, ``Mul``, pooling, ``Concat``…, which ``rangeprof build`` keeps FP32. These are the
tensors the build quantizes (it folds no scale into a conv from in front:
:func:`~rangeprof.profiler.ir.stages.fold_scale_axis_passes`), so a build of the export on its
own pairs is the build of the profile. So:

* an **activation** read by such an operator gets a pair ``x → QuantizeLinear → DequantizeLinear``
  on that edge (one pair per tensor, whichever quantized operators read it); other readers keep
  the FP32 tensor, as the build's FP32 operators do. Where every reader of an operator's output
  is quantized, the next pair sits right behind it and ONNX Runtime fuses the operator into an
  integer one (the build's 8-bit region chains);
* a **weight** (an initializer or ``Constant``) becomes an integer initializer ``<w>_quantized``
  and a ``DequantizeLinear``, per channel (``axis``) where the qparams are; where only quantized
  operators read the weight, its ``DequantizeLinear`` output takes its name (so a QDQ import
  gives the qparams back under the weight's profileID);
* a **bias** (``Conv``'s and ``Gemm``'s third input, one value per output channel, read by that
  operator alone) of an operator whose input and weight are quantized becomes int32 with scale
  ``s_x · s_w`` and zero point 0, as ONNX Runtime writes it (``Gemm``'s ``beta`` folded into it);
  one that int32 cannot hold at that scale stays FP32. (The x86 build adds it unrounded: half a
  unit of ``s_x · s_w`` at most apart.)

Scales and zero points are :func:`~rangeprof.profiler.calibrate.methods.qparams_for` of the
profile entry whose ``source_tensor`` is the tensor: activations and inputs with the options as
given; weights and weight transforms (static tensors) **symmetric int8** with the same method,
granularity and power-of-two rule — what every rangeprof target multiplies with 8-bit weights,
ONNX Runtime's default (``WeightSymmetric``) and TensorRT's only choice. (The x86 build on a CPU
without VNNI narrows some layers' weights to 7 bits by default; the export is its build with
``--weight-bits 8``.) Tensors without an entry stay FP32.

Per-channel ``DequantizeLinear`` needs opset 13 and 16-bit types opset 21: a model below that is
converted (``onnx.version_converter``). A profile of a transformed model (``model.transforms``,
e.g. cross-layer equalization) holds another model's ranges and is refused here: the export
workflow (:func:`rangeprof.workflows.profiling.render_export`) first writes the equalized
weights into the model's initializers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import onnx
from onnx import helper, numpy_helper, version_converter

from rangeprof.profiler.calibrate.methods import (
    DTYPES,
    CalibrationOptions,
    QParams,
    is_static,
    qparams_for,
)
from rangeprof.profiler.errors import RangeprofError

# Operator -> (its quantized inputs, its bias input or None).
QUANTIZED_OPS: dict[str, tuple[tuple[int, ...], int | None]] = {
    "Conv": ((0, 1), 2),
    "Gemm": ((0, 1), 2),
    "MatMul": ((0, 1), None),
}
_DOMAINS = ("", "ai.onnx")
_ZERO_TYPES = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16}
_PER_CHANNEL_OPSET, _INT16_OPSET, _QDQ_OPSET = 13, 21, 10
_INT32 = np.iinfo(np.int32)


def qdq_model(
    model: onnx.ModelProto, profile: dict, options: CalibrationOptions
) -> onnx.ModelProto:
    """``model`` (left unchanged) with the QDQ pairs of ``profile``'s qparams under ``options``
    (see the module doc)."""
    transforms = profile["model"].get("transforms")
    if transforms:
        raise RangeprofError(
            f"the profile is of the model after {', '.join(transforms)}: its ranges are not those "
            "of the ONNX model's tensors; profile it without that transform to export QDQ"
        )
    weight_options = replace(options, scheme="sym", dtype="int8")
    params: dict[str, QParams] = {}
    operands: dict[str, QParams] = {}  # activations as a MatMul's second operand
    static: set[str] = set()
    for entry in profile["tensors"]:
        name = entry["source_tensor"]
        if not name or entry["dtype"] != "float32" or name in params:
            continue
        static_entry = is_static(entry)
        params[name] = qparams_for(entry, weight_options if static_entry else options)
        if static_entry:
            static.add(name)
        elif params[name].axis is None:
            operands[name] = _operand(params[name])
    out = onnx.ModelProto()
    out.CopyFrom(model)
    needed = _Rewriter(out.graph, params, static, operands).needed_opset()
    out = at_opset(
        out,
        needed,
        what="per-channel or 16-bit QDQ",
        instead="convert it yourself, or export per-tensor int8",
    )
    _Rewriter(out.graph, params, static, operands).run()
    return out


def at_opset(model: onnx.ModelProto, needed: int, what: str, instead: str) -> onnx.ModelProto:
    """``model`` converted to opset ``needed``, its IR version raised to what that opset needs,
    where its default domain is below it; else ``model`` as it is. A conversion onnx cannot do
    is refused in one line: ``what`` needs the opset; do ``instead``."""
    opset = next((o.version for o in model.opset_import if o.domain in _DOMAINS), None)
    if opset is None or opset >= needed:
        return model
    try:
        converted = version_converter.convert_version(model, needed)
    except Exception as err:  # the converter raises bare RuntimeErrors from C++
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RangeprofError(
            f"{what} needs opset {needed}, and onnx cannot convert the model from opset "
            f"{opset} ({detail}): {instead}"
        ) from None
    minimum = helper.find_min_ir_version_for([helper.make_opsetid("", needed)])
    converted.ir_version = max(converted.ir_version, minimum)
    return converted


def fresh_name(base: str, taken: set[str]) -> str:
    """``base``, else ``base_1``, ``base_2``… whichever is first not in ``taken``; added to it."""
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


class _Rewriter:
    """Inserts the pairs into a graph in place, each in front of the first node that reads it."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        params: dict[str, QParams],
        static: set[str],
        operands: dict[str, QParams],
    ):
        self.graph = graph
        self.nodes = list(graph.node)  # held: the ids below name these very objects
        self.params = params
        inputs = {i.name for i in graph.input}
        self.weights = {
            t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name not in inputs
        }
        for node in self.nodes:
            if node.op_type == "Constant" and node.domain in _DOMAINS:
                value = _constant_value(node)
                if value is not None:
                    self.weights[node.output[0]] = value
        # Operators with a constant weight (or a weight transform): the integer kernels.
        self.quantized = {
            id(node)
            for node in self.nodes
            if node.op_type in QUANTIZED_OPS
            and node.domain in _DOMAINS
            and len(node.input) > 1
            and (node.input[1] in self.weights or node.input[1] in static)
        }
        # MatMuls of two profiled activations: the second one on its symmetric int8 grid.
        self.operands = {
            id(node): operands[node.input[1]]
            for node in self.nodes
            if node.op_type == "MatMul"
            and node.domain in _DOMAINS
            and id(node) not in self.quantized
            and node.input[0] in operands
            and node.input[1] in operands
        }
        self.quantized |= set(self.operands)
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        for node in self.nodes:
            for k, name in enumerate(node.input):
                self.readers[name].append((node, k))
        self.outputs = {o.name for o in graph.output}
        self.names = {n for node in self.nodes for n in (*node.input, *node.output, node.name)}
        self.names |= {t.name for t in graph.initializer} | inputs | self.outputs
        self.dequantized: dict[str, str] = {}  # tensor -> the DequantizeLinear output for it
        self.added: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.dropped: set[str] = set()  # constants now held in integers only

    def needed_opset(self) -> int:
        """The lowest opset whose ``QuantizeLinear`` / ``DequantizeLinear`` take the qparams of
        the tensors the quantized operators read."""
        needed = _QDQ_OPSET
        for node in self.nodes:
            if id(node) not in self.quantized:
                continue
            for k in QUANTIZED_OPS[node.op_type][0]:
                p = self.params.get(node.input[k]) if k < len(node.input) else None
                if p is not None and p.dtype == "int16":
                    needed = max(needed, _INT16_OPSET)
                if p is not None and p.axis is not None:
                    needed = max(needed, _PER_CHANNEL_OPSET)
        return needed

    def run(self) -> None:
        nodes = []
        for node in self.nodes:
            if id(node) in self.quantized:
                self._quantize(node)
            nodes += [*self.added, node]
            self.added = []
        del self.graph.node[:]
        self.graph.node.extend(
            n for n in nodes if not (n.op_type == "Constant" and n.output[0] in self.dropped)
        )
        kept = [t for t in self.graph.initializer if t.name not in self.dropped]
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept + self.initializers)

    def _quantize(self, node: onnx.NodeProto) -> None:
        inputs, bias = QUANTIZED_OPS[node.op_type]
        quantized = {}
        for k in inputs:
            name = node.input[k] if k < len(node.input) else ""
            p = self.params.get(name)
            if k == 1 and id(node) in self.operands:
                p = self.operands[id(node)]
            if p is None:
                continue
            if name in self.weights:
                node.input[k] = self._weight(name, p)
            else:
                node.input[k] = self._activation(name, p)
            quantized[k] = p
        if bias is not None and len(node.input) > bias and 0 in quantized and 1 in quantized:
            self._bias(node, bias, quantized[0], quantized[1])

    def _unique(self, name: str) -> str:
        return fresh_name(name, self.names)

    def _pair_parameters(self, name: str, scale, zero) -> tuple[str, str]:
        """Initializers for a scale (float32) and a zero point (its integer type)."""
        tensors = [
            numpy_helper.from_array(np.asarray(scale, np.float32), self._unique(f"{name}_scale")),
            numpy_helper.from_array(zero, self._unique(f"{name}_zero_point")),
        ]
        self.initializers += tensors
        return tensors[0].name, tensors[1].name

    def _activation(self, name: str, p: QParams) -> str:
        if name not in self.dequantized:
            scale, zero = self._pair_parameters(name, p.scale, _zero_point(p))
            axis = {} if p.axis is None else {"axis": p.axis}
            q = self._unique(f"{name}_QuantizeLinear_Output")
            dq = self._unique(f"{name}_DequantizeLinear_Output")
            q_node = self._unique(f"{name}_QuantizeLinear")
            dq_node = self._unique(f"{name}_DequantizeLinear")
            self.added += [
                helper.make_node("QuantizeLinear", [name, scale, zero], [q], q_node, **axis),
                helper.make_node("DequantizeLinear", [q, scale, zero], [dq], dq_node, **axis),
            ]
            self.dequantized[name] = dq
        return self.dequantized[name]

    def _weight(self, name: str, p: QParams) -> str:
        if name not in self.dequantized:
            integers = _quantized(self.weights[name], p)
            self.dequantized[name] = self._integer(name, integers, p.scale, _zero_point(p), p.axis)
        return self.dequantized[name]

    def _integer(self, name: str, integers: np.ndarray, scale, zero, axis: int | None) -> str:
        """The constant ``name`` as integers and a ``DequantizeLinear``; returns its output.

        Where only quantized operators read the constant, as inputs they quantize, the float
        constant goes and the output takes its name (what a QDQ import gives back)."""
        alone = name not in self.outputs and all(
            id(n) in self.quantized
            and (k in QUANTIZED_OPS[n.op_type][0] or k == QUANTIZED_OPS[n.op_type][1])
            for n, k in self.readers[name]
        )
        if alone:
            self.dropped.add(name)
        out = name if alone else self._unique(f"{name}_DequantizeLinear_Output")
        stored = numpy_helper.from_array(integers, self._unique(f"{name}_quantized"))
        self.initializers.append(stored)
        scale, zero = self._pair_parameters(name, scale, zero)
        attrs = {} if axis is None else {"axis": axis}
        node = self._unique(f"{name}_DequantizeLinear")
        self.added.append(
            helper.make_node("DequantizeLinear", [stored.name, scale, zero], [out], node, **attrs)
        )
        return out

    def _bias(self, node: onnx.NodeProto, index: int, x: QParams, w: QParams) -> None:
        """int32 in units of ``s_x · s_w`` (zero point 0), as ONNX Runtime quantizes a bias."""
        name = node.input[index]
        value = self.weights.get(name)
        # A bias shared by several operators would need one scale for all: it stays FP32.
        if value is None or value.ndim != 1 or len(self.readers[name]) > 1:
            return
        beta = next((a for a in node.attribute if a.name == "beta"), None)
        value = value.astype(np.float64) * (beta.f if beta is not None else 1.0)
        scale = np.float32(x.scale) * np.asarray(w.scale, np.float32)  # float32, as ORT's
        if w.axis is not None and scale.size != value.size:
            return
        q = np.rint(value / scale.astype(np.float64))
        if q.size and (q.min() < _INT32.min or q.max() > _INT32.max):
            return
        zero = np.zeros(scale.shape, np.int32)
        axis = None if w.axis is None else 0
        node.input[index] = self._integer(name, q.astype(np.int32), scale, zero, axis)
        if beta is not None:
            beta.f = 1.0


def _operand(p: QParams) -> QParams:
    """An activation's per-tensor range on the symmetric int8 grid, as the x86 build derives it
    from the activation's qparams: ``max(|lo|, |hi|) / 127``."""
    lo, hi = p.range
    scale = max(-lo, hi) / 127 or 1.0
    return replace(p, dtype="int8", scale=scale, zero_point=0, range=(-127 * scale, 127 * scale))


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    attr = node.attribute[0] if len(node.attribute) == 1 else None
    if attr is None or attr.name != "value":
        return None
    return numpy_helper.to_array(attr.t)


def _zero_point(p: QParams) -> np.ndarray:
    return np.asarray(p.zero_point, _ZERO_TYPES[p.dtype])


def _quantized(value: np.ndarray, p: QParams) -> np.ndarray:
    """``round(w / s) + z`` clamped to the symmetric grid, with the scale the model stores."""
    t = DTYPES[p.dtype]
    shape = [1] * value.ndim
    if p.axis is not None:
        shape[p.axis] = -1
    scale = np.asarray(p.scale, np.float32).astype(np.float64).reshape(shape)
    zero = np.asarray(p.zero_point, np.float64).reshape(shape)
    q = np.rint(value.astype(np.float64) / scale) + zero
    return np.clip(q, zero - t.half, zero + t.half).astype(_ZERO_TYPES[p.dtype])
