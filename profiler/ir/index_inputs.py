"""Which integer model inputs index an axis: token ids into an embedding table.

An ONNX Gather whose indices are a model input (directly, or through ops that keep every value:
casts, reshapes) takes them in ``[-n, n)``, ``n`` the gathered axis' extent; anything else is an
error in ONNX, and our compiled Gather clips it to the table (TVM's own read past it). Knowing
the extent before any data runs lets the data checks refuse such a value by its sample and
position (:mod:`rangeprof.profiler.profiling.data`), and random data stay inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

# Ops whose output holds exactly the values of their first input.
_KEEP_VALUES = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"})


@dataclass(frozen=True)
class IndexUse:
    """An input's values index an axis of ``extent`` in node ``node``: valid in
    ``[-extent, extent)``."""

    extent: int
    node: str

    def to_json(self) -> dict:
        return {"extent": self.extent, "node": self.node}

    def refusal(self, name: str, rows: np.ndarray) -> tuple[int, str] | None:
        """The first row of the 2-D ``rows`` (input ``name``'s samples) holding a value outside
        ``[-extent, extent)``, and why it cannot; None if every value fits."""
        outside = (rows < -self.extent) | (rows >= self.extent)
        if not outside.any():
            return None
        row = int(np.argmax(outside.any(axis=1)))
        col = int(np.argmax(outside[row]))
        return row, (
            f"holds {rows[row, col]} at position {col}, outside [{-self.extent}, "
            f"{self.extent - 1}]: input {name!r} indexes an axis of {self.extent} in {self.node!r}"
        )


def _static_dims(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The known static shapes: initializers', then value_info's where every dim is fixed."""
    dims = {t.name: list(t.dims) for t in graph.initializer}
    for vi in [*graph.value_info, *graph.input]:
        shape = [
            d.dim_value if d.HasField("dim_value") else 0 for d in vi.type.tensor_type.shape.dim
        ]
        if vi.name not in dims and vi.type.tensor_type.HasField("shape") and all(shape):
            dims[vi.name] = shape
    return dims


def index_uses(graph: onnx.GraphProto) -> dict[str, IndexUse]:
    """Per integer input of ``graph`` that Gathers read as indices, the smallest axis they
    index (a Gather's data of unknown shape is left out)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input[:1] if node.op_type in _KEEP_VALUES else node.input:
            readers.setdefault(name, []).append(node)
    dims = _static_dims(graph)
    uses = {}
    for vi in graph.input:
        elem = vi.type.tensor_type.elem_type
        if not elem or onnx.helper.tensor_dtype_to_np_dtype(elem).kind not in "iu":
            continue
        found = _gathers(vi.name, readers, dims)
        if found:
            uses[vi.name] = min(found, key=lambda use: use.extent)
    return uses


def _gathers(name: str, readers, dims) -> list[IndexUse]:
    found, names = [], [name]
    while names:
        value = names.pop()
        for node in readers.get(value, ()):
            if node.op_type in _KEEP_VALUES:
                names.append(node.output[0])
            elif node.op_type == "Gather" and node.input[1] == value and node.input[0] in dims:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                shape = dims[node.input[0]]
                found.append(IndexUse(shape[axis], node.name))
    return found
