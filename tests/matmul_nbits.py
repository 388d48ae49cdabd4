"""One-node onnxruntime models of a dense layer on given weights, the reference of the 4-bit
kernels' tests and benchmark: ``com.microsoft.MatMulNBits`` on 4-bit codes in its own layout,
and a plain FP32 ``MatMul``."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _model(node, inits: list, x_shape, n: int, microsoft: bool) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [*x_shape[:-1], n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 17)]
    if microsoft:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    return helper.make_model(graph, opset_imports=opsets)


def _nbits_inputs(q, scales, zeros, group: int) -> list:
    """``MatMulNBits``' B ``[N, blocks, group/2]`` (two codes a byte, the lower row in the low
    nibble), scales ``[N·blocks]`` and zero points (two a byte per column, low nibble first)."""
    k, n = q.shape
    blocks = -(-k // group)
    codes = np.pad(q, ((0, blocks * group - k), (0, 0))).T.reshape(n, blocks, group)
    inputs = [
        numpy_helper.from_array(codes[..., 0::2] | (codes[..., 1::2] << 4), "B"),
        numpy_helper.from_array(np.ascontiguousarray(scales.T).reshape(-1), "scales"),
    ]
    if zeros is not None:
        z = np.pad(zeros.T, ((0, 0), (0, blocks % 2)), constant_values=8)
        packed = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
        inputs.append(numpy_helper.from_array(packed, "zero_points"))
    return inputs


def matmul_nbits(q, scales, zeros, group: int, x_shape, accuracy_level: int = 0):
    """``x @ W`` with ``W[k, n] = s[k // g, n] · (q[k, n] − z[k // g, n])`` (``z`` 8 when
    ``zeros`` is None) as ``MatMulNBits``; ``accuracy_level`` 4 quantizes ``x`` to int8."""
    k, n = q.shape
    inits = _nbits_inputs(q, scales, zeros, group)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": group, "accuracy_level": accuracy_level}
    inputs = ["x", *(t.name for t in inits)]
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", **attrs)
    return _model(node, inits, x_shape, n, True)


def matmul(w: np.ndarray, x_shape) -> onnx.ModelProto:
    """``x @ w`` as an FP32 ``MatMul``."""
    node = helper.make_node("MatMul", ["x", "W"], ["y"])
    return _model(node, [numpy_helper.from_array(w, "W")], x_shape, w.shape[1], False)
