"""TVM's thread pool as our runtime sets it up (``rangeprof.profiler.compile.threads``): the
settings ``import rangeprof`` gives a fresh process, a thread count taking effect in the calling
thread's pool, workers left unpinned, and the choice of thread count following which count is
faster (on a clock the test drives: no timing), with a compiled model's outputs the same on
either count."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import tvm
from tvm import relax

from rangeprof.profiler.compile import threads
from rangeprof.profiler.compile.schedules import build
from rangeprof.profiler.compile.threads import (
    FIRST_PROBE,
    LAST_PROBE,
    PROBE_COST,
    RECHECK_S,
    RUN,
    SPIN_COUNT,
    WINDOW,
)
from rangeprof.profiler.ir.importer import import_onnx
from rangeprof.profiler.ir.onnx_load import load_model

from conftest import zoo_model

POOL = ("TVM_NUM_THREADS", "TVM_BIND_THREADS", "TVM_THREAD_POOL_SPIN_COUNT")


def _child(code: str, **env: str) -> str:
    """``code``'s output in a fresh Python, its environment without TVM's pool settings but
    ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in POOL}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_sets_the_pool_settings_and_keeps_the_users():
    show = f"import os, json, rangeprof; print(json.dumps([os.environ.get(k) for k in {POOL}]))"
    assert json.loads(_child(show)) == [str(os.cpu_count()), "0", str(SPIN_COUNT)]
    users = {"TVM_NUM_THREADS": "1", "TVM_BIND_THREADS": "1", "TVM_THREAD_POOL_SPIN_COUNT": "7"}
    assert json.loads(_child(show, **users)) == ["1", "1", "7"]


def test_a_count_takes_effect_in_the_calling_threads_pool():
    code = (
        "import threading, rangeprof, tvm\n"
        "from rangeprof.profiler.compile.threads import use_threads\n"
        "seen = []\n"
        "use_threads(1); seen.append(tvm.runtime.num_threads())\n"
        "use_threads(2); seen.append(tvm.runtime.num_threads())\n"
        "use_threads(1)\n"
        "other = threading.Thread(target=lambda: seen.append(tvm.runtime.num_threads()))\n"
        "other.start(); other.join()\n"
        "seen.append(tvm.runtime.num_threads())\n"
        "print(seen)\n"
    )
    # Another thread's pool is its own, at every thread.
    assert _child(code, TVM_NUM_THREADS="2") == "[1, 2, 2, 1]"


_AFFINITIES = (
    "import json, os, rangeprof\n"
    "from rangeprof.profiler.compile.threads import use_threads\n"
    "use_threads(2)\n"  # starts this thread's pool: its worker exists and is configured
    "tasks = sorted(int(t) for t in os.listdir('/proc/self/task'))\n"
    "print(json.dumps(sorted({len(os.sched_getaffinity(t)) for t in tasks})))\n"
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_workers_are_not_pinned_to_a_core():
    cores = len(os.sched_getaffinity(0))
    assert json.loads(_child(_AFFINITIES, TVM_NUM_THREADS="2")) == [cores]  # every thread
    # TVM's own default pins the worker to one core: what the setting above undoes.
    pinned = json.loads(_child(_AFFINITIES, TVM_NUM_THREADS="2", TVM_BIND_THREADS="1"))
    assert pinned[0] == 1


def _in_a_pool_of_two(monkeypatch, run):
    """``run()`` in a new Python thread, whose TVM pool starts with two workers whatever this
    process's count (one under pytest-xdist)."""
    monkeypatch.setenv("TVM_NUM_THREADS", "2")
    failure = []

    def target():
        try:
            run()
        except BaseException as err:  # re-raised in the test's thread
            failure.append(err)

    worker = threading.Thread(target=target)
    worker.start()
    worker.join()
    if failure:
        raise failure[0]


def _timed_kernel(monkeypatch, seconds):
    """A kernel that takes ``seconds(count)`` on the clock the chooser reads, ``count`` the
    threads it runs on."""
    clock = [0.0]
    monkeypatch.setattr(threads, "perf_counter", lambda: clock[0])

    def kernel():
        clock[0] += seconds(tvm.runtime.num_threads())

    return kernel


def _first_runs_choose(kernel, count: int) -> threads.AdaptiveThreads:
    chooser = threads.AdaptiveThreads(kernel, 2)
    while not chooser.settled:
        chooser()
    assert chooser.threads == count
    return chooser


def test_the_choice_follows_the_faster_count(monkeypatch):
    cost = {2: 1.0, 1: 2.0}  # an idle host: two threads faster
    counts = []
    kernel = _timed_kernel(monkeypatch, lambda count: counts.append(count) or cost[count])

    def scenario():
        chooser = threads.AdaptiveThreads(kernel, 2)
        first = (2 * WINDOW + 1) * RUN
        for _ in range(first - 1):
            chooser()
        assert not chooser.settled
        chooser()
        assert chooser.settled
        for _ in range(RUN * (FIRST_PROBE + 6 * max(FIRST_PROBE, math.ceil(1 / PROBE_COST)) + 3)):
            chooser()
        # Runs on the two counts in turn, then two threads with probe runs on one at intervals
        # that double.
        assert counts[:first] == ([2] * RUN + [1] * RUN) * WINDOW + [2] * RUN
        probes = [i for i in range(first, len(counts)) if counts[i] == 1 and counts[i - 1] == 2]
        assert all(counts[i : i + RUN] == [1] * RUN for i in probes)
        # A probe that loses a run's time (twice as slow) waits until that is PROBE_COST of
        # the time in between, and at least twice as long as the one before.
        second = max(2 * FIRST_PROBE, math.ceil(1 / PROBE_COST))
        assert probes[0] == first + RUN * FIRST_PROBE
        assert np.diff(probes).tolist() == [RUN * (second + 1), RUN * (2 * second + 1)]
        assert chooser.threads == 2

        cost.update({2: 10.0, 1: 2.5})  # a competing load: two threads collapse
        start = len(counts)
        while chooser.threads == 2:
            chooser()
        assert len(counts) - start <= 3 * RUN  # by the end of the second slow run
        # The first probe waits, as after a losing one, by the 3 runs' time a probe loses.
        start = len(counts)
        chooser()
        while counts[-1] == 1:
            chooser()
        assert len(counts) - 1 - start > RUN * 3 / PROBE_COST
        start = len(counts)
        for _ in range(3 * RUN * LAST_PROBE):
            chooser()
        # Probes only, their time at most about PROBE_COST of the whole.
        probe_time = counts[start:].count(2) * cost[2]
        assert probe_time <= 1.1 * PROBE_COST * (counts[start:].count(1) * cost[1] + probe_time)
        probes = [i for i in range(start, len(counts)) if counts[i] == 2 and counts[i - 1] == 1]
        # Each loses three runs' time (4x as slow): the next waits for 3 / PROBE_COST runs.
        assert min(np.diff(probes)) > RUN * 3 / PROBE_COST

        cost.update({2: 1.0, 1: 2.0})  # the load ends
        calls = 0
        while chooser.threads == 1:
            chooser()
            calls += 1
            assert calls <= RUN * (LAST_PROBE + 2)  # the next probe, confirmed at once

    _in_a_pool_of_two(monkeypatch, scenario)


def test_one_thread_wins_through_time_slices_lost(monkeypatch):
    """A sub-ms model on a busy host: two of its first three single-threaded calls lose a time
    slice to another process, while two threads are steadily slower."""
    one_thread = iter([9.0, 1.0, 9.0])
    kernel = _timed_kernel(monkeypatch, lambda c: next(one_thread, 1.0) if c == 1 else 1.5)
    _in_a_pool_of_two(monkeypatch, lambda: _first_runs_choose(kernel, 1))


def test_two_threads_slowed_at_random_lose_to_one(monkeypatch):
    """A busy neighbour takes the other core now and then: every run on two threads holds a
    call faster than one thread's, but their mean is slower."""
    calls = itertools.count()
    kernel = _timed_kernel(monkeypatch, lambda c: (0.8, 3.0)[next(calls) % 2] if c == 2 else 1.2)
    _in_a_pool_of_two(monkeypatch, lambda: _first_runs_choose(kernel, 1))


def test_a_small_models_wake_ups_are_not_timed(monkeypatch):
    """A 1 ms model on a host whose idle core takes 10 ms to come back: two threads' calls in
    the first 10 ms after calls on one run at a third of their speed, then twice one thread's."""
    last = {"count": None, "since": 0.0}

    def seconds(count):
        now = threads.perf_counter()
        if count != last["count"]:
            last.update(count=count, since=now)
        waking = count == 2 and now - last["since"] < 0.01
        return 0.002 if count == 1 else 0.003 if waking else 0.001

    kernel = _timed_kernel(monkeypatch, seconds)
    _in_a_pool_of_two(monkeypatch, lambda: _first_runs_choose(kernel, 2))


def test_probes_of_a_tiny_model_under_a_load_cost_little(monkeypatch):
    """A 20 us model whose calls on two threads are 5x slower: a probe's wake-up calls alone
    take 10 ms, and the probes that follow are put off until each costs PROBE_COST of the time
    in between."""
    spent = {1: 0.0, 2: 0.0}

    def cost(count):
        seconds = 0.00002 if count == 1 else 0.0001
        spent[count] += seconds
        return seconds

    kernel = _timed_kernel(monkeypatch, cost)

    def scenario():
        chooser = _first_runs_choose(kernel, 1)
        spent.update({1: 0.0, 2: 0.0})
        for _ in range(200_000):
            chooser()
        assert spent[2] / (spent[1] + spent[2]) < 2 * PROBE_COST

    _in_a_pool_of_two(monkeypatch, scenario)


def test_a_slow_start_on_two_threads_is_undone_at_the_first_probe(monkeypatch):
    """An idle host where two threads are faster, but their first runs met a busy spell: the
    first probe on two threads wins, is confirmed by the next run, and the choice changes."""
    two_threads = iter([5.0] * (WINDOW + 1) * RUN)  # the first runs' calls on two threads
    kernel = _timed_kernel(monkeypatch, lambda c: next(two_threads, 1.0) if c == 2 else 2.0)

    def scenario():
        chooser = _first_runs_choose(kernel, 1)
        for _ in range(RUN * (FIRST_PROBE + 2)):
            chooser()
        assert chooser.threads == 2

    _in_a_pool_of_two(monkeypatch, scenario)


def test_the_end_of_a_long_busy_spell_is_seen_within_a_recheck(monkeypatch):
    """A 10 ms model: two threads faster on the idle host, 1.5x slower than one during a
    two-minute busy spell (probes that lose a little, their intervals doubled), faster again
    once it ends, and chosen within about :data:`RECHECK_S` of that."""
    busy = [False]
    kernel = _timed_kernel(
        monkeypatch, lambda c: (0.015 if busy[0] else 0.006) if c == 2 else 0.010
    )

    def scenario():
        chooser = _first_runs_choose(kernel, 2)
        busy[0] = True
        end = threads.perf_counter() + 120.0
        while threads.perf_counter() < end:
            chooser()
        assert chooser.threads == 1
        busy[0] = False
        end = threads.perf_counter()
        while chooser.threads == 1:
            chooser()
        assert threads.perf_counter() - end < 1.2 * RECHECK_S

    _in_a_pool_of_two(monkeypatch, scenario)


def test_a_model_runs_alike_on_either_count(monkeypatch):
    executable = build(
        import_onnx(load_model(zoo_model("digits_cnn"), {"image": (4, 1, 8, 8)})).mod
    )
    vm = relax.VirtualMachine(executable, tvm.cpu())
    image = tvm.runtime.tensor(np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32))

    def scenario():
        main = threads.vm_function(vm)
        assert threads.vm_function(vm) is main  # one chooser per VM: its timings persist
        # The first calls run on each count in turn: the same outputs on each.
        outputs = [main(image).numpy() for _ in range(7)]
        for output in outputs[1:]:
            np.testing.assert_array_equal(output, outputs[0])

    _in_a_pool_of_two(monkeypatch, scenario)
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert not isinstance(threads.vm_function(vm), threads.AdaptiveThreads)
