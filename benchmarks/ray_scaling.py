"""Profiling throughput on Ray: samples/s with 1 and 2 workers, against a single process.

    python benchmarks/ray_scaling.py [--models digits_cnn resnet18] [--samples N] [--json OUT]

For each model (../shared/models, seeded random data: ``--samples`` per model) a single-process
run fills the build cache, and a second one is the reference; then one local Ray cluster with
all the machine's CPUs profiles the same data with 1 worker (every CPU) and with 2 (half each),
4 shards per worker. Figures:

* ``samples/s``: samples over the wall time of the whole call, as a user sees it;
* ``first s``: when the first shard came back: starting the worker processes (importing TVM,
  loading the cached program) and one shard, paid by every run;
* ``steady samples/s``: the samples of the shards that came back after every worker had
  returned one, over that time: the rate once the workers are up, which a large data set
  approaches.

Every Ray profile is checked to hold the single-process ``tensors`` byte for byte. The table is
printed; the JSON (machine, CPUs, rows) goes to ``--json``, default
``benchmarks/results/ray-scaling.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import ray

from rangeprof.profiler.profiling.distributed import profile_distributed
from rangeprof.profiler.profiling.document import tensors_bytes
from rangeprof.profiler.profiling.run import ProfileOptions, profile_model

SHARED = Path(__file__).resolve().parents[2] / "shared"
SAMPLES = {"digits_cnn": 4000, "resnet18": 96}


def _single(model: Path, samples: int) -> tuple[dict, dict]:
    start = time.perf_counter()
    doc = profile_model(model, "random", options=ProfileOptions(samples=samples))
    wall = time.perf_counter() - start
    return doc, {"how": "single", "wall_s": wall}


def _on_ray(model: Path, samples: int, workers: int) -> tuple[dict, dict]:
    returns = []  # (seconds since the start, samples done) at each shard's return

    def progress(done: int, _total: int) -> None:
        returns.append((time.perf_counter() - start, done))

    start = time.perf_counter()
    options = ProfileOptions(samples=samples)
    doc = profile_distributed(model, "random", workers=workers, options=options, progress=progress)
    wall = time.perf_counter() - start
    # From the time every worker has returned a shard (all are up) to the last return.
    (up_s, up), (last_s, last) = returns[workers - 1], returns[-1]
    steady = (last - up) / (last_s - up_s)
    return doc, {
        "how": f"ray {workers}",
        "wall_s": wall,
        "first_s": returns[0][0],
        "steady": steady,
    }


def _model_rows(name: str, samples: int) -> list[dict]:
    model = SHARED / "models" / f"{name}.onnx"
    _single(model, samples)  # fills the build cache
    single, row = _single(model, samples)
    rows = [row]
    for workers in (1, 2):
        doc, row = _on_ray(model, samples, workers)
        assert tensors_bytes(doc) == tensors_bytes(single), f"{name}: the Ray profile differs"
        rows.append(row)
    return [{"model": name, "samples": samples, **r, "per_s": samples / r["wall_s"]} for r in rows]


def _print(rows: list[dict]) -> None:
    print(
        f"{'model':<11} {'how':<7} {'samples':>7} {'wall s':>7} {'samples/s':>9} {'first s':>7} "
        f"{'steady samples/s':>16}"
    )
    for r in rows:
        first = f"{r['first_s']:.2f}" if "first_s" in r else "-"
        steady = f"{r['steady']:.1f}" if "steady" in r else "-"
        print(
            f"{r['model']:<11} {r['how']:<7} {r['samples']:>7} {r['wall_s']:>7.2f} "
            f"{r['per_s']:>9.1f} {first:>7} {steady:>16}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SAMPLES))
    parser.add_argument("--samples", type=int, help="per model (default: digits 4000, resnet 96)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = args.json or Path(__file__).parent / "results" / "ray-scaling.json"

    cpus = os.cpu_count() or 1
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        rows = []
        for name in args.models:
            rows += _model_rows(name, args.samples or SAMPLES.get(name, 32))
    finally:
        ray.shutdown()
    _print(rows)
    out.write_text(
        json.dumps({"machine": os.uname().nodename, "cpus": cpus, "rows": rows}, indent=1)
    )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
