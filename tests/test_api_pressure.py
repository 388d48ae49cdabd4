"""The service under pressure, through real HTTP: a 1 GB upload streams through in bounded server
memory, uploads past the server's cap are told to retry while reads go on, a data file over the
sample limit needs a count, a file name that is not UTF-8 is stored safely, and reads survive
database connections killed under them (PostgreSQL)."""

from __future__ import annotations

import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from rangeprof.service.limits import MB, Limits

import onnx_builders as mb
from conftest import poll_until, zoo_model
from service_fixtures import (
    client,
    connections_killed,
    database,
    free_port,
    live_service,
    rangeprof,
    rss_peak,
    serve,
    upload_model,
    write_calib,
)

_BOUNDARY = "rangeprof-test-boundary"


def _multipart(field: str, filename: bytes, parts: Iterator[bytes]) -> Iterator[bytes]:
    """A multipart/form-data body with one file, sent as it is produced (chunked)."""
    yield (
        f'--{_BOUNDARY}\r\nContent-Disposition: form-data; name="{field}"; filename="'.encode()
        + filename
        + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
    )
    yield from parts
    yield f"\r\n--{_BOUNDARY}--\r\n".encode()


def _post_streamed(api: httpx.Client, path: str, body: Iterator[bytes]) -> httpx.Response:
    headers = {"Content-Type": f"multipart/form-data; boundary={_BOUNDARY}"}
    return api.post(path, content=body, headers=headers)


def _wide_model(folder: Path, width: int) -> Path:
    """Relu of one float32 input ``x`` of shape [1, width]."""
    node = mb.helper.make_node("Relu", ["x"], ["y"], name="relu")
    return mb.save(mb.single_io_model([node], {}, [1, width], [1, width]), folder)


def _write_npz(path: Path, samples: int, width: int) -> None:
    """An .npz holding ``calib`` of shape [samples, width], written a chunk at a time."""
    rng = np.random.default_rng(0)
    chunk = rng.standard_normal((64, width), dtype=np.float32)
    header = {"descr": "<f4", "fortran_order": False, "shape": (samples, width)}
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive,
        archive.open("calib.npy", "w", force_zip64=True) as member,
    ):
        np.lib.format.write_array_header_2_0(member, header)
        for start in range(0, samples, len(chunk)):
            member.write(chunk[: samples - start].tobytes())


def test_a_1gb_data_upload_streams_through_bounded_server_memory(tmp_path):
    """A 1000 MB .npz goes to a `rangeprof serve` process and is received, hashed, stored and
    read through for its check: the server's resident memory grows by less than 64 MB."""
    width, samples = 65536, 4000  # 256 KiB a sample, 1000 MiB in all
    data = tmp_path / "big.npz"
    _write_npz(data, samples, width)
    assert data.stat().st_size > 1000 * MB
    with database("sqlite", tmp_path) as url:
        rangeprof("db", "upgrade", "--db", url)
        token = rangeprof("token", "create", "owner", "--db", url).strip()
        port = free_port()
        server = serve(url, tmp_path / "blobs", port, tmp_path / "serve.log", "--jobs", "0")
        try:
            api = client(f"http://127.0.0.1:{port}", token)
            model = upload_model(api, _wide_model(tmp_path, width))
            assert model.status_code == 201, model.text
            runs = f"/api/models/{model.json()['id']}/runs"
            small = tmp_path / "small.npz"
            _write_npz(small, 16, width)  # warms every code path the big upload takes
            with small.open("rb") as f:
                warm = api.post(runs, files={"data": f}, data={"key": "calib"})
            assert warm.status_code == 202, warm.text
            with rss_peak(server.process.pid) as memory, data.open("rb") as f:
                response = api.post(runs, files={"data": f}, data={"key": "calib"}, timeout=600)
            assert response.status_code == 202, response.text
            assert response.json()["data"]["name"] == "big.npz"
            assert memory.growth < 64 * MB, f"RSS grew by {memory.growth / MB:.0f} MB"
            api.close()
        finally:
            server.stop()


def _held_upload(live, sized: bool):
    """A model upload whose second half waits for ``release``: (thread, its responses, sending,
    release); ``sized`` sends its Content-Length, else it is chunked."""
    model = zoo_model("digits_cnn").read_bytes()
    sending, release = threading.Event(), threading.Event()

    def slow_parts() -> Iterator[bytes]:
        sending.set()  # the request's headers are on the wire
        yield model[: len(model) // 2]
        release.wait(60)
        yield model[len(model) // 2 :]

    body = list(_multipart("file", b"m.onnx", iter([b""])))
    size = sum(map(len, body)) + len(model)
    parts = _multipart("file", b"m.onnx", slow_parts())
    headers = {"Content-Type": f"multipart/form-data; boundary={_BOUNDARY}"}
    if sized:
        headers["Content-Length"] = str(size)
    first: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: first.append(live.owner.post("/api/models", content=parts, headers=headers))
    )
    sender.start()
    return sender, first, sending, release


def test_uploads_past_the_cap_are_told_to_retry_while_reads_go_on(tmp_path):
    """A chunked upload counts the most its route takes (1 GB): any other is then over a cap of
    1 MB."""
    with live_service("sqlite", tmp_path, Limits(max_upload_bytes=MB), jobs=0) as live:
        sender, first, sending, release = _held_upload(live, sized=False)
        # No probe before the first upload's request is out: a probe the server was receiving
        # when it arrived would have it refused (the cap at work), and the test would wait for
        # an upload that is not there.
        assert sending.wait(30)
        try:

            def refused():
                busy = upload_model(live.stranger, zoo_model("digits_cnn"))
                # Taken: the first upload's request had not reached the server yet; the cap
                # must apply once it has.
                assert busy.status_code in (201, 503), busy.text
                return busy if busy.status_code == 503 else None

            busy = poll_until(refused, 30, 0.05, "the cap applies")
            assert busy.headers["retry-after"] == "2"
            assert busy.json()["detail"] == (
                "the server is receiving 1024 MB of uploads, its limit is 1 MB; retry shortly"
            )
            assert live.owner.get("/api/models").status_code == 200  # reads are not uploads
        finally:
            release.set()
            sender.join()
        assert first[0].status_code == 201, first[0].text
        assert upload_model(live.stranger, zoo_model("digits_cnn")).status_code == 201


def test_the_cap_counts_bytes_not_requests(tmp_path):
    """Two uploads of 120 kB each fit a cap of 1 MB at once (a chunked one, counted as 1 GB,
    does not: it shows when the first is being received)."""
    model = zoo_model("digits_cnn").read_bytes()
    with live_service("sqlite", tmp_path, Limits(max_upload_bytes=MB), jobs=0) as live:
        sender, first, sending, release = _held_upload(live, sized=True)
        assert sending.wait(30)
        try:

            def refused():
                chunked = _multipart("file", b"probe.onnx", iter([model]))
                busy = _post_streamed(live.stranger, "/api/models", chunked)
                return busy if busy.status_code == 503 else None

            poll_until(refused, 30, 0.05, "the first upload is being received")
            second = upload_model(live.stranger, zoo_model("digits_cnn"))
            assert second.status_code == 201, second.text
        finally:
            release.set()
            sender.join()
        assert first[0].status_code == 201, first[0].text


def test_a_data_file_over_the_sample_limit_needs_a_count(tmp_path):
    with live_service("sqlite", tmp_path, Limits(max_samples=10), jobs=0) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        calib = write_calib(tmp_path, count=16)
        runs = f"/api/models/{model}/runs"
        refused = live.owner.post(runs, files={"data": (calib.name, calib.read_bytes())})
        assert refused.status_code == 400
        assert refused.json()["detail"] == (
            "calib.npz holds 16 samples, over this server's limit of 10 per run: give a count "
            "in field 'samples'"
        )
        taken = live.owner.post(
            runs, files={"data": (calib.name, calib.read_bytes())}, data={"samples": "8"}
        )
        assert taken.status_code == 202 and taken.json()["options"]["samples"] == 8


def test_a_file_name_that_is_not_utf8_is_stored_safely(tmp_path):
    with live_service("sqlite", tmp_path, Limits(), jobs=0) as live:
        model = zoo_model("digits_cnn").read_bytes()
        body = _multipart("file", "modèle".encode("latin-1") + b"\xff.onnx", iter([model]))
        response = _post_streamed(live.owner, "/api/models", body)
        assert response.status_code == 201, response.text
        name = response.json()["name"]
        assert name.isprintable() and name.encode("utf-8")  # JSON-safe text
        listed = live.owner.get("/api/models").json()
        assert [m["name"] for m in listed] == [name]
        control = _multipart("file", b"a\x07b.onnx", iter([model]))
        refused = _post_streamed(live.owner, "/api/models", control)
        assert refused.status_code == 400 and "control characters" in refused.json()["detail"]


def test_reads_survive_database_connections_killed_under_them(tmp_path):
    """PostgreSQL terminates the service's connections again and again while clients read: a
    read that loses its connection is tried again on a fresh one, so none fails."""
    with live_service("postgresql", tmp_path, Limits(), jobs=0) as live:
        model = upload_model(live.owner, zoo_model("digits_cnn")).json()["id"]
        run = live.owner.post(f"/api/models/{model}/runs", data={"random": "2"}).json()["id"]
        statuses = []
        with connections_killed(live.url, 0.05) as kills:
            for _ in range(60):
                for path in (
                    f"/api/models/{model}",
                    "/api/models",
                    f"/api/models/{model}/runs",
                    f"/api/runs/{run}",
                    "/api/token",
                ):
                    statuses.append(live.owner.get(path).status_code)
        assert sum(kills) > 20  # connections were in fact killed under the reads
        assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
