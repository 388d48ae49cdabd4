"""Shared fixtures: the read-only model zoo next to the repository and small ONNX builders."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

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


T = TypeVar("T")


def poll_until(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    interval: float = 0.1,
    what: str | Callable[[], object] = "the condition",
) -> T:
    """Calls ``predicate`` every ``interval`` seconds until it returns a true value, and returns
    that value. After ``timeout`` seconds the test fails, naming ``what`` (a callable: called
    then, to show the latest state): a bound on a hang, not a speed."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g} s: {what() if callable(what) else what}")
        time.sleep(interval)
    return value


def zoo_model(name: str) -> Path:
    path = MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"shared model zoo not available ({path})")
    return path


# Seconds a file takes (Zen 3, one core each, rounded), for those over half a minute. Under
# pytest-xdist (`--dist loadfile`, no reordering by test count) the files are handed out in
# this order, longest first, so that the two workers finish together instead of one waiting on
# a long file handed out last. Only the order depends on it: a stale number costs balance.
SLOW_FILES = {
    "test_api_faults.py": 460,
    "test_pypi_zoo.py": 280,
    "test_calibration.py": 230,
    "test_dashboard.py": 150,
    "test_api_builds.py": 150,
    "test_fuzz.py": 145,
    "test_profile.py": 130,
    "test_ray.py": 120,
    "test_export_qdq.py": 100,
    "test_converters.py": 75,
    "test_fold_scale_axis.py": 70,
    "test_schedules_audio.py": 60,
    "test_python_api.py": 60,
    "test_int16_fallback.py": 55,
    "test_bias_correction.py": 50,
    "test_zoo.py": 50,
    "test_batch_matmul.py": 45,
    "test_api_restart.py": 45,
    "test_byoc.py": 40,
    "test_export_model_explorer.py": 40,
    "test_channel_stats.py": 35,
    "test_npu.py": 35,
    "test_aarch64.py": 35,
    "test_api.py": 35,
    "test_api_pressure.py": 35,
    "test_package.py": 30,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """A test marked ``backend(NAME)`` runs on that database backend alone: of the
    parametrizations of its service fixture (``params=BACKENDS``), the others are deselected.
    (Deselected rather than parametrized anew, so that the module's service on each backend is
    still set up once and its tests keep their order.) Under pytest-xdist, the files are
    ordered by :data:`SLOW_FILES` (a stable sort: the tests of a file keep their order)."""
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
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))


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
