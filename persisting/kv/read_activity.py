"""Reads and transfers in flight, so the store's background disk writes can give way to them.

A get is on a request's critical path (an engine waits for the prefix it restores), and so
is a remote client's put while its bytes land (the client waits for the answer); a
write-behind is not (the value is already readable from memory). On a machine with few
cores both compete for the same CPUs: copying a batch of values into the page cache took
46% of the CPU samples of a read phase that ran beside it in LMCache's storage-backend
harness (``docs/lmcache.md``), and writing each remote put behind it halved the rate of a
burst of 8 MiB remote puts (``docs/service.md``). So a write-behind batch gives way
(:meth:`ReadActivity.give_way`): before it starts it waits until the store has been quiet
-- nothing in flight, and nothing ended within :data:`LINGER_S` (requests that follow one
another are one burst) -- and not at all once a full batch has queued up; between the
pieces of every file it writes it stops while reads are in flight (a batch already under
way when reads begin stops within one piece, instead of copying up to 256 MiB beside
them). Each batch waits at most a bounded time in all: a store that is read or written
without pause still writes every value, only later and in larger batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: How long the store counts as busy after its last read or transfer ended.
LINGER_S = 0.05


class ReadActivity:
    """A count of reads (and transfers) in flight that a background writer can wait on."""

    def __init__(self, linger_s: float = LINGER_S) -> None:
        self.linger_s = linger_s
        self._in_flight = 0
        self._last_end = float("-inf")
        self._quiet = threading.Condition()
        #: Seconds background writer threads spent waiting for reads to finish (summed
        #: over threads: a batch's files wait on several at once).
        self.yielded_s = 0.0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Mark a read (or a transfer on a request's critical path) as in flight while the
        block runs."""
        with self._quiet:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._quiet:
                self._in_flight -= 1
                self._last_end = time.monotonic()
                if not self._in_flight:
                    self._quiet.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def busy(self) -> bool:
        """Whether anything is in flight or ended within ``linger_s``."""
        return bool(self._in_flight) or time.monotonic() - self._last_end < self.linger_s

    def wait_quiet(self, limit_s: float, enough: Callable[[], bool] | None = None) -> float:
        """Wait until nothing is in flight and nothing ended for ``linger_s``, or
        ``limit_s`` seconds, or ``enough()`` (checked at least every ``linger_s``) is
        true; returns the wait."""
        start = time.monotonic()
        deadline = start + limit_s
        with self._quiet:
            while True:
                now = time.monotonic()
                if now >= deadline or (enough is not None and enough()):
                    break
                idle = now - self._last_end
                if not self._in_flight and idle >= self.linger_s:
                    break
                step = self.linger_s if self._in_flight else self.linger_s - idle
                self._quiet.wait(min(max(step, 0.001), deadline - now))
        waited = time.monotonic() - start
        self.yielded_s += waited
        return waited

    def give_way(self, limit_s: float, enough: Callable[[], bool] | None = None) -> GiveWay:
        """An allowance of ``limit_s`` seconds of waiting for reads, for one background job
        (one write-behind batch) that stops waiting once ``enough()``: see :class:`GiveWay`."""
        return GiveWay(self, limit_s, enough)


class GiveWay:
    """Waits of one background job for reads, within one allowance of ``limit_s`` seconds
    that runs from the first wait and is shared by every thread of the job (so the job is
    held ``limit_s`` at most in all, however many steps wait). :meth:`before` waits for a
    quiet store before the job starts, unless ``enough()`` says the job may not wait (a full
    batch queued, a flush waiting); calling the object between its steps returns at once
    while no read is in flight, else waits until none is -- unless the job started without
    waiting for a busy store because of ``enough()``: a job that is behind stays behind no
    longer than it must."""

    def __init__(
        self, reads: ReadActivity, limit_s: float, enough: Callable[[], bool] | None = None
    ):
        self._reads = reads
        self._limit_s = limit_s
        self._enough = enough
        self._deadline: float | None = None
        self._behind = False
        self._lock = threading.Lock()

    def before(self) -> None:
        """Wait until the store has been quiet (see :meth:`ReadActivity.wait_quiet`)."""
        self._wait(self._enough)
        self._behind = self._enough is not None and self._enough() and self._reads.busy()

    def __call__(self) -> None:
        if self._behind or not self._reads.in_flight:  # common: one attribute read, no lock
            return
        self._wait(None)

    def _wait(self, enough: Callable[[], bool] | None) -> None:
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self._limit_s
            left = self._deadline - time.monotonic()
        if left > 0:
            self._reads.wait_quiet(left, enough)


__all__ = ["LINGER_S", "GiveWay", "ReadActivity"]
