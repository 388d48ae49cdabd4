"""What the converters share: TVM's own converter of an op, constant inputs, static shapes."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.relax.frontend.onnx import onnx_frontend


def stock(op_type: str, opset: int):
    """TVM's converter of ``op_type`` at ``opset``."""
    return onnx_frontend._get_convert_map()[op_type].get_converter(opset)


def constant_input(inputs, k: int) -> np.ndarray | None:
    """The value of input ``k`` when it is given and constant."""
    expr = inputs[k] if len(inputs) > k else None
    if isinstance(expr, tvm.ir.GenericConst):
        return expr.value.numpy()
    return None


def static_dims(expr) -> list[int] | None:
    """The dims of a tensor expression, when all are known."""
    values = getattr(expr.ty.shape, "values", None)
    if values is None or not all(isinstance(d, tvm.tirx.IntImm) for d in values):
        return None
    return [int(d) for d in values]
