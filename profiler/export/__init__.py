"""A profile's ranges in other tools' formats (AIMET, ONNX Runtime, TensorRT)."""
