"""Normalization and regularization layers where TVM's converters miss ONNX's semantics.

BatchNormalization with ONNX's momentum in training mode; Dropout in training mode refused;
PRelu's channel slopes of opsets before 7; RMSNormalization over several axes; LayerNormalization's
Mean and InvStdDev outputs; LpNormalization, which TVM lacks.

ONNX updates running statistics as ``running * momentum + batch * (1 - momentum)``; Relax's
``batch_norm`` (PyTorch's convention) as ``running * (1 - momentum) + batch * momentum``. TVM's
converter passes ONNX's momentum through unchanged, so the running mean and variance a
``training_mode=1`` node returns came out wrong; here the momentum is converted.
"""

import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend

from rangeprof.profiler.errors import ConversionError

_ONNX_DEFAULT_MOMENTUM = 0.9


class BatchNormalization(onnx_frontend.BatchNormalization):
    @classmethod
    def _impl_v15(cls, bb, inputs, attr, params):
        if attr.get("training_mode", 0):
            attr = {**attr, "momentum": 1.0 - attr.get("momentum", _ONNX_DEFAULT_MOMENTUM)}
        return super()._impl_v15(bb, inputs, attr, params)


class Dropout(onnx_frontend.Dropout):
    """Dropout is the identity at inference; a ``training_mode`` input that is not the constant
    False makes it random, which no profile of ranges can stand for."""

    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        if len(inputs) >= 3 and inputs[2] is not None:
            training = onnx_frontend.get_constant(inputs[2], params)
            if not isinstance(training, tvm.ir.GenericConst) or bool(training.value.numpy()):
                raise ConversionError(
                    "Dropout in training mode is random; export the model for inference"
                )
        return super()._impl_v12(bb, inputs, attr, params)


class PRelu(onnx_frontend.PRelu):
    """Before opset 7 a 1-D slope holds one value per channel (axis 1), as PyTorch exported it;
    from opset 7 it broadcasts like numpy (TVM's converter reads every opset that way)."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x, slope = inputs[0], inputs[1]
        dims, slope_dims = x.ty.shape.values, slope.ty.shape.values
        if len(slope_dims) == 1 and len(dims) > 1 and int(slope_dims[0]) == int(dims[1]) > 1:
            return relax.op.nn.prelu(x, slope, 1)
        return super()._impl_v1(bb, inputs, attr, params)

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return super()._impl_v1(bb, inputs, attr, params)


class RMSNormalization(onnx_frontend.RMSNormalization):
    """``x / sqrt(mean(x², axes) + ε) · scale`` in primitives: TVM's ``rms_norm`` legalization
    fails when the scale has more than one axis (normalizing from axis 0, say)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        data, scale = inputs[0], inputs[1]
        rank = data.ty.ndim
        axes = list(range(attr.get("axis", -1) % rank, rank))
        dtype = str(data.ty.dtype)
        stash = "float32" if attr.get("stash_type", 1) == 1 else dtype
        x = data if dtype == stash else relax.op.astype(data, stash)
        mean_square = relax.op.mean(relax.op.multiply(x, x), axes, keepdims=True)
        epsilon = relax.const(attr.get("epsilon", 1e-5), stash)
        normalized = relax.op.divide(x, relax.op.sqrt(relax.op.add(mean_square, epsilon)))
        if dtype != stash:
            normalized = relax.op.astype(normalized, dtype)
        return relax.op.multiply(normalized, scale)


class LayerNormalization(onnx_frontend.LayerNormalization):
    """``Mean`` and ``InvStdDev``, when the node has them, as ONNX defines them (over the
    normalized axes, in the stash type, keeping the reduced axes); TVM's converter returns
    zero placeholders for both. ``Y`` stays TVM's ``layer_norm``."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        converted = super()._impl_v17(bb, inputs, attr, params)
        if attr["tvm_custom"]["num_outputs"] == 1:
            return converted
        data = inputs[0]
        rank = data.ty.ndim
        axes = list(range(attr.get("axis", -1) % rank, rank))
        dtype = str(data.ty.dtype)
        stash = "float32" if attr.get("stash_type", 1) == 1 else dtype
        x = data if dtype == stash else relax.op.astype(data, stash)
        mean = relax.op.mean(x, axes, keepdims=True)
        centered = relax.op.subtract(x, mean)
        variance = relax.op.mean(relax.op.multiply(centered, centered), axes, keepdims=True)
        epsilon = relax.const(attr.get("epsilon", 1e-5), stash)
        inv_std_dev = relax.op.rsqrt(relax.op.add(variance, epsilon))
        return relax.Tuple([converted.fields[0], mean, inv_std_dev])


class LpNormalization(onnx_frontend.OnnxOpConverter):
    """``x / (Σ|x|^p)^(1/p)`` along ``axis`` (p = 1 or 2), as ONNX's reference computes it."""

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        x = inputs[0]
        axis, p = attr.get("axis", -1), attr.get("p", 2)
        if p not in (1, 2):
            raise ConversionError(f"p={p}: LpNormalization is defined for p 1 and 2")
        magnitude = relax.op.abs(x) if p == 1 else relax.op.multiply(x, x)
        norm = relax.op.sum(magnitude, axis=[axis], keepdims=True)
        return relax.op.divide(x, norm if p == 1 else relax.op.sqrt(norm))
