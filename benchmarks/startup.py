"""Start-up time of the `rangeprof` command: what a user waits for before any work.

    python benchmarks/startup.py [--runs 5]

Each figure is the median wall time of ``--runs`` fresh processes: ``rangeprof --help``,
``rangeprof --version``, and ``rangeprof calibrate`` on a small profile (the digits CNN's, 16
random samples, made once by ``rangeprof profile``), next to the time Python takes to import
ONNX Runtime's quantizer (``python -c "import onnxruntime.quantization"``), the peer a user
would otherwise start. Target: help and calibrate under 1.5 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "digits_cnn.onnx"


def _host() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line)
    isa = "AVX-512 VNNI" if "avx512_vnni" in info else "AVX2"
    return f"{name} ({isa}), {len(os.sched_getaffinity(0))} vCPUs, {platform.node()}"


def _median_s(command: list[str], runs: int, cwd: Path) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rangeprof = shutil.which("rangeprof") or sys.exit("rangeprof is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = folder / "digits.profile.json"
        subprocess.run(
            [rangeprof, "profile", str(MODEL), "--data", "random", "--samples", "16",
             "--out", str(profile)],
            check=True, capture_output=True,
        )  # fmt: skip
        figures = {
            "rangeprof --help": _median_s([rangeprof, "--help"], args.runs, folder),
            "rangeprof --version": _median_s([rangeprof, "--version"], args.runs, folder),
            "rangeprof calibrate (small profile)": _median_s(
                [rangeprof, "calibrate", str(profile), "--out", str(folder / "q.json")],
                args.runs,
                folder,
            ),
        }
        peer = [sys.executable, "-c", "import onnxruntime.quantization"]
        ort = _median_s(peer, args.runs, folder)
    for name, seconds in figures.items():
        print(f"{name:<38} {seconds:5.2f} s   {seconds / ort:4.2f}x ORT quantizer import")
    print(f"{'import onnxruntime.quantization':<38} {ort:5.2f} s")
    print(f"host: {_host()}")


if __name__ == "__main__":
    main()
