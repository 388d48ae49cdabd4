"""Deploying a build with the TVM runtime alone (docs/deploy.md): the guide's Python script in a
fresh interpreter that imports tvm and numpy only, and its C++ program compiled with g++ against
the wheels' headers and libraries, each giving the outputs of ``rangeprof.Int8Model.run`` bit for
bit."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from typer.testing import CliRunner

from rangeprof import Int8Model
from rangeprof.cli import app

from onnx_builders import conv_relu, save

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"
# Runs the guide's script as ``python SCRIPT ARGS...`` would, then checks what it imported.
_RUN_ALONE = """
import runpy, sys
script, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
ours = sorted(m for m in sys.modules if m == "rangeprof" or m.startswith("rangeprof."))
assert not ours, ours
assert "tvm" in sys.modules
"""


def _block(language: str) -> str:
    """The guide's one code block in ``language``."""
    (block,) = re.findall(rf"```{language}(?: [^\n]*)?\n(.*?)```", GUIDE.read_text(), re.S)
    return block


def _cli(*args: str) -> None:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A conv + ReLU model built for x86 by ``rangeprof build`` from a profile on random data."""
    folder = tmp_path_factory.mktemp("deploy")
    model, _, _ = conv_relu(np.random.default_rng(0), 3, 8, 8)
    path = save(model, folder)
    profile = folder / "profile.json"
    _cli("profile", str(path), "--data", "random", "--samples", "8", "--out", str(profile))
    out = folder / "int8"
    _cli("build", str(path), "--profile", str(profile), "--target", "x86", "--out", str(out))
    return out


@pytest.fixture(scope="module")
def sample() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)


def _reference(built: Path, sample: np.ndarray) -> np.ndarray:
    (output,) = Int8Model.load(built).run(sample)
    return output


def test_the_manifest_says_what_main_takes(built):
    manifest = json.loads((built / "manifest.json").read_text())
    assert list(manifest)[:2] == ["model", "inputs"]
    assert manifest["inputs"] == {"x": {"shape": [1, 3, 8, 8], "dtype": "float32"}}
    assert [r["mode"] for r in manifest["regions"]] == ["int8"]  # the build is quantized


def test_the_python_script_runs_with_tvm_and_numpy_alone(built, sample, tmp_path):
    script = tmp_path / "run_int8.py"
    script.write_text(_block("python"))
    np.savez(tmp_path / "inputs.npz", x=sample)
    args = [str(script), str(built), str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz")]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALONE, *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    (output,) = np.load(tmp_path / "out.npz").values()
    expected = _reference(built, sample)
    assert output.dtype == expected.dtype and output.shape == (1, 8, 8, 8)
    assert output.tobytes() == expected.tobytes()
    assert (output > 0).any()  # not all clamped to zero: the comparison says something

    # A batch it was not built for is refused with the manifest's shape.
    np.savez(tmp_path / "inputs.npz", x=np.concatenate([sample, sample]))
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALONE, *args], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 1 and "built for (1, 3, 8, 8)" in done.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")
def test_the_cpp_program_compiles_against_the_wheels_and_gives_the_same_outputs(
    built, sample, tmp_path
):
    source = tmp_path / "deploy_int8.cc"
    source.write_text(_block("cpp"))
    runtime = Path(tvm.__file__).parent
    ffi = Path(tvm_ffi.__file__).parent
    command = ["g++", "-std=c++17", "-O2", f"-I{ffi}/include", f"-I{runtime}/include"]
    command += [str(source), "-o", str(tmp_path / "deploy_int8")]
    command += [f"-L{runtime}/lib", f"-L{ffi}/lib", "-Wl,--no-as-needed"]
    command += ["-ltvm_runtime", "-ltvm_ffi", f"-Wl,-rpath,{runtime}/lib", f"-Wl,-rpath,{ffi}/lib"]
    # The guide's command line, the same flags.
    assert "-Wl,--no-as-needed -ltvm_runtime -ltvm_ffi" in GUIDE.read_text()
    compiled = subprocess.run(command, capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr
    sample.tofile(tmp_path / "input.bin")
    dims = [str(d) for d in sample.shape]

    def program(*shape: str) -> subprocess.CompletedProcess:
        files = [built / "model.so", tmp_path / "input.bin", tmp_path / "output.bin"]
        return subprocess.run(
            [tmp_path / "deploy_int8", *files, *shape], capture_output=True, text=True
        )

    done = program(*dims)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "output.bin").read_bytes() == _reference(built, sample).tobytes()
    short = program("2", *dims[1:])  # a batch of 2 reads more than the file holds
    assert short.returncode == 1 and "fewer than" in short.stderr
