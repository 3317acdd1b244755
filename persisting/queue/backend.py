"""LanceBackend: a durable, append-only ``pulsing.streaming`` storage backend on Lance.

One backend owns one queue bucket: ``<storage_path>/data.lance`` (records as typed columns),
``<storage_path>/wal/`` (the write-ahead log) and ``<storage_path>/consumers/`` (committed
consumer positions). Records get consecutive offsets, stored in the ``_offset`` column, that
never change: flushes append, compaction keeps order, retention deletes a prefix.

Life of a put (``durability="wal"``): the record is normalized and checked against the
established schema (a misfit is rejected right there), written to the log, fsynced (group
commit, or every ``fsync_interval_ms``), buffered, and acknowledged. Reads see it at once.
A background worker flushes the buffer by size (``batch_size``) and by age
(``flush_interval_s``) as one Lance append, fsynced, after which the log segments it covered
are deleted; the same worker compacts, cleans old versions and applies retention.

With ``durability="flush"`` there is no log: puts are faster but live only in memory until
the next flush, so a crash loses what was put since.

Only one process may write a bucket (an ``flock`` on ``writer.lock``, released by the kernel
even on ``kill -9``); any number of ``read_only=True`` backends, in any process, read it and
see each flush as it is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persisting.errors import (
    AccessDeniedError,
    CorruptValueError,
    InvalidValueError,
    OffsetTrimmedError,
    PersistingError,
    StorageIOError,
    StoreClosedError,
)
from persisting.lance_store import LanceTable
from persisting.lance_store.durable import makedirs_durable
from persisting.lance_store.root import QUEUE_DATASET
from persisting.lance_store.table import disk_usage
from persisting.queue import maintenance, ownership, tensor_api
from persisting.queue.codec import decode_record, encode_record
from persisting.queue.options import resolve_options
from persisting.queue.positions import ConsumerPositions
from persisting.queue.schema import (
    OFFSET,
    TIMESTAMP,
    RecordDecoder,
    RecordSchema,
    base_schema,
    normalize_record,
)
from persisting.queue.tensor_api import ConsumptionTracker, PutResult
from persisting.queue.wal import WriteAheadLog, encode_frame, payload_crc

logger = logging.getLogger(__name__)

WAL_DIR = "wal"
#: Dataset config key: every offset below it was trimmed (so offsets continue after it).
TRIMMED_BEFORE = "persisting.queue.trimmed_before"


@dataclass(frozen=True)
class _View:
    """A committed dataset version and the offsets it holds: [first, first + count).

    ``ordered`` while rows sit in offset order, so offset ``o`` is row ``o - first``. Only a
    compaction run elsewhere over a live writer's appends breaks that (Lance then puts the
    merged fragments last); reads then find rows by filtering on ``_offset`` instead.
    """

    dataset: Any
    first: int
    count: int
    ordered: bool = True

    @property
    def next(self) -> int:
        return self.first + self.count


@dataclass
class _Counters:
    puts: int = 0
    flushes: int = 0
    flushed_records: int = 0
    compactions: int = 0
    cleanups: int = 0
    trimmed_records: int = 0
    errors: int = 0
    flush_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))


class _Notifier:
    """Wakes coroutines (on any event loop) waiting for new records; callable from any thread.

    A waiter is registered before the caller checks for records (so a put between the check
    and the wait still wakes it) and is removed when the caller stops waiting, however it
    stops: a reader that nobody notifies must not accumulate one future per call.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiters)

    @contextlib.contextmanager
    def waiter(self) -> Iterator[asyncio.Future]:
        """A future resolved by the next :meth:`notify_all`, forgotten when the block ends."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiters.append((loop, future))
        try:
            yield future
        finally:
            with self._lock:
                self._waiters = [(lp, f) for lp, f in self._waiters if f is not future]

    @staticmethod
    async def wait(future: asyncio.Future, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(future, timeout)

    def notify_all(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # that loop is closed
                continue


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _now_us() -> int:
    return time.time_ns() // 1000


class LanceBackend:
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
        self._flush_lock = threading.Lock()  # one flush (or trim) at a time
        self._maintenance_lock = threading.Lock()  # one compaction, cleanup or trim at a time
        self._maintenance: LanceTable | None = None
        self._notifier = _Notifier()
        self._counters = _Counters()
        self._consumption = ConsumptionTracker()
        self._buffer: list[dict[str, Any]] = []
        self._buffer_sizes: list[int] = []
        self._buffer_bytes = 0
        self._oldest_buffered = 0.0
        self._closing = False
        self._closed = False
        self._lock_fd: int | None = None
        self._wal: WriteAheadLog | None = None
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._decoder_cache: tuple[pa.Schema, RecordDecoder] | None = None
        self._buffer_decoder: tuple[int, RecordDecoder] | None = None
        self._last_refresh = 0.0

        if not self.read_only:
            ownership.close_previous_writer(self.bucket_dir)
            makedirs_durable(self.bucket_dir)
            self._lock_fd = ownership.acquire_writer_lock(
                self.bucket_dir, self.config.lock_timeout_s
            )
        try:
            self._table = LanceTable(self.path, base_schema())
            self._schema = RecordSchema(self._table.schema)
            self._view, self._last_ts = self._load_view()
            self._next_offset = self._view.next
            if not self.read_only:
                self._recover()
                self._worker = threading.Thread(
                    target=self._run_worker,
                    name=f"persisting-queue-{self.bucket_dir.name}",
                    daemon=True,
                )
                self._worker.start()
        except BaseException:
            self._release_writer_lock()
            raise
        ownership.track(self, writer=not self.read_only)

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else self.config.durability
        return f"LanceBackend(bucket_id={self.bucket_id}, path={str(self.path)!r}, {mode})"

    # -- opening ------------------------------------------------------------------------------

    def _load_view(self) -> tuple[_View, int]:
        """The offsets of the committed version (and the newest put time in it)."""
        dataset = self._table.dataset
        count = dataset.count_rows()
        floor = int(self._table.config().get(TRIMMED_BEFORE, "0"))
        if count == 0:
            return _View(dataset, floor, 0), 0
        edges = dataset.take([0, count - 1], columns=[OFFSET, TIMESTAMP])
        first, last = edges.column(OFFSET).to_pylist()
        last_ts = edges.column(TIMESTAMP).cast(pa.int64())[1].as_py() or 0
        if last - first + 1 == count:
            return _View(dataset, first, count), last_ts
        scanned = dataset.to_table(columns=[OFFSET, TIMESTAMP])  # rows out of offset order
        offsets = scanned.column(OFFSET)
        low, high = pc.min(offsets).as_py(), pc.max(offsets).as_py()
        if high - low + 1 != count:
            raise CorruptValueError(
                f"{self.path}: offsets {low}..{high} do not match its {count} rows"
            )
        last_ts = pc.max(scanned.column(TIMESTAMP).cast(pa.int64())).as_py() or 0
        logger.warning("%s: rows are out of offset order; reading by filter", self.path)
        return _View(dataset, low, count, ordered=False), last_ts

    def _recover(self) -> None:
        """Replay the log into Lance (skipping what a flush already stored), then start it."""
        if not self._use_wal:
            if any((self.bucket_dir / WAL_DIR).glob("*.wal")):
                # Switching from "wal" to "flush" must not strand acknowledged records.
                self._wal = WriteAheadLog(self.bucket_dir / WAL_DIR)
                self._settle_log(self._wal)
                self._wal = None
            return
        self._wal = WriteAheadLog(self.bucket_dir / WAL_DIR)
        self._settle_log(self._wal)
        self._wal.start(self._next_offset)

    def _settle_log(self, wal: WriteAheadLog) -> None:
        """Replay the log, flush what it held, then delete it; a log that cannot be replayed
        completely is set aside (``wal/unreplayed/``), never deleted."""
        if self._replay(wal):
            wal.drop_all_closed()
            return
        aside = wal.set_aside_closed()
        logger.error("%s: log segments that could not be replayed moved to %s", self.path, aside)

    def _replay(self, wal: WriteAheadLog) -> bool:
        """Buffer and flush the log's records not yet in Lance; False if some could not be."""
        entries = [e for e in wal.replay() if e.offset >= self._view.next]
        if not entries:
            return True
        if entries[0].offset != self._view.next:
            logger.error(
                "%s: the log starts at offset %d but the dataset ends at %d; not replaying",
                self.path,
                entries[0].offset,
                self._view.next,
            )
            return False
        complete = True
        records = []
        for entry in entries:
            try:
                records.append((entry, decode_record(entry.payload)))
            except CorruptValueError:
                logger.error("%s: unreadable log record at offset %d", self.path, entry.offset)
                complete = False
                break
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
                self._buffer.append(row)
                self._buffer_sizes.append(len(entry.payload))
                self._buffer_bytes += len(entry.payload)
                self._next_offset = entry.offset + 1
                self._last_ts = max(self._last_ts, entry.timestamp_us)
        logger.info("%s: replayed %d records from the log", self.path, len(self._buffer))
        self._flush_sync()
        return complete

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
            if self._wal is not None:
                frames = b"".join(
                    encode_frame(first + i, ts, p, crcs[i])  # type: ignore[index]
                    for i, p in enumerate(payloads)
                )
                position = self._wal.append(frames, len(rows))
                if self.config.fsync_interval_ms == 0:
                    log_position = position
            if not self._buffer:
                self._oldest_buffered = time.monotonic()
            self._buffer.extend(rows)
            sizes = [len(p) for p in payloads]
            self._buffer_sizes.extend(sizes)
            self._buffer_bytes += sum(sizes)
            self._next_offset = first + len(rows)
            self._last_ts = ts
            self._counters.puts += len(rows)
            if len(self._buffer) >= self.config.batch_size:
                self._wake.set()
            over_budget = (
                len(self._buffer) >= self.config.max_buffer_records
                or self._buffer_bytes >= self.config.max_buffer_bytes
            )
        return first, log_position, over_budget

    async def flush(self) -> None:
        """Append everything buffered to Lance as one durable commit."""
        if self.read_only:
            return
        self._check_open()
        await asyncio.to_thread(self._flush_sync)

    def _flush_sync(self) -> int:
        with self._flush_lock:
            with self._lock:
                count = len(self._buffer)
                if count == 0:
                    return 0
                rows = self._buffer[:count]
                if self._wal is not None:
                    self._wal.rotate(self._next_offset)
            started = time.perf_counter()
            deltas = self._schema.deltas(self._table.schema)
            if deltas:
                self._table.add_fields(deltas)
            table = pa.Table.from_pylist(rows, schema=self._table.schema)
            self._table.append(table, durable=True)
            elapsed = time.perf_counter() - started
            with self._lock:
                del self._buffer[:count]
                self._buffer_bytes -= sum(self._buffer_sizes[:count])
                del self._buffer_sizes[:count]
                if self._buffer:
                    self._oldest_buffered = time.monotonic()
                view = self._view
                self._view = _View(
                    self._table.dataset, view.first, view.count + count, view.ordered
                )
                self._counters.flushes += 1
                self._counters.flushed_records += count
                self._counters.flush_latency_s.append(elapsed)
            if self._wal is not None:
                self._wal.drop_flushed(self._view.next)
            if len(self._table.dataset.get_fragments()) > self.config.compact_max_fragments:
                self._wake.set()  # compaction is due: don't let fragments pile up until the tick
            return count

    # -- the StorageBackend protocol: reading --------------------------------------------------

    async def get(self, limit: int, offset: int) -> list[dict[str, Any]]:
        """Up to ``limit`` records from ``offset`` on (flushed or not).

        Raises OffsetTrimmedError if ``offset`` was trimmed by retention.
        """
        if limit <= 0:
            return []
        if offset < 0:
            raise InvalidValueError(f"offset must be >= 0, got {offset}")
        if self._refresh_due():
            await asyncio.to_thread(self._refresh, False)
        view, end, buffered, buffer_decoder = self._plan_read(limit, offset)
        records: list[dict[str, Any]] = []
        lance_end = min(end, view.next)
        if offset < lance_end:
            records = await asyncio.to_thread(self._read_lance, view, offset, lance_end)
        if buffered:
            records.extend(buffer_decoder.decode(row) for row in buffered)
        return records

    def _plan_read(
        self, limit: int, offset: int
    ) -> tuple[_View, int, list[dict[str, Any]], RecordDecoder]:
        with self._lock:
            self._check_open()
            view = self._view
            if offset < view.first:
                raise OffsetTrimmedError(
                    f"offset {offset} of {self.path} was trimmed by retention; "
                    f"the earliest offset is {view.first}"
                )
            end = min(offset + limit, self._next_offset if not self.read_only else view.next)
            buffered: list[dict[str, Any]] = []
            if end > view.next:
                start = max(offset, view.next) - view.next
                buffered = self._buffer[start : end - view.next]
            generation = self._schema.generation
            if self._buffer_decoder is None or self._buffer_decoder[0] != generation:
                self._buffer_decoder = (generation, RecordDecoder(self._schema.fields()))
            return view, end, buffered, self._buffer_decoder[1]

    def _read_lance(self, view: _View, start: int, end: int) -> list[dict[str, Any]]:
        try:
            table = self._scan(view, start, end)
        except Exception as exc:  # files of an old version cleaned up under us: retry fresh
            logger.debug("%s: read of an old version failed (%s); retrying", self.path, exc)
            self._refresh(True)
            with self._lock:
                view = self._view
            if start < view.first:
                raise OffsetTrimmedError(
                    f"offset {start} of {self.path} was trimmed by retention; "
                    f"the earliest offset is {view.first}"
                ) from exc
            end = min(end, view.next)
            try:
                table = self._scan(view, start, end)
            except Exception as again:
                raise StorageIOError(f"cannot read {self.path}: {again}") from again
        if not _holds_exactly(table, start, end):
            if not view.ordered:
                raise CorruptValueError(f"{self.path}: offsets {start}..{end} are not all there")
            self._mark_unordered(view)
            return self._read_lance(replace(view, ordered=False), start, end)
        return self._decoder(view.dataset.schema).decode_table(table)

    def _mark_unordered(self, view: _View) -> None:
        logger.warning("%s: rows are out of offset order; reading by filter", self.path)
        with self._lock:
            if self._view.dataset is view.dataset:
                self._view = replace(self._view, ordered=False)

    @staticmethod
    def _scan(view: _View, start: int, end: int) -> pa.Table:
        # Every column, unprojected: a projection list would parse a user's column named "*".
        if view.ordered:
            return view.dataset.to_table(offset=start - view.first, limit=end - start)
        found = view.dataset.to_table(filter=f"{OFFSET} >= {start} AND {OFFSET} < {end}")
        return found.sort_by(OFFSET)

    def _decoder(self, schema: pa.Schema) -> RecordDecoder:
        cached = self._decoder_cache
        if cached is not None and cached[0].equals(schema, check_metadata=True):
            return cached[1]
        decoder = RecordDecoder(schema)
        self._decoder_cache = (schema, decoder)
        return decoder

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
        while True:
            with self._notifier.waiter() as woken:
                if self._closed or self._closing:
                    return False
                if self._refresh_due():
                    await asyncio.to_thread(self._refresh, False)
                if self._visible_next() > offset:
                    return True
                pause = self.config.poll_interval_s if self.read_only else 1.0
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    pause = min(pause, left)
                await self._notifier.wait(woken, pause)

    def _visible_next(self) -> int:
        with self._lock:
            return self._view.next if self.read_only else self._next_offset

    def _refresh_due(self) -> bool:
        elapsed = time.monotonic() - self._last_refresh
        return self.read_only and elapsed >= self.config.poll_interval_s

    def _refresh(self, force: bool) -> None:
        """Move to the newest committed version.

        A reader does it to see new flushes (at most every ``poll_interval_s`` unless
        forced); a writer only when forced, after the files of the version it read were
        cleaned up by a compaction run elsewhere (``persisting compact``).
        """
        if not force and not self._refresh_due():
            return
        self._last_refresh = time.monotonic()
        if self.read_only:
            if not self._table.refresh() and not force:
                return
            view, _ = self._load_view()
            with self._lock:
                self._view = view
                self._next_offset = view.next
            return
        with self._flush_lock:  # no flush may commit between the reload and the swap
            self._table.refresh()
            view, _ = self._load_view()
            with self._lock:
                self._view = view

    async def stats(self) -> dict[str, Any]:
        """Records, bytes, flushes and their latency, fragments, versions and log size."""
        return await asyncio.to_thread(self._stats_sync)

    def _stats_sync(self) -> dict[str, Any]:
        if self.read_only:
            self._refresh(False)
        with self._lock:
            view = self._view
            buffered = len(self._buffer)
            buffered_bytes = self._buffer_bytes
            next_offset = self._next_offset if not self.read_only else view.next
            counters = self._counters
            latencies = list(counters.flush_latency_s)
            schema = {f.name: str(f.type) for f in self._schema.fields()}
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
            "puts": counters.puts,
            "flushes": counters.flushes,
            "flushed_records": counters.flushed_records,
            "flush_latency_ms": _latency_summary(latencies),
            "fragments": len(view.dataset.get_fragments()),
            "versions": len(view.dataset.versions()),
            "compactions": counters.compactions,
            "cleanups": counters.cleanups,
            "trimmed_records": counters.trimmed_records,
            "wal_bytes": self._wal.size_bytes() if self._wal is not None else 0,
            "wal_segments": self._wal.segment_count() if self._wal is not None else 0,
            "wal_fsyncs": self._wal.fsyncs if self._wal is not None else 0,
            "errors": counters.errors,
            "waiters": len(self._notifier),
            "schema": schema,
        }

    def total_count(self) -> int:
        """Records ever put (= the next offset); trimming does not lower it."""
        if self.read_only:
            self._refresh(False)
        return self._visible_next()

    def earliest_offset(self) -> int:
        """The oldest offset still stored (everything before it was trimmed)."""
        if self.read_only:
            self._refresh(False)
        with self._lock:
            return self._view.first

    # -- tensor-native methods (records addressed by offset) ------------------------------------

    async def put_tensor(self, data: Any, **kwargs: Any) -> PutResult:
        """Store a record (or list of records) holding tensors; returns their offsets.

        Tensors are stored as typed ``{kind, dtype, shape, data}`` columns, exactly, so a
        plain ``put`` does the same; Pulsing's extra arguments (``partition_id``) are ignored.
        """
        if isinstance(data, dict):
            records = [data]
        elif isinstance(data, list) and all(isinstance(r, dict) for r in data):
            records = data
        else:
            raise InvalidValueError("put_tensor expects a dict or a list of dicts")
        if not records:
            return PutResult([], [])
        first = await self._put(records)
        names = sorted({k for r in records for k in r if not str(k).startswith("_")})
        return PutResult(list(range(first, first + len(records))), names)

    async def get_data(self, batch_meta: Any, fields: list[str] | None = None) -> Any:
        """The records at ``batch_meta``'s ``global_indexes`` (offsets), optionally projected."""
        earliest, end = self.earliest_offset(), self._visible_next()
        wanted = [i for i in tensor_api.global_indexes(batch_meta) if earliest <= i < end]
        by_offset: dict[int, dict[str, Any]] = {}
        for start, stop in tensor_api.contiguous_runs(wanted):
            for index, record in enumerate(await self.get(stop - start, start), start):
                by_offset[index] = record
        rows = [by_offset[i] for i in wanted if i in by_offset]
        if not fields:
            return rows
        return [{k: v for k, v in row.items() if k in fields} for row in rows]

    async def get_meta(
        self,
        fields: list[str],
        batch_size: int,
        task_name: str = "default",
        sampler: Any = None,
        **sampling_kwargs: Any,
    ) -> Any:
        """Offsets ``task_name`` has not consumed yet (tracked in memory), as Pulsing expects."""
        taken = self._consumption.take(
            task_name,
            batch_size,
            self.earliest_offset(),
            self._visible_next(),
            sampler,
            **sampling_kwargs,
        )
        partition = sampling_kwargs.get("partition_id", "default")
        return tensor_api.batch_meta(taken, fields, partition)

    async def mark_consumed(self, task_name: str, global_indexes: list[int]) -> None:
        self._consumption.mark(task_name, global_indexes)

    async def reset_consumption(self, task_name: str) -> None:
        self._consumption.reset(task_name)

    # -- consumer positions and retention -------------------------------------------------------

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
        if self.read_only:
            raise AccessDeniedError(f"{self!r} is read-only")
        self._check_open()
        return await asyncio.to_thread(self._trim_sync, before)

    def _trim_sync(self, before: int) -> int:
        with self._flush_lock, self._maintenance_lock:  # a delete conflicts with a compaction
            with self._lock:
                view = self._view
            before = min(int(before), view.next)
            if before <= view.first:
                return 0
            # The watermark goes first: if we crash before the delete, nothing is lost.
            self._table.set_config({TRIMMED_BEFORE: str(before)}, durable=True)
            self._table.delete(f"{OFFSET} < {before}", durable=True)
            removed = before - view.first
            with self._lock:
                current = self._view
                self._view = _View(
                    self._table.dataset, before, current.next - before, current.ordered
                )
                self._counters.trimmed_records += removed
            return removed

    def _apply_retention(self) -> int:
        with self._lock:
            view = self._view
        if view.count == 0:
            return 0
        cutoffs = []
        if self.config.retention_s:
            cutoffs.append(
                maintenance.age_cutoff(view.dataset, view.first, self.config.retention_s, _now_us())
            )
        if self.config.retain_until_consumed:
            slowest = maintenance.consumer_cutoff(self.positions.all())
            if slowest is not None:
                cutoffs.append(slowest)
        if not cutoffs:
            return 0
        return self._trim_sync(max(cutoffs))

    async def maintain(self) -> dict[str, int]:
        """Run the background maintenance now: compaction (while due), old-version cleanup
        and retention. Returns the compaction steps run and the records trimmed."""
        if self.read_only:
            raise AccessDeniedError(f"{self!r} is read-only")
        self._check_open()

        def run() -> dict[str, int]:
            before = self._counters.compactions
            for _ in range(16):  # each round runs up to a few steps; stop once nothing is due
                if not self._compact_if_needed():
                    break
            self._cleanup_versions()
            trimmed = self._apply_retention()
            return {"compaction_steps": self._counters.compactions - before, "trimmed": trimmed}

        return await asyncio.to_thread(run)

    # -- background work ------------------------------------------------------------------------

    def _run_worker(self) -> None:
        last_sync = last_retention = time.monotonic()
        flushes_at_cleanup = 0
        while not self._stop.is_set():
            self._wake.wait(self._next_wakeup(last_sync, last_retention))
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                now = time.monotonic()
                if (
                    self._wal is not None
                    and self.config.fsync_interval_ms > 0
                    and now - last_sync >= self.config.fsync_interval_ms / 1000
                ):
                    self._wal.sync()
                    last_sync = now
                if self._flush_due(now):
                    self._flush_sync()
                compacted = self._compact_if_needed()
                flushes = self._counters.flushes
                if compacted or flushes - flushes_at_cleanup >= self.config.compact_max_fragments:
                    self._cleanup_versions()
                    flushes_at_cleanup = flushes
                if (
                    self.config.retention_s or self.config.retain_until_consumed
                ) and now - last_retention >= self.config.retention_interval_s:
                    last_retention = now
                    self._apply_retention()
            except Exception:
                self._counters.errors += 1
                logger.exception("%s: background flush/maintenance failed", self.path)
                self._stop.wait(0.5)

    def _next_wakeup(self, last_sync: float, last_retention: float) -> float:
        now = time.monotonic()
        waits = [1.0]
        if self._wal is not None and self.config.fsync_interval_ms > 0:
            waits.append(last_sync + self.config.fsync_interval_ms / 1000 - now)
        with self._lock:
            if self._buffer and self.config.flush_interval_s > 0:
                waits.append(self._oldest_buffered + self.config.flush_interval_s - now)
        if self.config.retention_s or self.config.retain_until_consumed:
            waits.append(last_retention + self.config.retention_interval_s - now)
        return max(0.0, min(waits))

    def _flush_due(self, now: float) -> bool:
        with self._lock:
            if not self._buffer:
                return False
            if len(self._buffer) >= self.config.batch_size:
                return True
            interval = self.config.flush_interval_s
            return interval > 0 and now - self._oldest_buffered >= interval

    def _compact_if_needed(self) -> bool:
        """Compact while no flush runs: a compaction committed over appends made meanwhile
        would put the merged fragments after them and break the offset order of rows."""
        if len(self._table.dataset.get_fragments()) <= self.config.compact_max_fragments:
            return False
        with self._flush_lock, self._maintenance_lock:
            steps = maintenance.compact(
                self._table,
                max_small=self.config.compact_max_fragments,
                target_rows=self.config.compact_target_rows,
            )
            if steps:
                with self._lock:
                    view = self._view
                    self._view = _View(self._table.dataset, view.first, view.count, view.ordered)
                    self._counters.compactions += steps
        return steps > 0

    def _cleanup_versions(self) -> None:
        """Delete old versions through a handle of its own: flushes need not wait for it."""
        with self._maintenance_lock:
            maintenance.cleanup_versions(self._maintenance_table(), self.config.version_retention_s)
        self._counters.cleanups += 1

    def _maintenance_table(self) -> LanceTable:
        if self._maintenance is None:
            self._maintenance = LanceTable(self.path, base_schema())
        return self._maintenance

    # -- closing --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"{self!r} is closed")

    def close(self) -> None:
        """Flush what is buffered, stop background work and release the bucket."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._stop.set()
        self._wake.set()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()
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


def _holds_exactly(table: pa.Table, start: int, end: int) -> bool:
    """True if ``table``'s offsets are exactly ``start, start + 1, ..., end - 1``."""
    offsets = table.column(OFFSET).to_numpy()
    return len(offsets) == end - start and bool(np.array_equal(offsets, np.arange(start, end)))


def _which(index: int, total: int) -> str:
    return f"record {index} of {total}: " if total > 1 else ""


def _latency_summary(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"last": None, "p50": None, "max": None}
    return {
        "last": latencies[-1] * 1000,
        "p50": statistics.median(latencies) * 1000,
        "max": max(latencies) * 1000,
    }


close_all = ownership.close_all

__all__ = ["TRIMMED_BEFORE", "WAL_DIR", "LanceBackend", "PutResult", "close_all"]
