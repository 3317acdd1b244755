"""The write-behind queue: values acknowledged from memory, made durable in batches.

One background thread drains whatever has queued up since its last write into one disk
batch (one capacity reservation, one directory-fsync pass, one metadata commit), so a
burst of async puts costs one batch, not one fsync round per chunk.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from persisting.errors import PersistingError
from persisting.kv.disk_tier import DiskTier, WriteItem

log = logging.getLogger(__name__)

#: Most items, and bytes, one batch writes.
MAX_BATCH_ITEMS = 64
MAX_BATCH_BYTES = 256 << 20


@dataclass(slots=True)
class _Job:
    item: WriteItem
    future: Future[bool]


class WriteBehind:
    """Writes submitted items to ``disk`` in the background; each future says if it stored."""

    def __init__(self, disk: DiskTier, on_done: Callable[[WriteItem, bool], None]):
        self._disk = disk
        self._on_done = on_done
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, name="persisting-kv-write-behind", daemon=True
        )
        self._thread.start()

    def submit(self, item: WriteItem) -> Future[bool]:
        future: Future[bool] = Future()
        self._queue.put(_Job(item, future))
        return future

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
        return batch

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = self._next_batch(first)
            try:
                stored = self._disk.write([j.item for j in batch], durable=True)
            except PersistingError as exc:
                # One bad item (too large, disk full) must not sink the others: retry singly.
                log.warning(
                    "write-behind batch of %d failed (%s); writing one by one", len(batch), exc
                )
                stored = [self._write_one(j.item) for j in batch]
            for job, ok in zip(batch, stored, strict=True):
                self._on_done(job.item, ok)
                job.future.set_result(ok)

    def _write_one(self, item: WriteItem) -> bool:
        try:
            return self._disk.write([item], durable=True)[0]
        except PersistingError as exc:
            log.warning("write-behind of %r failed: %s", item.key, exc)
            return False

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


__all__ = ["WriteBehind"]
