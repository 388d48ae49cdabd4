"""Normalization and regularization layers where TVM's converters miss ONNX's semantics.

BatchNormalization with ONNX's momentum in training mode.

ONNX updates running statistics as ``running * momentum + batch * (1 - momentum)``; Relax's
``batch_norm`` (PyTorch's convention) as ``running * (1 - momentum) + batch * momentum``. TVM's
converter passes ONNX's momentum through unchanged, so the running mean and variance a
``training_mode=1`` node returns came out wrong; here the momentum is converted.
"""

import tvm
from tvm.relax.frontend.onnx import onnx_frontend

from profiler.errors import ConversionError

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
