"""ONNX -> Relax import that knows which ONNX node every binding came from.

TVM's stock importer attaches no spans and names bindings ``lv, lv1, ...``. We subclass it to (1)
consult our converter registry first and report every unsupported op type at once, and (2) bind each
node's outputs as soon as the node is converted, so that each ONNX node's Relax bindings are created
while that node is current. After import, each node claims the bindings reachable backwards from its
outputs that no earlier node claimed; :class:`~rangeprof.profiler.ir.tagging.TagProfileIDs` then
writes the resulting profileIDs onto the IR."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field

import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from rangeprof.profiler.errors import (
    ConversionError,
    ConverterFailure,
    DynamicShapeError,
    RangeprofError,
    UnsupportedOperatorError,
    ValueInputError,
)
from rangeprof.profiler.ir.bindings import (
    function_bindings,
    op_name,
    tensor_dtype,
    tensor_shape,
    used_vars,
)
from rangeprof.profiler.ir.converters import CONVERTERS
from rangeprof.profiler.ir.fates import ALIASES, ELIMINATED, FOLDED_INTO, Fate
from rangeprof.profiler.ir.onnx_load import LoadedModel
from rangeprof.profiler.ir.tagging import (
    INPUT_PREFIX,
    OUTPUT_ID,
    WEIGHT_PREFIX,
    LayerRecord,
    TagProfileIDs,
    node_binding_ids,
)

# Ops the stock importer handles outside its converter map. ``If`` is not among them: control
# flow on data (an If that load-time folding could not decide) has no single program to profile.
_BUILTIN_OPS = frozenset({"Constant"})


@dataclass
class ImportedModel:
    """The tagged initial IR and what each of its profileIDs stands for."""

    loaded: LoadedModel
    mod: tvm.IRModule
    layers: list[LayerRecord]
    # ONNX nodes without a binding of their own: folded at load time or aliases of their input.
    fates: dict[str, str] = field(default_factory=dict)

    def layer(self, profile_id: str) -> LayerRecord:
        return next(r for r in self.layers if r.profile_id == profile_id)


def _unsupported_ops(graph: onnx.GraphProto) -> list[str]:
    stock = onnx_frontend._get_convert_map()
    missing = []
    for node in graph.node:
        known = node.op_type in CONVERTERS or node.op_type in stock
        if not known and node.op_type not in _BUILTIN_OPS:
            missing.append(node.op_type)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                missing += _unsupported_ops(attr.g)
    return missing


class _TrackingImporter(onnx_frontend.ONNXGraphImporter):
    """The stock graph importer with our converter registry and eager binding of node outputs."""

    def __init__(self, loaded: LoadedModel):
        # Parameters keep their ONNX names (``0``, ``x.1``): data is matched to inputs by them.
        super().__init__(dict(loaded.input_shapes), dict(loaded.input_dtypes), sanitize=False)
        graph = loaded.model.graph
        self._node_by_name = {n.name: n for n in graph.node}
        self._graph_outputs = {o.name for o in graph.output}
        self._sources = _value_sources(loaded)

    def _check_for_unsupported_ops(self, graph):
        missing = _unsupported_ops(graph)
        if missing:
            raise UnsupportedOperatorError(missing)

    def _convert_operator(self, op_name, inputs, attrs, opset):
        node_name = attrs["tvm_custom"]["name"]
        node = self._node_by_name.get(node_name)
        try:
            if op_name in CONVERTERS:
                convert = CONVERTERS[op_name].get_converter(opset)
                sym = convert(self.bb, inputs, attrs, [self._nodes, self._params])
                if isinstance(sym, relax.Expr):
                    sym = self.bb.normalize(sym)
            else:
                sym = super()._convert_operator(op_name, inputs, attrs, opset)
            if node is not None:
                _check_outputs(node, sym)
        except Exception as err:
            # A node reading a value it was imported without fails for that reason first.
            if node is not None:
                _check_value_inputs(node, self._sources, opset)
            if isinstance(err, RangeprofError):
                err.args = (f"node {node_name!r} ({op_name}): {err}",)
                raise
            # a stock converter rejecting this node in a way no check of ours foresaw
            raise ConverterFailure(
                f"node {node_name!r} ({op_name}): TVM's converter failed: {_first_line(err)}"
            ) from err
        # A graph output stays unbound so that emit_output binds it directly, without an alias.
        if node is not None and self._graph_outputs.isdisjoint(node.output):
            sym = self._bind(sym)
        return sym

    def _bind(self, sym):
        if isinstance(sym, relax.Tuple):
            return relax.Tuple([self._bind(f) for f in sym.fields])
        if isinstance(sym, tvm.ir.Call | relax.TupleGetItem):
            return self.bb.emit(sym)
        return sym


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _check_outputs(node: onnx.NodeProto, sym) -> None:
    """A node with several outputs is converted to at least as many values."""
    if len(node.output) < 2:
        return  # a single output may be a sequence (a tuple of any length)
    ty = sym.ty if isinstance(sym, relax.Expr) else None
    produced = len(ty.fields) if isinstance(ty, relax.TupleType) else 1
    missing = [name for name in node.output[produced:] if name]
    if missing:
        raise ConversionError(
            f"its output {missing[0]!r} is not supported (the converter computes only the "
            f"first {produced} of its {len(node.output)} outputs)"
        )


def _value_sources(loaded: LoadedModel) -> dict[str, frozenset[str]]:
    """The tensors computed from value inputs the model was loaded without a value for
    (``inspect`` has no data), each with those inputs; a ``Shape`` or ``Size`` of them is not."""
    sources = {name: frozenset([name]) for name in loaded.value_inputs if name not in loaded.bound}
    if not sources:
        return sources
    for node in loaded.model.graph.node:
        found = frozenset().union(*(sources.get(name, frozenset()) for name in node.input))
        if found and node.op_type not in ("Shape", "Size"):
            sources.update(dict.fromkeys(node.output, found))
    return sources


def _check_value_inputs(node: onnx.NodeProto, sources: dict, opset: int) -> None:
    """Raises :class:`ValueInputError` when ``node`` reads a value computed from a value input
    the model was loaded without (see :func:`_value_sources`); a setting's input first."""
    read = [k for k, name in enumerate(node.input) if name in sources]
    if not read:
        return
    k = next((k for k in read if k > 0), read[0])
    given = " and ".join(repr(name) for name in sorted(sources[node.input[k]]))
    raise ValueInputError(
        f"node {node.name!r} ({node.op_type}): its input {_formal_input(node, k, opset)!r} "
        f"comes from the model input {given}, whose value the import needs; "
        "`rangeprof profile --data` takes the value from the data, `inspect` has none "
        "(--input-shape fixes shapes, not values)"
    )


def _formal_input(node: onnx.NodeProto, k: int, opset: int) -> str:
    """The name ONNX gives input ``k`` of ``node`` (``axes``, ``shape``), else its position."""
    try:
        formal = onnx.defs.get_schema(node.op_type, opset, node.domain).inputs
    except onnx.defs.SchemaError:
        return f"#{k}"
    return formal[min(k, len(formal) - 1)].name if formal else f"#{k}"


def _claim_bindings(func: relax.Function, graph: onnx.GraphProto, tensors: dict) -> dict:
    """Maps each binding Var of ``func`` to the ONNX node it was built for.

    A node claims the unclaimed bindings reachable backwards from its outputs; nodes are visited
    in graph (topological) order, so a node never claims its producers' bindings. Bindings no
    output reaches (e.g. unused tuple fields) belong to the node converted when they were emitted,
    i.e. the owner of the nearest earlier binding (ahead of every claimed one: the first owner).
    """
    refs = list(function_bindings("main", func))
    value_of = {r.var: r.value for r in refs}
    var_of_value = {r.value: r.var for r in refs if not isinstance(r.value, relax.Var)}
    owner: dict[relax.Var, str] = {}
    for node in graph.node:
        stack = []
        for name in node.output:
            expr = tensors.get(name) if name else None
            if expr is None:
                continue
            if isinstance(expr, relax.Tuple):
                stack += [var_of_value.get(f, f) for f in expr.fields]
            else:
                stack.append(var_of_value.get(expr, expr))
        while stack:
            var = stack.pop()
            if not isinstance(var, relax.Var) or var not in value_of or var in owner:
                continue
            owner[var] = node.name
            stack += used_vars(value_of[var])
    previous = None
    for ref in refs:
        if ref.var in owner:
            previous = owner[ref.var]
        elif previous is not None:
            owner[ref.var] = previous
    # Bindings ahead of every claimed one (a converter's helpers, e.g. the shape computation of
    # a Squeeze with computed axes) belong to the first node that claimed a binding.
    first = next((owner[r.var] for r in refs if r.var in owner), None)
    if first is not None:
        for ref in refs:
            owner.setdefault(ref.var, first)
    return owner


def import_onnx(loaded: LoadedModel) -> ImportedModel:
    """Imports a loaded ONNX model into Relax and tags every binding, input and weight."""
    graph = loaded.model.graph
    mod, tensors = _convert(loaded)
    func = mod["main"]
    owner = _claim_bindings(func, graph, tensors)
    _check_static_shapes(func, owner, loaded)
    # A binding of a bare Var (a graph output that is an Identity of another value) is a rename,
    # not a computation: its lineage is that of the Var, and it gets no profileID of its own.
    refs = [r for r in function_bindings("main", func) if not isinstance(r.value, relax.Var)]
    tensor_of_var = _tensor_names(graph, tensors, refs)
    per_node: dict[str, list[relax.Var]] = {}
    for ref in refs:
        if ref.var in owner:
            per_node.setdefault(owner[ref.var], []).append(ref.var)
    binding_ids, activations = _activation_layers(graph, refs, owner, per_node, tensor_of_var)
    weight_ids = _weight_ids(graph, tensors)
    layers = _input_layers(func) + activations + _weight_layers(func, weight_ids)
    ids = [r.profile_id for r in layers]
    if len(ids) != len(set(ids)):
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        raise AssertionError(f"profileIDs are not unique: {dupes}")
    tagged = TagProfileIDs(binding_ids, weight_ids)(mod)
    fates = _fates(loaded, tensors, per_node, binding_ids, weight_ids, layers, tensor_of_var)
    return ImportedModel(loaded=loaded, mod=tagged, layers=layers, fates=fates)


def _convert(loaded: LoadedModel) -> tuple[tvm.IRModule, dict]:
    """The stock importer's module, through our converters, and the Relax value of every ONNX
    tensor name."""
    graph = loaded.model.graph
    importer = _TrackingImporter(loaded)
    # The stock importer prints the inputs of a node it fails on; the error we raise says it all.
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            mod = importer.from_onnx(graph, loaded.opset)
        except BaseException as err:
            _end_blocks(importer.bb)
            if isinstance(err, AssertionError):  # the frontend's own checks (of a subgraph, say)
                raise ConverterFailure(
                    f"{loaded.name}: TVM's importer failed: {_first_line(err)}"
                ) from err
            raise
    return mod, importer._nodes


def _end_blocks(bb: relax.BlockBuilder) -> None:
    """Ends the blocks a failed import left open (TVM warns on stderr of a builder dropped
    with open blocks)."""
    while True:
        try:
            bb.current_block_is_dataflow()
        except tvm.error.InternalError:  # no block is open
            return
        bb._end_block()


def _tensor_names(graph, tensors: dict, refs: list) -> dict[relax.Var, str]:
    """The ONNX tensor each variable holds: a node's output, or a graph output."""
    tensor_of_var = {}
    for node in graph.node:
        for name in node.output:
            expr = tensors.get(name) if name else None
            if isinstance(expr, relax.Var):
                tensor_of_var.setdefault(expr, name)
    # Graph outputs were bound by emit_output: find them by value.
    output_vars = {r.value: r.var for r in refs}
    for out in graph.output:
        expr = tensors.get(out.name)
        if expr in output_vars:
            tensor_of_var.setdefault(output_vars[expr], out.name)
    return tensor_of_var


def _input_layers(func: relax.Function) -> list[LayerRecord]:
    return [
        LayerRecord(
            profile_id=INPUT_PREFIX + str(param.name),
            kind="input",
            op="input",
            source_node=None,
            source_op=None,
            source_tensor=str(param.name),
            shape=tensor_shape(param.ty),
            dtype=tensor_dtype(param.ty),
        )
        for param in func.params
    ]


def _activation_layers(
    graph, refs: list, owner: dict, per_node: dict, tensor_of_var: dict
) -> tuple[dict[relax.Var, str], list[LayerRecord]]:
    """Each binding's profileID (its node's, numbered within the node; :data:`OUTPUT_ID` for
    one no node claimed) and its record."""
    nodes = {n.name: n for n in graph.node}
    binding_ids: dict[relax.Var, str] = {}
    layers = []
    for ref in refs:
        var = ref.var
        node_name = owner.get(var)
        if node_name is None:
            profile_id, node = OUTPUT_ID, None
        else:
            group = per_node[node_name]
            profile_id = node_binding_ids(node_name, len(group))[group.index(var)]
            node = nodes[node_name]
        binding_ids[var] = profile_id
        layers.append(
            LayerRecord(
                profile_id=profile_id,
                kind="activation",
                op=op_name(ref.value),
                source_node=node_name,
                source_op=node.op_type if node is not None else None,
                source_tensor=tensor_of_var.get(var),
                shape=tensor_shape(var.ty),
                dtype=tensor_dtype(var.ty),
            )
        )
    return binding_ids, layers


def _weight_layers(func: relax.Function, weight_ids: dict) -> list[LayerRecord]:
    """The records of the weights the function uses, by profileID."""
    used = _constants_used(func)
    layers = []
    for const, profile_id in sorted(weight_ids.items(), key=lambda item: item[1]):
        if const in used:
            array = const.value.numpy()
            layers.append(
                LayerRecord(
                    profile_id=profile_id,
                    kind="weight",
                    op="constant",
                    source_node=None,
                    source_op=None,
                    source_tensor=profile_id.removeprefix(WEIGHT_PREFIX),
                    shape=list(array.shape),
                    dtype=str(array.dtype),
                )
            )
    return layers


def _fates(
    loaded: LoadedModel,
    tensors: dict,
    per_node: dict,
    binding_ids: dict,
    weight_ids: dict,
    layers: list[LayerRecord],
    tensor_of_var: dict,
) -> dict[str, str]:
    """What became of the ONNX nodes and weights without a binding of their own: the load's
    fates, then aliases of their input and values folded into a node's result."""
    graph = loaded.model.graph
    result_id = {}  # node -> profileID of the binding that is its result
    for node_name, group in per_node.items():
        ids = node_binding_ids(node_name, len(group))
        results = [i for v, i in zip(group, ids, strict=True) if v in tensor_of_var]
        result_id[node_name] = (results or ids)[-1]
    fates = dict(loaded.fates)
    for node in graph.node:
        if node.op_type != "Constant" and node.name not in per_node:
            fate = _alias_fate(node, tensors, binding_ids)
            fates.setdefault(node.name, fate or _folded_fate(graph, node.output, result_id))
    listed = {r.profile_id for r in layers}
    for profile_id in weight_ids.values():
        if profile_id not in listed:
            name = profile_id.removeprefix(WEIGHT_PREFIX)
            fates.setdefault(profile_id, _folded_fate(graph, [name], result_id))
    return fates


def _static(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_static(field) for field in ty.fields)
    if isinstance(ty, relax.TensorType):
        shape = ty.shape
        if isinstance(shape, relax.Var):  # the shape a shape-valued variable holds, if known
            shape = shape.ty if isinstance(shape.ty, relax.ShapeType) else None
        values = None if shape is None else shape.values
        return values is not None and all(isinstance(d, tvm.tirx.IntImm) for d in values)
    return True  # shapes, objects: no tensor data to observe


def _check_static_shapes(func: relax.Function, owner: dict, loaded: LoadedModel) -> None:
    """With the input shapes fixed every tensor's shape is known, except where it depends on
    the data (NonZero, Unique, Compress, a Slice or Expand by an input): the compiled profiling
    program needs every shape from the input shapes alone."""
    nodes = {n.name: n for n in loaded.model.graph.node}
    for ref in function_bindings("main", func):
        if not _static(ref.var.ty):
            name = owner.get(ref.var, "?")
            if name in nodes:
                _check_value_inputs(nodes[name], _value_sources(loaded), loaded.opset)
            op = f" ({nodes[name].op_type})" if name in nodes else ""
            raise DynamicShapeError(
                f"node {name!r}{op}: its output shape {_shape_text(ref.var.ty)} depends on the "
                "input data; rangeprof profiles models whose tensor shapes follow from the "
                "input shapes"
            )


def _shape_text(ty) -> str:
    """A shape as the user reads it: ``[2, ?]``, ``?`` where even the rank is unknown."""
    if isinstance(ty, relax.TupleType):
        return "(" + ", ".join(_shape_text(field) for field in ty.fields) + ")"
    shape = getattr(ty, "shape", None)
    values = getattr(shape, "values", None)
    if values is None:
        return "?"
    dims = [str(int(d)) if isinstance(d, tvm.tirx.IntImm) else "?" for d in values]
    return f"[{', '.join(dims)}]"


def _weight_ids(graph: onnx.GraphProto, tensors: dict) -> dict:
    """Weight constants (initializers and Constant-node outputs) -> their profileIDs."""
    names = [t.name for t in graph.initializer]
    names += [o for n in graph.node if n.op_type == "Constant" for o in n.output]
    ids = {}
    for name in names:
        const = tensors.get(name)
        if isinstance(const, tvm.ir.GenericConst) and const not in ids:
            ids[const] = WEIGHT_PREFIX + name
    return ids


def _constants_used(func: relax.Function) -> set:
    used = set()

    def visit(expr):
        if isinstance(expr, tvm.ir.GenericConst) and isinstance(expr.value, tvm.runtime.Tensor):
            used.add(expr)

    relax.analysis.post_order_visit(func, visit)
    return used


def _alias_fate(node, tensors, binding_ids) -> str | None:
    """``aliases:<id>`` for a node whose output is an existing value (Identity-like)."""
    for name in node.output:
        expr = tensors.get(name)
        if isinstance(expr, relax.Var) and expr in binding_ids:
            return str(Fate(kind=ALIASES, target=binding_ids[expr]))
        if isinstance(expr, relax.Var):
            return str(Fate(kind=ALIASES, target=f"{INPUT_PREFIX}{expr.name}"))
    return None


def _folded_fate(graph: onnx.GraphProto, tensors: list[str], result_id: dict) -> str:
    """Where a value the frontend computed at import time went: the first node with bindings
    (in graph order) that consumes it, directly or through other folded nodes."""
    pending = set(tensors)
    for node in graph.node:
        if pending.isdisjoint(node.input):
            continue
        if node.name in result_id:
            return str(Fate(kind=FOLDED_INTO, target=result_id[node.name]))
        pending.update(node.output)
    return str(Fate(kind=ELIMINATED, target="constant"))
