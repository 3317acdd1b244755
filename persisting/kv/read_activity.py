"""Reads in flight, so the store's background disk writes can give way to them.

A get is on a request's critical path (an engine waits for the prefix it restores); a
write-behind is not (the value is already readable from memory). On a machine with few
cores both compete for the same CPUs: copying a batch of values into the page cache took
46% of the CPU samples of a read phase that ran beside it in LMCache's storage-backend
harness (``docs/lmcache.md``). So a write-behind batch gives way to reads in flight
(:meth:`ReadActivity.give_way`): before it starts, and between the pieces of every file it
writes (a batch already under way when reads begin stops within one piece, instead of
copying up to 256 MiB beside them). Each batch waits at most a bounded time in all: a
store that is read without pause still writes every value, only later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ReadActivity:
    """A count of reads in flight that a background writer can wait on."""

    def __init__(self) -> None:
        self._in_flight = 0
        self._quiet = threading.Condition()
        #: Seconds background writer threads spent waiting for reads to finish (summed
        #: over threads: a batch's files wait on several at once).
        self.yielded_s = 0.0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Mark a read as in flight while the block runs."""
        with self._quiet:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._quiet:
                self._in_flight -= 1
                if not self._in_flight:
                    self._quiet.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def wait_quiet(self, limit_s: float) -> float:
        """Wait until no read is in flight, or ``limit_s`` seconds; returns the wait."""
        start = time.monotonic()
        deadline = start + limit_s
        with self._quiet:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._quiet.wait(left)
            waited = time.monotonic() - start
            self.yielded_s += waited
        return waited

    def give_way(self, limit_s: float) -> GiveWay:
        """An allowance of ``limit_s`` seconds of waiting for reads, for one background job
        (one write-behind batch): see :class:`GiveWay`."""
        return GiveWay(self, limit_s)


class GiveWay:
    """Called by a background job between its steps (on any of its threads): returns at
    once while no read is in flight, else waits until none is, for as long as the job's
    allowance lasts. The allowance runs from the first wait, shared by every thread of the
    job, so the job is held ``limit_s`` seconds at most in all, however many steps wait."""

    def __init__(self, reads: ReadActivity, limit_s: float):
        self._reads = reads
        self._limit_s = limit_s
        self._deadline: float | None = None
        self._lock = threading.Lock()

    def __call__(self) -> None:
        if not self._reads.in_flight:  # the common case: one attribute read, no lock
            return
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self._limit_s
            left = self._deadline - time.monotonic()
        if left > 0:
            self._reads.wait_quiet(left)


__all__ = ["GiveWay", "ReadActivity"]
