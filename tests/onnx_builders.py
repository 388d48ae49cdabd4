"""Small ONNX models built with onnx.helper for the identity and lineage tests.

Every builder returns a ModelProto with seeded random float32 weights, opset 17, one input ``x``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def single_io_model(nodes, inits, x_shape, y_shape, name="test") -> onnx.ModelProto:
    """A checked opset-17 model with input ``x``, output ``y`` and float32 initializers."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
        [numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, folder: Path, name: str = "model.onnx") -> Path:
    path = folder / name
    onnx.save(model, path)
    return path


def gemm() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1)
    return single_io_model(
        [node], {"w": rng.normal(size=(5, 8)), "b": rng.normal(size=5)}, (2, 8), (2, 5)
    )


def conv_bias() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1])
    inits = {"w": rng.normal(size=(4, 3, 3, 3)), "b": rng.normal(size=4)}
    return single_io_model([node], inits, (1, 3, 6, 6), (1, 4, 6, 6))


def _bn_inits(rng, channels: int, prefix: str = "bn") -> dict:
    return {
        f"{prefix}.g": rng.uniform(0.5, 1.5, channels),
        f"{prefix}.b": rng.normal(size=channels),
        f"{prefix}.m": rng.normal(size=channels),
        f"{prefix}.v": rng.uniform(0.5, 2.0, channels),
    }


def _bn(inp: str, out: str, name: str, prefix: str = "bn"):
    ins = [inp, f"{prefix}.g", f"{prefix}.b", f"{prefix}.m", f"{prefix}.v"]
    return helper.make_node("BatchNormalization", ins, [out], name=name)


def conv_bn_relu_scale(sign: float = 1.0) -> onnx.ModelProto:
    """conv -> BN -> relu -> Mul(per-channel scale of the given sign), nothing after it."""
    rng = np.random.default_rng(2)
    inits = {"w": rng.normal(size=(4, 3, 3, 3)), **_bn_inits(rng, 4)}
    inits["s"] = sign * rng.uniform(0.5, 2.0, (1, 4, 1, 1))
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        _bn("c", "n", "bn"),
        helper.make_node("Relu", ["n"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "s"], ["y"], name="scale"),
    ]
    return single_io_model(nodes, inits, (1, 3, 6, 6), (1, 4, 6, 6))


def scale_before_conv() -> onnx.ModelProto:
    """Mul(per-channel scale, mixed signs) -> conv: the scale folds into the conv's weights."""
    rng = np.random.default_rng(3)
    inits = {"s": rng.normal(size=(1, 3, 1, 1)), "w": rng.normal(size=(4, 3, 3, 3))}
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["m"], name="scale"),
        helper.make_node("Conv", ["m", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    return single_io_model(nodes, inits, (1, 3, 6, 6), (1, 4, 6, 6))


def constant_subgraph() -> onnx.ModelProto:
    """A weight computed at run time from constants (Transpose, Mul) feeding a MatMul."""
    rng = np.random.default_rng(4)
    inits = {"wt": rng.normal(size=(5, 8)), "k": np.float32(0.5)}
    nodes = [
        helper.make_node("Transpose", ["wt"], ["w"], name="transpose_w", perm=[1, 0]),
        helper.make_node("Mul", ["w", "k"], ["w2"], name="halve_w"),
        helper.make_node("MatMul", ["x", "w2"], ["y"], name="matmul"),
    ]
    return single_io_model(nodes, inits, (2, 8), (2, 5))


def shape_arithmetic() -> onnx.ModelProto:
    """What exported transformers do with static shapes at run time: ``Shape`` → ``Gather`` →
    ``Unsqueeze`` → ``Concat`` → ``Reshape``, and a ``Gather`` of one row by a constant index
    (which the frontend normalises against the tensor's shape)."""
    rng = np.random.default_rng(6)
    inits = {"w": rng.normal(size=(4, 12)), "last": np.array([2], np.int64)}
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["qkv"], name="qkv"),
        helper.make_node("Shape", ["qkv"], ["dims"], name="dims"),
        helper.make_node("Gather", ["dims", "axis0"], ["batch"], name="batch", axis=0),
        helper.make_node("Unsqueeze", ["batch", "axis0_1d"], ["batch_1d"], name="batch_1d"),
        helper.make_node("Concat", ["batch_1d", "minus1", "last"], ["split"], name="split", axis=0),
        helper.make_node("Reshape", ["qkv", "split"], ["heads"], name="heads"),
        helper.make_node("Gather", ["heads", "one"], ["y"], name="second_head", axis=1),
    ]
    constants = {
        "w": inits["w"].astype(np.float32),
        "last": inits["last"],
        "axis0": np.array(0, np.int64),
        "axis0_1d": np.array([0], np.int64),
        "minus1": np.array([-1], np.int64),
        "one": np.array(1, np.int64),
    }
    graph = helper.make_graph(
        nodes,
        "shape_arithmetic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def unnamed_nodes() -> onnx.ModelProto:
    """Three unnamed nodes, two of the same op type."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b"]),
        helper.make_node("Relu", ["b"], ["y"]),
    ]
    return single_io_model(nodes, {}, (2, 3), (2, 3))


def unbalanced_pair(activation: str = "Relu") -> onnx.ModelProto:
    """conv (bias) -> BN -> activation -> depthwise conv -> conv: output channels of the first
    conv a thousand times apart in range, what cross-layer equalization evens out."""
    rng = np.random.default_rng(5)
    spread = np.geomspace(0.01, 10.0, 8)[:, None, None, None]
    inits = {
        "w1": rng.normal(size=(8, 3, 3, 3)) * spread,
        "b1": rng.normal(size=8),
        **_bn_inits(rng, 8),
        "w2": rng.normal(size=(8, 1, 3, 3)),
        "w3": rng.normal(size=(4, 8, 1, 1)),
    }
    act = (
        [helper.make_node("Clip", ["n", "lo", "hi"], ["a"], name="act")]
        if activation == "Clip"
        else [helper.make_node(activation, ["n"], ["a"], name="act")]
    )
    if activation == "Clip":
        inits |= {"lo": np.float32(0.0), "hi": np.float32(6.0)}
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        _bn("c", "n", "bn"),
        *act,
        helper.make_node("Conv", ["a", "w2"], ["d"], name="dw", pads=[1, 1, 1, 1], group=8),
        helper.make_node("Conv", ["d", "w3"], ["y"], name="pw"),
    ]
    return single_io_model(nodes, inits, (1, 3, 6, 6), (1, 4, 6, 6))


def conv_relu(rng, c_in: int, c_out: int, size: int):
    """``y = Relu(Conv3x3(x, pad 1) + b)`` on ``[1, c_in, size, size]`` (nodes ``conv``,
    ``act``), its weights drawn from ``rng``: ``(model, w, b)``."""
    w = (rng.normal(size=(c_out, c_in, 3, 3)) / 3).astype(np.float32)
    b = rng.normal(size=c_out).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1] * 4),
        helper.make_node("Relu", ["c"], ["y"], name="act"),
    ]
    shape = (1, c_out, size, size)
    return single_io_model(nodes, {"w": w, "b": b}, (1, c_in, size, size), shape), w, b


def mobilenet_v3_block() -> onnx.ModelProto:
    """A MobileNetV3 / PP-LCNet-style network on ``[1, 3, 16, 16]``: bias-free convs followed by
    BatchNormalization, HardSwish both as the ONNX op and decomposed (``x * Clip(x + 3, 0, 6) / 6``,
    its ``+ 3`` a scalar straight after a conv), a depthwise conv, a squeeze-and-excite branch gated
    by HardSigmoid, a residual add, and a dense head with HardSwish between its two Gemms."""
    rng = np.random.default_rng(11)
    inits = {
        "stem.w": rng.normal(size=(8, 3, 3, 3)) / 4,
        **_bn_inits(rng, 8, "stem.bn"),
        "dw.w": rng.normal(size=(8, 1, 3, 3)) / 2,
        **_bn_inits(rng, 8, "dw.bn"),
        "se1.w": rng.normal(size=(4, 8, 1, 1)) / 2,
        "se1.b": rng.normal(size=4),
        "se2.w": rng.normal(size=(8, 4, 1, 1)) / 2,
        "se2.b": rng.normal(size=8),
        "pw.w": rng.normal(size=(8, 8, 1, 1)) / 3,
        "three": np.array(3.0),
        "zero": np.array(0.0),
        "six": np.array(6.0),
        "fc1.w": rng.normal(size=(8, 16)) / 3,
        "fc1.b": rng.normal(size=16),
        "fc2.w": rng.normal(size=(16, 10)) / 4,
        "fc2.b": rng.normal(size=10),
    }
    node = helper.make_node
    nodes = [
        node("Conv", ["x", "stem.w"], ["s0"], name="stem", pads=[1] * 4, strides=[2, 2]),
        _bn("s0", "s1", "stem_bn", "stem.bn"),
        node("HardSwish", ["s1"], ["s2"], name="stem_act"),
        node("Conv", ["s2", "dw.w"], ["d0"], name="dw", pads=[1] * 4, group=8),
        _bn("d0", "d1", "dw_bn", "dw.bn"),
        node("Relu", ["d1"], ["d2"], name="dw_act"),
        node("GlobalAveragePool", ["d2"], ["p0"], name="se_pool"),
        node("Conv", ["p0", "se1.w", "se1.b"], ["p1"], name="se_reduce"),
        node("Relu", ["p1"], ["p2"], name="se_act"),
        node("Conv", ["p2", "se2.w", "se2.b"], ["p3"], name="se_expand"),
        node("HardSigmoid", ["p3"], ["p4"], name="se_gate", alpha=1 / 6, beta=0.5),
        node("Mul", ["d2", "p4"], ["e0"], name="se_scale"),
        node("Conv", ["e0", "pw.w"], ["c0"], name="pw"),
        node("Add", ["c0", "three"], ["h0"], name="hs_add"),
        node("Clip", ["h0", "zero", "six"], ["h1"], name="hs_clip"),
        node("Mul", ["c0", "h1"], ["h2"], name="hs_mul"),
        node("Div", ["h2", "six"], ["h3"], name="hs_div"),
        node("Add", ["h3", "s2"], ["r0"], name="residual"),
        node("GlobalAveragePool", ["r0"], ["g0"], name="pool"),
        node("Flatten", ["g0"], ["g1"], name="flatten"),
        node("Gemm", ["g1", "fc1.w", "fc1.b"], ["f0"], name="fc1"),
        node("HardSwish", ["f0"], ["f1"], name="fc1_act"),
        node("Gemm", ["f1", "fc2.w", "fc2.b"], ["y"], name="fc2"),
    ]
    return single_io_model(nodes, inits, (1, 3, 16, 16), (1, 10), name="mobilenet_v3_block")


TRANSFORMER_TOKENS, TRANSFORMER_WIDTH = 8, 16


def pre_ln_transformer(hidden_outlier: float = 1.0, lm_head: bool = False) -> onnx.ModelProto:
    """A pre-LN transformer block and head: q/k/v read one LayerNorm, a causal mask constant of
    -inf is sliced and added to the scores, fc2 reads a ReLU, the head a Gemm on a reshape of
    the last LayerNorm (``lm_head``: a MatMul on it, logits ``[1, T, 5]`` with a batch axis);
    one channel of the first LayerNorm an outlier (gamma 12), and one hidden channel of fc1
    ``hidden_outlier`` times the others."""
    T, D = TRANSFORMER_TOKENS, TRANSFORMER_WIDTH
    rng = np.random.default_rng(0)

    def w(*shape, scale=0.3):
        return rng.normal(size=shape) * scale

    gamma = np.ones(D)
    gamma[3] = 12.0
    mask = np.triu(np.full((16, 16), -np.inf), k=1)
    inits = {
        "g1": gamma, "b1": w(D), "g2": 1 + w(D), "b2": w(D), "g3": 1 + w(D), "b3": w(D),
        "wq": w(D, D), "wk": w(D, D), "wv": w(D, D), "wo": w(D, D), "w1": w(D, 4 * D),
        "w2": w(4 * D, D), "head": w(5, D), "hb": w(5), "mask": mask, "scale": np.array(0.25),
    }  # fmt: skip
    inits["w1"][:, 5] *= hidden_outlier
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "g1", "b1"], ["ln1"], name="ln1", axis=-1),
        *(n("MatMul", ["ln1", f"w{c}"], [c], name=c) for c in "qkv"),
        n("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["qk"], name="qk"),
        n("Mul", ["qk", "scale"], ["scores"], name="scores"),
        n("Slice", ["mask", "s0", "s1", "sa"], ["causal"], name="causal"),
        n("Add", ["scores", "causal"], ["masked"], name="masked"),
        n("Softmax", ["masked"], ["p"], name="p", axis=-1),
        n("MatMul", ["p", "v"], ["att"], name="att"),
        n("MatMul", ["att", "wo"], ["o"], name="o"),
        n("Add", ["x", "o"], ["r"], name="r"),
        n("LayerNormalization", ["r", "g2", "b2"], ["ln2"], name="ln2", axis=-1),
        n("MatMul", ["ln2", "w1"], ["h"], name="fc1"),
        n("Relu", ["h"], ["hr"], name="relu"),
        n("MatMul", ["hr", "w2"], ["f"], name="fc2"),
        n("Add", ["r", "f"], ["r2"], name="r2"),
        n("LayerNormalization", ["r2", "g3", "b3"], ["ln3"], name="ln3", axis=-1),
        n("Reshape", ["ln3", "flat"], ["rows"], name="rows"),
        n("Gemm", ["rows", "head", "hb"], ["y"], name="head", transB=1),
    ]
    y_shape = [T, 5]
    if lm_head:
        inits["head"] = inits["head"].T
        nodes[-2:] = [n("MatMul", ["ln3", "head"], ["y"], name="head")]
        y_shape = [1, T, 5]
    ints = {"s0": [0, 0], "s1": [T, T], "sa": [0, 1], "flat": [T, D]}
    if lm_head:
        del ints["flat"], inits["hb"]
    graph = helper.make_graph(
        nodes,
        "tiny_transformer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()]
        + [numpy_helper.from_array(np.asarray(v, np.int64), k) for k, v in ints.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def padding_mask_attention(tokens: int = 6, width: int = 4) -> onnx.ModelProto:
    """Self-attention with a padding mask made from the data, as Hugging Face's BERT exports it:
    ``where(attention_mask == 0, -inf, 0)`` added to the scores, then a softmax; ``big`` then
    takes the softmax's input past float32 (``overflowed``): a real overflow after a mask."""
    n = helper.make_node
    nodes = [
        n("Equal", ["attention_mask", "zero"], ["padded"], name="padded"),
        n("Where", ["padded", "minus_inf", "nought"], ["mask"], name="mask"),
        n("Unsqueeze", ["mask", "axis1"], ["mask3"], name="mask3"),
        n("Transpose", ["x"], ["xt"], name="xt", perm=[0, 2, 1]),
        n("MatMul", ["x", "xt"], ["scores"], name="scores"),
        n("Add", ["scores", "mask3"], ["masked"], name="masked"),
        n("Softmax", ["masked"], ["p"], name="p", axis=-1),
        n("MatMul", ["p", "x"], ["y"], name="y"),
        n("Mul", ["masked", "big"], ["large"], name="large"),
        n("Mul", ["large", "big"], ["overflowed"], name="overflowed"),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(-np.inf, np.float32), "minus_inf"),
        numpy_helper.from_array(np.array(0.0, np.float32), "nought"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array(1e38, np.float32), "big"),
    ]
    graph = helper.make_graph(
        nodes,
        "padding_mask_attention",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, width]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, tokens]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, tokens, width]),
            helper.make_tensor_value_info("overflowed", TensorProto.FLOAT, [1, tokens, tokens]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def embedding(vocabulary: int = 10, width: int = 3, tokens: int = 4, shift: int = 0):
    """Token ids ``ids`` (int64 ``[1, tokens]``) gathered from a table of ``vocabulary`` rows,
    then a ReLU; ``shift`` is added to the ids first (an index computed inside the model)."""
    n = helper.make_node
    nodes = [
        n("Add", ["ids", "shift"], ["shifted"], name="shifted"),
        n("Gather", ["table", "shifted" if shift else "ids"], ["rows"], name="rows", axis=0),
        n("Relu", ["rows"], ["y"], name="y"),
    ]
    if not shift:
        del nodes[0]
    table = np.random.default_rng(0).normal(size=(vocabulary, width)).astype(np.float32)
    inits = [numpy_helper.from_array(table, "table")]
    if shift:
        inits.append(numpy_helper.from_array(np.array(shift, np.int64), "shift"))
    graph = helper.make_graph(
        nodes,
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, tokens])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, tokens, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
