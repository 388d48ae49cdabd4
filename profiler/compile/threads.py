"""How compiled programs use the host's cores: TVM's thread pool set up to hold up when other
processes compete for the cores, and the thread count chosen while a program runs.

TVM 0.27's pool (``src/runtime/thread_pool.cc``, ``threading_backend.cc``) splits every parallel
kernel into one equal task per thread and waits for the slowest, by default pins each worker to
one core (``TVM_BIND_THREADS``) and lets an idle worker call ``sched_yield`` 300000 times
(``TVM_THREAD_POOL_SPIN_COUNT``) before it sleeps. On a 2-core host where another process keeps
one core busy, the worker pinned there waits a scheduler time slice at every kernel: PP-LCNet
took 300 ms on two threads against 1 ms on one, and a process took minutes to exit, joining a
worker whose every yield lasted a time slice. Unpinned and spinning briefly, two threads under
such a load are still several times slower than one on small models (each kernel waits for
both threads), while faster on an idle host: so the count is chosen by timing the program's
own calls (:class:`AdaptiveThreads`). ``TVM_NUM_THREADS=1`` leaves nothing to choose.

This module imports no TVM at its top: ``import rangeprof`` calls :func:`set_defaults` before
TVM's pool starts, and stays fast.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

# Yields an idle worker makes before it sleeps: on an idle host some 50-200 us, enough to stay
# awake between two kernels of one call; under contention a yield can last a time slice, and
# this bounds how long an idle worker holds on (TVM's default, 300000, for minutes).
SPIN_COUNT = 200
RUN = 3  # consecutive calls on one count, timed together
# Calls on more threads in the first WAKE_S of a run are not timed: the workers' wake-ups on a
# shared virtual machine (some 10 ms, against a 1 ms model's calls).
WAKE_S = 0.01
WINDOW = 3  # the latest timed runs at each count that are compared
# Runs at the chosen count between two probes of the other: doubled after each probe that
# keeps the choice, from the first to the last (or more, for a probe that lost much:
# PROBE_COST), back to the first after a change.
FIRST_PROBE, LAST_PROBE = 8, 1024
# On one thread, whose runs are not timed, only a probe sees a busy spell end: probes that
# lost little are at most this many seconds apart (doubled up to LAST_PROBE, a 10 ms model's
# are 30 s apart).
RECHECK_S = 1.0
# The largest share of the time between two probes that the time a losing probe lost may be:
# a probe much slower than the choice (two threads under a load: 3-6x) puts the next one off.
PROBE_COST = 1 / 32
_KBIG = 1  # TVM's ThreadGroup::AffinityMode kBig: every core of the fastest kind

_applied = threading.local()  # the count this thread's TVM pool was last set to


def set_defaults() -> None:
    """TVM's pool settings unless the environment has its own; read when a thread's pool starts.

    Every core (on x86 TVM halves the count for hyper-threading unless told, which leaves one
    worker on a 2-core machine); workers not pinned to a core, so that the kernel's scheduler
    moves them away from a busy one; a short spin (:data:`SPIN_COUNT`)."""
    os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
    os.environ.setdefault("TVM_BIND_THREADS", "0")
    os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", str(SPIN_COUNT))


def most_threads() -> int:
    """The threads TVM's pool has (``TVM_NUM_THREADS``, else every core)."""
    value = os.environ.get("TVM_NUM_THREADS", "")
    return max(1, int(value)) if value.isdigit() else os.cpu_count() or 1


def use_threads(count: int) -> None:
    """Runs the calling thread's next TVM kernels on ``count`` threads (at most the pool's);
    each Python thread has a pool of its own."""
    if getattr(_applied, "count", None) == count:
        return
    import tvm

    tvm.get_global_func("runtime.config_threadpool")(_KBIG, count)
    _applied.count = count


class AdaptiveThreads:
    """A compiled function run on whichever of ``most`` (more than one) threads and one is
    faster now.

    Calls go in runs on one count. A run on one thread is :data:`RUN` calls, as fast as its
    fastest: other processes only ever slow a call down, by a time slice (ms) here and there. A
    run on more threads is as fast as the mean of its :data:`RUN` - 1 calls after its first and
    after its first :data:`WAKE_S`. Those pay the wake-ups: a core left idle is slow to come
    back on a shared virtual machine (on a 2-vCPU EPYC, after a pause of a few hundred ms, a
    worker that sleeps between kernels takes ~10 ms to run at speed), so calls on more threads
    right after calls on one measure the wake-ups and not the count. The mean of the others: a
    load, or a host that lends the other core away now and then, slows most of them, each by
    its own amount (on a Zen 3 host the fastest of three two-thread calls beat one thread where
    their mean was 1.5x slower).

    The first runs alternate between the two counts (the first on more threads, whose first
    call, untimed, also pays the allocations and the pool's start) until each has :data:`WINDOW`
    of them; then runs are on the faster count, and one run now and then, at intervals that
    double while the choice holds (on one thread, at most :data:`RECHECK_S` apart), on the
    other. One thread's speed is the fastest of its latest runs, more threads' the median of
    theirs. So the choice leans to one thread, which cannot collapse, and runs on more threads
    are all timed: a load that starts makes them slower than one thread and the choice changes
    at the end of the second slow run. Runs on one thread that was chosen are not timed, which
    keeps a small model's calls as cheap as a plain call. A probe faster than the choice is
    followed at once by another, so a better count (a load that ended, a noisy start) is taken
    within two runs; a probe slower than the choice puts the next one off until its loss is at
    most :data:`PROBE_COST` of the time in between, and so does a change of the choice after the
    first runs, by the loss a probe of the count left would make (a load that starts is not
    probed again a few runs later)."""

    def __init__(self, function: Callable, most: int):
        self._function = function
        self._counts = (most, 1)
        self._times = {count: deque(maxlen=WINDOW) for count in self._counts}
        self.threads, self._other = most, 1  # the count chosen, the count probed
        self._plan = [most, 1] * WINDOW + [most]  # the first runs' counts, last first
        self._interval = self._left = FIRST_PROBE  # runs between probes, runs to the next
        self._first_choice = True
        self._limit = 0.0  # the other count's speed: a slower run may change the choice
        self._count, self._calls = most, 0  # the run going on: its count, timed calls left,
        self._started: float | None = None  # when its first call started,
        self._timed: list[float] = []  # its timed calls' seconds,
        self._speed, self._spent = float("inf"), 0.0  # its speed once over, its seconds

    @property
    def settled(self) -> bool:
        """Whether the first runs, which alternate between the counts, are over."""
        return not self._plan and not self._calls

    def __call__(self, *args: Any) -> Any:
        if not self._calls:
            self._next_run()
        count = self._count
        use_threads(count)
        if count == self.threads == 1 and not self._plan:
            self._calls -= 1
            return self._function(*args)
        start = perf_counter()
        if self._started is None:
            self._started = start
        result = self._function(*args)
        seconds = perf_counter() - start
        self._spent += seconds
        if count == 1 or start - self._started >= WAKE_S:
            self._timed.append(seconds)
            self._calls -= 1
        if not self._calls:
            self._end_run(count)
        return result

    def _next_run(self) -> None:
        if self._plan:
            self._count = self._plan.pop()
        else:
            self._left -= 1
            self._count = self.threads if self._left >= 0 else self._other
        self._calls = RUN if self._count == 1 else RUN - 1
        self._started, self._timed, self._spent = None, [], 0.0

    def _end_run(self, count: int) -> None:
        timed = self._timed
        self._speed = min(timed) if count == 1 else sum(timed) / len(timed)
        self._times[count].append(self._speed)
        if not self._plan and (count != self.threads or self._speed > self._limit):
            self._decide(count)

    def _decide(self, count: int) -> None:
        """The choice after a run on ``count`` threads: a probe, the last of the first runs,
        or a run slower than the other count."""
        speed = {c: min(t) if c == 1 else sorted(t)[len(t) // 2] for c, t in self._times.items()}
        before = self.threads
        self.threads = min(self._counts, key=speed.__getitem__)
        self._other = next(c for c in self._counts if c != self.threads)
        self._limit = speed[self._other]
        if self.threads != before:
            # After the first runs (a noisy start: probed soon), a change means the other count
            # became slower: probing it costs that much, and waits as a losing probe does.
            lost = 0.0 if self._first_choice else speed[self._other] / speed[self.threads] - 1
            self._interval = self._left = max(FIRST_PROBE, math.ceil(lost / PROBE_COST))
        elif count != before and self._speed < speed[before]:  # a probe faster than the choice
            self._left = 0
        elif count != before:  # a probe slower than the choice
            lost = self._spent / (RUN * speed[before]) - 1  # in runs at the chosen count
            longest = LAST_PROBE if before != 1 else self._recheck_runs(speed[before])
            wait = max(min(2 * self._interval, longest), math.ceil(lost / PROBE_COST))
            self._interval = self._left = wait
        self._first_choice = False

    @staticmethod
    def _recheck_runs(seconds: float) -> int:
        """The most runs of ``seconds`` calls on one thread between probes that lost little:
        :data:`RECHECK_S` of them (more threads' runs are timed, and see a load start)."""
        return min(LAST_PROBE, max(FIRST_PROBE, math.ceil(RECHECK_S / (RUN * seconds))))


_functions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vm_function(vm, name: str = "main") -> Callable:
    """``vm[name]`` run on the thread count that is faster now (:class:`AdaptiveThreads`), the
    same object on every call for one VM, so that its timings persist; ``vm[name]`` itself when
    the pool has one thread."""
    most = most_threads()
    if most == 1:
        return vm[name]
    functions = _functions.setdefault(vm, {})
    if name not in functions:
        functions[name] = AdaptiveThreads(vm[name], most)
    return functions[name]
