"""Our ONNX converters (LSTM, GRU, RNN) compiled with TVM and compared with onnxruntime.

Each model is converted the way TVM's ONNX importer does it (initializers become ``relax.const``,
graph inputs ``relax.Var``, attributes parsed by the frontend, every node's converter called
inside one BlockBuilder dataflow block), then compiled for the CPU and run; every output must
match onnxruntime to 1e-5. The last test goes through the project's own importer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter, _get_convert_map, onnx_input

from rangeprof.profiler.errors import ConversionError, RangeprofError
from rangeprof.profiler.ir.converters import CONVERTERS
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model

SEQ, BATCH, INPUT, HIDDEN = 5, 2, 3, 4
OPSET = 14
TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
DIRECTIONS = ["forward", "reverse", "bidirectional"]
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _rnn_model(
    op: str,
    *,
    direction: str = "forward",
    bias: bool = True,
    initial: str | None = None,  # None, "const" (initializers), "zeros" or "input" (graph inputs)
    peepholes: bool = False,
    sequence_lens: list[int] | None = None,
    outputs: tuple[str, ...] | None = None,
    weights_as_inputs: bool = False,
    layout: int = 0,
    seed: int = 0,
    **attrs,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A model with one LSTM/GRU node; returns it with random feeds for its graph inputs."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[op] * HIDDEN

    def rand(*shape):
        return rng.uniform(-1, 1, shape).astype(np.float32)

    # Values are drawn in layout 0 and transposed, so both layouts of one seed agree.
    batch_first = (1, 0, 2) if layout else (0, 1, 2)
    values = {
        "X": rand(SEQ, BATCH, INPUT).transpose(batch_first),
        "W": rand(dirs, gates, INPUT),
        "R": rand(dirs, gates, HIDDEN),
    }
    names = ["X", "W", "R", "", "", "", "", ""]
    if bias:
        values["B"], names[3] = rand(dirs, 2 * gates), "B"
    if sequence_lens is not None:
        values["seq_lens"], names[4] = np.array(sequence_lens, np.int32), "seq_lens"
    states = ["initial_h", "initial_c"] if op == "LSTM" else ["initial_h"]
    for k, name in enumerate(states):
        if initial is not None:
            state = rand(dirs, BATCH, HIDDEN)
            if initial == "zeros":
                state[:] = 0
            values[name], names[5 + k] = state.transpose(batch_first), name
    if peepholes:
        values["P"], names[7] = rand(dirs, 3 * HIDDEN), "P"
    while not names[-1]:
        names.pop()

    if outputs is None:
        outputs = ("Y", "Y_h", "Y_c") if op == "LSTM" else ("Y", "Y_h")
    y_shape = [SEQ, dirs, BATCH, HIDDEN]
    state_shape = [dirs, BATCH, HIDDEN]
    if layout:
        attrs["layout"] = layout
        y_shape = [BATCH, SEQ, dirs, HIDDEN]
        state_shape = [BATCH, dirs, HIDDEN]
    node = helper.make_node(
        op, names, list(outputs), name="rnn", hidden_size=HIDDEN, direction=direction, **attrs
    )
    runtime = {"X"} | (set(states) if initial == "input" else set())
    if weights_as_inputs:
        runtime |= {"W", "R", "B", "P"}
    runtime &= set(values)
    graph = helper.make_graph(
        [node],
        op.lower(),
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, values[n].shape) for n in runtime],
        [
            helper.make_tensor_value_info(o, TensorProto.FLOAT, state_shape if k else y_shape)
            for k, o in enumerate(outputs)
            if o
        ],
        [numpy_helper.from_array(v, n) for n, v in values.items() if n not in runtime],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8  # what this onnxruntime reads
    return model, {n: values[n] for n in runtime}


def _convert(model: onnx.ModelProto) -> tvm.IRModule:
    """Relax ``main`` for the model, built as TVM's importer builds it, with our converters."""
    graph = model.graph
    nodes: dict[str, relax.Expr] = {
        t.name: relax.const(numpy_helper.to_array(t)) for t in graph.initializer
    }
    params, symbols = [], {}
    for vi in graph.input:
        dims = vi.type.tensor_type.shape.dim
        shape = [
            d.dim_value or symbols.setdefault(d.dim_param, tvm.tirx.Var(d.dim_param, "int64"))
            for d in dims
        ]
        params.append(relax.Var(vi.name, relax.TensorType(shape, "float32")))
        nodes[vi.name] = params[-1]
    parse_attr = ONNXGraphImporter({}, {})._parse_attr
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            for node in graph.node:
                converter = CONVERTERS.get(node.op_type) or _get_convert_map()[node.op_type]
                attr = parse_attr(node.attribute)
                attr["tvm_custom"] = {"name": node.name, "num_outputs": len(node.output)}
                inputs = onnx_input([nodes[i] if i else None for i in node.input])
                out = converter.get_converter(OPSET)(bb, inputs, attr, [nodes, {}])
                out = bb.normalize(out)
                fields = out.fields if isinstance(out, relax.Tuple) else [out]
                nodes.update(zip(node.output, fields, strict=False))
            results = [nodes[o.name] for o in graph.output]
            gv = bb.emit_output(results[0] if len(results) == 1 else relax.Tuple(results))
        bb.emit_func_output(gv)
    return bb.get()


def _run(mod: tvm.IRModule, feeds: dict) -> list[np.ndarray]:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    args = [tvm.runtime.tensor(feeds[p.name]) for p in mod["main"].params]
    out = vm["main"](*args)  # a tensor, or an Array of them for several outputs
    return [o.numpy() for o in out] if isinstance(out, Sequence) else [out.numpy()]


def _reference(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _bindings(func: relax.Function) -> int:
    return sum(len(block.bindings) for block in func.body.blocks)


def _check(model: onnx.ModelProto, feeds: dict, *, clean: bool = True) -> tvm.IRModule:
    """Convert, compile, run and compare every output with onnxruntime."""
    mod = _convert(model)
    if clean:  # each binding gets a profileID: none may be dead
        assert _bindings(relax.analysis.remove_all_unused(mod["main"])) == _bindings(mod["main"])
    expected = _reference(model, feeds)
    actual = _run(mod, feeds)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return mod


# Bias and initial state are paired rather than crossed: each compile costs about a second.
# "const" initial states are initializers, "input" ones graph inputs (relax.Var).
BIAS_AND_INITIAL = [(True, None), (False, "const"), (True, "input")]


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("bias", "initial"), BIAS_AND_INITIAL, ids=["bias", "init", "bias-init_in"]
)
def test_lstm(direction, bias, initial):
    _check(*_rnn_model("LSTM", direction=direction, bias=bias, initial=initial))


@pytest.mark.parametrize(
    ("direction", "initial"), zip(DIRECTIONS, [None, "input", "const"], strict=True)
)
def test_lstm_peepholes(direction, initial):
    _check(*_rnn_model("LSTM", direction=direction, initial=initial, peepholes=True))


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("bias", "initial"), [(True, None), (False, "input")], ids=["bias", "init_in"]
)
@pytest.mark.parametrize("linear_before_reset", [0, 1], ids=["lbr0", "lbr1"])
def test_gru(direction, bias, initial, linear_before_reset):
    model, feeds = _rnn_model(
        "GRU",
        direction=direction,
        bias=bias,
        initial=initial,
        linear_before_reset=linear_before_reset,
    )
    _check(model, feeds)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize(
    ("bias", "initial"), [(True, None), (False, "input")], ids=["bias", "init_in"]
)
def test_rnn(direction, bias, initial):
    _check(*_rnn_model("RNN", direction=direction, bias=bias, initial=initial))


def test_rnn_attributes():
    options = {"clip": 0.5, "activations": ["Relu", "Sigmoid"], "initial": "const"}
    _check(*_rnn_model("RNN", direction="bidirectional", **options))


@pytest.mark.parametrize(
    ("op", "options"),
    [
        ("LSTM", {"clip": 0.5, "initial": "input"}),
        ("GRU", {"clip": 0.5, "initial": "input", "linear_before_reset": 1}),
        ("LSTM", {"input_forget": 1, "initial": "input", "peepholes": True}),
        ("LSTM", {"activations": ["Relu", "Sigmoid", "Relu"], "initial": "const"}),
        ("GRU", {"activations": ["Sigmoid", "Relu"], "initial": "const"}),
        # Lists for both directions, the GRU's differing between them.
        ("LSTM", {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "Tanh"] * 2}),
        (
            "GRU",
            {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "Sigmoid", "Relu"]},
        ),
        ("LSTM", {"sequence_lens": [SEQ] * BATCH, "initial": "const"}),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_attributes(op, options):
    _check(*_rnn_model(op, **options))


@pytest.mark.parametrize(
    ("op", "options"),
    [
        ("LSTM", {"direction": "bidirectional", "initial": "input"}),
        ("GRU", {"direction": "reverse", "initial": "const", "linear_before_reset": 1}),
        ("RNN", {"direction": "bidirectional", "initial": "input"}),
    ],
    ids=["lstm", "gru", "rnn"],
)
def test_batch_first_layout(op, options):
    """layout=1 (which onnxruntime lacks) against the layout-0 twin of the same model."""
    model, feeds = _rnn_model(op, layout=1, **options)
    mod = _convert(model)
    reference = _reference(*_rnn_model(op, **options))
    batch_first = [(2, 0, 1, 3)] + [(1, 0, 2)] * (len(reference) - 1)
    for got, want, axes in zip(_run(mod, feeds), reference, batch_first, strict=True):
        np.testing.assert_allclose(got, want.transpose(axes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("op", "options"),
    [
        ("LSTM", {"peepholes": True, "initial": "input"}),
        ("GRU", {"linear_before_reset": 1, "initial": "input"}),
        ("GRU", {"linear_before_reset": 0}),
    ],
    ids=["lstm", "gru_lbr1", "gru_lbr0"],
)
def test_weights_as_graph_inputs(op, options):
    """Weights that are function parameters (not constants) go through the same ops."""
    _check(*_rnn_model(op, direction="bidirectional", weights_as_inputs=True, **options))


def test_symbolic_batch():
    """Only the sequence length must be static; the batch may be symbolic."""
    model, feeds = _rnn_model("LSTM", direction="bidirectional", initial="input", peepholes=True)
    for vi in model.graph.input:  # X [seq, batch, input], initial states [dirs, batch, hidden]
        vi.type.tensor_type.shape.dim[1].dim_param = "batch"
    _check(model, feeds)


def test_zero_initial_state_is_treated_as_absent():
    """A zero initial state adds nothing to the graph: no H·Rᵀ or f·c on the first step."""
    for op in ("LSTM", "GRU"):
        zeros = _convert(_rnn_model(op, direction="bidirectional", initial="zeros")[0])
        absent = _convert(_rnn_model(op, direction="bidirectional", initial=None)[0])
        tvm.ir.assert_structural_equal(zeros, absent)


def test_only_declared_outputs_are_built():
    """A node declaring only Y returns Y alone, without building the final states."""
    model, feeds = _rnn_model("LSTM", direction="bidirectional", outputs=("Y",))
    mod = _check(model, feeds)
    full = _convert(_rnn_model("LSTM", direction="bidirectional")[0])
    assert _bindings(mod["main"]) == _bindings(full["main"]) - 2  # concats for Y_h and Y_c


def test_skipped_leading_output():
    """``["", "Y_h"]``: the unused Y is built anyway (the converter cannot tell), values match."""
    _check(*_rnn_model("GRU", outputs=("", "Y_h")), clean=False)


def test_lstm_feeding_matmul_add():
    rng = np.random.default_rng(7)
    model, feeds = _rnn_model("LSTM", direction="bidirectional", initial="input", outputs=("Y",))
    graph = model.graph
    graph.node.extend(
        [
            helper.make_node("MatMul", ["Y", "proj_w"], ["proj"], name="proj"),
            helper.make_node("Add", ["proj", "proj_b"], ["out"], name="bias"),
        ]
    )
    graph.initializer.extend(
        [
            numpy_helper.from_array(rng.uniform(-1, 1, (HIDDEN, 6)).astype(np.float32), "proj_w"),
            numpy_helper.from_array(rng.uniform(-1, 1, 6).astype(np.float32), "proj_b"),
        ]
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("out", TensorProto.FLOAT, None))
    _check(model, feeds)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"activations": ["LeakyRelu", "Tanh", "Tanh"]}, ConversionError, "LeakyRelu"),
        ({"sequence_lens": [SEQ, SEQ - 2]}, RangeprofError, "sequence_lens"),
        ({"direction": "sideways"}, RangeprofError, "direction"),
        (
            {"direction": "bidirectional", "activations": ["Sigmoid", "Tanh", "Tanh"]},
            RangeprofError,
            "6 activations",
        ),
    ],
    ids=["activation", "short_sequence", "direction", "activation_count"],
)
def test_unsupported_or_invalid(options, error, message):
    with pytest.raises(error, match=message):
        _convert(_rnn_model("LSTM", **options)[0])


def test_runtime_sequence_lens_and_dynamic_length_raise():
    model, _ = _rnn_model("GRU", sequence_lens=[SEQ] * BATCH)
    seq_lens = next(t for t in model.graph.initializer if t.name == "seq_lens")
    model.graph.initializer.remove(seq_lens)
    model.graph.input.append(helper.make_tensor_value_info("seq_lens", TensorProto.INT32, [BATCH]))
    with pytest.raises(ConversionError, match="run time"):
        _convert(model)

    model, _ = _rnn_model("GRU")
    x_dims = model.graph.input[0].type.tensor_type.shape.dim
    x_dims[0].dim_param = "seq"
    with pytest.raises(ConversionError, match="sequence length must be static"):
        _convert(model)


def test_registered():
    assert {"LSTM", "GRU", "RNN"} <= set(CONVERTERS)


@pytest.mark.parametrize(
    ("op", "options"),
    [("LSTM", {"peepholes": True}), ("GRU", {"linear_before_reset": 1})],
    ids=["lstm", "gru"],
)
def test_project_importer_end_to_end(tmp_path, op, options):
    """Through the project's loader and importer: the node's weights keep their profileIDs."""
    model, feeds = _rnn_model(op, direction="bidirectional", initial="input", **options)
    path = tmp_path / "rnn.onnx"
    onnx.save(model, path)
    imported = import_onnx(load_model(path))

    ids = {layer.profile_id for layer in imported.layers}
    weights = {"weight:W", "weight:R", "weight:B"} | ({"weight:P"} if op == "LSTM" else set())
    assert weights <= ids
    node_ops = {layer.source_op for layer in imported.layers if layer.source_node is not None}
    assert node_ops == {op}

    expected = _reference(model, feeds)
    actual = _run(imported.mod, feeds)
    for got, want in zip(actual, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
