"""Uploads under hostile input, through a real ``rangeprof serve`` process: labels are checked by
their .npy headers (a 1.5 MB .npz of 1.5 GiB of zero labels leaves the server's memory as it
was), a model's analysis runs in a child process under a wall-time limit while other uploads are
answered, a data check past the analysis memory is refused naming it, and SIGTERM stops the
server within seconds while a child analyses."""

from __future__ import annotations

import threading
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import pytest
from onnx import helper

from rangeprof.service.limits import MB

import onnx_builders as mb
from conftest import poll_until, zoo_model
from service_fixtures import (
    Rangeprof,
    alive,
    client,
    free_port,
    npz_bytes,
    rangeprof,
    rss_peak,
    serve,
    start_run,
    upload_model,
    wait_for_run,
    write_calib,
)


def _served(tmp_path: Path, *options: str) -> tuple[Rangeprof, httpx.Client]:
    """A fresh SQLite service (``rangeprof serve OPTIONS``) and a client with a token."""
    url = f"sqlite:///{tmp_path / 'service.db'}"
    rangeprof("db", "upgrade", "--db", url)
    token = rangeprof("token", "create", "owner", "--db", url).strip()
    port = free_port()
    server = serve(url, tmp_path / "blobs", port, tmp_path / "serve.log", *options)
    return server, client(f"http://127.0.0.1:{port}", token)


def _analyses(server: Rangeprof) -> list[int]:
    """The server's analysis processes (at work or ready)."""
    return server.children_running(b"rangeprof.service.analysis")


def _analysing(server: Rangeprof) -> list[int] | None:
    """The server's analysis processes once an upload is being analysed: its process, and the
    one started to be ready for the next upload."""
    found = _analyses(server)
    return found if len(found) >= 2 else None


def _deep_chain(folder: Path, length: int = 20_000) -> Path:
    """``length`` Relu nodes in a row on a [1, 8] input: a few hundred kB that take an
    analysis many minutes (the probe's model)."""
    names = ["x", *(f"t{i}" for i in range(length - 1)), "y"]
    nodes = [
        helper.make_node("Relu", [names[i]], [names[i + 1]], name=f"r{i}") for i in range(length)
    ]
    return mb.save(mb.single_io_model(nodes, {}, [1, 8], [1, 8]), folder, "deep.onnx")


def _zero_labels_bomb(path: Path, count: int) -> None:
    """An .npz whose array ``labels`` holds ``count`` int64 zeros, deflated as written (a few
    MB on disk, ``8 * count`` bytes unpacked)."""
    header = {"descr": "<i8", "fortran_order": False, "shape": (count,)}
    chunk = bytes(8 * MB)
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("labels.npy", "w", force_zip64=True) as member,
    ):
        np.lib.format.write_array_header_2_0(member, header)
        left = 8 * count
        while left:
            member.write(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))


def test_a_labels_bomb_is_refused_by_its_header_in_bounded_server_memory(tmp_path):
    bomb = tmp_path / "labels.npz"
    _zero_labels_bomb(bomb, 3 << 26)  # 1.5 GiB of int64 zeros
    assert bomb.stat().st_size < 4 * MB
    server, api = _served(tmp_path, "--jobs", "1")
    try:
        model = upload_model(api, zoo_model("digits_cnn")).json()["id"]
        calib = write_calib(tmp_path, count=16)
        run = wait_for_run(api, start_run(api, model, calib)["id"])
        assert run["status"] == "done", run["error"]
        evaluations = f"/api/runs/{run['id']}/evaluations"
        data = ("calib.npz", calib.read_bytes())
        # Too few labels: the same path up to the labels' length, refused; warms the server.
        few = npz_bytes(labels=np.zeros(4, np.int64))
        warm = api.post(evaluations, files={"data": data, "labels": ("few.npz", few)})
        assert warm.status_code == 400, warm.text
        assert warm.json()["detail"] == "few.npz:labels: 4 labels for 16 samples"

        with rss_peak(server.process.pid) as memory, bomb.open("rb") as labels:
            refused = api.post(evaluations, files={"data": data, "labels": labels})
        assert refused.status_code == 413, refused.text
        assert refused.json()["detail"] == (
            "labels.npz:labels: 201326592 labels, over this server's limit of 1000000"
        )
        assert memory.growth < 100 * MB, f"RSS grew by {memory.growth / MB:.0f} MB"
        assert api.get(evaluations).json() == []
    finally:
        api.close()
        server.stop()


def test_a_model_whose_analysis_takes_too_long_is_refused_while_others_are_answered(
    tmp_path, monkeypatch
):
    limit = 30
    monkeypatch.setenv("RANGEPROF_ANALYSIS_S", str(limit))
    deep = _deep_chain(tmp_path)
    server, api = _served(tmp_path, "--jobs", "0")
    try:
        answers: dict[str, tuple[httpx.Response, float]] = {}

        def upload_deep() -> None:
            start = time.monotonic()
            answers["deep"] = (upload_model(api, deep), time.monotonic() - start)

        sender = threading.Thread(target=upload_deep)
        sender.start()
        poll_until(lambda: _analysing(server), 60, what="the analysis starts")
        other = upload_model(api, zoo_model("digits_cnn"))
        still_analysing = sender.is_alive()
        sender.join()
        assert other.status_code == 201, other.text
        assert still_analysing, "the second upload was answered after the first"
        refused, seconds = answers["deep"]
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"] == (
            f"the model's analysis took longer than this server's limit of {limit} s"
        )
        # Within the limit, past the wait for its process's imports: a bound on a hang.
        assert seconds < limit + 60
        assert [m["name"] for m in api.get("/api/models").json()] == ["digits_cnn"]
    finally:
        api.close()
        server.stop()


def test_analysis_memory_refuses_a_large_model_and_a_data_check_past_it(tmp_path, monkeypatch):
    """A model 8 times larger than the analysis memory is refused before its analysis; a data
    file whose one sample needs more than it to be checked fails its check; both 422 naming the
    limit, and the server answers the next upload."""
    monkeypatch.setenv("RANGEPROF_ANALYSIS_MB", "100")
    rng = np.random.default_rng(0)
    gemm = helper.make_node("Gemm", ["x", "w"], ["y"], name="fc")
    large = mb.single_io_model([gemm], {"w": rng.normal(size=(8, 500_000))}, [1, 8], [1, 500_000])
    relu = helper.make_node("Relu", ["x"], ["y"], name="relu")
    wide = mb.single_io_model([relu], {}, [1, 50_000_000], [1, 50_000_000])  # 200 MB a sample
    data = tmp_path / "zeros.npz"
    np.savez_compressed(data, x=np.zeros((1, 50_000_000), np.float32))
    server, api = _served(tmp_path, "--jobs", "0")
    try:
        refused = upload_model(api, mb.save(large, tmp_path, "large.onnx"))
        assert refused.status_code == 422, refused.text
        assert refused.json()["detail"] == (
            "the model's analysis would need about 122 MB (8 times its size), over this "
            "server's limit of 100 MB"
        )
        model = upload_model(api, mb.save(wide, tmp_path, "wide.onnx"))
        assert model.status_code == 201, model.text
        runs = f"/api/models/{model.json()['id']}/runs"
        check = api.post(runs, files={"data": (data.name, data.read_bytes())})
        assert check.status_code == 422, check.text
        assert check.json()["detail"] == (
            "the check of the data needed more memory than this server's limit of 100 MB"
        )
        assert api.get(runs).json() == []
        assert upload_model(api, zoo_model("digits_cnn")).status_code == 201
    finally:
        api.close()
        server.stop()


@pytest.mark.parametrize("jobs", ["0", "1"])
def test_sigterm_during_an_analysis_stops_the_server_within_seconds(tmp_path, jobs):
    deep = _deep_chain(tmp_path)
    server, api = _served(tmp_path, "--jobs", jobs)
    answers: list[httpx.Response | Exception] = []

    def upload_deep() -> None:
        try:
            answers.append(upload_model(api, deep))
        except httpx.TransportError as err:  # the server went away first
            answers.append(err)

    sender = threading.Thread(target=upload_deep)
    sender.start()
    try:
        analyses = poll_until(lambda: _analysing(server), 60, what="the analysis starts")
        time.sleep(5)  # the chain is being tracked: seconds of CPU in its process
        assert any(map(alive, analyses))
        server.process.terminate()
        code = server.process.wait(timeout=20)
    finally:
        if server.process.poll() is None:
            server.kill()
        sender.join()
        api.close()
    assert code in (0, -15), server.log.read_text()
    poll_until(lambda: not any(map(alive, analyses)), 10, what="the analyses end")
    answer = answers[0]
    if isinstance(answer, httpx.Response):
        assert answer.status_code == 503, answer.text
        assert answer.json()["detail"] == "the server is stopping; retry shortly"
