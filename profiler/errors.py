"""User-facing errors.

Every problem caused by the user's input (a bad file, an unsupported model, a wrong shape) is a
:class:`RangeprofError`; the CLI prints its message on one line and exits with code 2, the API
turns it into a 4xx response. Anything else is a bug in rangeprof.
"""


class RangeprofError(Exception):
    """A problem with the user's input, explained in one line."""


class InvalidModelError(RangeprofError):
    """The model file is missing, not ONNX, truncated or otherwise unusable."""


class UnsupportedOperatorError(RangeprofError):
    """The model uses operators that no converter handles; lists all of them."""

    def __init__(self, op_types: list[str]):
        self.op_types = sorted(set(op_types))
        super().__init__("unsupported ONNX operators: " + ", ".join(self.op_types))


class UnsafeExternalDataError(RangeprofError):
    """An external-data reference points outside the model's folder."""


class InputShapeError(RangeprofError):
    """An input shape given by the user is malformed or does not fit the model."""


class UnsupportedTypeError(RangeprofError):
    """The model holds or computes tensors of an element type rangeprof cannot compute with."""


class DynamicShapeError(RangeprofError):
    """A tensor's shape depends on the input data, not only on the input shapes."""


class ConversionError(RangeprofError):
    """An ONNX node uses a feature (attribute, input form) its converter does not handle."""


class ConverterFailure(ConversionError):
    """TVM's converter of an ONNX node failed in a way no check of ours foresaw; the message
    quotes TVM's first line."""


class ValueInputError(RangeprofError):
    """A node needs the value of a model input (a shape or a setting such as axes) to be
    imported, and no value was given for it."""


class CalibrationDataError(RangeprofError):
    """Calibration data is missing, unreadable or does not fit the model's inputs."""
