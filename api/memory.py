"""A process's memory limit, and telling its overrun from other failures: the child processes
of the service (an upload's analysis, a job) run under an address-space limit (``RLIMIT_AS``),
so that one of them can fail, never the host or the server.

Address space, not resident memory, is what Linux can limit per process. glibc reserves 64 MB
of address space for each thread's malloc arena, which would count against the limit for every
thread a library starts: a limited process keeps two arenas, so the limit measures what is
allocated.

An allocation over the limit fails as whatever the allocating library makes of it: numpy's
``MemoryError``, a ``RuntimeError("Unable to allocate ...")`` when numpy runs inside a TVM
callback, TVM's ``std::bad_alloc``; :func:`out_of_memory` knows these.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource

MB = 1 << 20
_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter
_ALLOCATION_FAILED = re.compile(
    r"MemoryError|Unable to allocate|bad_alloc|Cannot allocate memory|out of memory", re.I
)


def address_space() -> int:
    """This process's address space now, in bytes (``VmSize``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def limit_address_space(limit: int) -> None:
    """Allocations that would take this process past ``limit`` bytes of address space fail
    from now on (the soft limit: our code may set another for its next task)."""
    with contextlib.suppress(AttributeError, OSError):  # not glibc: no arenas to cap
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, _ARENAS)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def release_memory() -> None:
    """Hand the heap's free memory back to the system (between two tasks of one process)."""
    gc.collect()
    with contextlib.suppress(AttributeError, OSError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is an allocation that failed."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, MemoryError) or _ALLOCATION_FAILED.search(f"{type(err)} {err}"):
            return True
        err = err.__cause__ or err.__context__
    return False
