"""Activations in the input's float type: TVM's converters of these build float32 constants, which
Relax refuses to combine with a float16 or float64 input; and Swish, which TVM lacks (its ONNX
function body is written for opset 24, so models of later opsets cannot import it as one)."""

from tvm import relax
from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter


def _elu(x, alpha: float):
    """``x`` where positive, ``alpha·(eˣ − 1)`` elsewhere, written as TVM's converter writes it."""
    dtype = str(x.ty.dtype)
    exp_part = relax.op.nn.relu(relax.op.subtract(relax.const(1.0, dtype), relax.op.exp(x)))
    negative = relax.op.multiply(relax.const(-alpha, dtype), exp_part)
    return relax.op.add(negative, relax.op.nn.relu(x))


class Elu(OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        return _elu(inputs[0], float(attr.get("alpha", 1.0)))


class Selu(OnnxOpConverter):
    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        alpha = float(attr.get("alpha", 1.67326319217681884765625))
        gamma = float(attr.get("gamma", 1.05070102214813232421875))
        return relax.op.multiply(relax.const(gamma, str(x.ty.dtype)), _elu(x, alpha))


class ThresholdedRelu(OnnxOpConverter):
    """``x`` where above ``alpha``, 0 elsewhere."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        dtype = str(x.ty.dtype)
        above = relax.op.greater(x, relax.const(float(attr.get("alpha", 1.0)), dtype))
        return relax.op.multiply(relax.op.astype(above, dtype), x)


class Swish(OnnxOpConverter):
    """``x · sigmoid(alpha · x)``."""

    @classmethod
    def _impl_v24(cls, bb, inputs, attr, params):
        x = inputs[0]
        alpha = relax.const(float(attr.get("alpha", 1.0)), str(x.ty.dtype))
        return relax.op.multiply(x, relax.op.sigmoid(relax.op.multiply(alpha, x)))
