"""Content-addressed file storage for uploads: ``<root>/<sha256[:2]>/<sha256><suffix>``.

Files are written to ``<root>/tmp`` first and renamed into place, so a blob path holds either
nothing or the complete file. Scratch folders there are named by the host and process that made
them, so that one left by a killed process is found and removed (:meth:`BlobStore.reap_scratch`,
when a worker starts) without touching those of live processes sharing the store. The same bytes are
stored once however often they are uploaded; :mod:`rangeprof.service.catalog` deletes a blob when no
row refers to it any more. The root is ``--storage``, else ``RANGEPROF_STORAGE``, else a folder next
to an SQLite database file (``<file>-blobs``) or in the user's data folder for other databases."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .db import data_dir, sqlite_path
from .settings import settings


def storage_root(url: str, given: str | Path | None = None) -> Path:
    configured = given or settings().storage
    if configured:
        return Path(configured)
    database = sqlite_path(url)
    if database is not None:
        return database.with_name(database.name + "-blobs")
    return data_dir() / "blobs"


class BlobStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str, suffix: str) -> Path:
        return self.root / sha256[:2] / f"{sha256}{suffix}"

    @contextmanager
    def scratch(self) -> Iterator[Path]:
        """A private folder on the store's file system, removed with everything in it."""
        prefix = f"{socket.gethostname()}-{os.getpid()}-"
        folder = Path(tempfile.mkdtemp(prefix=prefix, dir=self._tmp))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def reap_scratch(self) -> list[Path]:
        """Remove the scratch folders of this host's processes that are gone; return them."""
        host = socket.gethostname()
        reaped = []
        for folder in self._tmp.iterdir():
            owner_host, _, rest = folder.name.rpartition("-")[0].rpartition("-")
            if owner_host == host and rest.isdigit() and not _alive(int(rest)):
                shutil.rmtree(folder, ignore_errors=True)
                reaped.append(folder)
        return reaped

    def adopt(self, staged: Path, sha256: str, suffix: str) -> bool:
        """Move a complete file whose sha256 is known into the store; tell whether it is new."""
        target = self.path(sha256, suffix)
        if target.exists():
            return False
        target.parent.mkdir(exist_ok=True)
        os.replace(staged, target)
        return True

    def remove(self, sha256: str, suffix: str) -> None:
        path = self.path(sha256, suffix)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other blobs share the folder
            path.parent.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
