"""Recurrent cells and small-batch dense layers in the fast FP32 build, against onnxruntime.

An LSTM / GRU step is a matrix-vector product with the recurrent weights (one batch row) and
the gates (sigmoid, tanh). The build packs the recurrent weights once for every step, as four
vectors of columns for the matrix-vector product, and writes the gates' sigmoid and tanh as
vector arithmetic; a Gemm on one to four rows gets the same packing. Each test compares with
onnxruntime and checks, on the lowered program, that the schedule was the one meant.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper
from tvm import relax

from rangeprof.profiler.compile.schedules import host_target
from rangeprof.profiler.compile.schedules.dense import DENSE, MATMUL
from rangeprof.profiler.compile.schedules.isa import vector_unit

from schedule_checks import (
    assert_matches_onnxruntime,
    kernel_calls,
    kernel_scripts,
    lowered,
    onnx_model,
)

SEQ, INPUT, HIDDEN = 6, 16, 32


def _recurrent(op: str, batch: int, direction: str = "forward", **attrs) -> onnx.ModelProto:
    """One LSTM / GRU node with bias, its initial states as graph inputs (a streaming model's
    state, as Silero VAD has it)."""
    rng = np.random.default_rng(0)
    dirs = 2 if direction == "bidirectional" else 1
    gates = {"LSTM": 4, "GRU": 3}[op] * HIDDEN
    inits = {
        "W": rng.uniform(-0.3, 0.3, (dirs, gates, INPUT)),
        "R": rng.uniform(-0.3, 0.3, (dirs, gates, HIDDEN)),
        "B": rng.uniform(-0.3, 0.3, (dirs, 2 * gates)),
    }
    states = ["h", "c"] if op == "LSTM" else ["h"]
    state = [dirs, batch, HIDDEN]
    inputs = {"X": [SEQ, batch, INPUT], **{s: state for s in states}}
    outputs = {"Y": [SEQ, dirs, batch, HIDDEN], **{f"Y_{s}": state for s in states}}
    node = helper.make_node(
        op,
        ["X", "W", "R", "B", "", *states],
        list(outputs),
        hidden_size=HIDDEN,
        direction=direction,
        **attrs,
    )
    return onnx_model([node], inits, inputs, outputs, opset=14)


def _gemm(rows: int, k: int, n: int) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    inits = {"w": rng.normal(size=(n, k)) / np.sqrt(k), "b": rng.normal(size=n)}
    node = helper.make_node("Gemm", ["X", "w", "b"], ["Y"], transB=1)
    return onnx_model([node], inits, {"X": [rows, k]}, {"Y": [rows, n]})


def _dense_calls(program: tvm.IRModule) -> list[relax.Call]:
    return [c for c in kernel_calls(program) if f'sblock("{DENSE}' in program[c.op].script()]


def _packed_weights(calls: list[relax.Call]) -> list:
    """The packed weight constant of each dense call (its one ``[N/nb, K, nb]`` constant)."""
    return [
        next(a for a in c.args if isinstance(a, tvm.ir.expr.GenericConst) and a.ty.ndim == 3)
        for c in calls
    ]


@pytest.mark.parametrize(
    ("op", "batch", "direction", "attrs"),
    [
        ("LSTM", 1, "forward", {}),
        ("LSTM", 3, "bidirectional", {}),
        ("GRU", 1, "forward", {"linear_before_reset": 1}),
        ("GRU", 2, "reverse", {}),
    ],
)
def test_recurrent_cells_match_onnxruntime_with_packed_steps(op, batch, direction, attrs):
    """Every step's ``h · Rᵀ`` is a packed dense kernel (none of TVM's plain matmuls is left),
    each direction's recurrent weights packed once for all its steps, four vectors of columns
    wide; the gates hold no call of ``exp``, ``tanh`` or ``sigmoid``."""
    model = _recurrent(op, batch, direction, **attrs)
    program = lowered(model)
    assert_matches_onnxruntime(model, program)

    scripts = kernel_scripts(program)
    assert not any(f'sblock("{MATMUL}' in s for s in scripts.values())
    calls = _dense_calls(program)
    weights = [w for w in _packed_weights(calls) if int(w.ty.shape[1]) == HIDDEN]
    dirs = 2 if direction == "bidirectional" else 1
    # A GRU without linear_before_reset multiplies r ⊙ h by its third gate's weights apart.
    per_step = 2 if op == "GRU" and not attrs.get("linear_before_reset") else 1
    assert len(weights) == dirs * per_step * SEQ
    distinct = [w for k, w in enumerate(weights) if not any(w.same_as(v) for v in weights[:k])]
    assert len(distinct) == dirs * per_step
    lanes = vector_unit(host_target()).lanes
    for weight in distinct:
        blocks, _, width = (int(d) for d in weight.ty.shape)
        widest = next(w for w in (4 * lanes, 2 * lanes, lanes) if blocks * width % w == 0)
        assert width == widest
    for name, script in scripts.items():
        assert not re.search(r"T\.(exp|tanh|sigmoid)\(", script), name


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 100), (2, 48, 256), (4, 512, 256)])
def test_small_batch_dense_matches_onnxruntime_as_matrix_vector_products(rows, k, n):
    """A Gemm on one to four rows: weights packed four vectors of columns wide (100 columns
    padded to 128), the rows of the batch in one register tile as far as the registers hold
    them, the lanes vectorised; tiles in
    parallel only when the product is large enough to pay for the thread pool."""
    model = _gemm(rows, k, n)
    program = lowered(model)
    assert_matches_onnxruntime(model, program)

    (call,) = _dense_calls(program)
    (weight,) = _packed_weights([call])
    unit = vector_unit(host_target())
    lanes = unit.lanes
    assert int(weight.ty.shape[-1]) == 4 * lanes
    assert int(weight.ty.shape[0]) * 4 * lanes == -(-n // (4 * lanes)) * 4 * lanes
    script = program[call.op].script()
    assert re.search(rf"T\.vectorized\(T\.int64\({4 * lanes}\)\)", script)
    tile = unit.tile(rows, 4 * lanes)  # all rows where the registers hold them (not AVX2's 4)
    if tile > 1:
        assert re.search(rf"T\.unroll\(T\.int64\({tile}\)\)", script)
    assert ("T.parallel(" in script) == (rows * k * n >= 1 << 17)


def test_one_hot_matmul_is_a_row_gather():
    """``one_hot(x) @ W`` as JAX exports it (Equal with an arange, Cast, MatMul; Magika's byte
    embedding): no one-hot tensor and no matmul are left, the rows of ``W`` are gathered (zeros
    for tokens outside the table), and the results are onnxruntime's."""
    rows, tokens, width = 40, 257, 64
    rng = np.random.default_rng(5)
    inits = {
        "iota": np.arange(tokens, dtype=np.int32),
        "w": rng.normal(size=(tokens, width)),
        "b": rng.normal(size=width),
        "axis": np.array([-1], np.int64),
    }
    nodes = [
        helper.make_node("Unsqueeze", ["X", "axis"], ["x1"]),
        helper.make_node("Equal", ["x1", "iota"], ["hot"]),
        helper.make_node("Cast", ["hot"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["f", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["Y"]),
    ]
    model = onnx_model(nodes, inits, {"X": ([1, rows], TensorProto.INT32)}, {"Y": [1, rows, width]})
    program = lowered(model)
    tokens_in = rng.integers(-3, tokens + 3, (1, rows)).astype(np.int32)
    assert_matches_onnxruntime(model, program, inputs={"X": tokens_in})

    scripts = kernel_scripts(program)
    assert not any(f'sblock("{DENSE}' in s or f'sblock("{MATMUL}' in s for s in scripts.values())
    one_hot = re.compile(rf'T\.int64\({rows}\), T\.int64\({tokens}\)\), "float32"')
    assert not any(one_hot.search(s) for s in scripts.values())
