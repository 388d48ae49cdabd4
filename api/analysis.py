"""An upload's analysis, in a process of its own (``python -m rangeprof.service.analysis TASK``,
started by :mod:`rangeprof.service.sandbox`): a model loaded and tracked exactly as ``rangeprof
inspect`` does, or a data file read through with the profiler's checks, as ``rangeprof profile``
would read it. Each task takes and returns JSON values; a refusal is a
:class:`~rangeprof.profiler.errors.RangeprofError`, as in one process.

The child imports what its task needs, then says it is ready (``{"ready": true}``); it reads a
task as one JSON line on stdin (``{"args": {...}, "memory": BYTES, "settings": {...}}``: the
server's ``RANGEPROF_*`` variables now), limits its address space to what it holds then plus
``memory``, and answers one JSON line on stdout: ``{"done": result}``,
``{"refused": message, "content": bool}`` (``content``: data refused for what it holds),
``{"memory": true}`` (an allocation over the limit) or ``{"failed": message}`` (our bug, its
traceback on stderr); then it is ready for the next, until its stdin ends. Anything else it
prints goes to stderr. A child whose server is gone exits, even in the middle of a task.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import threading
import time
import traceback
from pathlib import Path

MODEL, DATA = "model", "data"
# What each task imports before it is ready: TVM takes seconds, a spare child has it loaded.
IMPORTS = {
    MODEL: (
        "rangeprof.byoc.plugin",
        "rangeprof.profiler.ir.onnx_load",
        "rangeprof.profiler.ir.tracking",
    ),
    DATA: ("numpy", "rangeprof.profiler.profiling.data"),
}
_CHECK_BYTES = 8 << 20  # read per batch while checking data


def parse_shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """``"x=1x3x48x192;y=1x10"`` -> ``{"x": (1, 3, 48, 192), "y": (1, 10)}``."""
    from rangeprof.profiler.errors import InputShapeError
    from rangeprof.profiler.ir.onnx_load import parse_input_shape

    shapes: dict[str, tuple[int, ...]] = {}
    for part in (text or "").split(";"):
        if part.strip():
            name, dims = parse_input_shape(part.strip())
            if name in shapes:
                raise InputShapeError(f"input {name!r} has two shapes in {text!r}")
            shapes[name] = dims
    return shapes


def analyse_model(path: str, name: str, shapes: str | None) -> dict:
    """Load and track the model at ``path`` (uploaded as ``name``.onnx) with input ``shapes``
    (``parse_shapes``): what the service keeps of it but its file."""
    from rangeprof.byoc.plugin import get_plugin
    from rangeprof.profiler.ir.onnx_load import load_model_bytes
    from rangeprof.profiler.ir.tracking import track

    parsed = parse_shapes(shapes)
    # No base_dir: external data outside the uploaded file is refused.
    loaded = load_model_bytes(Path(path).read_bytes(), f"{name}.onnx", parsed)
    # The stages as ``rangeprof inspect`` shows them, partitioned for the default target.
    tracked = track(loaded, get_plugin("x86").patterns()).to_json()
    return {
        "opset": loaded.opset,
        "input_shapes": {k: list(v) for k, v in parsed.items()},
        "inputs": [
            {"name": k, "shape": list(v), "dtype": loaded.input_dtypes[k]}
            | ({"index": loaded.index_uses[k].to_json()} if k in loaded.index_uses else {})
            for k, v in loaded.input_shapes.items()
        ],
        "layers": tracked["layers"],
        "stages": tracked["stages"],
    }


def read_data(
    folder: str,
    spec: str,
    inputs: list[dict],
    *,
    samples: int | None,
    seed: int,
    max_samples: int,
    allow_nonfinite: bool,
    cast: bool,
) -> int:
    """Open ``spec`` (a file in ``folder``, or ``random``) for the model's ``inputs`` and read it
    through with the profiler's data checks; return the number of samples it gives. Asking for
    more samples than the file holds is an error, not a cut; so is a file holding more than
    ``max_samples`` when no count is asked for. Random data is counted, not made."""
    import numpy as np

    from rangeprof.profiler.errors import CalibrationDataError
    from rangeprof.profiler.ir.index_inputs import IndexUse
    from rangeprof.profiler.profiling.data import RANDOM, InputSpec, open_data

    specs = [
        InputSpec(
            i["name"],
            tuple(i["shape"]),
            i["dtype"],
            index=IndexUse(**i["index"]) if "index" in i else None,
        )
        for i in inputs
    ]
    if spec == RANDOM:
        return open_data(spec, specs, samples=samples, seed=seed).num_samples
    path = f"{folder}/{spec}"
    checks = {"allow_nonfinite": allow_nonfinite, "cast": cast}
    available = open_data(path, specs, **checks).num_samples  # opening reads no array
    if samples is not None and samples > available:
        raise CalibrationDataError(f"{samples} samples asked for, but {spec} holds {available}")
    if samples is None and available > max_samples:
        raise CalibrationDataError(
            f"{spec} holds {available} samples, over this server's limit of {max_samples} "
            "per run: give a count in field 'samples'"
        )
    # Read in batches of a few MB whatever the sample size: checking holds no more.
    sample_bytes = sum(np.dtype(i.dtype).itemsize * math.prod(i.sample_shape) for i in specs)
    batch = max(1, _CHECK_BYTES // max(1, sample_bytes))
    source = open_data(path, specs, batch_size=batch, samples=samples, **checks)
    for _ in source.batches():
        pass
    return source.num_samples


TASKS = {MODEL: analyse_model, DATA: read_data}


def _main(task: str) -> None:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (TVM, onnxsim) must not garble the answers

    def answer(**message) -> None:
        try:
            answers.write(json.dumps(message) + "\n")
            answers.flush()
        except BrokenPipeError:  # the server is gone
            os._exit(1)

    threading.Thread(target=_exit_with_server, args=(os.getppid(),), daemon=True).start()
    for module in IMPORTS[task]:
        importlib.import_module(module)
    from .memory import release_memory

    while True:
        answer(ready=True)
        line = sys.stdin.readline()
        if not line:
            return  # the server is done with it
        request = json.loads(line)
        answer(**_serve(task, request))
        release_memory()


def _serve(task: str, request: dict) -> dict:
    """The answer to one task, under the server's settings and memory limit of the request."""
    from rangeprof.profiler.errors import RangeprofError
    from rangeprof.profiler.profiling.data import DataContentError
    from rangeprof.profiler.settings import PREFIX

    from .memory import address_space, limit_address_space, out_of_memory

    for name in [n for n in os.environ if n.startswith(PREFIX)]:
        del os.environ[name]
    os.environ.update(request["settings"])
    limit_address_space(address_space() + request["memory"])
    try:
        return {"done": TASKS[task](**request["args"])}
    except Exception as err:
        if out_of_memory(err):  # first: a refusal may have been raised from it
            return {"memory": True}
        if isinstance(err, RangeprofError):
            return {"refused": str(err), "content": isinstance(err, DataContentError)}
        traceback.print_exc()  # our bug: keep the traceback in the server's log
        return {"failed": f"{type(err).__name__}: {err}"}


def _exit_with_server(server: int) -> None:
    """End this process once its server is gone (it is then another process's child), even
    in the middle of a task."""
    while os.getppid() == server:
        time.sleep(1)
    os._exit(1)


if __name__ == "__main__":
    _main(sys.argv[1])
