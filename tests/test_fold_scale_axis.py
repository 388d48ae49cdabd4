"""FoldScaleAxis on small ONNX models and the shared zoo: what folds, what stays, and identity.

Every model is imported with ``from_onnx``, decomposed and constant-folded as in the product,
compiled before and after the pass and compared to each other and to onnxruntime.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from rangeprof.profiler.ir.passes.fold_scale_axis import (
    BackwardFoldScaleAxis,
    FoldScaleAxis,
    ForwardFoldScaleAxis,
)
from rangeprof.profiler.ir.spans import ids_of, with_ids

from conftest import zoo_model

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
# Folding rounds W*a to float32 once instead of rounding each op's output, so results differ by
# a few ulp of the magnitudes summed into each output, not of the output itself: outputs near
# zero (cancellation) need an absolute tolerance at that scale, 1e-5 of the largest output.
RTOL = 1e-5
ATOL_OF_MAX = 1e-5


# --- building and running models ------------------------------------------------------------


def _model(nodes, inputs: dict, initializers: dict, outputs=("y",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(a, np.float32), n) for n, a in initializers.items()],
    )
    # IR version 8 goes with opset 17 (the onnx package writes a newer one onnxruntime rejects);
    # shape inference fills in the output shapes left out above.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model, full_check=True)
    return model


def _bn(rng, name: str, x: str, y: str, channels: int) -> tuple[list, dict]:
    """A BatchNormalization node on ``x`` with realistic random statistics."""
    stats = {
        f"{name}_g": rng.uniform(0.5, 1.5, channels),
        f"{name}_b": rng.normal(0, 0.5, channels),
        f"{name}_m": rng.normal(0, 0.5, channels),
        f"{name}_v": rng.uniform(0.2, 2.0, channels),
    }
    return [helper.make_node("BatchNormalization", [x, *stats], [y], epsilon=1e-5)], stats


def _prepare(model: onnx.ModelProto, shape_dict=None) -> tvm.IRModule:
    mod = from_onnx(model, shape_dict=shape_dict)
    mod = relax.transform.DecomposeOpsForInference()(mod)
    return relax.transform.FoldConstant()(mod)


def _run(mod: tvm.IRModule, inputs: list[np.ndarray]) -> list[np.ndarray]:
    vm = relax.VirtualMachine(tvm.compile(mod, target=TARGET), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(x) for x in inputs])
    return [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]


def _assert_close(actual: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL_OF_MAX * np.abs(e).max())


def _fold_and_check(model: onnx.ModelProto, inputs: dict, fold=FoldScaleAxis):
    """The module before and after ``fold``; both compile and agree with onnxruntime."""
    before = _prepare(model)
    after = fold()(before)
    relax.analysis.well_formed(after)
    values = list(inputs.values())
    reference = _run(before, values)
    _assert_close(_run(after, values), reference)
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    _assert_close(session.run(None, inputs), reference)
    return before, after


def _bindings(mod: tvm.IRModule) -> list[relax.Binding]:
    return [b for block in mod["main"].body.blocks for b in block.bindings]


def _op_name(value) -> str:
    """The op of a call without its "relax." prefix ("nn.conv2d", "add"), else the class name."""
    if isinstance(value, tvm.ir.Call):
        return value.op.name.removeprefix("relax.")
    return type(value).__name__


def _ops(mod: tvm.IRModule) -> Counter:
    """How often each op (or Tuple / TupleGetItem) is bound in ``main``."""
    return Counter(_op_name(b.value) for b in _bindings(mod))


def _calls(mod: tvm.IRModule, op: str) -> list[tvm.ir.Call]:
    return [b.value for b in _bindings(mod) if _op_name(b.value) == op]


def _tag(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each binding value of main carrying the profileID "<index>:<var name>"
    (imported names repeat) and each constant argument of a call "<that ID>/<arg index>"."""

    @relax.expr_functor.mutator
    class Tagger(relax.PyExprMutator):
        def __init__(self):
            super().__init__()
            self.count = 0

        def visit_var_binding_(self, binding):
            tag = f"{self.count}:{binding.var.name}"
            self.count += 1
            value = binding.value
            if isinstance(value, tvm.ir.Call):
                args = [
                    with_ids(a, [f"{tag}/{k}"]) if isinstance(a, tvm.ir.GenericConst) else a
                    for k, a in enumerate(value.args)
                ]
                value = relax.Call(value.op, args, value.attrs, value.ty_args, ret_ty=value.ty)
            self.builder_.emit_normalized(relax.VarBinding(binding.var, with_ids(value, [tag])))

    tagged = mod.clone()
    tagged["main"] = Tagger().visit_expr(mod["main"])
    return tagged


def _tags_by_op(mod: tvm.IRModule) -> list[tuple[str, str]]:
    """(op name, profileID) of each binding of a tagged ``main``, in order."""
    out = []
    for b in _bindings(mod):
        (tag,) = ids_of(b.value)
        out.append((_op_name(b.value), tag))
    return out


# --- forward -------------------------------------------------------------------------------


def _conv_bn_relu_scale(rng, scale, bias: bool):
    """conv(+bias) -> BN -> relu -> Mul(scale), 3 -> 6 channels; ``scale=None`` leaves out the
    Mul. Returns the model and an input for it."""
    inits = {"w": rng.normal(0, 0.3, (6, 3, 3, 3))}
    conv_inputs = ["x", "w"]
    if bias:
        inits["b"] = rng.normal(0, 0.5, 6)
        conv_inputs.append("b")
    nodes = [helper.make_node("Conv", conv_inputs, ["c"], pads=[1, 1, 1, 1])]
    bn_nodes, stats = _bn(rng, "bn", "c", "n", 6)
    nodes += [*bn_nodes, helper.make_node("Relu", ["n"], ["r" if scale is not None else "y"])]
    inits.update(stats)
    if scale is not None:
        inits["s"] = np.asarray(scale).reshape(6, 1, 1)
        nodes.append(helper.make_node("Mul", ["r", "s"], ["y"]))
    inputs = {"x": rng.normal(size=(2, 3, 7, 7)).astype(np.float32)}
    return _model(nodes, {"x": [2, 3, 7, 7]}, inits), inputs


def test_conv_bn_folds_into_conv_and_one_bias_add():
    rng = np.random.default_rng(1)
    model, inputs = _conv_bn_relu_scale(rng, scale=None, bias=False)
    _, after = _fold_and_check(model, inputs)
    assert [_op_name(b.value) for b in _bindings(after)] == ["nn.conv2d", "add", "nn.relu"]


def test_conv_bias_bn_relu_positive_scale_folds_through_relu():
    rng = np.random.default_rng(2)
    model, inputs = _conv_bn_relu_scale(rng, scale=rng.uniform(0.1, 2.0, 6), bias=True)
    _, after = _fold_and_check(model, inputs)
    # Conv bias, BN and scale became one weight and one add, which stays in front of the relu.
    assert [_op_name(b.value) for b in _bindings(after)] == ["nn.conv2d", "add", "nn.relu"]
    conv, add, relu = _bindings(after)
    assert add.value.args[0].same_as(conv.var) and relu.value.args[0].same_as(add.var)


def test_affine_chain_with_constants_on_either_side_folds():
    """k - conv, / d, e + ., f * .: both operand orders fold into one weight and one bias."""
    rng = np.random.default_rng(15)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Sub", ["k", "c"], ["a"]),
        helper.make_node("Div", ["a", "d"], ["b"]),
        helper.make_node("Add", ["e", "b"], ["s"]),
        helper.make_node("Mul", ["f", "s"], ["y"]),
    ]
    inits = {name: rng.uniform(-2, 2, (4, 1, 1)) for name in "kdef"}
    inits["w"] = rng.normal(0, 0.3, (4, 3, 1, 1))
    model = _model(nodes, {"x": [1, 3, 5, 5]}, inits)
    _, after = _fold_and_check(model, {"x": rng.normal(size=(1, 3, 5, 5)).astype("f")})
    assert _ops(after) == Counter({"nn.conv2d": 1, "add": 1})


def test_negative_scale_after_relu_does_not_fold():
    rng = np.random.default_rng(3)
    scale = rng.uniform(0.5, 2.0, 4) * np.array([1, -1, 1, -1])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Mul", ["r", "s"], ["y"]),
    ]
    inits = {"w": rng.normal(0, 0.3, (4, 3, 3, 3)), "s": scale.reshape(4, 1, 1)}
    model = _model(nodes, {"x": [1, 3, 6, 6]}, inits)
    before, after = _fold_and_check(model, {"x": rng.normal(size=(1, 3, 6, 6)).astype("f")})
    assert _ops(after) == _ops(before)
    assert after["main"].same_as(before["main"])


@pytest.mark.parametrize("op, sign", [("Add", 1), ("Div", -1)], ids=["add", "negative-div"])
def test_ops_that_cannot_pass_a_relu_stay(op, sign):
    rng = np.random.default_rng(4)
    const = sign * rng.uniform(0.5, 2.0, 4)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node(op, ["r", "k"], ["y"]),
    ]
    inits = {"w": rng.normal(0, 0.3, (4, 3, 1, 1)), "k": const.reshape(4, 1, 1)}
    model = _model(nodes, {"x": [1, 3, 5, 5]}, inits)
    before, after = _fold_and_check(model, {"x": rng.normal(size=(1, 3, 5, 5)).astype("f")})
    assert after["main"].same_as(before["main"])


def test_conv_read_twice_keeps_its_batch_norm():
    """The conv output has a second reader, which must keep seeing the unscaled value."""
    rng = np.random.default_rng(5)
    bn_nodes, stats = _bn(rng, "bn", "c", "y", 4)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), *bn_nodes]
    inits = {"w": rng.normal(0, 0.3, (4, 3, 1, 1)), **stats}
    model = _model(nodes, {"x": [1, 3, 5, 5]}, inits, outputs=("y", "c"))
    before, after = _fold_and_check(model, {"x": rng.normal(size=(1, 3, 5, 5)).astype("f")})
    assert _ops(after) == _ops(before)


def test_depthwise_conv_bn_and_scale_in_front():
    """Depthwise (group = C, two outputs per channel): BN folds forward, the scale backward."""
    rng = np.random.default_rng(6)
    c = 4
    bn_nodes, stats = _bn(rng, "bn", "c", "y", 2 * c)
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["xs"]),
        helper.make_node("Conv", ["xs", "w"], ["c"], pads=[1, 1, 1, 1], group=c),
        *bn_nodes,
    ]
    scale = rng.uniform(0.5, 2.0, c) * np.array([1, -1, -1, 1])
    inits = {"s": scale.reshape(c, 1, 1), "w": rng.normal(0, 0.3, (2 * c, 1, 3, 3)), **stats}
    model = _model(nodes, {"x": [1, c, 6, 6]}, inits)
    _, after = _fold_and_check(model, {"x": rng.normal(size=(1, c, 6, 6)).astype("f")})
    ops = _ops(after)
    assert ops["multiply"] == ops["subtract"] == ops["divide"] == 0
    assert ops["nn.conv2d"] == 1 and ops["add"] == 1


# --- backward ------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2], ids=["dense", "grouped"])
@pytest.mark.parametrize("op", ["Mul", "Div"])
def test_scale_before_conv_folds_backward_whatever_its_sign(op, groups):
    rng = np.random.default_rng(7)
    scale = rng.uniform(0.5, 2.0, 4) * np.array([1, -1, 1, -1])
    nodes = [
        helper.make_node(op, ["x", "s"], ["xs"]),
        helper.make_node("Conv", ["xs", "w"], ["y"], pads=[1, 1, 1, 1], group=groups),
    ]
    inits = {"s": scale.reshape(1, 4, 1, 1), "w": rng.normal(0, 0.3, (6, 4 // groups, 3, 3))}
    model = _model(nodes, {"x": [1, 4, 6, 6]}, inits)
    _, after = _fold_and_check(
        model, {"x": rng.normal(size=(1, 4, 6, 6)).astype("f")}, fold=BackwardFoldScaleAxis
    )
    assert _ops(after) == Counter({"nn.conv2d": 1})


def test_scale_read_by_two_convs_folds_into_both_but_not_with_another_reader():
    rng = np.random.default_rng(8)
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["xs"]),
        helper.make_node("Conv", ["xs", "w1"], ["y1"]),
        helper.make_node("Conv", ["xs", "w2"], ["y2"]),
    ]
    inits = {
        "s": rng.uniform(-2, 2, (3, 1, 1)),
        "w1": rng.normal(0, 0.3, (2, 3, 1, 1)),
        "w2": rng.normal(0, 0.3, (5, 3, 3, 3)),
    }
    inputs = {"x": rng.normal(size=(1, 3, 5, 5)).astype("f")}
    _, after = _fold_and_check(_model(nodes, {"x": [1, 3, 5, 5]}, inits, ("y1", "y2")), inputs)
    assert _ops(after) == Counter({"nn.conv2d": 2, "Tuple": 1})

    nodes.append(helper.make_node("Relu", ["xs"], ["y3"]))
    model = _model(nodes, {"x": [1, 3, 5, 5]}, inits, ("y1", "y2", "y3"))
    before, after = _fold_and_check(model, inputs)
    assert _ops(after) == _ops(before)


# --- dense ---------------------------------------------------------------------------------


def test_gemm_then_per_column_mul_folds():
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1),
        helper.make_node("Mul", ["g", "s"], ["y"]),
    ]
    inits = {
        "w": rng.normal(0, 0.3, (5, 8)),
        "b": rng.normal(0, 0.5, 5),
        "s": rng.uniform(-2, 2, 5),
    }
    model = _model(nodes, {"x": [3, 8]}, inits)
    _, after = _fold_and_check(model, {"x": rng.normal(size=(3, 8)).astype("f")})
    assert _ops(after) == Counter({"matmul": 1, "add": 1})


def test_matmul_with_constant_weight_folds_both_ways():
    """(2, 3, 8) @ W: a per-K scale in front folds backward, a per-column one behind forward."""
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("Mul", ["x", "k"], ["xs"]),
        helper.make_node("MatMul", ["xs", "w"], ["m"]),
        helper.make_node("Mul", ["m", "s"], ["y"]),
    ]
    inits = {
        "k": rng.uniform(-2, 2, 8),
        "w": rng.normal(0, 0.3, (8, 5)),
        "s": rng.uniform(-2, 2, (1, 5)),
    }
    model = _model(nodes, {"x": [2, 3, 8]}, inits)
    _, after = _fold_and_check(model, {"x": rng.normal(size=(2, 3, 8)).astype("f")})
    assert _ops(after) == Counter({"matmul": 1})


@pytest.mark.parametrize(
    "op, operands, const_shape",
    [("Mul", ["m", "s"], (3, 1)), ("Div", ["s", "m"], (5,))],
    ids=["per-row-mul", "constant-over-value"],
)
def test_per_row_or_non_affine_constants_stay(op, operands, const_shape):
    rng = np.random.default_rng(11)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"]),
        helper.make_node(op, operands, ["y"]),
    ]
    inits = {"w": rng.normal(0, 0.3, (8, 5)), "s": rng.uniform(0.5, 2, const_shape)}
    model = _model(nodes, {"x": [3, 8]}, inits)
    before, after = _fold_and_check(model, {"x": rng.normal(size=(3, 8)).astype("f")})
    assert after["main"].same_as(before["main"])


# --- identity ------------------------------------------------------------------------------


def test_folded_conv_carries_the_ids_of_everything_it_absorbed():
    rng = np.random.default_rng(12)
    model, inputs = _conv_bn_relu_scale(rng, scale=rng.uniform(0.1, 2.0, 6), bias=True)
    before = _tag(_prepare(model))
    tags = _tags_by_op(before)
    ops = [op for op, _ in tags]
    assert ops == [
        *["nn.conv2d", "add", "subtract", "divide", "multiply", "add"],
        *["Tuple", "TupleGetItem", "nn.relu", "multiply"],
    ]
    conv, bias, sub, div, mul, shift, tup, item, relu, scale = (t for _, t in tags)

    after = ForwardFoldScaleAxis()(before)
    relax.analysis.well_formed(after)
    assert all(ids_of(b.value) for b in _bindings(after))
    (new_conv,) = _calls(after, "nn.conv2d")
    (new_bias,) = _calls(after, "add")
    (new_relu,) = _calls(after, "nn.relu")
    absorbed = {conv, bias, sub, div, mul, shift, tup, item, scale}
    assert ids_of(new_conv) == absorbed
    assert ids_of(new_bias) == absorbed
    assert ids_of(new_relu) == {relu, scale}
    # New constants: the weight from W and every scale, the bias from the shifts and later scales.
    assert ids_of(new_conv.args[1]) == {f"{conv}/1", f"{div}/1", f"{mul}/1", f"{scale}/1"}
    assert ids_of(new_bias.args[1]) == {
        *[f"{bias}/1", f"{sub}/1", f"{div}/1"],
        *[f"{mul}/1", f"{shift}/1", f"{scale}/1"],
    }
    _assert_close(_run(after, list(inputs.values())), _run(before, list(inputs.values())))


def test_backward_folded_conv_carries_the_scale_ids():
    rng = np.random.default_rng(13)
    nodes = [
        helper.make_node("Mul", ["s", "x"], ["xs"]),
        helper.make_node("Conv", ["xs", "w"], ["y"]),
    ]
    inits = {"s": rng.uniform(-2, 2, (3, 1, 1)), "w": rng.normal(0, 0.3, (2, 3, 1, 1))}
    before = _tag(_prepare(_model(nodes, {"x": [1, 3, 4, 4]}, inits)))
    (mul_op, mul), (conv_op, conv) = _tags_by_op(before)
    assert (mul_op, conv_op) == ("multiply", "nn.conv2d")
    after = FoldScaleAxis()(before)
    (binding,) = _bindings(after)
    assert ids_of(binding.value) == {mul, conv}
    assert ids_of(binding.value.args[1]) == {f"{mul}/0", f"{conv}/1"}


def test_primitive_functions_are_left_alone():
    rng = np.random.default_rng(14)
    model, _ = _conv_bn_relu_scale(rng, scale=None, bias=False)
    mod = _prepare(model)
    mod["main"] = mod["main"].with_attr("Primitive", 1)
    assert FoldScaleAxis()(mod)["main"].same_as(mod["main"])


# --- shared models -------------------------------------------------------------------------


@pytest.mark.zoo
@pytest.mark.parametrize(
    "name, shape",
    [
        ("digits_cnn", [1, 1, 8, 8]),
        ("resnet18", [1, 3, 224, 224]),
        ("mobilenet_v2", [1, 3, 224, 224]),
    ],
)
def test_zoo_batch_norms_and_scales_all_fold(name, shape):
    model = onnx.load(zoo_model(name))
    before = _tag(_prepare(model, {model.graph.input[0].name: shape}))
    after = FoldScaleAxis()(before)
    relax.analysis.well_formed(after)
    ops, ops_before = _ops(after), _ops(before)
    # The models' only subtract/divide/multiply come from their BNs and digits_cnn's scale.
    assert ops["subtract"] == ops["divide"] == ops["multiply"] == 0
    assert ops["Tuple"] == ops["TupleGetItem"] == 0
    assert ops["nn.conv2d"] == ops_before["nn.conv2d"]
    assert all(ids_of(b.value) for b in _bindings(after))
    assert FoldScaleAxis()(after)["main"].same_as(after["main"]), "a second run changes nothing"
    if name == "digits_cnn":
        # The scale after block 1 is positive, so it moves through the relu into conv 1.
        tags = _tags_by_op(before)
        first_relu = next(i for i, (op, _) in enumerate(tags) if op == "nn.relu")
        assert tags[first_relu + 1][0] == "multiply"
        first_conv = _calls(after, "nn.conv2d")[0]
        assert {tags[0][1], tags[1][1], tags[first_relu + 1][1]} <= ids_of(first_conv)

    x = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    _assert_close(_run(after, [x]), _run(before, [x]))
