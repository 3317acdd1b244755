"""Which CPUs the CPU worker's own threads run on.

vLLM's CPU backend binds each OpenMP thread of a worker process to one CPU, the process's
main thread included: libgomp applies ``GOMP_CPU_AFFINITY`` (libiomp ``KMP_AFFINITY``) as
it loads, before any of the connector's code runs. Linux gives a new thread the CPU mask of
the thread that starts it, and the connector's job and read threads are started from that
main thread: left alone, every one of them would run on the main thread's single CPU. A
load's blocks, meant to be read in parallel, would then be read one at a time, each thread
taking turns with the main thread -- which busy-polls vLLM's message queue between engine
steps while a request waits for its blocks. So each of the worker's threads widens its own
mask, as it starts, to every CPU some thread of the process may run on (the CPUs vLLM gave
the engine's OpenMP threads): never beyond what the engine was allowed (``taskset``, a
cgroup's cpuset), and vLLM's own threads keep their binding.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

_TASKS = "/proc/self/task"


def process_cpus() -> frozenset[int] | None:
    """The CPUs any thread of this process may run on; None where threads' masks cannot be
    read (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return None
    cpus: set[int] = set()
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            cpus |= os.sched_getaffinity(int(task))
    return frozenset(cpus) or None


def run_on(cpus: Collection[int] | None) -> None:
    """Let the calling thread run on ``cpus`` (a thread pool's initializer); nothing when
    ``cpus`` is None or the mask cannot be set."""
    if cpus and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)


__all__ = ["process_cpus", "run_on"]
