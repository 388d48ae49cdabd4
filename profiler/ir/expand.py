"""Operators imported as their ONNX function bodies.

ONNX defines many operators as functions of others (Attention, the training losses,
RotaryEmbedding, CenterCropPad, …). Where TVM's frontend has no converter for such an operator,
or one that covers only part of its definition (:data:`PARTIAL`), the node is replaced, at load
time, by the body ONNX gives for it (for its opset, attributes and input types), and each node
of the body is named ``<node>/<OpType>_<k>``: their profileIDs say which node they came from.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx.inliner

# TVM's converter reads only part of these operators' definitions (Attention: only with
# ``num_heads``, as in onnxruntime's contrib op); their function bodies cover all of it.
PARTIAL = frozenset({"Attention"})
_DOMAIN = "rangeprof.expanded"


def _body(node: onnx.NodeProto, opset: int, types: dict) -> onnx.FunctionProto | None:
    """The ONNX function body of ``node``, or None where ONNX defines none."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    if schema.has_function:
        return schema.function_body
    if not schema.has_context_dependent_function:
        return None
    # Omitted optional inputs ("") are passed as empty types.
    input_types = [types.get(i, onnx.TypeProto()).SerializeToString() for i in node.input]
    try:
        data = schema.get_context_dependent_function(node.SerializeToString(), input_types)
    except Exception:  # a type ONNX's function builder does not take: leave the node as it is
        return None
    return onnx.FunctionProto.FromString(data) if data else None


_ROUNDS = 4  # a body may call operators defined as functions in turn (SoftmaxCrossEntropyLoss)


def expand_functions(
    model: onnx.ModelProto, opset: int, convertible: Callable[[onnx.NodeProto], bool]
) -> onnx.ModelProto:
    """``model`` with every node of the main graph that ``convertible`` rejects, and that ONNX
    defines as a function, replaced by its body (see the module docstring), down to operators
    that are no functions."""
    for _ in range(_ROUNDS):
        expanded = _expand_once(model, opset, convertible)
        if expanded is model:
            return model
        model = expanded
    return model


def _expand_once(
    model: onnx.ModelProto, opset: int, convertible: Callable[[onnx.NodeProto], bool]
) -> onnx.ModelProto:
    targets = {
        node.name
        for node in model.graph.node
        if node.domain in ("", "ai.onnx") and not convertible(node)
    }
    if not targets:
        return model
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except (onnx.shape_inference.InferenceError, ValueError):
        inferred = model.graph
    types = {vi.name: vi.type for vi in [*inferred.input, *inferred.value_info, *inferred.output]}
    for tensor in model.graph.initializer:
        types.setdefault(
            tensor.name,
            onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)),
        )
    expanded = onnx.ModelProto()
    expanded.CopyFrom(model)
    selected = []
    for index, node in enumerate(expanded.graph.node):
        if node.name not in targets:
            continue
        body = _body(node, opset, types)
        # ONNX's inliner takes bodies written against the model's own opset only.
        if body is None or any(
            o.domain in ("", "ai.onnx") and o.version != opset for o in body.opset_import
        ):
            continue
        for k, inner in enumerate(body.node):
            inner.name = f"{node.name}/{inner.op_type}_{k}"
        # ONNX's inliner leaves a reference to an attribute the node omits empty (a Constant
        # without a value, a Cast without ``to``): the node states its defaults.
        _state_defaults(node, opset)
        body.name, body.domain = f"f{index}", _DOMAIN
        node.op_type, node.domain = body.name, body.domain
        expanded.functions.append(body)
        selected.append((body.domain, body.name))
    if not selected:
        return model
    expanded.opset_import.append(onnx.helper.make_opsetid(_DOMAIN, 1))
    inlined = onnx.inliner.inline_selected_functions(expanded, selected)
    del inlined.opset_import[:]
    inlined.opset_import.extend(o for o in expanded.opset_import if o.domain != _DOMAIN)
    return inlined


def _state_defaults(node: onnx.NodeProto, opset: int) -> None:
    """``node`` given every attribute its schema has a default for and it omits."""
    given = {attr.name for attr in node.attribute}
    schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    node.attribute.extend(
        attr.default_value
        for name, attr in schema.attributes.items()
        if name not in given and attr.default_value.type
    )
