"""The ONNX Runtime side of the benchmarks: a model made ready for ``quantize_static`` the way
ORT recommends, as :mod:`accuracy` and :mod:`int8_vs_fp32` both compare against it."""

from __future__ import annotations

import contextlib
from pathlib import Path

import onnx
from onnx import version_converter
from onnxruntime import quantization as ortq


def prepared_for_quantization(model: Path, folder: Path) -> Path:
    """``model`` at opset 13 or later (per-channel DequantizeLinear needs it; ppocr_cls and
    PP-OCRv4 rec are 11) after ``quant_pre_process``, written in ``folder``. Where ORT's
    symbolic shape inference fails (ppocr_cls's Concat, magika's LayerNorm, tiny BERT, PP-OCRv4
    rec), without it, as ORT allows."""
    source, prepared = folder / "opset13.onnx", folder / "prepared.onnx"
    proto = onnx.load(model)
    if next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) < 13:
        proto = version_converter.convert_version(proto, 13)
    onnx.save(proto, source)
    # A failed symbolic inference saves its partial model in the working directory: keep that
    # in the folder, not wherever the benchmark was started.
    with contextlib.chdir(folder):
        try:
            ortq.quant_pre_process(str(source), str(prepared))
        except Exception:
            ortq.quant_pre_process(str(source), str(prepared), skip_symbolic_shape=True)
    return prepared
