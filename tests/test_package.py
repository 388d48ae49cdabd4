"""The installable package: the wheel `python -m build` makes holds every module and data file
(migrations, schemas, dashboard assets), installs into a fresh virtual environment and runs from
there; the CLI works without the service's libraries, and their commands then say what to
install."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import zoo_model

REPO = Path(__file__).resolve().parents[1]
SERVICE_LIBRARIES = ("fastapi", "sqlalchemy", "alembic", "uvicorn")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    command = [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    (built,) = dist.glob("rangeprof-*.whl")
    return built


def test_the_wheel_holds_code_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "rangeprof/__init__.py",
        "rangeprof/cli.py",
        "rangeprof/workflows/quantize.py",
        "rangeprof/profiler/ir/onnx_load.py",
        "rangeprof/profiler/compile/schedules/conv2d.py",
        "rangeprof/byoc/cpu/conv2d_int8.py",
        "rangeprof/profiler/schemas/profile.schema.json",
        "rangeprof/profiler/schemas/qparams.schema.json",
        "rangeprof/byoc/x86/__init__.py",
        "rangeprof/byoc/aarch64/vm_host.cc",
        "rangeprof/service/app.py",
        "rangeprof/service/dashboard/pages/base.html",
        "rangeprof/service/dashboard/static/vendor/chart.umd.min.js",
        "rangeprof/migrations/env.py",
        "rangeprof/migrations/script.py.mako",
        "rangeprof/migrations/versions/0008_ids_never_reused.py",
    ):
        assert expected in names, expected
    # Every module of the repository's folders, under its installed name.
    folders = {"rangeprof": "rangeprof", "profiler": "rangeprof/profiler",
               "byoc_plugins": "rangeprof/byoc", "api": "rangeprof/service",
               "migrations": "rangeprof/migrations"}  # fmt: skip
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True)
    for name in tracked.stdout.split():
        top, _, rest = name.partition("/")
        if top in folders and rest:
            assert f"{folders[top]}/{rest}" in names, name
    # Nothing of the repository's own layout leaks in under its folder names.
    assert not [n for n in names if n.split("/")[0] in ("profiler", "api", "byoc_plugins", "tests")]


def test_the_wheel_installs_and_runs(wheel, tmp_path):
    """A fresh environment (the machine's libraries visible, rangeprof only from the wheel): the
    version, `inspect` and `db upgrade` run, from a folder outside the repository."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True)
    rangeprof = str(venv / "bin" / "rangeprof")

    def run(*args: str) -> str:
        result = subprocess.run([rangeprof, *args], cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert run("--version").strip() == "rangeprof 0.1.0"
    code = "import rangeprof.service.migrate as m; print(m.SCRIPTS)"
    python = str(venv / "bin" / "python")
    found = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    where = found.stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not the repository's
    assert '"layers"' in run("inspect", str(zoo_model("digits_cnn")), "--json")
    run("db", "upgrade", "--db", f"sqlite:///{tmp_path / 'fresh.db'}")
    assert (tmp_path / "fresh.db").stat().st_size > 0


def _without_service(*args: str) -> subprocess.CompletedProcess:
    """``rangeprof ARGS`` in an interpreter where the service's libraries cannot be imported."""
    block = "".join(f"sys.modules[{m!r}] = None; " for m in SERVICE_LIBRARIES)
    code = f"import sys; {block}from rangeprof.cli import app; app()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )


def test_the_cli_works_without_the_service_extra(tmp_path):
    result = _without_service("inspect", str(zoo_model("digits_cnn")), "--json")
    assert result.returncode == 0, result.stderr
    for command in (["serve"], ["db", "upgrade"], ["token", "list"], ["worker"]):
        refused = _without_service(*command)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.strip().splitlines() == [
            "error: this command needs rangeprof's service extra (alembic is not installed): "
            "pip install 'rangeprof[service]'"
        ]


# Each layer and what it may import of ours: the pipeline only itself, the targets the pipeline,
# the workflows both, the service the workflows and below; the CLI and the facade anything.
_LAYERS = {
    "profiler": ("rangeprof.profiler",),
    "byoc_plugins": ("rangeprof.profiler", "rangeprof.byoc"),
    "rangeprof/workflows": ("rangeprof.profiler", "rangeprof.byoc", "rangeprof.workflows"),
    "api": ("rangeprof.profiler", "rangeprof.byoc", "rangeprof.workflows", "rangeprof.service"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """The absolute imports of ``path``: (line, module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("folder", list(_LAYERS))
def test_no_layer_imports_one_above_it(folder):
    allowed = _LAYERS[folder]
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in sorted((REPO / folder).rglob("*.py"))
        for line, name in _imports(path)
        if name.split(".")[0] == "rangeprof" and not name.startswith(allowed)
    ]
    assert wrong == []


# The pipeline's rooms, lowest first; each may import itself and the rooms before it: the errors,
# the typed records' base and the settings (modules), the IR, its compilation to CPU code, the
# profiling run, the calibration from its statistics, the exports of profiles and qparams.
_PIPELINE = ("errors", "records", "settings", "ir", "compile", "profiling", "calibrate", "export")


def _room_files(room: str) -> list[Path]:
    folder = REPO / "profiler" / room
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [folder.with_suffix(".py")]


def test_every_pipeline_module_is_in_a_room():
    top = {p.stem for p in (REPO / "profiler").iterdir() if p.suffix == ".py" or p.is_dir()}
    assert top - {"__init__", "__pycache__", "schemas"} == set(_PIPELINE)


@pytest.mark.parametrize("room", _PIPELINE)
def test_no_pipeline_room_imports_one_above_it(room):
    below = _PIPELINE[: _PIPELINE.index(room) + 1]
    allowed = tuple(f"rangeprof.profiler.{r}" for r in below)
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {name}"
        for path in _room_files(room)
        for line, name in _imports(path)
        if name.split(".")[0] == "rangeprof"
        and not any(name == a or name.startswith(a + ".") for a in allowed)
    ]
    assert wrong == []
