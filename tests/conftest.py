"""Shared fixtures: the read-only model zoo next to the repository and small ONNX builders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Under pytest-xdist (addopts: two workers) each worker takes its share of the cores for TVM's
# thread pool, whose threads spin while they wait: two pools of every core each would fight.
# Set before our package is imported (it defaults the count to every core); the workers inherit
# the controller's environment, which that default has already been written to.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["TVM_NUM_THREADS"] = str(max(1, _share))

# Our package first: it sets TVM's thread count before TVM starts its pool.
import rangeprof  # noqa: F401

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODELS = SHARED / "models"
# The service's database backends (tests/service_fixtures.py parametrizes over them).
BACKENDS = ("sqlite", "postgresql")

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


def pytest_collection_modifyitems(config, items):
    """A test marked ``backend(NAME)`` runs on that database backend alone: of the
    parametrizations of its service fixture (``params=BACKENDS``), the others are deselected.
    (Deselected rather than parametrized anew, so that the module's service on each backend is
    still set up once and its tests keep their order.)"""
    keep, deselected = [], []
    for item in items:
        marker = item.get_closest_marker("backend")
        if marker is None:
            keep.append(item)
            continue
        (backend,) = marker.args
        callspec = getattr(item, "callspec", None)
        on = [p for p in (callspec.params.values() if callspec else ()) if p in BACKENDS]
        assert backend in BACKENDS and len(on) == 1, f"{item.nodeid}: no backend parameter"
        (keep if on[0] == backend else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep


@pytest.fixture(autouse=True, scope="session")
def _isolated_build_cache(tmp_path_factory):
    """Each test session starts with an empty build cache (subprocesses inherit it). Under
    pytest-xdist the workers share one, in the run's temporary folder (entries are written to
    a partial file and renamed, so concurrent writers are safe): a program one worker compiled
    is not compiled again by the other."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        os.environ["RANGEPROF_CACHE"] = str(tmp_path_factory.mktemp("build-cache"))
        return
    shared = tmp_path_factory.getbasetemp().parent / "build-cache"
    shared.mkdir(exist_ok=True)
    os.environ["RANGEPROF_CACHE"] = str(shared)


@pytest.fixture(scope="session")
def digits_profile():
    """The trained digits CNN profiled on 64 calibration images (read-only: tests copy it)."""
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    model = zoo_model("digits_cnn")
    return profile_model(
        model, f"{SHARED}/data/digits.npz:calib", options=ProfileOptions(samples=64)
    )


TEXTLINES = SHARED / "data" / "textlines.npz"


@pytest.fixture(scope="session")
def ppocr_profile():
    """ppocr_cls on 32 text lines: batch norms without ReLU, hard-swish, SE-block tensors that do
    not reach 0, and first ReLUs with spiky histograms (flat regions of the images). Read-only."""
    from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

    return profile_model(
        zoo_model("ppocr_cls"),
        f"{TEXTLINES}:calib",
        input_shapes=ZOO_SHAPES["ppocr_cls"],
        options=ProfileOptions(samples=32),
    )


@pytest.fixture(scope="session")
def ppocr_x86(ppocr_profile):
    """ppocr_cls imported and partitioned once for the x86 target (each calibration replans it,
    as ``evaluate --method all`` does) and :func:`~rangeprof.byoc.evaluate.evaluate`'s program
    cache, shared by the accuracy tests: the FP32 program is compiled once."""
    from rangeprof.byoc.plugin import get_plugin
    from rangeprof.byoc.quantized import qparams_from_profile, quantize_model

    x86 = get_plugin("x86")
    qparams = qparams_from_profile(ppocr_profile, x86, "max", 99.99)
    qm = quantize_model(zoo_model("ppocr_cls"), qparams, x86, ZOO_SHAPES["ppocr_cls"])
    return qm, {}
