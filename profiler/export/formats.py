"""Quantization parameters in other tools' file formats, keyed by ONNX tensor names.

Only entries with a ``source_tensor`` are exported: the others are Relax-internal sub-bindings
that no ONNX tool can name.

* ``aimet``: AIMET encodings, version 2.0.0 (``{"version": "2.0.0", "encodings": [...]}``; each
  encoding ``name``, ``output_dtype``, ``y_scale``, ``y_zero_point`` and, per channel, ``axis`` —
  the fields of ``onnx::QuantizeLinear``). Inputs, activations and weights. ``y_zero_point`` is
  always written although AIMET's own exporter leaves out all-zero ones (its spec makes the field
  optional, defaulting to zero).
* ``ort``: ONNX Runtime's ``calibration.cache`` text (``write_calibration_table``): a
  ``name value`` line per tensor, sorted by name, ``value`` the symmetric threshold
  ``max(|lo|, |hi|)`` printed as ORT prints a float32. The line holds one number, which
  TensorRT's execution provider reads as the dynamic range ``[-value, value]``: no asymmetric
  range fits in it. ORT writes ``max(highest, lowest)``, the same number for the symmetric ranges
  its TensorRT path produces and for a one-sided tensor (``lo = 0``, a ReLU output: the upper end
  of its asymmetric range, as written here); for a range with a larger negative side it would
  drop that side, so we write the threshold that covers both. ``ort-json`` holds the asymmetric
  ranges.
* ``ort-json``: ONNX Runtime's ``TensorsData`` JSON, as ``save_tensors_data`` writes it and
  ``quantize_static(calibration_cache_path=...)`` / ``load_tensors_data`` read it: per tensor
  ``lowest`` and ``highest`` = the range the grid represents, so ORT re-derives our scale and
  zero point when its settings match ours (``activation_type``; ``ActivationSymmetric`` for
  ``sym``) — except for uint8 symmetric, where ORT's grid differs (see
  :mod:`rangeprof.profiler.calibrate.methods`). With ``scheme="asym"`` a one-sided tensor (min ≥ 0,
  a ReLU output) keeps its asymmetric range ``[0, (qmax − z) s]``, all the levels on the values it
  takes, not the symmetric ``[-t, t]`` that would spend half of them below 0.
  ``calibration_method`` is always ``MinMax``: the ranges are final, and ``MinMax`` is
  ``quantize_static``'s default, which the cache must match.
* ``tensorrt``: a TensorRT calibration cache: header ``TRT-8601-EntropyCalibration2`` (TensorRT
  8.6.1) then ``name: <hex>`` per tensor, the hex the big-endian float32 bits of the int8 scale
  ``threshold / 127``. TensorRT quantizes symmetrically to int8, so this needs ``scheme="sym"``
  and ``dtype="int8"``.

ORT and TensorRT calibrate activations only (they quantize weights from the weights
themselves), so their formats hold inputs and activations, each with one per-tensor range.

Two formats are written from the profiled ONNX model as well (:data:`MODEL_FORMATS`): ``qdq``, the
model with QuantizeLinear / DequantizeLinear pairs (:mod:`.qdq_model`), and ``model-explorer``,
node-data overlays for Google Model Explorer (:mod:`.model_explorer`), which alone reads an
evaluation report.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from rangeprof.profiler.calibrate.methods import CalibrationOptions, QParams, qparams_for
from rangeprof.profiler.errors import RangeprofError

AIMET_VERSION = "2.0.0"
TENSORRT_HEADER = "TRT-8601-EntropyCalibration2"
QDQ, MODEL_EXPLORER = "qdq", "model-explorer"
MODEL_FORMATS = (QDQ, MODEL_EXPLORER)


def export(profile: dict, fmt: str, options: CalibrationOptions) -> str:
    """The file content of ``profile``'s quantization parameters in format ``fmt``."""
    writer = _WRITERS.get(fmt)
    if writer is None:
        check_inputs(fmt, None, None)
        choices = ", ".join((*FORMATS, *MODEL_FORMATS))
        raise RangeprofError(f"unknown export format {fmt!r}; expected one of {choices}")
    if fmt == "tensorrt" and (options.scheme, options.dtype) != ("sym", "int8"):
        raise RangeprofError(
            "TensorRT calibration caches hold symmetric int8 scales: use scheme 'sym' and dtype "
            f"'int8' (got {options.scheme!r}, {options.dtype!r})"
        )
    if fmt != "aimet":  # calibration tables hold one range per tensor
        options = replace(options, granularity="per-tensor")
    params = [qparams_for(e, options) for e in profile["tensors"] if e["source_tensor"]]
    return writer(params)


def check_inputs(fmt: str, model: object | None, evaluation: object | None) -> None:
    """What ``fmt`` reads besides the profile: ``qdq`` and ``model-explorer`` the profiled ONNX
    model; only ``model-explorer`` an evaluation report."""
    if fmt in MODEL_FORMATS and model is None:
        raise RangeprofError(f"the {fmt} export needs the profiled ONNX model (--model)")
    if evaluation is not None and fmt != MODEL_EXPLORER:
        raise RangeprofError(f"an evaluation report (--evaluation) goes with {MODEL_EXPLORER}")


def _aimet(params: list[QParams]) -> str:
    encodings = []
    for p in params:
        encoding = {
            "name": p.source_tensor,
            "output_dtype": p.dtype,
            "y_scale": list(p.scale) if p.axis is not None else p.scale,
            "y_zero_point": list(p.zero_point) if p.axis is not None else p.zero_point,
        }
        if p.axis is not None:
            encoding["axis"] = p.axis
        encodings.append(encoding)
    return json.dumps({"version": AIMET_VERSION, "encodings": encodings}, indent=2) + "\n"


def _activations(params: list[QParams]) -> list[QParams]:
    return [p for p in params if p.kind != "weight"]


def _float32_text(value: float) -> str:
    # What ORT prints: str() of a float32 widened to a Python float.
    return str(float(np.float32(value)))


def _ort_lines(params: list[QParams]) -> str:
    ordered = sorted(_activations(params), key=lambda p: p.source_tensor)
    return "".join(f"{p.source_tensor} {_float32_text(p.threshold)}\n" for p in ordered)


def _ort_json(params: list[QParams]) -> str:
    def array(value: float) -> dict:
        # The CalibrationCacheEncoder form of a 0-d float32 numpy array.
        return {"data": float(np.float32(value)), "dtype": "float32", "CLS": "numpy.array"}

    data = {
        p.source_tensor: {
            "lowest": array(p.range[0]),
            "highest": array(p.range[1]),
            "CLS": "TensorData",
        }
        for p in _activations(params)
    }
    doc = {
        "CLS": "TensorsData",
        "data": data,
        "calibration_method": {"CLS": "CalibrationMethod", "value": "CalibrationMethod.MinMax"},
        "smooth_quant": False,
    }
    return json.dumps(doc) + "\n"


def _tensorrt(params: list[QParams]) -> str:
    lines = [TENSORRT_HEADER]
    for p in _activations(params):
        lines.append(f"{p.source_tensor}: {struct.pack('>f', p.scale).hex()}")
    return "\n".join(lines) + "\n"


_WRITERS: dict[str, Callable[[list[QParams]], str]] = {
    "aimet": _aimet,
    "ort": _ort_lines,
    "ort-json": _ort_json,
    "tensorrt": _tensorrt,
}
FORMATS = tuple(_WRITERS)
