"""Shared fixtures: the read-only model zoo next to the repository and small ONNX builders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Our package first: it sets TVM's thread count before TVM starts its pool.
import rangeprof  # noqa: F401

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


@pytest.fixture(autouse=True, scope="session")
def _isolated_build_cache(tmp_path_factory):
    """Each test session starts with an empty build cache (subprocesses inherit it)."""
    os.environ["RANGEPROF_CACHE"] = str(tmp_path_factory.mktemp("build-cache"))


@pytest.fixture(scope="session")
def digits_profile():
    """The trained digits CNN profiled on 64 calibration images (read-only: tests copy it)."""
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    model = zoo_model("digits_cnn")
    return profile_model(
        model, f"{SHARED}/data/digits.npz:calib", options=ProfileOptions(samples=64)
    )
