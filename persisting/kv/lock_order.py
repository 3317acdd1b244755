"""The order a KV store takes its locks in, and a checker of it for tests.

A thread holding one of these locks takes only locks further down the list (or one it
already holds: all of them but the metadata table's are re-entrant):

1. ``MetadataTable._commit_lock`` -- one commit of a table's pending rows at a time; a
   commit takes the metadata lock below (through the disk tier's guard).
2. ``SharedUsage`` metadata lock -- the ``.metadata.lock`` ``flock`` and the re-entrant
   thread lock around it: one metadata change at a time, across processes.
3. ``SharedUsage`` usage lock -- the ``.lock`` ``flock`` and its re-entrant thread lock:
   the directory's byte counter; eviction runs under it.
4. ``Tiers.lock`` -- the memory tier's index, and a step over both tiers as one; never held
   across disk I/O, so never while a ``flock`` (which may wait for another process's I/O)
   is taken.
5. ``DiskTier._lock`` -- the disk index (every reader and writer of it, its entries and
   their leases) and the keys being written.
6. ``MetadataTable._lock`` -- the table's pending rows and deletions.

Every other lock of the store (its counters, the write-behind's queue, the thread pools'
start locks, the shared pool's allocator) is a leaf: nothing is taken while it is held.

Set ``PERSISTING_CHECK_LOCK_ORDER=1`` (or use :func:`checking`) before a store opens and
its locks record, per thread, what each acquisition was taken under: an acquisition of a
lock at or above one already held (other than a re-entry) is an inversion, logged in
:data:`LOG`. Off (the default), :func:`ordered` returns the lock itself: no cost.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar, cast


class Rank(IntEnum):
    """Where a lock comes in the order (a lower rank is taken first)."""

    METADATA_COMMIT = 1
    METADATA_FLOCK = 2
    USAGE_FLOCK = 3
    TIERS = 4
    DISK_INDEX = 5
    METADATA_PENDING = 6


@dataclass
class LockOrderLog:
    """What checked locks saw: every (held, taken) pair of ranks, and the inversions."""

    pairs: set[tuple[Rank, Rank]] = field(default_factory=set)
    inversions: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, held: Rank, taken: Rank, thread: str) -> None:
        with self._lock:
            self.pairs.add((held, taken))
            if held >= taken:
                self.inversions.append(f"{thread}: took {taken.name} while holding {held.name}")


#: Where checked locks report (a new log per :func:`checking` block).
LOG = LockOrderLog()
_enabled = os.environ.get("PERSISTING_CHECK_LOCK_ORDER", "") not in ("", "0")
_held = threading.local()

L = TypeVar("L")


class _CheckedLock:
    """A lock that records what its holder already held when it was taken."""

    __slots__ = ("_lock", "rank")

    def __init__(self, rank: Rank, lock: Any):
        self.rank = rank
        self._lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        stack: list[_CheckedLock] = _stack()
        if self not in stack:  # a re-entry waits for nothing
            name = threading.current_thread().name
            for held in stack:
                LOG.record(held.rank, self.rank, name)
        got = bool(self._lock.acquire(blocking, timeout))
        if got:
            stack.append(self)
        return got

    def release(self) -> None:
        self._lock.release()
        stack = _stack()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is self:
                del stack[i]
                break

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _stack() -> list[_CheckedLock]:
    stack = getattr(_held, "stack", None)
    if stack is None:
        stack = _held.stack = []
    return cast("list[_CheckedLock]", stack)


def ordered(rank: Rank, lock: L) -> L:
    """``lock``, checked against the order when checking is on (else ``lock`` itself)."""
    return cast("L", _CheckedLock(rank, lock)) if _enabled else lock


@contextmanager
def checking() -> Iterator[LockOrderLog]:
    """Check the locks of stores opened in this block; yields the log they report to."""
    global LOG, _enabled
    before = LOG, _enabled
    LOG, _enabled = LockOrderLog(), True
    try:
        yield LOG
    finally:
        LOG, _enabled = before


__all__ = ["LOG", "LockOrderLog", "Rank", "checking", "ordered"]
