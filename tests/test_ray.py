"""Profiling on Ray (rangeprof.profiler.profiling.distributed): shards merged into the
single-process profile byte for byte, a worker killed mid-shard, workers lost for good, the CLI's
--ray, the service's RANGEPROF_RAY setting, and rangeprof without Ray installed.

One local cluster (2 CPUs) serves the module; the CLI test starts its own with ``--ray local``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.distributed import plan_shards, profile_distributed
from rangeprof.profiler.profiling.document import tensors_bytes, validate
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model
from rangeprof.service.jobs import ray_setting
from rangeprof.service.limits import Limits

from conftest import SHARED, poll_until, zoo_model
from service_fixtures import live_service, start_run, upload_model, wait_for_run, write_calib

DIGITS = SHARED / "data" / "digits.npz"
CALIB = f"{DIGITS}:calib"
# 196 of the 200 samples in batches of 8: 24 full batches and a last one of 4. Shard boundaries
# must fall on multiples of 8 (a split by samples alone would change the batches' float64 sums).
OPTIONS = ProfileOptions(batch_size=8, samples=196)
CLI_OPTIONS = ("--batch-size", "8", "--samples", "196")
# Ray titles a worker process after the actor method it is running.
PROFILING_TITLE = b"ray::ShardProfiler.profile"


@pytest.fixture(scope="module")
def cluster() -> str:
    """A local Ray cluster with 2 CPUs, connected to this process; its address."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def single() -> dict:
    """The single-process profile of digits_cnn on its calibration samples."""
    return profile_model(zoo_model("digits_cnn"), CALIB, options=OPTIONS)


def _profile(**how) -> dict:
    return profile_distributed(zoo_model("digits_cnn"), CALIB, options=OPTIONS, **how)


def _same_profile(doc: dict, reference: dict) -> None:
    validate(doc)
    assert tensors_bytes(doc) == tensors_bytes(reference)
    assert doc["run"]["samples"] == reference["run"]["samples"]
    assert doc["run"]["batches"] == reference["run"]["batches"]
    assert (doc["model"], doc["lineage"]) == (reference["model"], reference["lineage"])


def test_shards_split_on_batch_boundaries():
    plan = plan_shards(num_samples=50, batch_size=8, shards=3)  # 7 batches, the last of 2
    assert [(s.start, s.stop, s.batches) for s in plan] == [(0, 16, 2), (16, 32, 2), (32, 50, 3)]
    assert len(plan_shards(num_samples=3, batch_size=1, shards=5)) == 3  # a shard per batch


@pytest.mark.zoo
@pytest.mark.parametrize("shards", [1, 2, 5])
def test_shards_merge_into_the_single_process_profile(cluster, single, shards):
    doc = _profile(workers=2, shards=shards)
    _same_profile(doc, single)
    assert (doc["run"]["samples"], doc["run"]["batches"]) == (196, 25)
    assert doc["run"]["distributed"] == {
        "engine": "ray",
        "workers": min(2, shards),
        "shards": shards,
        "shards_on_restarted_workers": 0,
    }


def _profiling_workers() -> set[int]:
    """PIDs of the Ray workers profiling a shard right now."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(PROFILING_TITLE):
                found.add(int(cmdline.parent.name))
        except OSError:  # the process has gone meanwhile
            continue
    return found


def _kill_workers(run, times: int) -> tuple[object, list[int]]:
    """Runs ``run()`` in a thread and SIGKILLs a worker each time one has started a shard,
    ``times`` times; returns the future and the killed PIDs."""
    killed: list[int] = []
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run)

        def killed_enough() -> bool:
            for pid in sorted(_profiling_workers() - set(killed))[: times - len(killed)]:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return len(killed) >= times or future.done()

        # A bound on a hang, not a speed: the suite runs two test files at once (pytest-xdist),
        # and a restarted Ray worker may wait more than a minute for a core on 2 vCPUs.
        poll_until(killed_enough, 180, 0.01, "a worker starts a shard")
        future.exception()  # wait for the end
    return future, killed


@pytest.mark.zoo
def test_a_worker_killed_mid_shard_is_replaced_and_the_profile_is_identical(cluster, single):
    future, killed = _kill_workers(lambda: _profile(workers=2, shards=2), times=1)
    doc = future.result()
    _same_profile(doc, single)
    assert doc["run"]["samples"] == 196
    # The killed worker's shard was profiled again, from the start, by its restarted successor.
    assert doc["run"]["distributed"]["shards_on_restarted_workers"] == 1
    assert len(killed) == 1


@pytest.mark.zoo
def test_a_worker_lost_beyond_its_restarts_fails_the_run(cluster):
    run = functools.partial(_profile, workers=1, shards=1, retries=1)
    future, killed = _kill_workers(run, times=2)
    assert len(killed) == 2  # the worker, then its one restart
    with pytest.raises(
        RangeprofError, match=r"shard 0 \(samples 0-195\) failed on Ray in 2 attempts"
    ):
        future.result()


def _cli(*args: str, block_ray: bool = False) -> subprocess.CompletedProcess:
    """``rangeprof ARGS`` in a fresh interpreter; ``block_ray`` makes ``import ray`` fail there,
    as it does where the extra is not installed."""
    block = "import sys; sys.modules['ray'] = None; " if block_ray else ""
    # The service and the Ray module itself import without it too.
    modules = (
        "rangeprof.service.app, rangeprof.service.jobs, rangeprof.profiler.profiling.distributed"
    )
    imports = f"import {modules}; " if block_ray else ""
    code = f"{block}{imports}from rangeprof.cli import app; app()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.zoo
def test_cli_ray_local_writes_the_plain_cli_profile(single, tmp_path):
    # `single` is what the plain CLI writes (it calls profile_model with these options).
    pytest.importorskip("ray")
    out = tmp_path / "p.json"
    args = ["profile", str(zoo_model("digits_cnn")), "--data", CALIB, "--out", str(out)]
    result = _cli(*args, *CLI_OPTIONS, "--ray", "local", "--workers", "2")
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    _same_profile(doc, single)
    assert doc["run"]["distributed"]["workers"] == 2
    per_run = ("timings", "build_cache", "distributed")
    assert {k: v for k, v in doc["run"].items() if k not in per_run} == {
        k: v for k, v in single["run"].items() if k not in per_run
    }


def test_without_ray_everything_else_imports_and_ray_is_a_one_line_error(tmp_path):
    out = tmp_path / "p.json"
    args = ["profile", "model.onnx", "--data", "random", "--out", str(out), "--ray", "local"]
    result = _cli(*args, block_ray=True)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: profiling on Ray needs the ray package: pip install 'rangeprof[ray]'"
    ]
    assert not out.exists()


def test_an_address_nobody_listens_on_is_a_one_line_error_at_once(tmp_path):
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "p.json"
    model = zoo_model("digits_cnn")
    args = ["profile", str(model), "--data", "random", "--out", str(out)]
    result = _cli(*args, "--ray", f"127.0.0.1:{port}")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: cannot reach the Ray cluster at 127.0.0.1:{port}")
    assert not out.exists()


def test_service_ray_setting(monkeypatch):
    monkeypatch.delenv("RANGEPROF_RAY", raising=False)
    assert ray_setting() is None
    monkeypatch.setenv("RANGEPROF_RAY", "local")
    monkeypatch.setenv("RANGEPROF_RAY_WORKERS", "lots")
    with pytest.raises(RangeprofError, match="RANGEPROF_RAY_WORKERS='lots'"):
        ray_setting()
    monkeypatch.setenv("RANGEPROF_RAY_WORKERS", "3")
    pytest.importorskip("ray")
    assert ray_setting() == {"address": "local", "workers": 3}


@pytest.mark.zoo
def test_service_runs_on_ray_give_the_single_process_tensors(
    cluster, single, tmp_path, monkeypatch
):
    calib = write_calib(tmp_path, count=16)
    options = ProfileOptions(batch_size=8)  # the programs `single` compiled: no compile here
    reference = profile_model(zoo_model("digits_cnn"), f"{calib}:calib", options=options)
    monkeypatch.setenv("RANGEPROF_RAY", cluster)
    monkeypatch.setenv("RANGEPROF_RAY_WORKERS", "2")
    limits = Limits(max_model_bytes=400_000, max_data_bytes=200_000)
    with live_service("sqlite", tmp_path, limits) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()
        queued = start_run(live.owner, model["id"], calib, batch_size="8")
        run = wait_for_run(live.owner, queued["id"])
        assert run["status"] == "done", run["error"]
        assert (run["samples_done"], run["samples_total"]) == (16, 16)
        served = live.owner.get(f"/api/runs/{run['id']}/profile").json()
    _same_profile(served, reference)
    assert served["run"]["distributed"]["workers"] == 2
    assert served["run"]["build_cache"] == "hit"
