"""The profiling process: each run executes ``profile_model`` in a child process of its worker
(``python -m api.execute``).

Why a process per run: runs stay isolated from each other and from the server — onnxsim and the
build cache's stderr muting touch process-wide state, TVM sizes its thread pool per process, a
crash or an out-of-memory kill takes one run down and not the server, and a run can be stopped.
A fresh interpreter costs the imports (about 3 s), small beside a profiling run.

The child runs in a folder that holds the model and the data under their upload names, so the
document says ``digits_cnn`` and ``calib.npz:calib`` just as a CLI run on those files would.
It reads its :class:`Job` as one JSON line on stdin and answers with JSON lines on stdout:
``{"progress": [done, total]}`` as it goes, then ``{"done": document}`` or ``{"failed":
message}``; anything else it prints goes to stderr. Stdin stays open as a lifeline: when the
worker dies, the child reads end-of-file and exits, so no run outlives its worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Job:
    model_file: str  # "<name>.onnx", in the child's folder
    data: str  # the --data value, relative to that folder
    input_shapes: dict[str, list[int]]
    options: dict  # ProfileOptions fields


def start(job: Job, folder: Path) -> subprocess.Popen:
    """Start the child for ``job`` in ``folder``; its stdout carries the answers."""
    child = subprocess.Popen(
        [sys.executable, "-m", "api.execute"],
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

    def answer(**message) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    from profiler.errors import RangeprofError
    from profiler.profiling import ProfileOptions, profile_model

    try:
        doc = profile_model(
            job.model_file,
            job.data,
            input_shapes={k: tuple(v) for k, v in job.input_shapes.items()},
            options=ProfileOptions(**job.options),
            progress=lambda done, total: answer(progress=[done, total]),
        )
    except RangeprofError as err:
        answer(failed=str(err))
    except Exception as err:  # our bug: keep the traceback in the worker's log
        traceback.print_exc()
        answer(failed=f"internal error: {type(err).__name__}: {err}")
    else:
        answer(done=doc)


def _exit_with_worker() -> None:
    sys.stdin.read()  # the worker writes nothing more: this returns when it is gone
    os._exit(1)


if __name__ == "__main__":
    _main()
