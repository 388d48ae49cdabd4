"""Converters of our own for ONNX operators that TVM's Relax frontend lacks or gets wrong.

Each converter is an ``OnnxOpConverter`` subclass (TVM's own convention: ``_impl_v<opset>``
classmethods taking ``(bb, inputs, attr, params)`` and returning a Relax expression), listed here
by ONNX op type. The importer consults this registry before TVM's map, so an entry here also
overrides a stock converter.
"""

from tvm.relax.frontend.onnx.onnx_frontend import OnnxOpConverter

from rangeprof.profiler.ir.converters.activations import Elu, Selu, Swish, ThresholdedRelu
from rangeprof.profiler.ir.converters.arithmetic import CumProd, Max, Mean, Min, Pow, Sum
from rangeprof.profiler.ir.converters.checked import ReduceMax, ReduceMin, Resize, Split, TopK
from rangeprof.profiler.ir.converters.normalization import (
    BatchNormalization,
    Dropout,
    LayerNormalization,
    LpNormalization,
    PRelu,
    RMSNormalization,
)
from rangeprof.profiler.ir.converters.pooling import MaxPool, MaxUnpool
from rangeprof.profiler.ir.converters.quantization import DequantizeLinear, QuantizeLinear
from rangeprof.profiler.ir.converters.recurrent import GRU, LSTM, RNN
from rangeprof.profiler.ir.converters.tensors import (
    EyeLike,
    Gather,
    GatherElements,
    GatherND,
    OneHot,
    OptionalHasElement,
    Reshape,
    ReverseSequence,
    SequenceInsert,
    SequenceLength,
    Slice,
    Trilu,
    Upsample,
)

CONVERTERS: dict[str, type[OnnxOpConverter]] = {
    "BatchNormalization": BatchNormalization,
    "CumProd": CumProd,
    "DequantizeLinear": DequantizeLinear,
    "Dropout": Dropout,
    "Elu": Elu,
    "EyeLike": EyeLike,
    "Gather": Gather,
    "GatherElements": GatherElements,
    "GatherND": GatherND,
    "GRU": GRU,
    "LayerNormalization": LayerNormalization,
    "LpNormalization": LpNormalization,
    "LSTM": LSTM,
    "Max": Max,
    "MaxPool": MaxPool,
    "MaxUnpool": MaxUnpool,
    "Mean": Mean,
    "Min": Min,
    "OneHot": OneHot,
    "OptionalHasElement": OptionalHasElement,
    "Pow": Pow,
    "PRelu": PRelu,
    "QuantizeLinear": QuantizeLinear,
    "ReduceMax": ReduceMax,
    "ReduceMin": ReduceMin,
    "Reshape": Reshape,
    "Resize": Resize,
    "ReverseSequence": ReverseSequence,
    "RMSNormalization": RMSNormalization,
    "RNN": RNN,
    "Selu": Selu,
    "SequenceInsert": SequenceInsert,
    "SequenceLength": SequenceLength,
    "Slice": Slice,
    "Split": Split,
    "Sum": Sum,
    "Swish": Swish,
    "ThresholdedRelu": ThresholdedRelu,
    "TopK": TopK,
    "Trilu": Trilu,
    "Upsample": Upsample,
}


def converts(node) -> bool:
    """Whether the importer converts ``node`` itself: by a converter of ours or of TVM, except for
    operators TVM converts only in part (:data:`rangeprof.profiler.ir.expand.PARTIAL`), which are
    better imported as their ONNX function bodies."""
    from tvm.relax.frontend.onnx import onnx_frontend

    from rangeprof.profiler.ir.expand import PARTIAL

    if node.op_type in PARTIAL:
        return False
    return node.op_type in CONVERTERS or node.op_type in onnx_frontend._get_convert_map()
