"""Warm profiling time of this checkout against another revision, and ONNX Runtime's MinMax
calibrator, interleaved so that both sides see the same machine load.

    python benchmarks/profile_ab.py BASE_REV [--models resnet18 mobilenet_v2] [--samples 32]
        [--repeat 4]

The base revision is checked out in a temporary git worktree; its ``profiler`` package is put
first on ``PYTHONPATH`` while ``profile_vs_ort.py``'s own ``profile`` figure runs (a fresh process
per figure, histograms on, a build cache per side filled by one cold run first). Each round runs
base, this checkout and the MinMax calibrator once; the minimum and the median over the rounds
are printed (the machine is shared: the minimum is the least disturbed figure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "benchmarks" / "profile_vs_ort.py"


def figure(package_root: Path, **args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(package_root))
    cmd = [sys.executable, str(FIGURES), "--figure", json.dumps(args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"figure {args} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(sides: dict[str, Path], name: str, samples: int, repeat: int, cache: Path) -> None:
    walls: dict[str, list[float]] = {side: [] for side in [*sides, "ort_minmax"]}

    def profile(side: str) -> dict:
        folder = cache / f"{side}-{name}"
        return figure(
            sides[side], figure="profile", name=name, samples=samples, bins=2048, cache=str(folder)
        )

    for side in sides:
        print(f"{name} {side}: cold {profile(side)['wall_s']:.2f} s", flush=True)
    for _ in range(repeat):
        for side in sides:
            walls[side].append(profile(side)["wall_s"])
        ort = figure(ROOT, figure="ort_calibrator", name=name, samples=samples, method="MinMax")
        walls["ort_minmax"].append(ort["wall_s"])
    for side, values in walls.items():
        print(
            f"{name} {side:<10} warm, {samples} samples: min {min(values):.2f} s, "
            f"median {statistics.median(values):.2f} s, runs {[round(v, 2) for v in values]}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision to compare against")
    parser.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base],
            check=True,
            capture_output=True,
        )
        try:
            sides = {"base": base, "head": ROOT}
            for name in args.models:
                compare(sides, name, args.samples, args.repeat, Path(folder))
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False
            )


if __name__ == "__main__":
    main()
