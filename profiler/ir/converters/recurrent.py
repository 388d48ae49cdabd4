"""ONNX ``LSTM``, ``GRU`` and ``RNN`` converters (TVM 0.27's Relax ONNX frontend has none).

The recurrence is unrolled over the static sequence length with plain Relax tensor ops, so every
gate of every step is an ordinary binding that the profiler can observe. The input projection
``X·Wᵀ + bias`` is one matmul for all timesteps and directions (``[seq, batch, dirs*gates]``);
each step slices its part, adds ``H·Rᵀ`` and applies the gates. States keep a leading time axis
of size 1 (``[1, batch, hidden]``) so the per-step outputs concatenate straight into ``Y``.

The weights stay the node's own inputs and are rearranged with Relax ops (a transpose of ``W``
and ``R``, slices per direction, the two biases summed): the importer's profileIDs live on the
initializer constants, and a pass like FoldConstant folds these few weight-only bindings later
while lineage records it. The same code therefore also serves weights passed as function
parameters.

A missing initial state, bias or peephole input, or a constant one that is all zero, is
``None``, and the ``_add`` / ``_mul`` / ``_matmul`` helpers treat ``None`` as zero: products with
zero never reach the graph, so every emitted binding is used and none is constantly zero.

Where the ONNX text is loose this follows onnxruntime: ``clip`` bounds the gate
pre-activations, not the cell state given to ``h``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter, get_constant

from rangeprof.profiler.errors import ConversionError, InvalidModelError

Expr = relax.Expr
Activation = Callable[[Expr], Expr]

_ACTIVATIONS: dict[str, Activation] = {
    "sigmoid": relax.op.sigmoid,
    "tanh": relax.op.tanh,
    "relu": relax.op.nn.relu,
}
_DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}
# Input positions (LSTM adds initial_c at 6 and the peepholes P at 7).
_X, _W, _R, _B, _SEQUENCE_LENS, _INITIAL_H, _INITIAL_C, _P = range(8)


def _text(value: str | bytes) -> str:
    # The frontend passes string attributes as bytes.
    return value.decode() if isinstance(value, bytes) else value


def _is_zero(value: Expr | None) -> bool:
    """Absent, or a constant whose elements are all zero."""
    if value is None:
        return True
    return isinstance(value, tvm.ir.GenericConst) and not value.value.numpy().any()


def _static_shape(value: Expr, what: str, op: str) -> tuple[int, ...]:
    shape = value.ty.shape
    if shape is None or not all(isinstance(s, tvm.tirx.IntImm) for s in shape):
        raise ConversionError(f"{op}: {what} needs a static shape, got {shape}")
    return tuple(int(s) for s in shape)


# --- zero-aware emission: ``None`` stands for an all-zero tensor ---------------------------------


def _add(bb: relax.BlockBuilder, a: Expr | None, b: Expr | None) -> Expr | None:
    if a is None or b is None:
        return b if a is None else a
    return bb.emit(relax.op.add(a, b))


def _mul(bb: relax.BlockBuilder, a: Expr | None, b: Expr | None) -> Expr | None:
    if a is None or b is None:
        return None
    return bb.emit(relax.op.multiply(a, b))


def _matmul(bb: relax.BlockBuilder, a: Expr | None, b: Expr) -> Expr | None:
    return None if a is None else bb.emit(relax.op.matmul(a, b))


def _slice(bb: relax.BlockBuilder, x: Expr | None, axes, begin, end) -> Expr | None:
    if x is None:
        return None
    return bb.emit(relax.op.strided_slice(x, axes=axes, begin=begin, end=end))


def _gate(
    bb: relax.BlockBuilder, x: Expr | None, k: int, hidden: int, count: int = 1
) -> Expr | None:
    """Gates ``k .. k+count-1`` of a ``[1, batch, n*hidden]`` tensor (None stays None)."""
    return _slice(bb, x, [2], [k * hidden], [(k + count) * hidden])


def _one_minus(bb: relax.BlockBuilder, x: Expr) -> Expr:
    return bb.emit(relax.op.subtract(relax.const(1, x.ty.dtype.dtype), x))


def _concat(bb: relax.BlockBuilder, items: list[Expr], axis: int) -> Expr:
    return items[0] if len(items) == 1 else bb.emit(relax.op.concat(items, axis=axis))


# --- node parsing ---------------------------------------------------------------------------


def _activations(attr: dict, defaults: tuple[str, ...], num_directions: int, op: str):
    """Per direction, the activation functions (``f, g[, h]``) as Relax op builders."""
    names = [_text(n) for n in attr.get("activations", defaults * num_directions)]
    if len(names) != len(defaults) * num_directions:
        raise InvalidModelError(
            f"{op}: expected {len(defaults) * num_directions} activations, got {names}"
        )
    unknown = sorted({n for n in names if n.lower() not in _ACTIVATIONS})
    if unknown:
        raise ConversionError(
            f"{op}: activation(s) {', '.join(unknown)} not supported "
            "(supported: Sigmoid, Tanh, Relu)"
        )
    funcs = [_ACTIVATIONS[n.lower()] for n in names]
    n = len(defaults)
    return [funcs[d * n : (d + 1) * n] for d in range(num_directions)]


@dataclass
class _Node:
    """One LSTM/GRU/RNN node with its attributes parsed and its shapes checked."""

    inputs: list  # the frontend's ``onnx_input``: None for a missing optional input
    attr: dict
    seq_len: int
    input_size: int
    hidden: int
    gates: int  # number of gates * hidden
    num_directions: int
    reverse: bool  # direction == "reverse" (the second direction of a bidirectional always is)
    activations: list[list[Activation]]
    clip: float | None
    layout: int

    def clipped(self, bb: relax.BlockBuilder, value: Expr) -> Expr:
        """``value`` bounded to ``[-clip, clip]`` when the node has a ``clip`` attribute."""
        if self.clip is None:
            return value
        dtype = value.ty.dtype.dtype
        lo = relax.prim_value(tvm.tirx.const(-self.clip, dtype))
        hi = relax.prim_value(tvm.tirx.const(self.clip, dtype))
        return bb.emit(relax.op.clip(value, lo, hi))

    def activate(self, bb: relax.BlockBuilder, d: int, k: int, pre: Expr) -> Expr:
        """Activation ``k`` of direction ``d`` applied to a (clipped) pre-activation."""
        return bb.emit(self.activations[d][k](self.clipped(bb, pre)))

    def direction_slice(self, bb: relax.BlockBuilder, value: Expr, d: int, lo: int, hi: int):
        """``value[d:d+1, ..., lo:hi]`` of a ``[dirs, ..., n]`` tensor; ``value`` itself when
        that is all of it."""
        last = int(value.ty.shape[-1])
        if self.num_directions == 1 and (lo, hi) == (0, last):
            return value
        return _slice(bb, value, [0, value.ty.ndim - 1], [d, lo], [d + 1, hi])


class _Recurrent(OnnxOpConverter):
    """Shared driver: parse the node, project the input, unroll each direction, pack outputs.

    Subclasses give the gate count, default activations, which recurrent biases fold into the
    input projection, per-direction recurrent weights and the cell step. A state is a tuple:
    ``(h,)`` for GRU and RNN, ``(h, c)`` for LSTM.
    """

    num_gates = 0
    default_activations: tuple[str, ...] = ()
    state_inputs: tuple[int, ...] = (_INITIAL_H,)

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        node = cls._parse(inputs, attr, params)
        dirs = range(node.num_directions)
        x = inputs[_X]
        if node.layout:  # [batch, seq, input] -> [seq, batch, input]
            x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))

        # One projection for every timestep and direction: [seq, batch, dirs * gates].
        w_t = bb.emit(relax.op.permute_dims(inputs[_W], [2, 0, 1]))
        w_t = bb.emit(relax.op.reshape(w_t, [node.input_size, node.num_directions * node.gates]))
        xw = _add(bb, bb.emit(relax.op.matmul(x, w_t)), cls._input_bias(bb, node))
        r_t = bb.emit(relax.op.permute_dims(inputs[_R], [0, 2, 1]))  # [dirs, hidden, gates]

        initial = [cls._initial_state(bb, node, index) for index in cls.state_inputs]
        outputs, finals = [], []
        for d in dirs:
            weights = cls._recurrent_weights(bb, node, r_t, d)
            state = tuple(s[d] for s in initial)
            hs = [None] * node.seq_len
            backwards = node.reverse or d == 1
            for t in reversed(range(node.seq_len)) if backwards else range(node.seq_len):

                def xw_t(lo: int, hi: int, t=t, d=d) -> Expr:
                    """Columns ``lo:hi`` of direction d's projected input at step t."""
                    base = d * node.gates
                    return _slice(bb, xw, [0, 2], [t, base + lo], [t + 1, base + hi])

                state = cls._step(bb, node, d, xw_t, state, weights)
                hs[t] = state[0]
            outputs.append(_concat(bb, hs, axis=0))
            finals.append(state)
        return cls._pack(bb, node, outputs, finals)

    @classmethod
    def _parse(cls, inputs, attr: dict, params) -> _Node:
        op = cls.__name__
        layout = attr.get("layout", 0)
        x_shape = inputs[_X].ty.shape
        seq_len = None if x_shape is None else x_shape[layout]
        if not isinstance(seq_len, tvm.tirx.IntImm):
            raise ConversionError(
                f"{op}: the sequence length must be static to unroll the recurrence, got X of "
                f"shape {x_shape}"
            )
        seq_len = int(seq_len)
        lens = inputs[_SEQUENCE_LENS]
        if lens is not None:
            lens = get_constant(lens, params)
            if not isinstance(lens, tvm.ir.GenericConst):
                raise ConversionError(
                    f"{op}: sequence_lens computed at run time is not supported, only a constant "
                    "equal to the sequence length"
                )
            if not np.all(lens.value.numpy() == seq_len):
                raise ConversionError(
                    f"{op}: sequence_lens {lens.value.numpy().tolist()} differing from the "
                    f"sequence length {seq_len} (padded batches) is not supported"
                )
        direction = _text(attr.get("direction", "forward"))
        if direction not in _DIRECTIONS:
            raise InvalidModelError(f"{op}: unknown direction {direction!r}")
        num_directions = _DIRECTIONS[direction]
        w_shape = _static_shape(inputs[_W], "W", op)
        r_shape = _static_shape(inputs[_R], "R", op)
        hidden = attr.get("hidden_size", r_shape[-1])
        gates = cls.num_gates * hidden
        if w_shape[:2] != (num_directions, gates) or r_shape != (num_directions, gates, hidden):
            raise InvalidModelError(
                f"{op}: W {w_shape} / R {r_shape} do not match direction={direction} and "
                f"hidden_size={hidden}"
            )
        clip = attr.get("clip")
        return _Node(
            inputs=inputs,
            attr=attr,
            seq_len=seq_len,
            input_size=w_shape[2],
            hidden=hidden,
            gates=gates,
            num_directions=num_directions,
            reverse=direction == "reverse",
            activations=_activations(attr, cls.default_activations, num_directions, op),
            clip=None if clip is None else float(clip),
            layout=layout,
        )

    @classmethod
    def _input_bias(cls, bb, node: _Node) -> Expr | None:
        """``Wb + Rb`` as ``[dirs * gates]``, without the recurrent parts that must stay in the
        step (``_recurrent_bias_mask``)."""
        b = node.inputs[_B]
        if _is_zero(b):
            return None
        pairs = bb.emit(relax.op.reshape(b, [node.num_directions, 2, node.gates]))
        mask = cls._recurrent_bias_mask(node)
        if mask is not None:
            pairs = bb.emit(relax.op.multiply(pairs, relax.const(mask, pairs.ty.dtype.dtype)))
        summed = bb.emit(relax.op.sum(pairs, axis=1))
        return bb.emit(relax.op.reshape(summed, [node.num_directions * node.gates]))

    @classmethod
    def _recurrent_bias_mask(cls, node: _Node) -> np.ndarray | None:
        return None  # by default both biases fold into the input projection

    @classmethod
    def _initial_state(cls, bb, node: _Node, index: int) -> list[Expr | None]:
        """Per direction, the initial state at input ``index`` as ``[1, batch, hidden]``."""
        value = node.inputs[index]
        if _is_zero(value):
            return [None] * node.num_directions
        if node.layout:  # [batch, dirs, hidden] -> [dirs, batch, hidden]
            value = bb.emit(relax.op.permute_dims(value, [1, 0, 2]))
        if node.num_directions == 1:
            return [value]
        return [_slice(bb, value, [0], [d], [d + 1]) for d in range(node.num_directions)]

    @classmethod
    def _pack(cls, bb, node: _Node, outputs: list[Expr], finals: list[tuple]):
        """``Y`` [seq, dirs, batch, hidden], then each final state [dirs, batch, hidden].

        Only the outputs the node declares are built (the importer passes their count in
        ``tvm_custom``), so a node using only ``Y`` gets no dead concat for its final states.
        """
        if node.num_directions == 1:
            y = bb.emit(relax.op.expand_dims(outputs[0], 1))
        else:
            y = bb.emit(relax.op.stack(outputs, axis=1))
        if node.layout:  # -> [batch, seq, dirs, hidden]
            y = bb.emit(relax.op.permute_dims(y, [2, 0, 1, 3]))
        num_states = len(cls.state_inputs)
        wanted = node.attr.get("tvm_custom", {}).get("num_outputs", 1 + num_states)
        packed = [y]
        for k in range(min(wanted - 1, num_states)):
            final = _concat(bb, [state[k] for state in finals], axis=0)
            if node.layout:  # -> [batch, dirs, hidden]
                final = bb.emit(relax.op.permute_dims(final, [1, 0, 2]))
            packed.append(final)
        return packed[0] if len(packed) == 1 else relax.Tuple(packed)


class LSTM(_Recurrent):
    """ONNX LSTM (opset 7+): gates ``i, o, f, c``, optional peepholes ``P``, ``input_forget``."""

    num_gates = 4
    default_activations = ("Sigmoid", "Tanh", "Tanh")
    state_inputs = (_INITIAL_H, _INITIAL_C)

    @classmethod
    def _recurrent_weights(cls, bb, node: _Node, r_t: Expr, d: int) -> dict:
        p = node.inputs[_P]  # [dirs, 3 * hidden]: p_i, p_o, p_f
        n = node.hidden
        peepholes = [None] * 3
        if not _is_zero(p):
            # With input_forget the forget gate is 1 - i, so p_f has no use.
            for k in range(2 if node.attr.get("input_forget", 0) else 3):
                peepholes[k] = node.direction_slice(bb, p, d, k * n, (k + 1) * n)
        return {"r_t": node.direction_slice(bb, r_t, d, 0, node.gates), "peepholes": peepholes}

    @classmethod
    def _step(cls, bb, node: _Node, d: int, xw_t, state, weights) -> tuple:
        n = node.hidden
        h, c = state
        p_i, p_o, p_f = weights["peepholes"]
        pre = _add(bb, xw_t(0, 4 * n), _matmul(bb, h, weights["r_t"]))
        i = node.activate(bb, d, 0, _add(bb, _gate(bb, pre, 0, n), _mul(bb, p_i, c)))
        forget = None  # f·c_{t-1} vanishes on a zero cell state: f is only built when used
        if c is not None and node.attr.get("input_forget", 0):
            forget = _one_minus(bb, i)
        elif c is not None:
            forget = node.activate(bb, d, 0, _add(bb, _gate(bb, pre, 2, n), _mul(bb, p_f, c)))
        g = node.activate(bb, d, 1, _gate(bb, pre, 3, n))
        c_new = _add(bb, _mul(bb, forget, c), _mul(bb, i, g))
        o = node.activate(bb, d, 0, _add(bb, _gate(bb, pre, 1, n), _mul(bb, p_o, c_new)))
        h_new = _mul(bb, o, bb.emit(node.activations[d][2](c_new)))
        return h_new, c_new


class GRU(_Recurrent):
    """ONNX GRU (opset 7+): gates ``z, r, h``, ``linear_before_reset`` 0 or 1."""

    num_gates = 3
    default_activations = ("Sigmoid", "Tanh")

    @classmethod
    def _recurrent_bias_mask(cls, node: _Node) -> np.ndarray | None:
        if not node.attr.get("linear_before_reset", 0):
            return None
        # Rb_h is scaled by the reset gate, so it stays in the step (see _recurrent_weights).
        mask = np.ones((2, node.gates))
        mask[1, 2 * node.hidden :] = 0
        return mask

    @classmethod
    def _recurrent_weights(cls, bb, node: _Node, r_t: Expr, d: int) -> dict:
        n = node.hidden
        if node.attr.get("linear_before_reset", 0):
            # H·Rhᵀ + Rbh does not depend on r, so all three gates share one matmul.
            b = node.inputs[_B]
            rb_h = None if _is_zero(b) else node.direction_slice(bb, b, d, 5 * n, 6 * n)
            return {"r_t": node.direction_slice(bb, r_t, d, 0, 3 * n), "rb_h": rb_h}
        return {
            "r_zr_t": node.direction_slice(bb, r_t, d, 0, 2 * n),
            "r_h_t": node.direction_slice(bb, r_t, d, 2 * n, 3 * n),
        }

    @classmethod
    def _step(cls, bb, node: _Node, d: int, xw_t, state, weights) -> tuple:
        n = node.hidden
        (h,) = state
        linear_before_reset = node.attr.get("linear_before_reset", 0)
        if linear_before_reset:
            rec = _matmul(bb, h, weights["r_t"])
            pre_zr = _add(bb, xw_t(0, 2 * n), _gate(bb, rec, 0, n, count=2))
            reset_scaled = _add(bb, _gate(bb, rec, 2, n), weights["rb_h"])
        else:
            pre_zr = _add(bb, xw_t(0, 2 * n), _matmul(bb, h, weights["r_zr_t"]))
            reset_scaled = h
        z = node.activate(bb, d, 0, _gate(bb, pre_zr, 0, n))
        # The reset gate only scales a recurrent term; on a zero state there is none.
        reset = None if reset_scaled is None else node.activate(bb, d, 0, _gate(bb, pre_zr, 1, n))
        recurrent = _mul(bb, reset, reset_scaled)
        if not linear_before_reset:
            recurrent = _matmul(bb, recurrent, weights["r_h_t"])
        candidate = node.activate(bb, d, 1, _add(bb, xw_t(2 * n, 3 * n), recurrent))
        h_new = _add(bb, _mul(bb, _one_minus(bb, z), candidate), _mul(bb, z, h))
        return (h_new,)


class RNN(_Recurrent):
    """ONNX RNN (opset 7+): ``h = f(X·Wᵀ + H·Rᵀ + Wb + Rb)``."""

    num_gates = 1
    default_activations = ("Tanh",)

    @classmethod
    def _recurrent_weights(cls, bb, node: _Node, r_t: Expr, d: int) -> dict:
        return {"r_t": node.direction_slice(bb, r_t, d, 0, node.gates)}

    @classmethod
    def _step(cls, bb, node: _Node, d: int, xw_t, state, weights) -> tuple:
        (h,) = state
        pre = _add(bb, xw_t(0, node.hidden), _matmul(bb, h, weights["r_t"]))
        return (node.activate(bb, d, 0, pre),)
