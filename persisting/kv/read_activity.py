"""Reads in flight, so the store's background disk writes can give way to them.

A get is on a request's critical path (an engine waits for the prefix it restores); a
write-behind is not (the value is already readable from memory). On a machine with few
cores both compete for the same CPUs: copying a batch of values into the page cache took
46% of the CPU samples of a read phase that ran beside it in LMCache's storage-backend
harness (``docs/lmcache.md``). So the write-behind thread waits, before each batch, until
no read is in flight, for at most a bounded time: a store that is read without pause
still writes every value, only later.
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
        #: Seconds background writers spent waiting for reads to finish.
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


__all__ = ["ReadActivity"]
