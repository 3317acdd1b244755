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
them). A batch that started behind (a full batch queued) still stops for reads between
pieces, but not for puts landing (:meth:`ReadActivity.landing`): a store written without
pause must write as fast as it is written, or its backlog grows. A writer that is behind
waits for a burst of reads to end, not only for the read in flight: reads that follow one
another within :data:`LINGER_S` are one burst, and a writer let in at each gap between
two of them (a 4 MiB piece, an fsync) slowed the next. Each batch waits at most
a bounded time in all: a store that is read or written without pause still writes every
value, only later and in larger batches.

Measured in LMCache's harness as shipped (48 writes of 28 MiB, then 48 reads, concurrency
4, medians of per-round ratios to LocalDisk): while a batch that started behind wrote
beside the reads, the plugin read at 0.75x (5 rounds) and 0.78x (3); with such a batch
stopping for reads between its pieces 0.80x (3); with the next batch waiting for the
reads too 0.85x (3); with nothing written behind (``durability = "write_back"``) 1.01x
(3). With each file's fsync also waiting for reads, and a writer that is behind staying
out of the gaps between reads too, 1.12x (5 rounds; ``docs/lmcache.md``).
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
        self._landing = 0  # of those, puts whose bytes are landing
        self._last_end = float("-inf")
        self._last_read_end = float("-inf")  # of a read (puts landing left out)
        self._quiet = threading.Condition()
        #: Seconds background writer threads spent waiting for reads to finish (summed
        #: over threads: a batch's files wait on several at once).
        self.yielded_s = 0.0

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Mark a read (or a value being sent on a request's critical path) as in flight
        while the block runs."""
        with self._marked(landing=False):
            yield

    @contextmanager
    def landing(self) -> Iterator[None]:
        """Mark a put whose bytes are landing (a remote client waits for its answer) as in
        flight: a writer that is not behind waits for it as for a read."""
        with self._marked(landing=True):
            yield

    @contextmanager
    def _marked(self, landing: bool) -> Iterator[None]:
        with self._quiet:
            self._in_flight += 1
            self._landing += landing
        try:
            yield
        finally:
            with self._quiet:
                self._in_flight -= 1
                self._landing -= landing
                self._last_end = time.monotonic()
                if not landing:
                    self._last_read_end = self._last_end
                if not self.reads_in_flight:  # none in flight at all among them
                    self._quiet.notify_all()

    @property
    def reads_in_flight(self) -> int:
        """Reads in flight (puts landing left out)."""
        return self._in_flight - self._landing

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def busy(self) -> bool:
        """Whether anything is in flight or ended within ``linger_s``."""
        return bool(self._in_flight) or time.monotonic() - self._last_end < self.linger_s

    def reading_busy(self) -> bool:
        """Whether a read is in flight or one ended within ``linger_s`` (puts landing do
        not count): reads that follow one another are one burst, and a writer let in
        between two of them would slow the next."""
        return bool(self.reads_in_flight) or (
            time.monotonic() - self._last_read_end < self.linger_s
        )

    def wait_quiet(self, limit_s: float, enough: Callable[[], bool] | None = None) -> float:
        """Wait until nothing is in flight and nothing ended for ``linger_s``, or
        ``limit_s`` seconds, or ``enough()`` (checked at least every ``linger_s``) is
        true; returns the wait."""
        return self._wait_until(limit_s, enough, reads_only=False)

    def wait_reads(self, limit_s: float, enough: Callable[[], bool] | None = None) -> float:
        """Wait until no read is in flight and none ended for ``linger_s`` (puts landing
        do not count), or ``limit_s`` seconds, or ``enough()``; returns the wait."""
        return self._wait_until(limit_s, enough, reads_only=True)

    def _wait_until(
        self, limit_s: float, enough: Callable[[], bool] | None, reads_only: bool
    ) -> float:
        start = time.monotonic()
        deadline = start + limit_s
        with self._quiet:
            while True:
                now = time.monotonic()
                if now >= deadline or (enough is not None and enough()):
                    break
                busy = self.reads_in_flight if reads_only else self._in_flight
                idle = now - (self._last_read_end if reads_only else self._last_end)
                if not busy and idle >= self.linger_s:
                    break
                step = self.linger_s if busy else self.linger_s - idle
                self._quiet.wait(min(max(step, 0.001), deadline - now))
        waited = time.monotonic() - start
        self.yielded_s += waited
        return waited

    def give_way(
        self,
        limit_s: float,
        enough: Callable[[], bool] | None = None,
        hurried: Callable[[], bool] | None = None,
    ) -> GiveWay:
        """An allowance of ``limit_s`` seconds of waiting for reads, for one background job
        (one write-behind batch): see :class:`GiveWay`."""
        return GiveWay(self, limit_s, enough, hurried)


class GiveWay:
    """Waits of one background job for reads, within one allowance of ``limit_s`` seconds
    that runs from the first wait and is shared by every thread of the job (so the job is
    held ``limit_s`` at most in all, however many steps wait).

    :meth:`before` waits for a quiet store before the job starts; once ``enough()`` (a full
    batch queued) only for reads in flight, not for puts landing; not at all for a flush.
    Calling the object between the job's steps returns at once while nothing is in flight,
    else waits until nothing is -- or, for a job that started behind (``enough()`` while
    the store was busy), until no *read* is (puts landing go on beside it, or the backlog
    would grow); a job that started behind because someone waits for it (``hurried()``: a
    flush) does not wait at all."""

    def __init__(
        self,
        reads: ReadActivity,
        limit_s: float,
        enough: Callable[[], bool] | None = None,
        hurried: Callable[[], bool] | None = None,
    ):
        self._reads = reads
        self._limit_s = limit_s
        self._enough = enough
        self._hurried = hurried
        self._deadline: float | None = None
        self._behind = False
        self._rushed = False
        self._lock = threading.Lock()

    def before(self) -> None:
        """Wait until the store has been quiet (see :meth:`ReadActivity.wait_quiet`); once a
        full batch has queued, until no read is in flight (puts landing do not hold it);
        not at all while someone waits for the writes (a flush)."""
        reads = self._reads
        if self._hurried is None or not self._hurried():
            left = self._allowance()
            if left > 0:
                reads.wait_quiet(left, self._enough)
            left = self._allowance()
            if left > 0 and self._enough is not None and self._enough():
                reads.wait_reads(left, self._hurried)
        self._behind = self._enough is not None and self._enough() and reads.busy()
        self._rushed = self._behind and self._hurried is not None and self._hurried()

    def __call__(self) -> None:
        if self._rushed:
            return
        reads = self._reads
        if self._behind:
            if not reads.reading_busy():
                return
        elif not reads.in_flight:  # common: attribute reads, no lock
            return
        left = self._allowance()
        if left <= 0:
            return
        if self._behind:
            reads.wait_reads(left)
        else:
            reads.wait_quiet(left)

    def _allowance(self) -> float:
        """Seconds of the allowance left (it starts running at the first wait)."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + self._limit_s
            return self._deadline - time.monotonic()


__all__ = ["LINGER_S", "GiveWay", "ReadActivity"]
