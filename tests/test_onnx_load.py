"""The ONNX loading stage: errors, input shapes, node names, folding and the shared model zoo."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from tvm.relax.frontend.onnx import from_onnx

from rangeprof.profiler.errors import InputShapeError, InvalidModelError, UnsafeExternalDataError
from rangeprof.profiler.ir.onnx_load import load_model, load_model_bytes, parse_input_shape

from conftest import ZOO_SHAPES, zoo_model


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    # Keeps onnx.helper's newest IR version, which the onnxruntime inside onnxsim cannot read:
    # loading must cope with that.
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _relu_model() -> onnx.ModelProto:
    """y = relu(x) + sum(w), with a 4096-float weight so that half the file cuts into the graph."""
    w = np.arange(4096, dtype=np.float32).reshape(1024, 4) / 1000
    return _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("ReduceSum", ["w"], ["ws"], name="sum", keepdims=0),
            helper.make_node("Add", ["r", "ws"], ["y"], name="add"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(w, "w")],
    )


def _save(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


# --- parse_input_shape -------------------------------------------------------------------------


def test_parse_input_shape():
    assert parse_input_shape("x=1x3x48x192") == ("x", (1, 3, 48, 192))
    assert parse_input_shape("a=b=7") == ("a=b", (7,))  # split on the last '='


@pytest.mark.parametrize("text", ["x", "=1x2", "x=", "x=1x0", "x=1x-2", "x=1xx2", "x=1.5", "x=1,2"])
def test_parse_input_shape_rejects(text):
    with pytest.raises(InputShapeError, match="malformed input shape") as err:
        parse_input_shape(text)
    assert repr(text) in str(err.value)


# --- file errors -------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(InvalidModelError, match="no such file") as err:
        load_model(tmp_path / "nope.onnx")
    assert "nope.onnx" in str(err.value)


def test_directory(tmp_path):
    with pytest.raises(InvalidModelError, match="is a directory"):
        load_model(tmp_path)


def test_not_a_regular_file(tmp_path):
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    with pytest.raises(InvalidModelError, match="not a regular file"):
        load_model(fifo)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"this is a text file, not a model\n", "not an ONNX model"),
        (np.random.default_rng(0).bytes(4096), "not an ONNX model"),
        (b"", "no graph"),
        (helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString(), "no nodes"),
    ],
)
def test_not_onnx(tmp_path, data, problem):
    path = tmp_path / "model.onnx"
    path.write_bytes(data)
    with pytest.raises(InvalidModelError, match=problem) as err:
        load_model(path)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_truncated(tmp_path):
    data = _relu_model().SerializeToString()
    path = tmp_path / "model.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelError, match="truncated"):
        load_model(path)


def test_checker_failure(tmp_path):
    model = _relu_model()
    model.graph.node[0].input[0] = "undefined"
    with pytest.raises(InvalidModelError, match="invalid ONNX model") as err:
        load_model(_save(model, tmp_path / "model.onnx"))
    assert "\n" not in str(err.value)


# --- external data -----------------------------------------------------------------------------


def _external(tmp_path: Path, location: str) -> Path:
    """A model in tmp_path/model whose weight points at ``location``; the real data, valid and
    readable, lies both in tmp_path/model/w.bin and in tmp_path/outside/w.bin."""
    path = tmp_path / "model" / "model.onnx"
    path.parent.mkdir()
    onnx.save(_relu_model(), path, save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "w.bin").write_bytes((path.parent / "w.bin").read_bytes())
    model = onnx.load(path, load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    return _save(model, path)


def test_external_data_inside_folder_loads(tmp_path):
    lm = load_model(_external(tmp_path, "w.bin"))
    x = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    (got,) = ReferenceEvaluator(lm.model).run(None, x)
    (want,) = ReferenceEvaluator(_relu_model()).run(None, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    ("location", "problem"),
    [
        ("ABSOLUTE", "is outside the model's folder"),
        ("../outside/w.bin", "is outside the model's folder"),
        ("link.bin", "resolves outside the model's folder"),
    ],
)
def test_external_data_outside_folder(tmp_path, location, problem):
    if location == "ABSOLUTE":
        location = str(tmp_path / "outside" / "w.bin")
    path = _external(tmp_path, location)
    (path.parent / "link.bin").symlink_to(tmp_path / "outside" / "w.bin")
    # The data is valid, so an error proves the reference was refused before being read.
    with pytest.raises(UnsafeExternalDataError, match=problem) as err:
        load_model(path)
    assert str(path) in str(err.value)


def test_external_data_missing(tmp_path):
    with pytest.raises(InvalidModelError, match="not found") as err:
        load_model(_external(tmp_path, "nope.bin"))
    assert "nope.bin" in str(err.value)


def test_external_data_of_bytes(tmp_path):
    path = _external(tmp_path, "w.bin")
    with pytest.raises(InvalidModelError, match="without its folder"):
        load_model_bytes(path.read_bytes(), "upload")
    assert load_model_bytes(path.read_bytes(), "upload", base_dir=path.parent).name == "upload"


# --- identity and input shapes -----------------------------------------------------------------


def test_bytes_and_path_agree(tmp_path):
    path = _save(_relu_model(), tmp_path / "relu.onnx")
    from_path = load_model(path)
    from_bytes = load_model_bytes(path.read_bytes(), "relu")
    assert from_path.name == from_bytes.name == "relu"
    assert from_path.sha256 == from_bytes.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert from_path.model == from_bytes.model
    assert from_path.opset == 17


def _input_model(dims, elem_type=TensorProto.FLOAT, initializer_input=False) -> onnx.ModelProto:
    """y = -x; ``dims`` None gives x an unknown rank (and y rank 3, for a given shape of rank 3)."""
    inputs = [helper.make_tensor_value_info("x", elem_type, dims)]
    inits = []
    if initializer_input:  # old models also list their weights as inputs
        inputs.append(helper.make_tensor_value_info("w", elem_type, [1]))
        w = np.ones(1, helper.tensor_dtype_to_np_dtype(elem_type))
        inits.append(numpy_helper.from_array(w, "w"))
    y = helper.make_tensor_value_info("y", elem_type, [None] * 3 if dims is None else dims)
    return _model([helper.make_node("Neg", ["x"], ["y"], name="neg")], inputs, [y], inits)


def _shaped(tmp_path, dims, shapes=None, **kwargs):
    return load_model(_save(_input_model(dims, **kwargs), tmp_path / "m.onnx"), shapes)


def _static_input_dims(lm) -> list[int]:
    return [d.dim_value for d in lm.model.graph.input[0].type.tensor_type.shape.dim]


def test_static_shape_and_dtype(tmp_path):
    lm = _shaped(tmp_path, [2, 4], elem_type=TensorProto.INT64, initializer_input=True)
    assert lm.input_shapes == {"x": (2, 4)}
    assert lm.input_dtypes == {"x": "int64"}


@pytest.mark.parametrize("batch", ["N", None, -1])
def test_unknown_batch_defaults_to_one(tmp_path, batch):
    lm = _shaped(tmp_path, [batch, 4])
    assert lm.input_shapes == {"x": (1, 4)}
    assert _static_input_dims(lm) == [1, 4]


@pytest.mark.parametrize("dims", [["N", "C"], [1, -1], None])
def test_unknown_dims_need_a_shape(tmp_path, dims):
    with pytest.raises(InputShapeError, match="pass --input-shape x=DIMS"):
        _shaped(tmp_path, dims)


def test_user_shape_wins(tmp_path):
    lm = _shaped(tmp_path, ["N", "C"], {"x": [3, 5]})
    assert lm.input_shapes == {"x": (3, 5)}
    assert _static_input_dims(lm) == [3, 5]
    assert _shaped(tmp_path, None, {"x": (2, 2, 2)}).input_shapes == {"x": (2, 2, 2)}


@pytest.mark.parametrize(
    ("shape", "problem"),
    [
        ((1, 4, 1), "does not fit its model shape"),
        ((1, 5), "does not fit its model shape"),
        ((0, 4), "not positive integers"),
        (("1", 4), "not positive integers"),
    ],
)
def test_user_shape_must_fit(tmp_path, shape, problem):
    with pytest.raises(InputShapeError, match=problem):
        _shaped(tmp_path, ["N", 4], {"x": shape})


def test_user_shape_for_unknown_input(tmp_path):
    with pytest.raises(InputShapeError, match="no input named 'w'; the model's inputs are 'x'"):
        _shaped(tmp_path, [1, 4], {"w": (1,)}, initializer_input=True)


# --- node names --------------------------------------------------------------------------------


def _naming_model() -> onnx.ModelProto:
    names_and_ops = [
        ("", "Relu"),
        ("dup", "Relu"),
        ("dup", "Relu"),
        ("", "Relu"),
        ("dup_1", "Neg"),
        ("Relu_3", "Neg"),
        ("", "Neg"),
    ]
    nodes = [
        helper.make_node(op, [f"t{i}"], [f"t{i + 1}"], name=name)
        for i, (name, op) in enumerate(names_and_ops)
    ]
    n = len(nodes)
    return _model(
        nodes,
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [2])],
    )


def test_node_names(tmp_path):
    path = _save(_naming_model(), tmp_path / "m.onnx")
    names = [node.name for node in load_model(path).model.graph.node]
    assert names == ["Relu_0", "dup", "dup_2", "Relu_3_1", "dup_1", "Relu_3", "Neg_2"]
    assert names == [node.name for node in load_model(path).model.graph.node]


# --- folding -----------------------------------------------------------------------------------


def _shape_chain_model() -> onnx.ModelProto:
    """x -> Identity -> Reshape to [batch, -1] computed by Shape -> Gather -> Unsqueeze -> Concat;
    + a weight behind an Identity; + a weight computed from Constant nodes; and a graph output
    computed from the shape alone."""
    minus1, two = np.array([-1], np.int64), np.float32(2)
    nodes = [
        helper.make_node("Identity", ["x"], ["xi"], name="id_x"),
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["g"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["g", "axes"], ["gu"], name="unsqueeze"),
        helper.make_node("Constant", [], ["minus1"], value=numpy_helper.from_array(minus1)),
        helper.make_node("Concat", ["gu", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["xi", "target"], ["flat"], name="reshape"),
        helper.make_node("Identity", ["w"], ["wi"], name="id_w"),
        helper.make_node("Add", ["flat", "wi"], ["biased"], name="add"),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(48, "f"))),
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(two)),
        helper.make_node("Mul", ["c", "two"], ["c2"], name="scale_c"),
        helper.make_node("Add", ["biased", "c2"], ["y"], name="add_c"),
        helper.make_node("Cast", ["s"], ["dims"], name="dims", to=TensorProto.FLOAT),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.linspace(-1, 1, 48, dtype=np.float32), "w"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 48]),
            helper.make_tensor_value_info("dims", TensorProto.FLOAT, [4]),
        ],
        inits,
    )


def test_folding_fates(tmp_path):
    original = _shape_chain_model()
    lm = load_model(_save(original, tmp_path / "chain.onnx"))
    # Identity on data is not eliminated, and weight computations on initializers stay for Relax.
    assert [node.name for node in lm.model.graph.node] == [
        "id_x",
        "reshape",
        "id_w",
        "add",
        "add_c",
    ]
    assert lm.fates == {
        "shape": "folded_into:reshape",
        "gather": "folded_into:reshape",
        "unsqueeze": "folded_into:reshape",
        "concat": "folded_into:reshape",
        "scale_c": "folded_into:add_c",  # Constant nodes get no fate: they are weights
        "dims": "eliminated:constant",  # a graph output that is now a constant
    }
    assert [o.name for o in lm.model.graph.output] == ["y", "dims"]
    assert lm.model.ir_version == original.ir_version
    assert not lm.model.metadata_props  # onnxsim's log stays out

    x = np.random.default_rng(0).standard_normal((1, 3, 4, 4)).astype(np.float32)
    for got, want in zip(
        ReferenceEvaluator(lm.model).run(None, {"x": x}),
        ReferenceEvaluator(original).run(None, {"x": x}),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert from_onnx(lm.model, shape_dict=lm.input_shapes)["main"] is not None


# --- the shared model zoo ----------------------------------------------------------------------


def _random_inputs(lm) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for name, shape in lm.input_shapes.items():
        if lm.input_dtypes[name] == "int64":  # token ids; tiny_bert's vocabulary is larger
            feeds[name] = rng.integers(0, 1000, shape, dtype=np.int64)
        else:
            feeds[name] = rng.standard_normal(shape).astype(lm.input_dtypes[name])
    return feeds


def _count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(node.op_type == op_type for node in model.graph.node)


@pytest.mark.zoo
@pytest.mark.parametrize("name", list(ZOO_SHAPES))
def test_zoo_loads_imports_and_matches(name):
    import onnxruntime as ort

    path = zoo_model(name)
    lm = load_model(path, ZOO_SHAPES[name])
    original = onnx.load(path)
    names = [node.name for node in lm.model.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert names == [node.name for node in load_model(path, ZOO_SHAPES[name]).model.graph.node]
    assert _count(lm.model, "BatchNormalization") == _count(original, "BatchNormalization")

    from_onnx(lm.model, shape_dict=lm.input_shapes)

    feeds = _random_inputs(lm)
    got = ort.InferenceSession(lm.model.SerializeToString()).run(None, feeds)
    want = ort.InferenceSession(str(path)).run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.zoo
def test_zoo_truncated(tmp_path):
    data = zoo_model("digits_cnn").read_bytes()
    path = tmp_path / "digits_cnn.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelError, match="truncated"):
        load_model(path)


@pytest.mark.zoo
def test_zoo_ppocr_needs_a_shape_and_folds_its_reshape_target():
    path = zoo_model("ppocr_cls")
    with pytest.raises(InputShapeError, match="--input-shape x=DIMS"):
        load_model(path)
    lm = load_model(path, ZOO_SHAPES["ppocr_cls"])
    assert lm.input_shapes == {"x": (1, 3, 48, 192)}
    assert lm.opset == 11
    chain_ops = ("Shape", "Cast", "Slice", "Concat")
    chain = {n: f for n, f in lm.fates.items() if n.split("@")[0] in chain_ops}
    assert len(chain) == 6
    assert set(chain.values()) == {"folded_into:Reshape@18"}
    assert all(f.startswith("folded_into:") for f in lm.fates.values())


def test_folded_values_are_checked_against_onnxruntime():
    """A Shape -> Reshape target folded right passes the check; one folded to another constant
    (as onnxsim was seen to do on a recognition model) is caught with onnxruntime's value, which
    loading then uses."""
    from rangeprof.profiler.ir.onnx_load import misfolded

    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["shape"], name="shape"),
            helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    right = numpy_helper.from_array(np.array([2, 3, 5], np.int64), "folded_shape")
    wrong = numpy_helper.from_array(np.array([2, 15], np.int64), "folded_shape")
    assert misfolded(model, {"shape": right}) == {}
    corrected = misfolded(model, {"shape": wrong})
    assert list(corrected) == ["shape"] and corrected["shape"].tolist() == [2, 3, 5]
