"""LanceBackend: a durable, append-only ``pulsing.streaming`` storage backend on Lance.

One backend owns one queue bucket: ``<storage_path>/data.lance`` (records as typed columns),
``<storage_path>/wal/`` (the write-ahead log) and ``<storage_path>/consumers/`` (committed
consumer positions). Records get consecutive offsets, stored in the ``_offset`` column, that
never change: flushes append, compaction keeps order, retention deletes a prefix.

Life of a put (``durability="wal"``): the record is normalized and checked against the
established schema (a misfit is rejected right there), written to the log, fsynced (group
commit, or every ``fsync_interval_ms``), buffered (:mod:`~persisting.queue.write_buffer`),
and acknowledged. Reads see it at once. The worker (:mod:`~persisting.queue.worker`) flushes
the buffer by size (``batch_size``) and by age (``flush_interval_s``) as one durable Lance
append (:mod:`~persisting.queue.dataset`), after which the log segments it covered are
deleted; it also compacts, cleans up old versions and applies retention.

With ``durability="flush"`` there is no log: puts are faster but live only in memory until
the next flush, so a crash loses what was put since.

Only one process may write a bucket (an ``flock`` on ``writer.lock``, released by the kernel
even on ``kill -9``); any number of ``read_only=True`` backends, in any process, read it and
see each flush as it is committed.

Over 500 lines on purpose: this is Pulsing's backend interface, one class whose methods
share the buffer, log and worker; their mechanics already live in the modules named above.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from persisting.errors import (
    AccessDeniedError,
    InvalidValueError,
    PersistingError,
    StoreClosedError,
)
from persisting.lance_store.access import check_private
from persisting.lance_store.durable import makedirs_durable
from persisting.lance_store.root import QUEUE_DATASET, QUEUE_DIR
from persisting.lance_store.table import disk_usage
from persisting.queue import ownership, recovery
from persisting.queue.codec import encode_record
from persisting.queue.dataset import TRIMMED_BEFORE, DatasetView, QueueDataset, trimmed_error
from persisting.queue.decoding import RecordDecoder
from persisting.queue.notifier import Notifier
from persisting.queue.options import resolve_options
from persisting.queue.positions import ConsumerPositions
from persisting.queue.records import OFFSET, TIMESTAMP, normalize_record
from persisting.queue.schema import RecordSchema
from persisting.queue.stats import Counters
from persisting.queue.tensor_methods import ConsumptionTracker, TensorMethods, TensorPutResult
from persisting.queue.wal import WriteAheadLog, payload_crc
from persisting.queue.worker import Worker, WorkerTasks
from persisting.queue.write_buffer import WriteBuffer

logger = logging.getLogger(__name__)

WAL_DIR = "wal"


def check_queue_dirs(bucket_dir: Path) -> None:
    """Refuse a bucket directory another user owns or can write, and so its topic
    directory and, in a storage root's layout (``<root>/queue/<topic>/bucket_<id>``), the
    ``queue/`` directory and the root (:func:`~persisting.lance_store.access.check_private`)."""
    bucket = bucket_dir.resolve()
    check_private(bucket, "queue bucket directory")
    check_private(bucket.parent, "queue topic directory")
    if bucket.parent.parent.name == QUEUE_DIR:
        check_private(bucket.parent.parent, "queue directory")
        check_private(bucket.parent.parent.parent, "storage root")


def _now_us() -> int:
    return time.time_ns() // 1000


class LanceBackend(TensorMethods):
    """A queue bucket stored in Lance: the ``pulsing.streaming.StorageBackend`` protocol.

    Pulsing builds it as ``LanceBackend(bucket_id=, storage_path=, batch_size=, **options)``;
    ``options`` are those of :class:`~persisting.queue.options.BackendOptions`: the fields of
    :class:`~persisting.config.QueueSettings` (``durability``, ``fsync_interval_ms``,
    ``flush_interval_s``, ``compact_max_fragments``, ``retention_s``, ``retain_until_consumed``,
    ``version_retention_s``; defaults from ``PERSISTING_QUEUE__*``) and ``read_only``,
    ``max_buffer_records``, ``max_buffer_bytes``, ``poll_interval_s``, ``lock_timeout_s``,
    ``compact_target_rows``, ``read_batch_size``, ``retention_interval_s``; ``settings`` (a
    PersistingSettings) replaces the environment as the source of defaults.
    """

    def __init__(
        self,
        bucket_id: int,
        storage_path: str | os.PathLike[str],
        batch_size: int = 100,
        **options: Any,
    ):
        self.bucket_id = bucket_id
        self.config = resolve_options(batch_size, options)
        self.read_only = self.config.read_only
        self.bucket_dir = Path(storage_path).expanduser().absolute()
        self.path = self.bucket_dir / QUEUE_DATASET
        self.positions = ConsumerPositions(self.bucket_dir)
        self._use_wal = self.config.durability == "wal" and not self.read_only

        self._lock = threading.Lock()  # buffer, offsets, schema, view, log appends
        self._notifier = Notifier()
        self._counters = Counters()
        self._consumption = ConsumptionTracker()
        self._buffer = WriteBuffer(self.config.batch_size, self.config.flush_interval_s)
        self._closing = False
        self._closed = False
        self._lock_fd: int | None = None
        self._wal: WriteAheadLog | None = None
        self._worker: Worker | None = None

        if not self.read_only:
            ownership.close_previous_writer(self.bucket_dir)
            makedirs_durable(self.bucket_dir)
            check_queue_dirs(self.bucket_dir)
            self._lock_fd = ownership.acquire_writer_lock(
                self.bucket_dir, self.config.lock_timeout_s
            )
        try:
            self._data = QueueDataset(
                self.path,
                view_lock=self._lock,
                counters=self._counters,
                writer=not self.read_only,
                version_retention_s=self.config.version_retention_s,
                poll_interval_s=self.config.poll_interval_s,
            )
            self._schema = RecordSchema(self._data.table.schema)
            self._last_ts = self._data.last_ts
            self._next_offset = self._data.view.next
            if not self.read_only:
                self._recover()
                self._worker = self._start_worker()
        except BaseException:
            self._release_writer_lock()
            raise
        ownership.track(self, writer=not self.read_only)

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else self.config.durability
        return f"LanceBackend(bucket_id={self.bucket_id}, path={str(self.path)!r}, {mode})"

    # -- opening ------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Replay the log into Lance (skipping what a flush already stored), then start it."""
        if not self._use_wal:
            if any((self.bucket_dir / WAL_DIR).glob("*.wal")):
                # Switching from "wal" to "flush" must not strand acknowledged records.
                self._settle_log(WriteAheadLog(self.bucket_dir / WAL_DIR))
            return
        self._wal = WriteAheadLog(self.bucket_dir / WAL_DIR)
        self._settle_log(self._wal)
        self._wal.start(self._next_offset)

    def _settle_log(self, wal: WriteAheadLog) -> None:
        """Replay the log's unflushed records, flush them, then delete the log (or set it
        aside when some records could not be replayed)."""
        records, complete = recovery.records_to_replay(wal, self._data.view.next, self.path)
        with self._lock:
            for entry, record in records:
                try:
                    (row,) = self._schema.admit([record])
                except PersistingError as exc:  # cannot happen for a record admitted before
                    logger.error("%s: log record %d rejected: %s", self.path, entry.offset, exc)
                    complete = False
                    break
                row[OFFSET] = entry.offset
                row[TIMESTAMP] = entry.timestamp_us
                self._buffer.append([row], [len(entry.payload)])
                self._next_offset = entry.offset + 1
                self._last_ts = max(self._last_ts, entry.timestamp_us)
        if records:
            logger.info("%s: replayed %d records from the log", self.path, len(self._buffer))
            self._flush_sync()
        recovery.settle(wal, complete, self.path)

    def _start_worker(self) -> Worker:
        config = self.config
        wal = self._wal
        tasks = WorkerTasks(
            flush_due=self._flush_due,
            flush_deadline=self._flush_deadline,
            flush=self._flush_sync,
            compact=lambda: self._data.compact_if_needed(
                max_small=config.compact_max_fragments, target_rows=config.compact_target_rows
            ),
            cleanup=self._data.cleanup_versions,
            sync_log=wal.sync if wal is not None and config.fsync_interval_ms > 0 else None,
            retain=(
                self._apply_retention
                if config.retention_s or config.retain_until_consumed
                else None
            ),
        )
        worker = Worker(
            f"persisting-queue-{self.bucket_dir.name}",
            tasks,
            self._counters,
            fsync_interval_s=config.fsync_interval_ms / 1000,
            retention_interval_s=config.retention_interval_s,
        )
        worker.start()
        return worker

    # -- the StorageBackend protocol: writing --------------------------------------------------

    async def put(self, record: dict[str, Any]) -> None:
        """Store one record (acknowledged once it is in the log, or buffered without one)."""
        await self._put([record])

    async def put_batch(self, records: list[dict[str, Any]]) -> None:
        """Store records atomically: all are admitted, or none is (the error says which)."""
        if not isinstance(records, list | tuple):
            raise InvalidValueError(f"put_batch takes a list of records, got {type(records)}")
        await self._put(records)

    async def _put(self, records: Sequence[Any]) -> int:
        """Store ``records``; return the offset of the first."""
        if self.read_only:
            raise AccessDeniedError(f"{self!r} is read-only")
        normalized = []
        for index, record in enumerate(records):
            try:
                normalized.append(normalize_record(record))
            except InvalidValueError as exc:
                raise type(exc)(_which(index, len(records)) + str(exc)) from exc
        payloads = [encode_record(record) for record in normalized]
        crcs = [payload_crc(p) for p in payloads] if self._use_wal else None
        first, log_position, over_budget = self._enqueue(normalized, payloads, crcs)
        if log_position is not None:
            await asyncio.to_thread(self._wal.sync, log_position)  # type: ignore[union-attr]
        self._notifier.notify_all()
        if over_budget:
            try:
                await asyncio.to_thread(self._flush_sync)
            except Exception:  # the put itself succeeded: its records are buffered (and logged)
                self._counters.errors += 1
                logger.exception("%s: flush for a full buffer failed; will retry", self.path)
        return first

    def _enqueue(
        self, records: list[dict[str, Any]], payloads: list[bytes], crcs: list[int] | None
    ) -> tuple[int, int | None, bool]:
        """Admit, number, log and buffer ``records`` under the lock; returns the first offset,
        the log position to fsync up to before acknowledging (if any), and whether the buffer
        is over its budget."""
        with self._lock:
            if self._closing:
                raise StoreClosedError(f"{self!r} is closed")
            rows = self._schema.admit(records)
            first = self._next_offset
            ts = max(_now_us(), self._last_ts)
            for index, row in enumerate(rows):
                row[OFFSET] = first + index
                row[TIMESTAMP] = ts
            log_position = None
            if self._wal is not None and crcs is not None:
                position = self._wal.append_records(first, ts, payloads, crcs)
                if self.config.fsync_interval_ms == 0:
                    log_position = position
            self._buffer.append(rows, [len(p) for p in payloads])
            self._next_offset = first + len(rows)
            self._last_ts = ts
            self._counters.puts += len(rows)
            if self._buffer.full() and self._worker is not None:
                self._worker.wake()
            over_budget = self._buffer.over(
                self.config.max_buffer_records, self.config.max_buffer_bytes
            )
        return first, log_position, over_budget

    async def flush(self) -> None:
        """Append everything buffered to Lance as one durable commit."""
        if self.read_only:
            return
        self._check_open()
        await asyncio.to_thread(self._flush_sync)

    def _flush_sync(self) -> int:
        data = self._data
        with data.flush_lock:
            with self._lock:
                count = len(self._buffer)
                if count == 0:
                    return 0
                rows = self._buffer.head(count)
                if self._wal is not None:
                    self._wal.rotate(self._next_offset)
            started = time.perf_counter()
            data.append(rows, self._schema)
            elapsed = time.perf_counter() - started
            with self._lock:
                self._buffer.drop_head(count)
                data.extend_view(count)
                persisted_next = data.view.next
                self._counters.flushes += 1
                self._counters.flushed_records += count
                self._counters.flush_latency_s.append(elapsed)
            if self._wal is not None:
                self._wal.drop_flushed(persisted_next)
            if (
                data.table.num_fragments() > self.config.compact_max_fragments
                and self._worker is not None
            ):
                self._worker.wake()  # compaction is due: don't let fragments pile up
            return count

    def _flush_due(self, now: float) -> bool:
        with self._lock:
            return self._buffer.flush_due(now)

    def _flush_deadline(self) -> float | None:
        with self._lock:
            return self._buffer.flush_deadline()

    # -- the StorageBackend protocol: reading --------------------------------------------------

    async def get(self, limit: int, offset: int) -> list[dict[str, Any]]:
        """Up to ``limit`` records from ``offset`` on (flushed or not).

        Raises OffsetTrimmedError if ``offset`` was trimmed by retention.
        """
        if limit <= 0:
            return []
        if offset < 0:
            raise InvalidValueError(f"offset must be >= 0, got {offset}")
        if self._data.refresh_due():
            await asyncio.to_thread(self._data.refresh)
        view, end, buffered, buffer_decoder = self._plan_read(limit, offset)
        records: list[dict[str, Any]] = []
        lance_end = min(end, view.next)
        if offset < lance_end:
            records = await asyncio.to_thread(self._data.read, view, offset, lance_end)
        if buffered:
            records.extend(buffer_decoder.decode(row) for row in buffered)
        return records

    def _plan_read(
        self, limit: int, offset: int
    ) -> tuple[DatasetView, int, list[dict[str, Any]], RecordDecoder]:
        """What a read of ``limit`` records from ``offset`` takes, from one consistent moment:
        the committed view, the end offset, the buffered rows beyond the view, their decoder."""
        with self._lock:
            self._check_open()
            view = self._data.view
            if offset < view.first:
                raise trimmed_error(self.path, offset, view.first)
            end = min(offset + limit, self._next_offset if not self.read_only else view.next)
            buffered: list[dict[str, Any]] = []
            if end > view.next:
                start = max(offset, view.next) - view.next
                buffered = self._buffer.rows(start, end - view.next)
            return view, end, buffered, self._buffer.decoder(self._schema)

    async def get_stream(
        self,
        limit: int,
        offset: int,
        wait: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """Batches of records from ``offset`` until ``limit`` records were yielded.

        With ``wait`` it waits for new records (puts here, or flushes by the writer when this
        backend is a reader elsewhere); a truthy ``timeout`` bounds the waiting of the whole
        stream (at most ``timeout`` seconds in all, however many batches it yields), a falsy
        one waits until ``limit`` records came.
        """
        deadline = time.monotonic() + timeout if wait and timeout else None
        current, remaining = offset, limit
        while remaining > 0:
            records = await self.get(min(remaining, self.config.read_batch_size), current)
            if records:
                yield records
                current += len(records)
                remaining -= len(records)
                continue
            if not wait or not await self._wait_beyond(current, deadline):
                return

    async def _wait_beyond(self, offset: int, deadline: float | None) -> bool:
        """Wait until a record at ``offset`` or later exists; False at ``deadline`` (a
        ``time.monotonic()`` value, None: no limit) or when the backend closes."""

        async def arrived() -> bool:
            if self._data.refresh_due():  # a reader sees flushes only by looking
                await asyncio.to_thread(self._data.refresh)
            return self._visible_next() > offset

        return await self._notifier.wait_until(
            arrived,
            stopped=lambda: self._closed or self._closing,
            deadline=deadline,
            poll_s=self.config.poll_interval_s if self.read_only else 1.0,
        )

    def _visible_next(self) -> int:
        with self._lock:
            return self._data.view.next if self.read_only else self._next_offset

    async def stats(self) -> dict[str, Any]:
        """Records, bytes, flushes and their latency, fragments, versions and log size."""
        return await asyncio.to_thread(self._stats_sync)

    def _stats_sync(self) -> dict[str, Any]:
        if self.read_only:
            self._data.refresh()
        with self._lock:
            view = self._data.view
            buffered, buffered_bytes = len(self._buffer), self._buffer.bytes
            next_offset = self._next_offset if not self.read_only else view.next
            schema = {f.name: str(f.type) for f in self._schema.fields()}
            counters = self._counters.as_dict()
        wal = self._wal
        return {
            "bucket_id": self.bucket_id,
            "backend": "lance",
            "path": str(self.path),
            "durability": self.config.durability,
            "read_only": self.read_only,
            "buffer_size": buffered,
            "buffer_bytes": buffered_bytes,
            "persisted_count": view.count,
            "total_count": next_offset,
            "records": view.count + buffered,
            "first_offset": view.first,
            "bytes": disk_usage(self.path) if self.path.exists() else 0,
            "fragments": len(view.dataset.get_fragments()),
            "versions": len(view.dataset.versions()),
            **counters,
            "wal_bytes": wal.size_bytes() if wal is not None else 0,
            "wal_segments": wal.segment_count() if wal is not None else 0,
            "wal_fsyncs": wal.fsyncs if wal is not None else 0,
            "waiters": len(self._notifier),
            "schema": schema,
        }

    def total_count(self) -> int:
        """Records ever put (= the next offset); trimming does not lower it."""
        if self.read_only:
            self._data.refresh()
        return self._visible_next()

    def earliest_offset(self) -> int:
        """The oldest offset still stored (everything before it was trimmed)."""
        if self.read_only:
            self._data.refresh()
        with self._lock:
            return self._data.view.first

    # -- consumer positions, retention and maintenance -----------------------------------------

    async def commit_position(self, consumer: str, position: int) -> None:
        """Durably record that ``consumer`` will next read ``position`` (from any process)."""
        await asyncio.to_thread(self.positions.commit, consumer, position)

    async def committed_position(self, consumer: str) -> int | None:
        """The position ``consumer`` last committed, or None."""
        return await asyncio.to_thread(self.positions.get, consumer)

    async def trim(self, before: int) -> int:
        """Delete flushed records with offsets below ``before``; return how many went.

        Offsets of the remaining records do not change, and new records continue after the
        highest offset ever put.
        """
        self._check_writable()
        return await asyncio.to_thread(self._data.trim, before)

    def _apply_retention(self) -> int:
        positions = self.positions.all() if self.config.retain_until_consumed else None
        return self._data.apply_retention(self.config.retention_s, positions, _now_us())

    async def maintain(self) -> dict[str, int]:
        """Run the background maintenance now: compaction (while due), old-version cleanup
        and retention. Returns the compaction steps run and the records trimmed."""
        self._check_writable()
        assert self._worker is not None  # every writer has one
        return await asyncio.to_thread(self._worker.run_now)

    # -- closing --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed")

    def _check_writable(self) -> None:
        if self.read_only:
            raise AccessDeniedError(f"{self!r} is read-only")
        self._check_open()

    def close(self) -> None:
        """Flush what is buffered, stop background work and release the bucket."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self._worker is not None:
            self._worker.stop()
        try:
            if not self.read_only:
                self._flush_sync()
        finally:
            if self._wal is not None:
                self._wal.close()
            self._release_writer_lock()
            self._closed = True
            ownership.untrack(self)
            self._notifier.notify_all()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> LanceBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    def _release_writer_lock(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            ownership.release_writer_lock(fd)


def _which(index: int, total: int) -> str:
    return f"record {index} of {total}: " if total > 1 else ""


close_all = ownership.close_all

__all__ = ["TRIMMED_BEFORE", "WAL_DIR", "LanceBackend", "TensorPutResult", "close_all"]
