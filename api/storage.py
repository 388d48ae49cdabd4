"""Content-addressed file storage for uploads: ``<root>/<sha256[:2]>/<sha256><suffix>``.

Files are written to ``<root>/tmp`` first, flushed to the disk with the folder they go to, and
renamed into place, so a blob path holds either nothing or the complete file, after a crash too.
Scratch folders there are named by the host and process that made them, so that one left by a
killed process is found and removed (:meth:`BlobStore.reap_scratch`, when a worker starts)
without touching those of live processes sharing the store. The same bytes are stored once
however often they are uploaded; :mod:`rangeprof.service.catalog` deletes a blob when no row
refers to it any more. The root is ``--storage``, else ``RANGEPROF_STORAGE``, else a folder next
to an SQLite database file (``<file>-blobs``) or in the user's data folder for other databases.

:meth:`BlobStore.lock` orders blob writes and deletions against the transactions that refer to
them across every process of this host sharing the store (``rangeprof serve --workers N``,
workers): a file lock on ``<root>/lock``. A full disk is :func:`out_of_space`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .db import data_dir, sqlite_path
from .settings import settings

# A write refused for lack of room: the disk, the user's quota, the process's file size limit.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_space(err: BaseException) -> bool:
    """Whether ``err`` is a write refused for lack of room."""
    return isinstance(err, OSError) and err.errno in _NO_SPACE


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
        self._lock = self.root / "lock"
        self._lock.touch()

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

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the store's lock: one holder at a time among the threads and processes of this
        host (each holder opens the file anew, so threads of one process exclude each other)."""
        with self._lock.open("a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
            yield

    def adopt(self, staged: Path, sha256: str, suffix: str) -> bool:
        """Move a complete file whose sha256 is known into the store; tell whether it is new.
        The file and its folder reach the disk before the rename, and the rename after it."""
        target = self.path(sha256, suffix)
        if target.exists():
            return False
        _fsync(staged)
        if not target.parent.exists():
            target.parent.mkdir(exist_ok=True)
            _fsync(self.root)  # the new folder's entry
        _fsync(target.parent)
        os.replace(staged, target)
        _fsync(target.parent)  # the rename
        return True

    def remove(self, sha256: str, suffix: str) -> None:
        path = self.path(sha256, suffix)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # other blobs share the folder
            path.parent.rmdir()


def _fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
