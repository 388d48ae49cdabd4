"""Shared fixtures: the read-only model zoo next to the repository and small ONNX builders."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODELS = SHARED / "models"

# Shapes the shared models need (ppocr_cls has symbolic H and W, digits_cnn a symbolic batch).
ZOO_SHAPES = {
    "resnet18": {},
    "mobilenet_v2": {},
    "tiny_bert": {},
    "digits_cnn": {},
    "ppocr_cls": {"x": (1, 3, 48, 192)},
}


def zoo_model(name: str) -> Path:
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"shared model zoo not available ({path})")
    return path
