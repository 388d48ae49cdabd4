"""The service's estimate of a job's peak memory (``rangeprof.service.estimate``) beside the
peak address space (``VmPeak``) the job's workflow reaches, for profiles, evaluations and builds
of the zoo's models and of single-tensor models from 4 MB to 400 MB a sample. Each job runs in a
fresh process with the job process's malloc setting (two arenas, :mod:`rangeprof.service.memory`)
and no build cache, so that it compiles as a first job does. The estimate must stay above the
measurement (ratio > 1: the job's address-space limit is the estimate's cap), and not far above
(a high ratio refuses jobs that would fit).

    python benchmarks/job_memory.py [--json benchmarks/results/job-memory-zen3.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from harness import host, model_path
from onnx import TensorProto, helper

from rangeprof.service.analysis import analyse_model
from rangeprof.service.estimate import ModelShapes, estimate
from rangeprof.service.execute import BUILD, EVALUATE, PROFILE
from rangeprof.service.memory import MB

# The workflow in a process of its own, as the job's: its peak address space at the end.
_CHILD = """
import sys
from typer.testing import CliRunner
from rangeprof.service.memory import limit_address_space
limit_address_space(1 << 45)  # the job process's arenas; no limit to speak of
from rangeprof.cli import app
result = CliRunner().invoke(app, sys.argv[1:])
assert result.exit_code == 0, result.output
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(int(status["VmPeak"].split()[0]) * 1024)
"""


def _chain(folder: Path, channels: int) -> Path:
    """Relu, Sigmoid, Relu of one [1, channels, 1000, 1000] float32 input."""
    shape = [1, channels, 1000, 1000]
    names = ["x", "a", "b", "y"]
    nodes = [
        helper.make_node(op, [names[i]], [names[i + 1]], name=f"n{i}")
        for i, op in enumerate(("Relu", "Sigmoid", "Relu"))
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / f"chain{channels}.onnx"
    onnx.save(model, path)
    return path


def _peak(folder: Path, *args: str) -> int:
    env = {**os.environ, "RANGEPROF_CACHE": "off"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(done.stderr[-2000:])
    return int(done.stdout.split()[-1])


def _data(folder: Path, model: Path, inputs: list[dict], samples: int) -> Path:
    """``samples`` random samples of every float input, zeros of every other (token ids),
    named as the inputs."""
    rng = np.random.default_rng(0)
    arrays = {}
    for i in inputs:
        shape = (samples, *i["shape"][1:])
        floating = np.issubdtype(np.dtype(i["dtype"]), np.floating)
        arrays[i["name"]] = (
            rng.standard_normal(shape, dtype=np.float32).astype(i["dtype"])
            if floating
            else np.zeros(shape, i["dtype"])
        )
    path = folder / f"{model.stem}.npz"
    np.savez(path, **arrays)
    return path


def _cases(folder: Path, model: Path, bins: int) -> tuple[list[tuple[str, str, list[str]]], dict]:
    """(task, options, CLI arguments) of the jobs measured on ``model``, and its analysis."""
    found = analyse_model(str(model), model.stem, None)
    data = _data(folder, model, found["inputs"], 2)
    profile = folder / f"{model.stem}.profile.json"
    return [
        (
            PROFILE,
            f"bins {bins}",
            [
                "profile",
                str(model),
                "--data",
                str(data),
                "--bins",
                str(bins),
                "--out",
                str(profile),
            ],
        ),
        (EVALUATE, "", ["evaluate", str(model), "--profile", str(profile), "--data", str(data)]),
        (
            BUILD,
            "",
            ["build", str(model), "--profile", str(profile), "--target", "x86", "--out", "out"],
        ),
    ], found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="Write the figures here.")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        models = [model_path(n) for n in ("digits_cnn", "resnet18", "tiny_bert")]
        models += [_chain(folder, c) for c in (1, 10, 100)]
        for model in models:
            for bins in (2048, 65536) if model.stem == "resnet18" else (2048,):
                cases, found = _cases(folder, model, bins)
                shapes = ModelShapes.from_layers(found["layers"], found["inputs"])
                for task, options, cli in cases:
                    if task != PROFILE and bins != 2048:
                        continue
                    guess = estimate(shapes, task, bins=bins, data=False).peak
                    measured = _peak(folder, *cli)
                    row = {
                        "model": model.stem,
                        "job": f"{task} {options}".strip(),
                        "estimate_mb": round(guess / MB),
                        "measured_mb": round(measured / MB),
                        "ratio": round(guess / measured, 2),
                    }
                    rows.append(row)
                    print(
                        f"{row['model']:<12} {row['job']:<18} estimate {row['estimate_mb']:6d} MB"
                        f"  measured {row['measured_mb']:6d} MB  ratio {row['ratio']:.2f}",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps({**host(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
