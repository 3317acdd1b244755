"""The write-behind queue: values acknowledged from memory, made durable in batches.

One background thread drains whatever has queued up since its last write into one disk
batch (one capacity reservation, one directory-fsync pass, one metadata commit), so a
burst of async puts costs one batch, not one fsync round per chunk.

Reads and remote puts come first: before each batch the thread waits until the store has
been quiet for a moment (no get or data-path transfer in flight or just ended), and between
the pieces of every file it writes, and before each file's fsync, it stops while gets are
in flight (so a batch already under way when reads begin stops within one piece), for at
most :data:`YIELD_TO_READS_S` in all, and not at all once a full batch (:data:`MAX_BATCH_ITEMS`,
:data:`MAX_BATCH_BYTES`) has queued up or someone waits for the writes (see
:mod:`persisting.kv.read_activity`): a burst of puts is acknowledged from memory at
network speed and written in one batch after it, and a store written without pause still
writes full batches back to back.

The thread outlives every failure: a batch that fails is retried item by item, an
unexpected exception completes the affected futures with that error (and is counted and
logged), and a failing completion hook is logged and counted too. :meth:`drain` and
:meth:`close` therefore always return.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from persisting.errors import PersistingError, StorageIOError
from persisting.kv import at_exit
from persisting.kv.disk_tier import DiskTier, WriteItem
from persisting.kv.payload_files import Pause
from persisting.kv.read_activity import ReadActivity

log = logging.getLogger(__name__)

#: Most items, and bytes, one batch writes.
MAX_BATCH_ITEMS = 64
MAX_BATCH_BYTES = 256 << 20
#: Longest a batch waits in all for the store's reads in flight (before it starts and
#: between pieces of its files) before it is written anyway: a store read without pause
#: still writes, one batch per this many seconds plus the batch's own time.
YIELD_TO_READS_S = 2.0

#: on_done(item, stored, error): ``error`` is the exception that stopped the write, if any.
DoneHook = Callable[[WriteItem, bool, BaseException | None], None]


@dataclass(slots=True)
class _Job:
    item: WriteItem
    future: Future[bool]


class WriteBehind:
    """Writes submitted items to ``disk`` in the background; each future says if it stored
    (False: already present, cancelled or refused for capacity) or carries the error."""

    def __init__(self, disk: DiskTier, on_done: DoneHook, reads: ReadActivity | None = None):
        self._disk = disk
        self._on_done = on_done
        self._reads = reads
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._queued_bytes = 0  # submitted, not yet taken into a batch
        self._hurry = 0  # callers waiting in drain() or close(): give way no longer
        #: Writes that failed with an unexpected error, and completion hooks that raised.
        self.errors = 0
        self.hook_errors = 0
        self._thread = threading.Thread(
            target=self._run, name="persisting-kv-write-behind", daemon=True
        )
        self._thread.start()
        at_exit.track(self, at_exit.WRITER)  # drained at exit if its store was not closed

    def submit(self, item: WriteItem) -> Future[bool]:
        future: Future[bool] = Future()
        with self._idle:
            self._outstanding += 1
            self._queued_bytes += item.layout.nbytes
        self._queue.put(_Job(item, future))
        return future

    def drain(self) -> None:
        """Wait until every submitted write has completed (successfully or not)."""
        with self._idle:
            self._hurry += 1
            try:
                while self._outstanding:
                    if not self._thread.is_alive():
                        raise StorageIOError("the write-behind thread is gone; pending writes lost")
                    self._idle.wait(timeout=1.0)
            finally:
                self._hurry -= 1

    def _hurried(self) -> bool:
        """Whether someone waits for the writes (a flush)."""
        return self._hurry > 0

    def _batch_waiting(self) -> bool:
        """Whether a full batch has queued up, or someone waits for the writes (the writer
        then stops giving way)."""
        return (
            self._hurry > 0
            or self._queue.qsize() + 1 >= MAX_BATCH_ITEMS
            or self._queued_bytes >= MAX_BATCH_BYTES
        )

    def _next_batch(self, first: _Job) -> list[_Job]:
        batch, size = [first], first.item.layout.nbytes
        while len(batch) < MAX_BATCH_ITEMS and size < MAX_BATCH_BYTES:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # keep the stop signal for the main loop
                break
            batch.append(job)
            size += job.item.layout.nbytes
        with self._idle:
            self._queued_bytes -= size
        return batch

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            give_way = (
                self._reads.give_way(YIELD_TO_READS_S, self._batch_waiting, self._hurried)
                if self._reads is not None
                else None
            )
            if give_way is not None:
                give_way.before()
            batch = self._next_batch(first)  # after the wait: whatever queued meanwhile
            try:
                outcomes = self._write(batch, give_way)
            except Exception as exc:  # not even the fallback worked: fail the batch
                self.errors += 1
                log.exception("write-behind batch of %d failed", len(batch))
                outcomes = [exc] * len(batch)
            for job, outcome in zip(batch, outcomes, strict=True):
                self._complete(job, outcome)

    def _write(self, batch: list[_Job], pause: Pause | None) -> list[bool | BaseException]:
        try:
            return list(self._disk.write([j.item for j in batch], durable=True, pause=pause))
        except Exception as exc:
            # One bad item (too large, disk full, a failing file) must not sink the others.
            log.warning("write-behind batch of %d failed (%s); writing one by one", len(batch), exc)
            return [self._write_one(j.item, pause) for j in batch]

    def _write_one(self, item: WriteItem, pause: Pause | None) -> bool | BaseException:
        try:
            return self._disk.write([item], durable=True, pause=pause)[0]
        except PersistingError as exc:
            log.warning("write-behind of %r failed: %s", item.key, exc)
            return False
        except Exception as exc:
            self.errors += 1
            log.exception("write-behind of %r failed unexpectedly", item.key)
            return exc

    def _complete(self, job: _Job, outcome: bool | BaseException) -> None:
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
        with self._idle:
            self._outstanding -= 1
            if not self._outstanding:
                self._idle.notify_all()

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        at_exit.untrack(self, at_exit.WRITER)
        with self._idle:
            self._hurry += 1  # for good: nothing waits for quiet any more
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


__all__ = ["DoneHook", "WriteBehind"]
