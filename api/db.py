"""The database connection: which URL, an engine tuned per backend, and short sessions.

The URL comes from ``--db``, else ``RANGEPROF_DB``, else an SQLite file in the user's data
folder. SQLite runs in WAL mode (readers never wait for the writer) with foreign keys on, and
every transaction of :meth:`Database.session` starts with ``BEGIN IMMEDIATE``: a transaction
that reads and then writes would otherwise fail with "database is locked" instead of waiting
when another connection wrote in between. :meth:`Database.read` transactions only read, and
start with a plain ``BEGIN``: they do not queue behind each other for the write lock. PostgreSQL
URLs use psycopg 3. The pool holds as many connections as the server has request threads.

Errors that can pass (:func:`transient`: a connection lost, a serialization failure, a locked
SQLite, a full disk) are what :meth:`Database.retried` tries again, with backoff, for
``RANGEPROF_DB_RETRY_S``; the worker's reads and writes go through it.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import platformdirs
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool

from rangeprof.profiler.errors import RangeprofError

from .settings import settings

_SQLITE_BUSY_TIMEOUT_S = 30
# anyio's default of 40 threads runs the sync request handlers: one connection each at most.
_POOL = {"pool_size": 8, "max_overflow": 32}
_READ_ONLY = "rangeprof_read_only"  # execution option of Database.read's connections
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 0.05, 2.0  # between tries of Database.retried
_DISK_FULL, _FOREIGN_KEY = "53100", "23503"  # PostgreSQL's SQLSTATEs
T = TypeVar("T")
log = logging.getLogger(__name__)


class DatabaseUrlError(RangeprofError):
    """The database URL is malformed or names a backend we do not support."""


def transient(err: BaseException) -> bool:
    """Whether a later try can get past database error ``err``: a connection lost (a restart, a
    killed backend), a serialization failure or a deadlock, a locked SQLite, a full disk; not a
    constraint or a statement the database refuses."""
    if isinstance(err, OperationalError | InterfaceError):
        return True
    return isinstance(err, DBAPIError) and err.connection_invalidated


def disk_full(err: BaseException) -> bool:
    """Whether database error ``err`` says the database's disk is full."""
    cause = getattr(err, "orig", None)
    if getattr(cause, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return True
    return getattr(cause, "sqlstate", None) == _DISK_FULL


def foreign_key_violation(err: BaseException) -> bool:
    """Whether database error ``err`` is a row referring to one that does not exist (any more)."""
    cause = getattr(err, "orig", None)
    if getattr(cause, "sqlite_errorcode", None) == sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY:
        return True
    return getattr(cause, "sqlstate", None) == _FOREIGN_KEY


def data_dir() -> Path:
    """Where the embedded defaults live (database, blobs)."""
    return Path(platformdirs.user_data_dir("rangeprof"))


def database_url(given: str | None = None) -> str:
    """The URL to use: ``given``, else ``$RANGEPROF_DB``, else the default SQLite file."""
    return given or settings().db or f"sqlite:///{data_dir() / 'rangeprof.db'}"


def sqlite_path(url: str) -> Path | None:
    """The file of an SQLite URL; ``None`` for other backends."""
    parsed = make_url(url)
    return Path(parsed.database) if parsed.get_backend_name() == "sqlite" else None


def make_engine(url: str) -> Engine:
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(f"malformed database URL {url!r}") from None
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        return create_engine(
            parsed.set(drivername="postgresql+psycopg"), pool_pre_ping=True, **_POOL
        )
    if backend != "sqlite":
        raise DatabaseUrlError(
            f"unsupported database {backend!r} in {parsed.render_as_string()!r}; "
            "use sqlite:///FILE or postgresql://USER@HOST/DB"
        )
    if not parsed.database or parsed.database == ":memory:":
        raise DatabaseUrlError(
            f"{url!r}: an in-memory database cannot be shared by the server and its worker; "
            "give a file, e.g. sqlite:///rangeprof.db"
        )
    Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        parsed, connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_S}, poolclass=QueuePool, **_POOL
    )

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record):
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves, below
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection):
        read_only = connection.get_execution_options().get(_READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


class Database:
    """An engine and its sessions; one per process and URL."""

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        reader = self.engine.execution_options(**{_READ_ONLY: True})
        self._readers = sessionmaker(reader, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with self._sessions.begin() as session:
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A transaction that only reads (the GET routes): on SQLite it takes no write lock."""
        with self._readers.begin() as session:
            yield session

    def on_flush(self, check: Callable[[Session], None]) -> None:
        """Call ``check(session)`` before each flush of a :meth:`session`: a check that must
        see, and lock, what its transaction is about to write (it may raise to refuse it)."""
        event.listen(self._sessions, "before_flush", lambda session, *_: check(session))

    def retried(self, call: Callable[[], T], what: str, stop: threading.Event | None = None) -> T:
        """``call()`` (whole transactions: a failed one was rolled back), tried again while it
        fails with a :func:`transient` error, pausing twice as long each time, for up to
        ``RANGEPROF_DB_RETRY_S`` seconds; then its last error is raised. Once ``stop`` is set
        (the worker stopping), a failed try is not tried again."""
        deadline = time.monotonic() + settings().db_retry_s
        pause, waiting = _FIRST_PAUSE_S, stop or threading.Event()
        while True:
            try:
                return call()
            except DBAPIError as err:
                late = time.monotonic() + pause > deadline
                if waiting.is_set() or late or not transient(err):
                    raise
                reason = next(iter(str(err.orig).strip().splitlines()), type(err.orig).__name__)
                log.warning("%s: %s; trying again in %.2f s", what, reason, pause)
            waiting.wait(pause)
            pause = min(2 * pause, _LONGEST_PAUSE_S)

    def dispose(self) -> None:
        self.engine.dispose()
