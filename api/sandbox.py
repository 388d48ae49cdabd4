"""Uploads analysed in child processes (:mod:`rangeprof.service.analysis`) under a wall-time and a
memory limit (``RANGEPROF_ANALYSIS_S``, ``RANGEPROF_ANALYSIS_MB``): a model whose analysis would
take an hour, or a data file whose check would take gigabytes, costs one refused upload (422
naming the limit) and nothing else. No lock is held while a child works, so other uploads are
answered meanwhile; the server's memory stays its own; and :func:`start` has SIGTERM kill the
children at once, so that the server stops within seconds whatever they are doing.

A model's analysis imports TVM, seconds of work: a child analyses models one after another, as
the server itself once did, until one of them goes wrong (past a limit, or its process dies: it
is killed) or it has served :data:`_USES`; one is kept ready for the next upload. The wall time
counts from the task, not from the start of its child. A data check, which imports little, has
a process of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any

from fastapi import HTTPException, status

from rangeprof.profiler.errors import RangeprofError
from rangeprof.profiler.profiling.data import DataContentError
from rangeprof.profiler.settings import PREFIX

from .analysis import MODEL
from .memory import MB
from .settings import settings

# A child's imports, before its task's clock starts: generous, a loaded host is slow. Past it,
# the upload is refused as if the task had taken too long.
_START_S = 300.0
_TIMEOUT = "timeout"
_USES = 50  # model analyses a child serves, then a fresh one: whatever it kept goes with it
_IDLE = 2  # model analysis processes kept ready at most (about 140 MB each)


class _Child:
    """A child process and its answers, read by a thread of their own."""

    def __init__(self, task: str):
        self.task, self.uses = task, 0
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rangeprof.service.analysis", task],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.answers: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            with self.process.stdout:
                for line in self.process.stdout:
                    self.answers.put(json.loads(line))
        finally:
            self.answers.put(None)  # the child is gone

    def answer(self, args: dict, seconds: float, memory: int) -> dict | str | None:
        """Its answer to ``args`` within ``seconds``: a message, ``None`` if it died,
        :data:`_TIMEOUT`."""
        self.uses += 1
        try:
            if self.answers.get(timeout=_START_S) is None:  # ready, once imported
                return None
            try:
                task = {"args": args, "memory": memory, "settings": _settings()}
                self.process.stdin.write(json.dumps(task) + "\n")
                self.process.stdin.flush()
            except OSError:
                pass  # it died: its answers end, which says so
            return self.answers.get(timeout=seconds)
        except queue.Empty:
            return _TIMEOUT

    def end(self) -> int:
        """Kill it (if it still runs) and reap it; its exit code."""
        self.process.kill()
        code = self.process.wait()
        with contextlib.suppress(OSError):  # a task it never read
            self.process.stdin.close()
        return code


def _settings() -> dict[str, str]:
    """The settings in this process's environment now: a child started earlier reads them as
    the server would (they are read afresh at each call)."""
    return {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}


class _Children:
    """This process's children, the idle model analyses among them. :meth:`stop` takes no
    lock: it runs in a signal handler, possibly while another thread holds the lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self._all: set[_Child] = set()
        self._idle: list[_Child] = []
        self.stopping = False

    def warm(self) -> None:
        """Start a model analysis process unless one is idle."""
        with self._lock:
            if not self.stopping and not self._idle:
                self._idle.append(self._start(MODEL))

    def take(self, task: str) -> _Child:
        with self._lock:
            if self.stopping:
                raise _stopping()
            child = None
            while task == MODEL and self._idle and child is None:
                child = self._idle.pop()  # the latest: the most likely to be ready
                if child.process.poll() is not None:  # one that died idle: reap it
                    self._drop(child)
                    child = None
            if child is None:
                child = self._start(task)
        if task == MODEL:
            self.warm()
        return child

    def give_back(self, child: _Child, reusable: bool) -> int | None:
        """``child`` after its task: idle again when ``reusable`` (its task ended as asked),
        room is left and it has uses left; else ended (its exit code)."""
        with self._lock:
            keep = reusable and child.task == MODEL and child.uses < _USES
            if keep and not self.stopping and len(self._idle) < _IDLE:
                self._idle.append(child)
                return None
            return self._drop(child)

    def _start(self, task: str) -> _Child:
        child = _Child(task)
        self._all.add(child)
        if self.stopping:  # stop() ran meanwhile and did not see it
            child.process.kill()
        return child

    def _drop(self, child: _Child) -> int:
        self._all.discard(child)
        return child.end()

    def stop(self) -> None:
        """Kill every child now, and start none from now on: the server is stopping."""
        self.stopping = True
        for child in list(self._all):
            child.process.kill()


_CHILDREN = _Children()


def _stopping() -> HTTPException:
    return HTTPException(
        status.HTTP_503_SERVICE_UNAVAILABLE,
        "the server is stopping; retry shortly",
        headers={"Retry-After": "5"},
    )


def run(task: str, what: str, **args: Any) -> Any:
    """``analysis.TASKS[task](**args)`` in a child process under this server's limits; ``what``
    names the work in its refusals (``"the model's analysis"``)."""
    current = settings()
    seconds, memory = current.analysis_s, current.analysis_mb
    child = _CHILDREN.take(task)
    answer = None
    try:
        answer = child.answer(args, seconds, memory * MB)
    finally:
        ended = isinstance(answer, dict) and ("done" in answer or "refused" in answer)
        code = _CHILDREN.give_back(child, ended)
    if answer == _TIMEOUT:
        raise _refused(f"{what} took longer than this server's limit of {seconds:g} s")
    if answer is None:
        if _CHILDREN.stopping:
            raise _stopping()
        died = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise _refused(
            f"{what} failed: its process died ({died}) within this server's limits of "
            f"{seconds:g} s and {memory} MB"
        )
    if "memory" in answer:
        raise _refused(f"{what} needed more memory than this server's limit of {memory} MB")
    if "refused" in answer:
        raise (DataContentError if answer["content"] else RangeprofError)(answer["refused"])
    if "failed" in answer:
        raise RuntimeError(f"{what}: {answer['failed']}")  # our bug: a server error
    return answer["done"]


def _refused(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)


def start() -> None:
    """At the server's start: a model analysis process starts importing, so that the first
    upload finds one ready; SIGINT and SIGTERM kill the analyses in progress before doing what
    they did (uvicorn's graceful shutdown, which waits for the requests in progress: those then
    answer 503 at once). Only the main thread sets handlers: a server in a thread (tests) keeps
    its own."""
    _CHILDREN.warm()
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(signum)
        if callable(previous):
            signal.signal(signum, functools.partial(_stop_then, previous))


def _stop_then(previous, signum: int, frame) -> None:
    _CHILDREN.stop()
    previous(signum, frame)
