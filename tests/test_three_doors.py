"""The same request through every door gives the same answer: one profile, one request, and the
CLI, the Python API and the REST API write byte-identical qparams and build INT8 programs whose
outputs are identical bit for bit. Each face's defaults are the option groups' own
(``rangeprof/workflows/options.py``), so an empty request is the same request everywhere."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest
import tvm
from tvm import relax

import rangeprof
from rangeprof.service.limits import Limits

from conftest import poll_until, zoo_model
from service_fixtures import (
    DIGITS,
    live_service,
    start_run,
    upload_model,
    wait_for_run,
    write_calib,
)
from service_fixtures import rangeprof as cli

ACTIVE = ("queued", "running")
# A request with every calibration choice spelled out, beside the empty (all-default) one.
CHOSEN = {"target": "npu", "method": "percentile", "percentile": 99.9, "power_of_two": True}


def _flags(options: dict) -> list[str]:
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def _text(document: dict) -> str:
    return json.dumps(document, indent=1)  # as `rangeprof calibrate` writes it


def _outputs(library, x: np.ndarray) -> np.ndarray:
    main = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())["main"]
    return np.stack([main(tvm.runtime.tensor(sample[None])).numpy() for sample in x])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live service (SQLite, in-process worker) that profiled digits_cnn; its profile."""
    folder = tmp_path_factory.mktemp("service")
    with live_service("sqlite", folder, Limits()) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()
        run = start_run(live.owner, model["id"], write_calib(folder, count=16), key="calib")
        run = wait_for_run(live.owner, run["id"])
        assert run["status"] == "done", run["error"]
        profile = folder / "profile.json"
        profile.write_text(live.owner.get(f"/api/runs/{run['id']}/profile").text)
        yield live, run["id"], profile


@pytest.mark.parametrize("options", [{}, CHOSEN], ids=["defaults", "chosen"])
def test_qparams_are_the_same_bytes_through_every_door(served, tmp_path, options):
    live, run_id, profile = served
    out = tmp_path / "q.json"
    cli("calibrate", str(profile), "--out", str(out), *_flags(options))
    by_cli = out.read_text()
    by_python = rangeprof.Profile.load(profile).calibrate(**options).to_json()
    response = live.owner.post(f"/api/runs/{run_id}/qparams", json=options)
    assert response.status_code == 201, response.text
    by_api = _text(response.json()["document"])
    assert by_cli == by_python == by_api
    assert json.loads(by_cli)["options"]["target"] == options.get("target", "x86")


def test_int8_programs_are_the_same_through_every_door(served, tmp_path):
    live, run_id, profile = served
    x = np.load(DIGITS)["test"][:16].astype(np.float32)

    cli("build", str(zoo_model("digits_cnn")), "--profile", str(profile), "--out", str(tmp_path))
    by_cli = _outputs(tmp_path / "model.so", x)

    built = rangeprof.build(
        rangeprof.load(zoo_model("digits_cnn")), rangeprof.Profile.load(profile)
    )
    by_python = np.stack([built.run(sample[None])[0] for sample in x])

    response = live.owner.post(f"/api/runs/{run_id}/builds", json={})
    assert response.status_code == 202, response.text
    build_id = response.json()["id"]

    def ended() -> dict | None:
        build = live.owner.get(f"/api/builds/{build_id}").json()
        return None if build["status"] in ACTIVE else build

    build = poll_until(ended, 300, 0.2, lambda: live.owner.get(f"/api/builds/{build_id}").json())
    assert build["status"] == "done", build["error"]
    artifact = live.owner.get(f"/api/builds/{build_id}/artifact").content
    with zipfile.ZipFile(io.BytesIO(artifact)) as archive:
        archive.extractall(tmp_path / "served")
    by_api = _outputs(tmp_path / "served" / "model.so", x)

    assert np.array_equal(by_cli, by_python) and np.array_equal(by_cli, by_api)
    manifests = [
        json.loads((tmp_path / "manifest.json").read_text()),
        built.manifest.to_json(),
        build["manifest"],
    ]
    assert len({json.dumps(m["calibration"], sort_keys=True) for m in manifests}) == 1
