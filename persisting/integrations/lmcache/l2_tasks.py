"""Bookkeeping of the L2 adapter's tasks: ids, finished results, event fds, key locks.

LMCache submits store, lookup-and-lock and load tasks from its controller threads and
learns of their completion through one event fd per kind of task; it then pops (store)
or queries (lookup, load) each result exactly once. Locks taken by lookups are counted
per key and expire, so a lookup whose unlock never comes cannot pin a chunk forever.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from lmcache.v1.platform import create_event_notifier

R = TypeVar("R")

_task_ids = itertools.count()
_task_ids_lock = threading.Lock()


def next_task_id() -> int:
    """A task id unique in this process."""
    with _task_ids_lock:
        return next(_task_ids)


class TaskBoard(Generic[R]):
    """Finished tasks of one kind, and the event fd that signals each finish."""

    def __init__(self) -> None:
        self._notifier = create_event_notifier()
        self._lock = threading.Lock()
        self._done: dict[int, R] = {}

    def fileno(self) -> int:
        return int(self._notifier.fileno())

    def finish(self, task_id: int, result: R) -> None:
        with self._lock:
            self._done[task_id] = result
        self._notifier.notify()

    def pop(self, task_id: int) -> R | None:
        with self._lock:
            return self._done.pop(task_id, None)

    def pop_all(self) -> dict[int, R]:
        with self._lock:
            done, self._done = self._done, {}
        return done

    def close(self) -> None:
        self._notifier.close()


class KeyLocks:
    """Counted locks per key string, each expiring ``ttl_s`` after it was taken."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._deadlines: dict[str, deque[float]] = {}
        self.expired = 0

    def lock(self, text: str) -> None:
        with self._lock:
            self._deadlines.setdefault(text, deque()).append(self._clock() + self.ttl_s)

    def unlock(self, text: str) -> bool:
        """Release one lock of ``text``; False if it held none (never taken, or expired)."""
        with self._lock:
            held = self._deadlines.get(text)
            if not held:
                return False
            held.popleft()
            if not held:
                del self._deadlines[text]
            return True

    def locked(self, text: str) -> bool:
        with self._lock:
            return text in self._deadlines

    def count(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._deadlines.values())

    def expire(self) -> list[str]:
        """One entry per lock past its deadline (forgotten here; the caller releases it)."""
        now = self._clock()
        out: list[str] = []
        with self._lock:
            for text in list(self._deadlines):
                held = self._deadlines[text]
                while held and held[0] <= now:
                    held.popleft()
                    out.append(text)
                if not held:
                    del self._deadlines[text]
            self.expired += len(out)
        return out

    def clear(self) -> list[str]:
        with self._lock:
            out = [text for text, held in self._deadlines.items() for _ in held]
            self._deadlines.clear()
        return out


__all__ = ["KeyLocks", "TaskBoard", "next_task_id"]
