"""Profiling on a Ray cluster: shard the calibration data, profile the shards on workers, merge.

One job: ``profile_distributed`` gives the profile
:func:`~rangeprof.profiler.profiling.run.profile_model` gives, with a ``tensors`` section
byte-identical to it whatever the shard and worker counts.

Why it is exact. Statistics merge exactly (:mod:`rangeprof.profiler.profiling.statistics`) provided
every executor run sees the batches a single run would see: each run's float64 sums are computed
from that batch alone. So shards are made of whole batches (only the last shard can end with the
data's smaller last batch), and the shard profiles are merged in shard order, never in the order
they finish: the merge keeps the first of equal extremes, so order matters for signed zeros.

How it runs. The driver (this process) opens and checks the data exactly as a single run does,
then reads it once, shard by shard, and puts each shard's arrays in Ray's object store once:
workers receive references, a retried shard reuses the same object, and at most one shard more
than the workers can take is held at a time. Each worker is a Ray actor that compiles the model
on its first shard (from the build cache when it can) and keeps the compiled program for the
next ones; the model's bytes reach it by reference too, so no shared filesystem is needed.

Faults. An actor that dies (killed, out of memory, its node lost) is restarted by Ray and the shard
it was profiling runs again from the start, up to ``retries`` times; each shard's result is the
statistics of one complete pass over it, so no sample is counted twice or dropped. After that, or on
any other error, the run fails with a :class:`~rangeprof.profiler.errors.RangeprofError` naming the
shard; the merged profile's sample and batch counts are checked against the data's.

Ray is an optional dependency (``pip install 'rangeprof[ray]'``), imported only here and only
when a run asks for it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.ir.onnx_load import graph_tensors
from rangeprof.profiler.profiling.data import CalibrationData, Preprocess
from rangeprof.profiler.profiling.document import merge_profiles
from rangeprof.profiler.profiling.run import (
    ModelProfiler,
    ProfileOptions,
    Progress,
    open_calibration,
)

LOCAL = "local"  # the address that starts a Ray cluster on this machine for the run
SHARDS_PER_WORKER = 4  # balances uneven workers; a retry redoes a quarter of a worker's part
RETRIES = 3  # default restarts of a dead worker, and re-runs of the shard it held


def require_ray() -> ModuleType:
    """The ``ray`` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RangeprofError(
            "profiling on Ray needs the ray package: pip install 'rangeprof[ray]'"
        ) from None
    return ray


@dataclass(frozen=True)
class Shard:
    """Samples ``[start, stop)`` of the data: ``batches`` whole batches of the run."""

    index: int
    start: int
    stop: int
    batches: int

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def __str__(self) -> str:
        return f"shard {self.index} (samples {self.start}-{self.stop - 1})"


def plan_shards(num_samples: int, batch_size: int, shards: int) -> list[Shard]:
    """Up to ``shards`` contiguous shards of near-equal batch counts, cut on batch boundaries (a
    cut inside a batch would change the batches), so never more shards than batches."""
    num_batches = -(-num_samples // batch_size)
    count = min(shards, num_batches)
    plan = []
    for index in range(count):
        first, last = index * num_batches // count, (index + 1) * num_batches // count
        stop = min(last * batch_size, num_samples)
        plan.append(Shard(index, first * batch_size, stop, last - first))
    return plan


class ShardProfiler:
    """A Ray actor's body: profiles shards of one model, compiled once per worker process."""

    def __init__(self, name: str, input_shapes: dict | None, options: ProfileOptions, bound: dict):
        self.name, self.input_shapes, self.options = name, input_shapes, options
        self.bound = bound  # the value inputs' values
        self.profiler: ModelProfiler | None = None  # compiled on the first shard, then kept

    def profile(
        self, shard: Shard, data: str, arrays: dict[str, np.ndarray], model: list
    ) -> tuple[dict, bool]:
        """The profile document of one shard, and whether this worker was restarted by Ray
        (after a predecessor died, maybe on this very shard).

        ``model`` holds a reference to the ONNX file's bytes, fetched on the first shard only
        (Ray resolves a bare reference before every call; in the constructor it would make Ray
        warn that a restart may find it gone)."""
        import ray

        start = time.perf_counter()
        if self.profiler is None:
            self.profiler = ModelProfiler.prepare(
                _local_copy(ray.get(model[0]), self.name),
                input_shapes=self.input_shapes,
                options=self.options,
                bound=self.bound,
            )
        profiler = self.profiler
        size = profiler.batch_size
        batches = [
            {name: array[i : i + size] for name, array in arrays.items()}
            for i in range(0, shard.samples, size)
        ]
        profiler.ready_for(shard.samples - (len(batches) - 1) * size)  # a smaller last batch
        stats, done = profiler.observe(batches, None)
        doc = profiler.document(
            stats,
            samples=done,
            batches=len(batches),
            data=data,
            options=self.options,
            timings={"total_s": round(time.perf_counter() - start, 6)},
        )
        return doc, ray.get_runtime_context().was_current_actor_reconstructed


def _local_copy(model: bytes, name: str) -> Path:
    """The model file on the worker's machine, written once per content (under its own name:
    the profile names the model after the file) and shared by the workers there."""
    path = Path(tempfile.gettempdir()) / "rangeprof-ray" / hashlib.sha256(model).hexdigest() / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{name}.{os.getpid()}.partial")
        partial.write_bytes(model)
        os.replace(partial, path)  # a worker never reads a half-written copy
    return path


def _model_bytes(path: Path) -> bytes:
    """The ONNX file, which workers receive alone: its weights must be inside it."""
    data = path.read_bytes()
    model = onnx.load_model_from_string(data)  # external data stays unread
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph_tensors(model.graph)):
        raise RangeprofError(
            f"{path}: keeps weights in external data files, which Ray workers do not receive; "
            "save the model with its weights inside the .onnx file"
        )
    return data


@contextmanager
def _connected(ray: ModuleType, address: str, workers: int) -> Iterator[None]:
    """Connected to a cluster: this process's connection if it has one (left open), else a new
    local cluster (``local``) or the cluster at ``address``, shut down afterwards."""
    if ray.is_initialized():
        yield
        return
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    if address != LOCAL:
        _check_reachable(address)
    try:
        if address == LOCAL:
            cpus = max(os.cpu_count() or 1, workers)
            ray.init(address=LOCAL, num_cpus=cpus, include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise RangeprofError(f"cannot connect to the Ray cluster at {address}: {err}") from None
    try:
        yield
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fails fast on a ``host:port`` (or ``ray://host:port``) nobody listens on: ``ray.init``
    would retry for minutes before giving up."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and the like: Ray resolves them itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise RangeprofError(f"cannot reach the Ray cluster at {address}: {err}") from None


def _worker_cpus(ray: ModuleType, workers: int) -> int:
    """CPUs per worker: the cluster's, shared evenly, and no more than its largest node has
    (an actor asking for more would wait forever)."""
    nodes = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]]
    if sum(nodes) < workers:
        raise RangeprofError(
            f"the Ray cluster has {sum(nodes):g} CPUs, fewer than the {workers} workers asked for"
        )
    return max(1, min(int(sum(nodes) // workers), int(max(nodes))))


def _shard_arrays(source: CalibrationData, plan: list[Shard]) -> Iterator[dict[str, np.ndarray]]:
    """Each shard's samples, one array per input, read in a single pass over the source."""
    batches = source.batches()
    for shard in plan:
        parts = list(itertools.islice(batches, shard.batches))
        yield {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _result(ray: ModuleType, ref, shard: Shard, retries: int) -> tuple[dict, bool]:
    """A shard's result, or the run's error: a user error raised on the worker as itself, a
    worker lost beyond its restarts as a :class:`RangeprofError` naming the shard."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, RangeprofError):
            raise err.cause from None
        raise
    except ray.exceptions.RayError as err:
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise RangeprofError(
            f"{shard} failed on Ray in {retries + 1} attempts ({type(err).__name__}: {first})"
        ) from None


def _dispatch(
    ray: ModuleType,
    actors: list,
    plan: list[Shard],
    source: CalibrationData,
    data: str,
    model_ref,
    retries: int,
    progress: Progress | None,
) -> list[tuple[dict, bool]]:
    """Every shard profiled, each given to the next idle worker; results in shard order."""
    idle, running, results = list(actors), {}, {}
    done = 0

    def collect() -> None:
        nonlocal done
        [ref], _ = ray.wait(list(running), num_returns=1)
        shard, actor = running.pop(ref)
        results[shard.index] = _result(ray, ref, shard, retries)
        idle.append(actor)
        done += shard.samples
        if progress:
            progress(done, source.num_samples)

    for shard, arrays in zip(plan, _shard_arrays(source, plan), strict=True):
        arrays_ref = ray.put(arrays)  # once: a retry of the shard reads the same object
        del arrays  # the object store has it: no copy here while waiting for a worker
        if not idle:
            collect()
        actor = idle.pop(0)
        call = actor.profile.remote(shard, data, arrays_ref, [model_ref])
        running[call] = (shard, actor)
    while running:
        collect()
    return [results[shard.index] for shard in plan]


def _merge(plan: list[Shard], results: list[tuple[dict, bool]], source: CalibrationData) -> dict:
    """The shard profiles merged in shard order, each checked to hold its samples exactly."""
    for shard, (doc, _) in zip(plan, results, strict=True):
        run = doc["run"]
        if (run["samples"], run["batches"]) != (shard.samples, shard.batches):
            raise RangeprofError(
                f"{shard} came back with {run['samples']} samples in {run['batches']} batches, "
                f"not {shard.samples} in {shard.batches}"
            )
    merged = functools.reduce(merge_profiles, (doc for doc, _ in results))
    counts = (merged["run"]["samples"], merged["run"]["batches"])
    if counts != (source.num_samples, source.num_batches):
        raise RangeprofError(
            f"the shards hold {counts[0]} samples in {counts[1]} batches, not the data's "
            f"{source.num_samples} in {source.num_batches}"
        )
    return merged


def profile_distributed(
    path: str | Path,
    data: str,
    *,
    address: str = LOCAL,
    workers: int = 2,
    shards: int | None = None,
    retries: int = RETRIES,
    input_shapes: dict | None = None,
    options: ProfileOptions | None = None,
    preprocess: Preprocess | None = None,
    progress: Progress | None = None,
) -> dict:
    """Profiles one ONNX model on calibration data with ``workers`` Ray workers and ``shards``
    shards (default :data:`SHARDS_PER_WORKER` per worker; never more than the batches), a dead
    worker restarted and its shard re-run up to ``retries`` times. Returns the profile document of
    :func:`~rangeprof.profiler.profiling.run.profile_model`, with ``run.distributed`` saying how it
    ran.

    ``address`` is ``local`` (a cluster on this machine, for this run) or a Ray address
    (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``); a process already connected to Ray uses
    its connection. Workers need rangeprof installed, nothing else: model and data travel
    through Ray.
    """
    start = time.perf_counter()
    if workers < 1:
        raise RangeprofError(f"{workers} workers: at least one is needed")
    if shards is not None and shards < 1:
        raise RangeprofError(f"{shards} shards: at least one is needed")
    if retries < 0:
        raise RangeprofError(f"{retries} retries: cannot be negative")
    ray = require_ray()
    path, options = Path(path), options or ProfileOptions()
    source = open_calibration(
        path, data, input_shapes=input_shapes, options=options, preprocess=preprocess
    )
    plan = plan_shards(source.num_samples, source.batch_size, shards or SHARDS_PER_WORKER * workers)
    model = _model_bytes(path)
    workers = min(workers, len(plan))  # a worker without a shard would only cost its start
    with _connected(ray, address, workers):
        cpus = _worker_cpus(ray, workers)
        worker = ray.remote(ShardProfiler).options(
            num_cpus=cpus,
            max_restarts=retries,
            max_task_retries=retries,
            # TVM sizes its thread pool from this; by default every worker would take all cores.
            runtime_env={"env_vars": {"TVM_NUM_THREADS": str(cpus)}},
        )
        model_ref = ray.put(model)  # once; every worker reads it on its first shard
        bound = source.bound_values()
        actors = [worker.remote(path.name, input_shapes, options, bound) for _ in range(workers)]
        prepared = time.perf_counter()
        try:
            results = _dispatch(ray, actors, plan, source, data, model_ref, retries, progress)
        finally:
            for actor in actors:
                ray.kill(actor)  # frees the CPUs now, also on a connection left open
    doc = _merge(plan, results, source)
    run = doc["run"]
    run["build_cache"] = (
        "hit" if all(d["run"]["build_cache"] == "hit" for d, _ in results) else "miss"
    )
    end = time.perf_counter()
    run["timings"] = {
        "prepare_s": round(prepared - start, 6),  # data checked, cluster reached, workers asked
        "run_s": round(end - prepared, 6),  # the shards: compiles on the workers included
        "total_s": round(end - start, 6),
    }
    run["distributed"] = {
        "engine": "ray",
        "workers": len(actors),
        "shards": len(plan),
        "shards_on_restarted_workers": sum(restarted for _, restarted in results),
    }
    return doc
