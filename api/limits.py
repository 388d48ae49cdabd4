"""Limits on the work one request can ask for. Upload sizes: a request body over its route's
limit is refused with 413 as soon as its Content-Length, or the bytes received so far, show it;
the uploaded file is then checked against the exact limit while it is read, and an .npz against
the size its arrays unpack to (a small zip of zeros can unpack to gigabytes). Run options
(samples, histogram bins, batch size): the defaults are the OpenAPI schema's ``maximum``; a
server configured lower refuses more (422). A job's wall time: the worker stops it and fails it
with the reason. Jobs queued per token: more is 429 until some have run. File bytes received
at once (each upload counts its Content-Length, or its route's limit when it sends none): more
is 503 with ``Retry-After``.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MB = 1 << 20
_MULTIPART_SLACK = 64 * 1024  # boundaries, headers and small form fields around the file
_OTHER_BODIES = 1 * MB  # JSON bodies (calibration options)
_CHUNK = 1 * MB
_FILE_PART = b"filename="  # in the headers of a multipart part that carries a file
_RUNS_PATH = re.compile(r"^/api/models/[^/]+/runs$")
# Evaluation data and labels (or a report); a build's with an accuracy budget.
_EVALUATIONS_PATH = re.compile(r"^/api/runs/[^/]+/(evaluations(/report)?|builds)$")


@dataclass(frozen=True)
class Limits:
    max_model_bytes: int = 1024 * MB
    max_data_bytes: int = 1024 * MB
    max_unpacked_bytes: int = 4096 * MB  # an .npz's arrays, decompressed
    max_samples: int = 1_000_000  # per run (random data included)
    max_bins: int = 1 << 16
    max_batch_size: int = 4096
    max_job_seconds: float = 3600.0  # a run, evaluation or build, then it fails with the reason
    max_queued_per_token: int = 16  # jobs waiting for a worker: one token cannot starve others
    max_upload_bytes: int = 2048 * MB  # file bytes being received and checked at once


DEFAULT_LIMITS = Limits()


def check_run_options(limits: Limits, **values: int | None) -> None:
    """422 where a run option (``samples=…``, ``bins=…``) is over this server's limit."""
    for name, value in values.items():
        limit = getattr(limits, f"max_{name}")
        if value is not None and value > limit:
            raise HTTPException(
                status.HTTP_422_UNPROCESSABLE_CONTENT,
                f"{name} {value} is over this server's limit of {limit}",
            )


def check_unpacked(path: Path, what: str, limit: int) -> None:
    """413 when the .npz at ``path`` unpacks to more than ``limit`` bytes (by its directory:
    zipfile reads no member past its recorded size)."""
    try:
        with zipfile.ZipFile(path) as archive:
            unpacked = sum(member.file_size for member in archive.infolist())
    except (OSError, zipfile.BadZipFile):
        return  # not a zip: the data check names that
    if unpacked > limit:
        raise _too_large(f"{what} unpacked ({unpacked} bytes)", limit)


def _too_large(what: str, limit: int) -> HTTPException:
    return HTTPException(
        status.HTTP_413_CONTENT_TOO_LARGE,
        f"{what} is larger than the limit of {limit} bytes ({limit / MB:g} MB)",
    )


class BodyLimit:
    """ASGI middleware applying :class:`Limits` to request bodies."""

    def __init__(self, app: ASGIApp, limits: Limits):
        self.app, self.limits = app, limits
        self._in_flight = 0  # bytes of the uploads in progress

    def _limit(self, path: str) -> tuple[str, int]:
        if path == "/api/models":
            return "the model upload", self.limits.max_model_bytes + _MULTIPART_SLACK
        if _RUNS_PATH.match(path):
            return "the data upload", self.limits.max_data_bytes + _MULTIPART_SLACK
        if _EVALUATIONS_PATH.match(path):  # data and labels, each within the limit
            return "the evaluation upload", 2 * self.limits.max_data_bytes + _MULTIPART_SLACK
        return "the request body", _OTHER_BODIES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        what, limit = self._limit(scope["path"])
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            error = _too_large(what, limit)
            await JSONResponse({"detail": error.detail}, error.status_code)(scope, receive, send)
            return
        if scope["method"] != "POST" or limit == _OTHER_BODIES:
            await self._receive(scope, receive, send, what, limit)
            return
        # Each upload holds disk space and memory while it is received and checked: past the
        # cap, a client retries rather than the server running out of either. What counts is a
        # request carrying a file (a body past the form fields' slack by its Content-Length, or
        # a part naming a file as it arrives; a run of random samples carries none), by its
        # Content-Length, else the most its route takes. One upload alone is always received.
        # The count is only touched on the event loop's thread, so it needs no lock.
        size = int(length) if length.isdigit() else limit
        holds = 0

        def carrying(file: bool) -> bool:
            """Count the request's bytes once it shows a file; tell whether it counts."""
            nonlocal holds
            if holds or not file:
                return bool(holds)
            if self._in_flight and self._in_flight + size > self.limits.max_upload_bytes:
                raise HTTPException(
                    status.HTTP_503_SERVICE_UNAVAILABLE,
                    f"the server is receiving {self._in_flight / MB:.0f} MB of uploads, its "
                    f"limit is {self.limits.max_upload_bytes / MB:.0f} MB; retry shortly",
                    headers={"Retry-After": "2"},
                )
            self._in_flight += size
            holds = size
            return True

        try:
            try:
                carrying(length.isdigit() and int(length) > _MULTIPART_SLACK)
            except HTTPException as busy:
                answer = JSONResponse({"detail": busy.detail}, busy.status_code, busy.headers)
                await answer(scope, receive, send)
                return
            await self._receive(scope, receive, send, what, limit, carrying)
        finally:
            self._in_flight -= holds

    async def _receive(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        what: str,
        limit: int,
        carrying: Callable[[bool], bool] | None = None,
    ) -> None:
        received, tail = 0, b""
        watching = carrying is not None

        async def counted() -> Message:
            nonlocal received, tail, watching
            message = await receive()
            body = message.get("body", b"")
            received += len(body)
            if received > limit:
                raise _too_large(what, limit)  # FastAPI passes it on from body parsing
            if watching:  # a 503 is passed on the same way
                seen = tail + body  # the marker may straddle two chunks
                watching = not carrying(received > _MULTIPART_SLACK or _FILE_PART in seen)
                tail = seen[-len(_FILE_PART) :]
            return message

        await self.app(scope, counted, send)


def copy_file(upload: BinaryIO, target: Path, what: str, limit: int) -> str:
    """Copy an upload to ``target`` within ``limit`` bytes; return its sha256."""
    digest, size = hashlib.sha256(), 0
    with target.open("wb") as out:
        while chunk := upload.read(_CHUNK):
            size += len(chunk)
            if size > limit:
                raise _too_large(what, limit)
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()
