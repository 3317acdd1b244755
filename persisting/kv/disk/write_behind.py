"""The write-behind: values acknowledged from memory, written to disk in the background.

The rule, all of it:

- A writer thread takes whatever is queued -- at most :data:`MAX_BATCH_ITEMS` values or
  :data:`MAX_BATCH_BYTES` -- and writes it as one disk batch (one capacity reservation, one
  pass of directory fsyncs, one metadata commit), then the next. It and the threads that
  write its files run at the lowest CPU priority (:func:`lower_priority`): the kernel gives
  them a core only when nothing else wants it. Where cores are free they write at full
  speed; where they are not, gets, puts and the engine go first.
- It stays off the disk while a get is reading from it (:meth:`WriteBehind.reading`): it
  starts no batch then, and a batch under way waits between its pieces. A disk is shared
  however many cores the host has, and reads are on a request's critical path; the
  lag bound below caps the wait.
- Two bounds stop that from falling behind without limit (``kv`` settings, see
  :class:`persisting.config.KVSettings`): once the oldest value not yet on disk has waited
  ``write_behind_lag_s`` (default :data:`LAG_S`), or more than ``write_behind_bytes``
  (default :data:`MAX_BYTES`) are acknowledged but not on disk, the writes go on at normal
  priority, on a second writer thread, until neither holds; and a put that finds more than
  ``write_behind_bytes`` waiting waits until they are written.
- Whoever waits for the writes -- :meth:`WriteBehind.drain` (a flush), :meth:`close`, a put
  over the byte bound -- never waits behind the low-priority thread: the batch it is writing
  hands over at its next checkpoint (every piece of a file, and before each file's fsync;
  see :meth:`~persisting.kv.disk.payload_files.PayloadFiles.write`) and the normal-priority writer
  writes it. What the low-priority writer had written of it is discarded (its files were
  not published).

Write-back evictions (``durability = "write_back"``) queue here too: a put that evicts a
dirty value does not write it on the caller's thread.

Both threads outlive every failure: a batch that fails is retried item by item, an
unexpected exception completes the affected futures with that error (and is counted and
logged), and a failing completion hook is logged and counted too. :meth:`drain` and
:meth:`close` therefore always return.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from persisting.config import KVSettings
from persisting.errors import PersistingError, StorageIOError
from persisting.kv import at_exit
from persisting.kv.disk.leases import Clock
from persisting.kv.disk.payload_files import WRITE_THREADS
from persisting.kv.disk.tier import DiskTier, WriteItem

log = logging.getLogger(__name__)

#: Most items, and bytes, one batch writes.
MAX_BATCH_ITEMS = 64
MAX_BATCH_BYTES = 256 << 20
#: Defaults of the two bounds, defined by the ``kv.write_behind_lag_s`` and
#: ``kv.write_behind_bytes`` settings: the longest a value waits at low priority, and the
#: acknowledged bytes not yet on disk past which the writes go on at normal priority and
#: puts wait.
LAG_S: float = KVSettings.model_fields["write_behind_lag_s"].default
MAX_BYTES: int = KVSettings.model_fields["write_behind_bytes"].default
#: The nice value of the low-priority writer threads (19: the lowest there is).
BACKGROUND_NICE = 19


@dataclass(frozen=True, slots=True)
class Bounds:
    """The write-behind's two bounds: ``lag_s``, the longest a value waits for the
    low-priority writer; ``max_bytes``, the pending bytes past which the writes are urgent
    and puts wait."""

    lag_s: float = LAG_S
    max_bytes: int = MAX_BYTES


#: on_done(item, stored, error): ``error`` is the exception that stopped the write, if any.
DoneHook = Callable[[WriteItem, bool, BaseException | None], None]


def lower_priority() -> None:
    """Run the calling thread at nice :data:`BACKGROUND_NICE` (Linux sets nice per thread;
    elsewhere, or where it is refused, nothing changes)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


class _HandOver(Exception):
    """Raised between the pieces of a low-priority batch: the normal-priority writer takes
    the batch over."""


@dataclass(eq=False, slots=True)
class _Job:
    item: WriteItem
    seq: int  # submission order
    since: float  # when it was submitted, on the writer's clock
    future: Future[bool] = field(default_factory=Future)

    @property
    def nbytes(self) -> int:
        return self.item.layout.nbytes


class WriteBehind:
    """Writes submitted items to ``disk`` in the background; each future says if it stored
    (False: already present, cancelled or refused for capacity) or carries the error.

    ``bounds`` are the two bounds (see the module); ``clock`` times the lag; ``lower`` is
    what each low-priority thread runs first (:func:`lower_priority`)."""

    def __init__(
        self,
        disk: DiskTier,
        on_done: DoneHook,
        bounds: Bounds = Bounds(),
        *,
        clock: Clock = time.monotonic,
        lower: Callable[[], None] = lower_priority,
    ):
        self._disk = disk
        self._on_done = on_done
        self.lag_s = bounds.lag_s
        self.max_bytes = bounds.max_bytes
        self._clock = clock
        self._lower = lower
        self._cond = threading.Condition()  # a leaf: nothing is called while it is held
        self._queue: deque[_Job] = deque()  # submitted, not taken into a batch
        self._pending: dict[int, _Job] = {}  # submitted, not completed, by seq: oldest first
        self._seq = itertools.count()
        self._bytes = 0  # of the pending jobs
        self._waiting = 0  # callers in drain() or close(): the writes are urgent
        self._low_busy = False  # the low-priority writer has a batch: the other waits
        self._disk_reads = 0  # gets reading from the disk now: the low writer waits
        self._stopping = False
        #: Writes that failed with an unexpected error, and completion hooks that raised.
        self.errors = 0
        self.hook_errors = 0
        #: Low-priority batches handed over to the normal-priority writer, and times the
        #: low-priority writer waited for disk reads.
        self.handovers = 0
        self.deferrals = 0
        self._low_writers = ThreadPoolExecutor(
            WRITE_THREADS, thread_name_prefix="persisting-kv-write-behind-file", initializer=lower
        )
        self._threads = [
            threading.Thread(target=self._run_low, name="persisting-kv-write-behind", daemon=True),
            threading.Thread(
                target=self._run_urgent, name="persisting-kv-write-behind-due", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        at_exit.track(self, at_exit.WRITER)  # drained at exit if its store was not closed

    # -- what callers do ----------------------------------------------------------------

    def submit(self, item: WriteItem) -> Future[bool]:
        with self._cond:
            job = _Job(item, next(self._seq), self._clock())
            self._pending[job.seq] = job
            self._bytes += job.nbytes
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Mark a get reading from the disk while the block runs: the low-priority writer
        starts nothing and pauses between pieces until none is."""
        with self._cond:
            self._disk_reads += 1
        try:
            yield
        finally:
            with self._cond:
                self._disk_reads -= 1
                if not self._disk_reads:
                    self._cond.notify_all()

    def throttle(self) -> None:
        """Wait while more than ``max_bytes`` are pending (a put calls this first, holding
        no lock of the store: the writes it waits for take them)."""
        with self._cond:
            while self._bytes > self.max_bytes and self._alive():
                self._cond.wait(timeout=1.0)

    def drain(self) -> None:
        """Wait until every submitted write has completed (successfully or not)."""
        with self._cond:
            self._waiting += 1
            self._cond.notify_all()
            try:
                while self._pending:
                    if not self._alive():
                        raise StorageIOError("the write-behind threads are gone; writes lost")
                    self._cond.wait(timeout=1.0)
            finally:
                self._waiting -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """Write what is queued (at normal priority), then stop the threads."""
        at_exit.untrack(self, at_exit.WRITER)
        with self._cond:
            self._stopping = True
            self._waiting += 1  # for good: the rest is urgent
            self._cond.notify_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
        self._low_writers.shutdown(wait=True)

    @property
    def urgent(self) -> bool:
        """Whether the writes go on at normal priority now (a bound reached, or someone
        waiting for them)."""
        with self._cond:
            return self._urgent()

    @property
    def pending_bytes(self) -> int:
        """Bytes acknowledged and not yet on disk (or known not to get there)."""
        with self._cond:
            return self._bytes

    def pending_age_s(self) -> float:
        """How long the oldest pending value has waited (0 with none)."""
        with self._cond:
            oldest = next(iter(self._pending.values()), None)
            return max(0.0, self._clock() - oldest.since) if oldest is not None else 0.0

    # -- the rule -----------------------------------------------------------------------

    def _urgent(self) -> bool:
        """Whether the writes go on at normal priority now (caller holds ``_cond``)."""
        if self._waiting or self._bytes > self.max_bytes:
            return True
        due_in = self._due_in()
        return due_in is not None and due_in <= 0.0

    def _due_in(self) -> float | None:
        """Seconds until the oldest pending value is due (None with none pending; caller
        holds ``_cond``)."""
        oldest = next(iter(self._pending.values()), None)
        if oldest is None:
            return None
        return max(0.0, oldest.since + self.lag_s - self._clock())  # 0: due

    def _checkpoint(self) -> None:
        """Between the pieces of a low-priority batch: wait while a get reads from the disk;
        hand the batch over once the writes are urgent."""
        with self._cond:
            waited = False
            while not self._urgent():
                if not self._disk_reads:
                    return
                if not waited:
                    self.deferrals += 1
                    waited = True
                self._cond.wait(self._due_in())  # a read ending, urgency, or the lag due
            raise _HandOver

    def _alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    # -- the two writers ----------------------------------------------------------------

    def _run_low(self) -> None:
        """The low-priority writer: batches while the writes are not urgent."""
        self._lower()
        while True:
            with self._cond:
                deferred = False
                while not self._stopping and (
                    not self._queue or self._urgent() or self._disk_reads
                ):
                    if self._queue and self._disk_reads and not deferred:
                        self.deferrals += 1
                        deferred = True
                    self._cond.wait()  # what ends each of them is notified
                if self._stopping:
                    return
                batch = self._take()
                self._low_busy = True
            try:
                outcomes = self._write(batch, self._checkpoint, self._low_writers)
            except _HandOver:
                with self._cond:
                    self._queue.extendleft(reversed(batch))
                    self.handovers += 1
                    self._low_busy = False
                    self._cond.notify_all()
                continue
            self._complete(batch, outcomes)
            with self._cond:
                self._low_busy = False
                self._cond.notify_all()

    def _run_urgent(self) -> None:
        """The normal-priority writer: batches while the writes are urgent (a value waited
        ``lag_s``, ``max_bytes`` pending, someone waiting), never beside a low-priority
        batch (one batch at a time: two writes of one key must not race)."""
        while True:
            with self._cond:
                while not (self._queue and self._urgent() and not self._low_busy):
                    if self._stopping and not self._pending:
                        return
                    # Urgent: the low-priority batch under way is handed over (or ends) at
                    # its next checkpoint, which is notified; else until the oldest is due.
                    self._cond.wait(None if self._urgent() else self._due_in())
                batch = self._take()
            self._complete(batch, self._write(batch, None, None))

    def _take(self) -> list[_Job]:
        """The next batch from the queue (caller holds ``_cond``; the queue is not empty)."""
        batch = [self._queue.popleft()]
        size = batch[0].nbytes
        while self._queue and len(batch) < MAX_BATCH_ITEMS and size < MAX_BATCH_BYTES:
            job = self._queue.popleft()
            batch.append(job)
            size += job.nbytes
        return batch

    def _write(
        self,
        batch: list[_Job],
        checkpoint: Callable[[], None] | None,
        writers: Executor | None,
    ) -> list[bool | BaseException]:
        """Each item's outcome: stored (True) or not (False), or the unexpected error that
        stopped it. A failing batch is written again item by item (without checkpoints);
        :class:`_HandOver` propagates."""
        items = [j.item for j in batch]
        try:
            try:
                return list(
                    self._disk.write(items, durable=True, pause=checkpoint, writers=writers)
                )
            except _HandOver:
                raise
            except Exception as exc:
                # One bad item (too large, disk full, a failing file) must not sink the rest.
                log.warning("write-behind batch of %d failed (%s); one by one", len(batch), exc)
                return [self._write_one(item) for item in items]
        except _HandOver:
            raise
        except Exception as exc:  # not even the fallback worked: fail the batch
            self.errors += 1
            log.exception("write-behind batch of %d failed", len(batch))
            return [exc] * len(batch)

    def _write_one(self, item: WriteItem) -> bool | BaseException:
        try:
            return self._disk.write([item], durable=True)[0]
        except PersistingError as exc:
            log.warning("write-behind of %r failed: %s", item.key, exc)
            return False
        except Exception as exc:
            self.errors += 1
            log.exception("write-behind of %r failed unexpectedly", item.key)
            return exc

    def _complete(self, batch: list[_Job], outcomes: list[bool | BaseException]) -> None:
        for job, outcome in zip(batch, outcomes, strict=True):
            stored = outcome is True
            error = outcome if isinstance(outcome, BaseException) else None
            try:
                self._on_done(job.item, stored, error)
            except Exception:
                self.hook_errors += 1
                log.exception("write-behind completion of %r raised", job.item.key)
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(stored)
            with self._cond:
                del self._pending[job.seq]
                self._bytes -= job.nbytes
                self._cond.notify_all()


__all__ = ["LAG_S", "MAX_BYTES", "Bounds", "DoneHook", "WriteBehind", "lower_priority"]
