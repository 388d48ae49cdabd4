"""The job process: each run executes ``profile_model``, each evaluation ``evaluate`` and each
build ``build_artifact`` of :mod:`rangeprof.byoc`, in a child process of its worker (``python -m
rangeprof.service.execute``).

Why a process per job: jobs stay isolated from each other and from the server — onnxsim and the
build cache's stderr muting touch process-wide state, TVM sizes its thread pool per process, a
crash or an out-of-memory kill takes one job down and not the server, and a job can be stopped.
A fresh interpreter costs the imports (about 3 s), small beside a profiling run. The child holds
itself to ``RANGEPROF_JOB_MEMORY_MB`` of address space, the memory the server's estimate let the
job in with (:mod:`rangeprof.service.estimate`): an allocation past it fails the job with
"memory limit", never the host.

The child runs in a folder that holds the model and the data under their upload names, so the
document says ``digits_cnn`` and ``calib.npz:calib`` just as a CLI run on those files would.
It reads its :class:`Job` as one JSON line on stdin: the job's stored workflow request, which
it validates and hands to the workflow the CLI runs. It answers with JSON lines on stdout:
``{"progress": [done, total]}`` as it goes (evaluations and builds add ``"phase"``: compiling
which program, or evaluating; quantizing, compiling, packing), then ``{"done": result}`` (the
profile document, the evaluation report of ``rangeprof evaluate --json``, or the build's
manifest and its zipped artifact in the folder) or ``{"failed": message}``; anything else it prints
goes to stderr. Stdin stays open as a lifeline: when the worker dies, the child reads
end-of-file and exits, so no job outlives its worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILE, EVALUATE, BUILD = "profile", "evaluate", "build"
ARTIFACT = "artifact.zip"  # a build's model.so and manifest.json, in the child's folder


@dataclass(frozen=True)
class Job:
    task: str  # PROFILE, EVALUATE or BUILD
    # The workflow's request (ProfileRequest, EvaluateRequest or BuildRequest) as the job's row
    # stores it, model_dump(mode="json"): its paths are names in the child's folder.
    request: dict
    # PROFILE on a Ray cluster: profile_distributed's address and workers
    # (rangeprof.service.jobs.ray_setting), the worker's setting rather than the job's.
    ray: dict | None = None


def start(job: Job, folder: Path) -> subprocess.Popen:
    """Start the child for ``job`` in ``folder``; its stdout carries the answers."""
    child = subprocess.Popen(
        [sys.executable, "-m", "rangeprof.service.execute"],
        cwd=folder,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child.stdin.write(json.dumps(asdict(job)) + "\n")
    child.stdin.flush()
    return child


def _main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (TVM, onnxsim) must not garble the answers
    job = Job(**json.loads(sys.stdin.readline()))
    threading.Thread(target=_exit_with_worker, daemon=True).start()
    limit = _limit_memory(job)

    def answer(**message) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    from rangeprof.profiler.errors import RangeprofError

    from .storage import out_of_space

    try:
        result = {PROFILE: _profile, EVALUATE: _evaluate, BUILD: _build}[job.task](job, answer)
    except RangeprofError as err:
        answer(failed=_over_memory(err, limit) or str(err))
    except Exception as err:
        if over := _over_memory(err, limit):
            answer(failed=over)
            return
        if out_of_space(err):  # its folder is on the store's disk: the result could not be written
            answer(failed=f"no space left on the server's storage: {err}")
            return
        traceback.print_exc()  # our bug: keep the traceback in the worker's log
        answer(failed=f"internal error: {type(err).__name__}: {err}")
    else:
        answer(done=result)


def _limit_memory(job: Job) -> int | None:
    """Hold this process to ``RANGEPROF_JOB_MEMORY_MB`` of address space, what the server's
    estimate let in (:mod:`rangeprof.service.estimate`); return it. A profile on a Ray cluster
    does its work there, under Ray's own limits (its processes would inherit this one)."""
    if job.ray is not None:
        return None
    from .memory import MB, limit_address_space
    from .settings import settings

    limit = settings().job_memory_mb
    limit_address_space(limit * MB)
    return limit


def _over_memory(err: Exception, limit: int | None) -> str | None:
    """The job's failure when ``err`` is an allocation over its memory ``limit``."""
    from .memory import out_of_memory

    if limit is None or not out_of_memory(err):
        return None
    return f"stopped at this server's memory limit for a job, {limit} MB"


def _profile(job: Job, answer: Callable[..., None]) -> dict:
    """``rangeprof profile``, the same workflow."""
    from rangeprof.workflows import profiling
    from rangeprof.workflows.requests import ProfileRequest

    ray = {"ray": job.ray["address"], "workers": job.ray["workers"]} if job.ray else {}
    request = ProfileRequest.model_validate(job.request | ray)
    return profiling.profile(request, lambda done, total: answer(progress=[done, total])).to_json()


def _evaluate(job: Job, answer: Callable[..., None]) -> dict:
    """``rangeprof evaluate --profile P --json``, the same workflow."""
    from rangeprof.workflows import quantize
    from rangeprof.workflows.requests import EvaluateRequest

    request = EvaluateRequest.model_validate(job.request)
    return quantize.evaluate(
        request, lambda phase, done, total: answer(progress=[done, total], phase=phase)
    ).to_json()


def _build(job: Job, answer: Callable[..., None]) -> dict:
    """``rangeprof build --target T (--profile P --method M | --qparams Q)``, zipped."""
    import hashlib
    import time
    import zipfile

    from rangeprof.byoc.artifact import LIBRARY, MANIFEST
    from rangeprof.workflows import quantize
    from rangeprof.workflows.requests import BuildRequest

    request = BuildRequest.model_validate(job.request)
    start = time.perf_counter()
    phases = {"quantizing": start}

    def report(phase: str, done: int, total: int) -> None:
        phases.setdefault(phase, time.perf_counter())
        answer(progress=[done, total], phase=phase)

    manifest = quantize.build(request, report).to_json()
    report("packing", 2, 3)
    with zipfile.ZipFile(ARTIFACT, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in (LIBRARY, MANIFEST):
            archive.write(request.out / name, name)
    return {
        "manifest": manifest,
        "sha256": hashlib.sha256(Path(ARTIFACT).read_bytes()).hexdigest(),
        "timings": {
            "quantize_s": round(phases["compiling"] - start, 3),
            **manifest["timings"],
            "total_s": round(time.perf_counter() - start, 3),
        },
    }


def _exit_with_worker() -> None:
    sys.stdin.read()  # the worker writes nothing more: this returns when it is gone
    os._exit(1)


if __name__ == "__main__":
    _main()
