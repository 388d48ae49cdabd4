"""Loading an ONNX model for profiling: validate it, name its nodes, fix its input shapes and fold
its shape computations, so that the Relax importer gets a static, self-contained model.

Node names
    A node's name is its profileID downstream, so every node of the main graph gets a unique,
    non-empty name that depends only on the model file:

    1. A name that occurs exactly once in the graph is kept.
    2. Every other node, in graph order, starts from a base name: its own name, or
       ``{op_type}_{k}`` when it has none, where ``k`` is its 0-based index among the graph's nodes
       of that op type (named ones included).
    3. It takes the base name if that is still free, else ``{base}_{n}`` with the smallest
       ``n >= 1`` that is free. Names kept by rule 1 are never free.

    Nodes inside subgraphs (``If``/``Loop`` bodies) keep their names.

Value inputs
    A graph input whose value reaches a shape or setting input (a ``Reshape`` target, a
    ``Resize``'s sizes, ``TopK``'s k, a ``Reduce``'s axes: :data:`_SHAPE_INPUTS`) decides the
    shapes the program computes with, so no single compiled program serves every value. Such
    inputs are listed as ``value_inputs``; profiling feeds them whole (constants) and loads the
    model with the values the data gives bound as initializers (``bound``), then folds.

Folding and fates
    With the input shapes fixed, onnxsim folds what the Relax importer needs static: values
    computed from input shapes (a ``Shape`` chain into a ``Reshape`` target), integer arithmetic
    on constants (shape-like values) and subgraphs fed only by ``Constant`` nodes. Float
    computations on initializers (a weight's ``Transpose`` or ``Identity``) stay, for Relax's
    constant folding, where lineage follows them. onnxsim's graph optimizer stays off, so
    ``BatchNormalization`` and all other computing nodes survive with their names and output
    tensors. Folded values become initializers, so every node of the loaded model is a node of
    the original one. Folding must not change what the model means: every folded value is
    checked against what onnxruntime computes for that tensor (:func:`misfolded`) and takes
    onnxruntime's value where they differ (onnxsim was seen folding a recognition model's
    Reshape targets for another width); a model onnxsim cannot fold is imported unfolded. Each
    original node that folding removed, except ``Constant`` nodes (their values simply become
    weights), gets a fate:

    - ``folded_into:<name>``: ``<name>`` is the first surviving node, in the original graph order,
      that consumes its outputs directly or through other removed nodes;
    - ``eliminated:constant``: no surviving node consumes its value (say, a graph output that is
      now a constant).
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import numpy as np
import onnx
import onnxsim
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from rangeprof.profiler.errors import (
    InputShapeError,
    InvalidModelError,
    UnsafeExternalDataError,
    UnsupportedTypeError,
)
from rangeprof.profiler.ir.fates import ELIMINATED, FOLDED_INTO, Fate
from rangeprof.profiler.ir.index_inputs import IndexUse, index_uses
from rangeprof.profiler.ir.operator_quantized import as_qdq
from rangeprof.profiler.ir.qdq import EmbeddedQ
from rangeprof.profiler.ir.qdq import dequantize as dequantized

# onnx.helper writes its newest IR version (14 with onnx 1.23), which the onnxruntime inside
# onnxsim may not read yet; folding runs at this version at most, which onnxruntime >= 1.20 reads.
_FOLD_IR_VERSION = 10


@dataclass(frozen=True)
class ModelFacts:
    """What loading learned about a model: enough to read data for it and to describe it."""

    name: str
    sha256: str  # of the .onnx bytes as given
    input_shapes: dict[str, tuple[int, ...]]
    input_dtypes: dict[str, str]  # numpy dtype names
    opset: int  # of the default ONNX domain
    fates: dict[str, str]  # removed node name -> fate (see the module docstring)
    # Inputs whose values decide shapes or settings (see "Value inputs" in the module docstring),
    # and the values the model was loaded with (``bound``): its program takes the others.
    value_inputs: tuple[str, ...] = field(default=(), kw_only=True)
    bound: dict[str, np.ndarray] = field(default_factory=dict, kw_only=True)
    # Integer inputs that index an axis (token ids): the values they may hold.
    index_uses: dict[str, IndexUse] = field(default_factory=dict, kw_only=True)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "sha256": self.sha256,
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "input_dtypes": self.input_dtypes,
            "opset": self.opset,
            "fates": self.fates,
            "value_inputs": list(self.value_inputs),
            "bound": {k: v.tolist() for k, v in self.bound.items()},
            "index_uses": {k: v.to_json() for k, v in self.index_uses.items()},
        }

    @classmethod
    def from_json(cls, doc: dict) -> ModelFacts:
        shapes = {k: tuple(v) for k, v in doc["input_shapes"].items()}
        dtypes = doc["input_dtypes"]
        return cls(
            doc["name"],
            doc["sha256"],
            shapes,
            dtypes,
            doc["opset"],
            doc["fates"],
            value_inputs=tuple(doc["value_inputs"]),
            bound={k: np.asarray(v, dtypes[k]) for k, v in doc["bound"].items()},
            index_uses={k: IndexUse(**v) for k, v in doc.get("index_uses", {}).items()},
        )

    @property
    def program_inputs(self) -> list[str]:
        """The inputs the compiled program takes: all but the bound ones."""
        return [name for name in self.input_shapes if name not in self.bound]


@dataclass(frozen=True)
class LoadedModel(ModelFacts):
    """A model ready for the Relax importer."""

    model: onnx.ModelProto
    # The pairs taken out of a QDQ model loaded with ``dequantize=True``
    # (rangeprof.profiler.ir.qdq).
    embedded: tuple[EmbeddedQ, ...] = ()

    @property
    def facts(self) -> ModelFacts:
        return ModelFacts(
            self.name,
            self.sha256,
            self.input_shapes,
            self.input_dtypes,
            self.opset,
            self.fates,
            value_inputs=self.value_inputs,
            bound=self.bound,
            index_uses=self.index_uses,
        )


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse a CLI value ``NAME=DIMS`` such as ``x=1x3x48x192``.

    The split is on the last ``=``, as tensor names may contain ``=`` but dims never do.
    """
    name, sep, dims_text = text.rpartition("=")
    dims = dims_text.split("x")
    if not sep or not name or not all(d.isdecimal() and int(d) > 0 for d in dims):
        raise InputShapeError(
            f"malformed input shape {text!r}: expected NAME=DIMS with positive integer dims "
            "separated by 'x', e.g. x=1x3x224x224"
        )
    return name, tuple(int(d) for d in dims)


def load_model(
    path: str | os.PathLike[str],
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    dequantize: bool = False,
    bound: Mapping[str, np.ndarray] | None = None,
) -> LoadedModel:
    """Load the ONNX file at ``path``; external data is read from its folder, and only from it.

    ``bound`` gives value inputs their values: the model is loaded specialised to them.

    With ``dequantize``, a QDQ model loads as the FP32 model beneath its QuantizeLinear /
    DequantizeLinear pairs, the pairs' parameters in ``embedded``
    (:mod:`rangeprof.profiler.ir.qdq`): what an INT8 build compiles, its plugin quantizing the FP32
    graph itself. A model in the operator-oriented format (``QLinearConv``, ``ConvInteger``…)
    loads in its QDQ form first (:mod:`rangeprof.profiler.ir.operator_quantized`)."""
    path = Path(path)
    if not path.exists():
        raise InvalidModelError(f"{path}: no such file")
    if path.is_dir():
        raise InvalidModelError(f"{path}: is a directory, not an ONNX file")
    if not path.is_file():
        raise InvalidModelError(f"{path}: not a regular file")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InvalidModelError(f"{path}: cannot read the file: {err.strerror}") from err
    return _load(data, path.stem, str(path), path.parent, input_shapes, dequantize, bound)


def load_model_bytes(
    data: bytes,
    name: str,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    dequantize: bool = False,
) -> LoadedModel:
    """Load an ONNX model from its bytes (an upload); ``name`` names it in messages and results.

    External data is read from ``base_dir``; without one the model must keep all data inline.
    ``dequantize`` as for :func:`load_model`.
    """
    base = None if base_dir is None else Path(base_dir)
    return _load(data, name, name, base, input_shapes, dequantize)


def _load(
    data: bytes,
    name: str,
    source: str,
    base_dir: Path | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    dequantize: bool = False,
    bound: Mapping[str, np.ndarray] | None = None,
) -> LoadedModel:
    model = _parse(data, source)
    if _check_external_data(model, base_dir, source):
        try:
            onnx.load_external_data_for_model(model, str(base_dir))
        except (OSError, ValueError, onnx.checker.ValidationError) as err:
            raise InvalidModelError(f"{source}: cannot read external data: {_line(err)}") from err
    inputs = _real_inputs(model.graph)
    shapes = _resolve_shapes(inputs, input_shapes or {}, source)
    # Before checking: the checker wants every input shaped, and folding wants them static.
    for vi in inputs:
        dims = vi.type.tensor_type.shape.dim
        del dims[:]
        for size in shapes[vi.name]:
            dims.add(dim_value=size)
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError) as err:
        raise InvalidModelError(f"{source}: invalid ONNX model: {_line(err)}") from err
    opset = _default_opset(model, source)
    _check_element_types(model, source)
    dtypes = {vi.name: _dtype(vi, source) for vi in inputs}
    _name_nodes(model.graph)
    removed = as_qdq(model)  # operator-oriented quantization as QDQ pairs (.operator_quantized)
    embedded = ()
    if dequantize:
        stripped = dequantized(model)
        model, embedded, removed = stripped.model, stripped.embedded, removed | stripped.fates
    expanded = _expanded(model, opset)
    _constant_values(expanded.graph)
    value_inputs = _value_inputs(expanded.graph)
    bound = _bind(expanded.graph, dict(bound or {}), value_inputs, source)
    folded, fates = _fold(expanded)
    return LoadedModel(
        name=name,
        sha256=hashlib.sha256(data).hexdigest(),
        model=folded,
        input_shapes=shapes,
        input_dtypes=dtypes,
        opset=opset,
        fates=removed | fates,
        embedded=embedded,
        value_inputs=value_inputs,
        bound=bound,
        index_uses=index_uses(folded.graph),
    )


def _expanded(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    """Operators the importer cannot convert, as their ONNX function bodies
    (rangeprof.profiler.ir.expand)."""
    from rangeprof.profiler.ir.converters import converts
    from rangeprof.profiler.ir.expand import expand_functions

    return expand_functions(model, opset, lambda node: node.op_type == "Constant" or converts(node))


# Constant's scalar and list forms, as the tensor its ``value`` form holds (TVM reads ``value``).
_CONSTANT_FORMS = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def _constant_values(graph: onnx.GraphProto) -> None:
    """Every ``Constant`` given as ``value_float(s)`` / ``value_int(s)`` written as ``value``
    (function bodies write their attribute constants that way)."""
    for node in graph.node:
        if node.op_type != "Constant" or len(node.attribute) != 1:
            continue
        attr = node.attribute[0]
        dtype = _CONSTANT_FORMS.get(attr.name)
        if dtype is None:
            continue
        value = np.asarray(onnx.helper.get_attribute_value(attr), dtype=dtype)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(value)))


def _value_inputs(graph: onnx.GraphProto) -> tuple[str, ...]:
    """The graph inputs whose values reach a shape or setting input (:data:`_SHAPE_INPUTS`)
    through anything but ``Shape`` / ``Size``, in input order."""
    wanted = {
        node.input[k]
        for node in graph.node
        for k in _SHAPE_INPUTS.get(node.op_type, ())
        if k < len(node.input)
    }
    for node in reversed(graph.node):
        if node.op_type not in _SHAPE_OF and wanted & set(node.output):
            wanted |= _node_inputs(node)
    return tuple(vi.name for vi in _real_inputs(graph) if vi.name in wanted)


def _bind(
    graph: onnx.GraphProto,
    values: dict[str, np.ndarray],
    value_inputs: tuple[str, ...],
    source: str,
) -> dict[str, np.ndarray]:
    """Value inputs given in ``values`` become initializers of ``graph``."""
    unknown = sorted(set(values) - set(value_inputs))
    if unknown:
        raise InputShapeError(
            f"{source}: {_quoted(unknown)} decides no shape or setting; only value inputs are "
            f"bound ({_quoted(value_inputs) or 'none'})"
        )
    bound = {}
    for vi in [vi for vi in graph.input if vi.name in values]:
        value = np.asarray(values[vi.name], _dtype(vi, source))
        graph.input.remove(vi)
        graph.initializer.append(numpy_helper.from_array(value, vi.name))
        bound[vi.name] = value
    return bound


def _line(err: BaseException) -> str:
    """The first line of an error's text (onnx and onnxsim errors often span several)."""
    return next(iter(str(err).strip().splitlines()), type(err).__name__)


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    try:
        model = onnx.load_model_from_string(data)
    except DecodeError as err:
        raise InvalidModelError(
            f"{source}: not an ONNX model, or a truncated one (cannot parse the protobuf)"
        ) from err
    if not model.HasField("graph"):
        raise InvalidModelError(f"{source}: not an ONNX model (no graph)")
    if not model.graph.node:
        raise InvalidModelError(f"{source}: not an ONNX model (the graph has no nodes)")
    return model


def graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every tensor a graph stores: initializers, sparse ones, node attributes, subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            sparse_tensors = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
            for sparse in [*sparse_tensors, *attr.sparse_tensors]:
                yield from (sparse.values, sparse.indices)
            for subgraph in [attr.g] if attr.HasField("g") else attr.graphs:
                yield from graph_tensors(subgraph)


def _check_external_data(model: onnx.ModelProto, base_dir: Path | None, source: str) -> bool:
    """Check that every external-data reference stays inside ``base_dir`` and exists, before
    anything is read; tell whether there are any."""
    found = False
    for tensor in graph_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        found = True
        location = {e.key: e.value for e in tensor.external_data}.get("location", "")
        what = f"external data {location!r} of tensor {tensor.name!r}"
        if not location:
            raise InvalidModelError(
                f"{source}: tensor {tensor.name!r} has external data without a location"
            )
        relative = PurePath(os.path.normpath(location))
        if relative.is_absolute() or relative.parts[:1] == ("..",):
            raise UnsafeExternalDataError(f"{source}: {what} is outside the model's folder")
        if base_dir is None:
            raise InvalidModelError(
                f"{source}: {what} cannot be read: the model came without its folder"
            )
        folder = base_dir.resolve()
        target = (folder / relative).resolve()  # follows symlinks
        if not target.is_relative_to(folder):
            raise UnsafeExternalDataError(f"{source}: {what} resolves outside the model's folder")
        if not target.is_file():
            raise InvalidModelError(f"{source}: {what} not found")
    return found


def _default_opset(model: onnx.ModelProto, source: str) -> int:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return opset.version
    raise InvalidModelError(f"{source}: the model does not import the default ONNX opset")


def _real_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs fed at run time (old models also list their initializers as inputs)."""
    weights = {t.name for t in graph.initializer} | {
        s.values.name for s in graph.sparse_initializer
    }
    return [vi for vi in graph.input if vi.name not in weights]


def _dims(vi: onnx.ValueInfoProto, source: str) -> list[int | None] | None:
    """An input's dims, ``None`` where unknown (a 0 is a zero-size dim, as ONNX defines it;
    exporters write -1 for unknown); ``None`` for an unknown rank."""
    if vi.type.WhichOneof("value") != "tensor_type":
        raise InvalidModelError(f"{source}: input {vi.name!r} is not a tensor")
    if not vi.type.tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None
        for d in vi.type.tensor_type.shape.dim
    ]


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names))


def _shape_text(dims: Sequence[int | None] | None) -> str:
    if dims is None:
        return "of unknown rank"
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _resolve_shapes(
    inputs: list[onnx.ValueInfoProto], given: Mapping[str, Sequence[int]], source: str
) -> dict[str, tuple[int, ...]]:
    names = [vi.name for vi in inputs]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InputShapeError(
            f"{source}: no input named {_quoted(unknown)}; the model's inputs are {_quoted(names)}"
        )
    shapes = {}
    for vi in inputs:
        dims = _dims(vi, source)
        if vi.name in given:
            shapes[vi.name] = _given_shape(vi.name, dims, given[vi.name], source)
        elif dims is None or None in dims[1:]:
            raise InputShapeError(
                f"{source}: input {vi.name!r} has shape {_shape_text(dims)}, which is not static "
                f"beyond the batch dim; pass --input-shape {vi.name}=DIMS"
            )
        else:
            # An unknown first dim is the batch; profiling runs one sample at a time.
            shapes[vi.name] = tuple(1 if d is None else d for d in dims)
    return shapes


def _given_shape(
    name: str, dims: list[int | None] | None, value: Sequence[int], source: str
) -> tuple[int, ...]:
    try:
        shape = tuple(operator.index(d) for d in value)
        valid = all(d > 0 for d in shape)
    except TypeError:
        valid = False
    if not valid:
        raise InputShapeError(
            f"{source}: input shape {value!r} for {name!r} is not positive integers"
        )
    if dims is not None and (
        len(shape) != len(dims) or any(d not in (None, s) for d, s in zip(dims, shape, strict=True))
    ):
        raise InputShapeError(
            f"{source}: input shape {list(shape)} for {name!r} does not fit its model shape "
            f"{_shape_text(dims)}"
        )
    return shape


# Element types TVM computes and numpy holds: everything else (strings, bfloat16, float8, 4- and
# 2-bit integers, complex) is refused up front rather than failing deep inside a build.
_ELEMENT_TYPES = frozenset(
    getattr(onnx.TensorProto, name)
    for name in (
        "FLOAT", "DOUBLE", "FLOAT16", "BOOL",
        "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
    )
)  # fmt: skip


def _check_element_types(model: onnx.ModelProto, source: str) -> None:
    """Every tensor the model holds or computes has an element type of :data:`_ELEMENT_TYPES`
    (as far as ONNX shape inference tells; ``Cast`` targets are checked as well)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError):
        inferred = model.graph  # inference is a help here; the importer reports what it fails on
    typed = [*inferred.input, *inferred.value_info, *inferred.output]
    found = [
        (vi.name, vi.type.tensor_type.elem_type)
        for vi in typed
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type
    ]
    found += [(t.name, t.data_type) for t in graph_tensors(model.graph)]
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type in ("Cast", "EyeLike", "RandomNormal", "RandomUniform") and (
                attr.name in ("to", "dtype")
            ):
                found.append((node.output[0], attr.i))
    for name, elem_type in found:
        if elem_type and elem_type not in _ELEMENT_TYPES:
            kind = onnx.TensorProto.DataType.Name(elem_type).lower()
            raise UnsupportedTypeError(
                f"{source}: tensor {name!r} is of type {kind}; rangeprof handles float16/32/64, "
                "integer and bool tensors"
            )


def _dtype(vi: onnx.ValueInfoProto, source: str) -> str:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name
    except KeyError as err:
        raise InvalidModelError(f"{source}: input {vi.name!r} has no numpy element type") from err


def _name_nodes(graph: onnx.GraphProto) -> None:
    """Name every node of ``graph`` by the rule in the module docstring."""
    counts = Counter(node.name for node in graph.node if node.name)
    taken = {name for name, count in counts.items() if count == 1}
    seen_of_op: Counter[str] = Counter()
    for node in graph.node:
        k = seen_of_op[node.op_type]
        seen_of_op[node.op_type] += 1
        if counts[node.name] == 1:
            continue
        base = node.name or f"{node.op_type}_{k}"
        name, n = base, 0
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        node.name = name


def _fold(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The folded model (see the module docstring) and the fates of the nodes it lost."""
    ir_version = model.ir_version
    model.ir_version = min(ir_version, _FOLD_IR_VERSION)  # restored on the result below
    try:
        folded, _ = onnxsim.simplify(
            model,
            skip_fuse_bn=True,
            perform_optimization=False,
            initializers_as_constants=False,  # weights are Relax's to fold (see above)
            certify=False,
        )
    except Exception:  # onnxsim's own C++ errors: the importer works the shapes out itself
        model.ir_version = ir_version
        return model, {}
    folded.ir_version = ir_version
    # onnxsim logs its work in metadata_props; the fates below say the same per node.
    del folded.metadata_props[:]
    folded.metadata_props.extend(model.metadata_props)

    original = {node.name: node for node in model.graph.node}
    kept, created = [], []
    for node in folded.graph.node:
        before = original.get(node.name)
        same = before is not None and (before.op_type, before.output) == (node.op_type, node.output)
        (kept if same else created).append(node)
    # With its optimizer off onnxsim removes no dead code, so constants that folding left unused
    # stay behind; drop them.
    used = {output.name for output in folded.graph.output}
    for node in kept:
        used |= _node_inputs(node)
    del folded.graph.node[:]
    values = [_folded_value(n) for n in created if n.output[0] in used]
    _correct_folds(model, original, folded, kept, values)
    folded.graph.node.extend(n for n in kept if n.op_type != "Constant" or used & set(n.output))
    folded.graph.initializer.extend(values)
    removed = _fold_shape_inputs(folded)
    return folded, _fates(model.graph.node, {n.name for n in kept if n.name not in removed})


def _correct_folds(
    model: onnx.ModelProto,
    original: dict[str, onnx.NodeProto],
    folded: onnx.ModelProto,
    kept: list[onnx.NodeProto],
    values: list[onnx.TensorProto],
) -> None:
    """Every value onnxsim folded (new initializers of ``folded`` and ``values``) set to what
    onnxruntime computes for the tensor it replaces in ``model`` (whose nodes by name are
    ``original``), where the two differ."""
    # onnxsim may name a folded value anew: the tensor it replaces is the kept node's input
    # in the same position of the original node.
    replaced = {}
    for node in kept:
        for before, after in zip(original[node.name].input, node.input, strict=True):
            if before != after:
                replaced[after] = before
    weights = {t.name for t in model.graph.initializer}
    new = [*values, *(t for t in folded.graph.initializer if t.name not in weights)]
    by_tensor = {replaced.get(t.name, t.name): t for t in new}
    wrong = misfolded(model, by_tensor)
    for name, value in wrong.items():
        tensor = by_tensor[name]
        tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
    if wrong:
        del folded.graph.value_info[:]  # shapes onnxsim inferred from its wrong values


def misfolded(model: onnx.ModelProto, values: dict[str, onnx.TensorProto]) -> dict[str, np.ndarray]:
    """What onnxruntime computes for each tensor of ``model`` whose folded value (``values``, by
    the name of the tensor it replaces) differs: inputs of their fixed shapes, zero-filled
    (folded values depend on shapes only); only the nodes they need run. Empty where
    onnxruntime cannot run those nodes."""
    weights = {t.name for t in model.graph.initializer}
    names = [name for name in values if name not in weights]
    results = _computed(model, names) if names else None
    if results is None:  # onnxruntime cannot run these nodes: nothing to check against
        return {}
    wrong = {}
    for name, result in zip(names, results, strict=True):
        folded = numpy_helper.to_array(values[name])
        if folded.shape != result.shape or not np.array_equal(folded, result, equal_nan=True):
            wrong[name] = np.asarray(result, dtype=folded.dtype)
    return wrong


def _computed(model: onnx.ModelProto, names: list[str]) -> list[np.ndarray] | None:
    """What onnxruntime computes for tensors ``names`` of ``model`` that depend on input shapes
    only (inputs of their fixed shapes, zero-filled; only the nodes they need run), or None
    where it cannot."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.ir_version = min(probe.ir_version, _FOLD_IR_VERSION)
    del probe.graph.output[:]
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    needed_nodes = _needed_nodes(probe.graph, set(names))
    del probe.graph.node[:]
    probe.graph.node.extend(needed_nodes)
    del probe.graph.value_info[:]
    feeds = {}
    needed = {i for node in probe.graph.node for i in _node_inputs(node)}
    for vi in _real_inputs(probe.graph):
        if vi.name in needed:
            shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            feeds[vi.name] = np.zeros(
                shape, onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            )
    del probe.graph.input[:]
    probe.graph.input.extend(vi for vi in model.graph.input if vi.name in feeds)
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # its warnings about the probe's unused weights: noise
        session = ort.InferenceSession(
            probe.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return session.run(names, feeds)
    except Exception:  # an operator onnxruntime lacks, say
        return None


# Inputs that give an operator's output its shape (by position): the importer needs them static.
_SHAPE_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Range": (0, 1, 2),
    "ConstantOfShape": (0,), "Pad": (1, 2, 3), "Resize": (1, 2, 3), "Upsample": (1,),
    "OneHot": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "TopK": (1,), "Split": (1,),
    "CumSum": (1,), "CumProd": (1,), "AffineGrid": (1,), "CenterCropPad": (1,), "Col2Im": (1, 2),
    "SplitToSequence": (1,), "MaxUnpool": (2,),
    **{f"Reduce{kind}": (1,) for kind in (
        "Mean", "Sum", "Max", "Min", "L1", "L2", "LogSum", "LogSumExp", "Prod", "SumSquare"
    )},
}  # fmt: skip
# Operators whose outputs depend on no input value: their own shapes, or randomness (never folded).
_SHAPE_OF = frozenset({"Shape", "Size"})
_NEVER_FOLDED = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"}
)
# Operators whose output shape depends on input values.
_DATA_SHAPED = frozenset(
    {"NonZero", "Unique", "Compress", "NonMaxSuppression", "If", "Loop", "Scan"}
)


def _fold_shape_inputs(model: onnx.ModelProto) -> set[str]:
    """Folds what onnxsim left of the values that give outputs their shapes (a Reshape target
    computed from a Shape): each value that depends on input shapes only and feeds a shape input
    of :data:`_SHAPE_INPUTS` becomes an initializer computed by onnxruntime; returns the names of
    the nodes that no longer compute anything used."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    static = set(initializers)  # values independent of input values
    dynamic_shape: set[str] = set()  # tensors whose shape depends on input values
    for node in graph.node:
        inputs = {i for i in node.input if i}
        shaping = {
            node.input[k] for k in _SHAPE_INPUTS.get(node.op_type, ()) if k < len(node.input)
        }
        if node.op_type in _DATA_SHAPED or dynamic_shape & inputs or not shaping - {""} <= static:
            dynamic_shape.update(node.output)
        if node.op_type in _NEVER_FOLDED:
            continue
        if node.op_type in _SHAPE_OF:
            if not dynamic_shape & inputs:
                static.update(node.output)
        elif inputs <= static:  # Constant nodes included: they have no inputs
            static.update(node.output)
    wanted = []
    for node in graph.node:
        for k in _SHAPE_INPUTS.get(node.op_type, ()):
            name = node.input[k] if k < len(node.input) else ""
            if name in static and name not in initializers and name not in wanted:
                wanted.append(name)
    if not wanted:
        return set()
    values = _computed(model, wanted)
    if values is None:
        return set()
    graph.initializer.extend(
        numpy_helper.from_array(np.asarray(v), n) for n, v in zip(wanted, values, strict=True)
    )
    # Nodes whose outputs nothing reads any more go.
    removed: set[str] = set()
    while True:
        read = {o.name for o in graph.output}
        for node in graph.node:
            read |= _node_inputs(node)
        produced_now = {t.name for t in graph.initializer}
        dead = [
            n for n in graph.node
            if all(not o or o not in read or o in produced_now for o in n.output)
        ]  # fmt: skip
        if not dead:
            return removed
        removed.update(n.name for n in dead)
        keep = [n for n in graph.node if n not in dead]
        del graph.node[:]
        graph.node.extend(keep)


def _needed_nodes(graph: onnx.GraphProto, names: set[str]) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` that ``names`` depend on, in graph order."""
    needed, wanted = [], set(names)
    for node in reversed(graph.node):
        if wanted & set(node.output):
            needed.append(node)
            wanted |= _node_inputs(node)
    return list(reversed(needed))


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    """The tensors a node reads, including those its subgraphs read from the outer scope."""
    names = set(node.input) - {""}  # "" marks an omitted optional input
    for attr in node.attribute:
        for graph in [attr.g] if attr.HasField("g") else attr.graphs:
            names.update(output.name for output in graph.output)
            for inner in graph.node:
                names |= _node_inputs(inner)
    return names


def _folded_value(node: onnx.NodeProto) -> onnx.TensorProto:
    """The initializer for a ``Constant`` node that onnxsim created to hold a folded value."""
    if node.op_type != "Constant" or [a.name for a in node.attribute] != ["value"]:
        raise RuntimeError(f"onnxsim created an unexpected {node.op_type} node {node.name!r}")
    tensor = onnx.TensorProto()
    tensor.CopyFrom(node.attribute[0].t)
    tensor.name = node.output[0]
    return tensor


def _fates(nodes: Sequence[onnx.NodeProto], kept: set[str]) -> dict[str, str]:
    consumers: defaultdict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(nodes):
        for name in _node_inputs(node):
            consumers[name].append(i)
    # The checker made sure the graph is topologically sorted, so one backward sweep finds, for
    # every node, the first kept node its value reaches.
    first_kept: list[int | None] = [None] * len(nodes)
    for i in reversed(range(len(nodes))):
        reached = [
            j if nodes[j].name in kept else first_kept[j]
            for output in nodes[i].output
            if output
            for j in consumers[output]
        ]
        first_kept[i] = min((j for j in reached if j is not None), default=None)
    fates = {}
    for i, node in enumerate(nodes):
        if node.name in kept or node.op_type == "Constant":
            continue
        j = first_kept[i]
        fate = Fate(kind=ELIMINATED, target="constant")
        if j is not None:
            fate = Fate(kind=FOLDED_INTO, target=nodes[j].name)
        fates[node.name] = str(fate)
    return fates
