"""One bucket's committed records: its Lance dataset, the view reads use, and the commits that
change it (flush appends, compaction steps, trims) with the version cleanup that follows.

The view pairs a dataset version with the offsets it holds. It changes together with the
writer's buffer (a flush moves records from one to the other), so it is swapped under the
backend's lock (``view_lock``). Lock order: ``flush_lock``, ``maintenance_lock``, ``view_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from persisting.errors import CorruptValueError, OffsetTrimmedError, StorageIOError
from persisting.lance_store import LanceTable
from persisting.queue import maintenance
from persisting.queue.decoding import RecordDecoder
from persisting.queue.records import OFFSET, TIMESTAMP, base_schema
from persisting.queue.schema import RecordSchema
from persisting.queue.stats import Counters

logger = logging.getLogger(__name__)

#: Dataset config key: every offset below it was trimmed (so offsets continue after it).
TRIMMED_BEFORE = "persisting.queue.trimmed_before"
#: Attempts at opening the newest version when the one just seen is cleaned up meanwhile.
_CHECKOUT_ATTEMPTS = 3


@dataclass(frozen=True)
class DatasetView:
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


def trimmed_error(path: Path, offset: int, earliest: int) -> OffsetTrimmedError:
    return OffsetTrimmedError(
        f"offset {offset} of {path} was trimmed by retention; the earliest offset is {earliest}"
    )


class QueueDataset:
    """The Lance side of one bucket, for its writer (``writer=True``) or a reader."""

    def __init__(
        self,
        path: Path,
        *,
        view_lock: threading.Lock,
        counters: Counters,
        writer: bool,
        version_retention_s: float,
        poll_interval_s: float,
    ):
        self.path = path
        self.writer = writer
        self.table = LanceTable(path, base_schema())
        self.flush_lock = threading.Lock()  # commits that must not interleave with appends
        self.maintenance_lock = threading.Lock()  # one compaction, cleanup or trim at a time
        self._view_lock = view_lock
        self._counters = counters
        self._poll_interval_s = poll_interval_s
        self._last_refresh = 0.0
        self._cleaner: LanceTable | None = None
        self._decoder_cache: tuple[pa.Schema, RecordDecoder] | None = None
        self.view, self.last_ts = self.load_view()
        self.versions = (
            maintenance.VersionKeeper(
                version_retention_s,
                maintenance.lowest_version(self.table),
                self.table.version,
                time.monotonic(),
            )
            if writer
            else None
        )

    def load_view(self) -> tuple[DatasetView, int]:
        """The offsets of the table's current version (and the newest put time in it)."""
        dataset = self.table.dataset
        count = dataset.count_rows()
        floor = int(self.table.config().get(TRIMMED_BEFORE, "0"))
        if count == 0:
            return DatasetView(dataset, floor, 0), 0
        edges = dataset.take([0, count - 1], columns=[OFFSET, TIMESTAMP])
        first, last = edges.column(OFFSET).to_pylist()
        last_ts = edges.column(TIMESTAMP).cast(pa.int64())[1].as_py() or 0
        if last - first + 1 == count:
            return DatasetView(dataset, first, count), last_ts
        scanned = dataset.to_table(columns=[OFFSET, TIMESTAMP])  # rows out of offset order
        offsets = scanned.column(OFFSET)
        low, high = pc.min(offsets).as_py(), pc.max(offsets).as_py()
        if high - low + 1 != count:
            raise CorruptValueError(
                f"{self.path}: offsets {low}..{high} do not match its {count} rows"
            )
        last_ts = pc.max(scanned.column(TIMESTAMP).cast(pa.int64())).as_py() or 0
        logger.warning("%s: rows are out of offset order; reading by filter", self.path)
        return DatasetView(dataset, low, count, ordered=False), last_ts

    # -- commits --------------------------------------------------------------------------------

    def append(self, rows: list[dict[str, Any]], schema: RecordSchema) -> None:
        """Append admitted rows as one durable commit (under ``flush_lock``); the caller then
        calls :meth:`extend_view` under ``view_lock`` with the buffer they leave."""
        deltas = schema.deltas(self.table.schema)
        if deltas:
            self.table.add_fields(deltas)
        self.table.append(pa.Table.from_pylist(rows, schema=self.table.schema), durable=True)

    def extend_view(self, count: int) -> None:
        """The view after an append of ``count`` rows (the caller holds ``view_lock``)."""
        view = self.view
        self.view = DatasetView(self.table.dataset, view.first, view.count + count, view.ordered)

    def compact_if_needed(self, *, max_small: int, target_rows: int) -> bool:
        """Compact while no flush runs: a compaction committed over appends made meanwhile
        would put the merged fragments after them and break the offset order of rows."""
        if self.table.num_fragments() <= max_small:
            return False
        with self.flush_lock, self.maintenance_lock:
            steps = maintenance.compact(
                self.table,
                max_small=max_small,
                target_rows=target_rows,
                on_rewrite=self._rewriting,
            )
            if steps:
                # The merged files are durable before a cleanup can delete the originals.
                self.table.sync()
                with self._view_lock:
                    view = self.view
                    self.view = replace(view, dataset=self.table.dataset)
                    self._counters.compactions += steps
        return steps > 0

    def _rewriting(self, from_version: int) -> None:
        if self.versions is not None:
            self.versions.rewrote(from_version, time.monotonic())

    def cleanup_versions(self) -> None:
        """Delete the versions no reader needs (see :class:`maintenance.VersionKeeper`),
        through a handle of its own so that flushes need not wait for it."""
        if self.versions is None:
            return
        with self.maintenance_lock:
            if self._cleaner is None:
                self._cleaner = LanceTable(self.path, base_schema())
            latest, now = self.table.version, time.monotonic()
            doomed = self.versions.doomed(latest, now)
            try:
                self._cleaner.remove_versions(doomed)
            except TypeError:  # a pylance without cleanup by version number: by age, as before
                maintenance.cleanup_versions(self._cleaner, self.versions.retention_s)
            self.versions.cleaned()
        self.table.forget_removed_files()
        self._counters.cleanups += 1

    def trim(self, before: int) -> int:
        """Delete committed records with offsets below ``before``; return how many went."""
        with self.flush_lock, self.maintenance_lock:  # a delete conflicts with a compaction
            with self._view_lock:
                view = self.view
            before = min(int(before), view.next)
            if before <= view.first:
                return 0
            # The watermark goes first: if we crash before the delete, nothing is lost.
            self.table.set_config({TRIMMED_BEFORE: str(before)}, durable=True)
            self._rewriting(self.table.version)
            self.table.delete(f"{OFFSET} < {before}", durable=True)
            removed = before - view.first
            with self._view_lock:
                current = self.view
                self.view = DatasetView(
                    self.table.dataset, before, current.next - before, current.ordered
                )
                self._counters.trimmed_records += removed
            return removed

    def apply_retention(
        self, retention_s: float | None, consumer_positions: dict[str, int] | None, now_us: int
    ) -> int:
        """Trim what retention lets go (by age, by the slowest committed consumer, or both:
        either lets a record go); return how many records went."""
        with self._view_lock:
            view = self.view
        if view.count == 0:
            return 0
        cutoff = maintenance.retention_cutoff(
            view.dataset,
            view.first,
            retention_s=retention_s,
            consumer_positions=consumer_positions,
            now_us=now_us,
        )
        return 0 if cutoff is None else self.trim(cutoff)

    # -- reading --------------------------------------------------------------------------------

    def read(self, view: DatasetView, start: int, end: int) -> list[dict[str, Any]]:
        """The records at offsets ``start..end`` of ``view`` (all committed there)."""
        try:
            table = _scan(view, start, end)
        except Exception as exc:  # files of an old version cleaned up under us: retry fresh
            logger.debug("%s: read of an old version failed (%s); retrying", self.path, exc)
            self.refresh(force=True)
            with self._view_lock:
                view = self.view
            if start < view.first:
                raise trimmed_error(self.path, start, view.first) from exc
            end = min(end, view.next)
            try:
                table = _scan(view, start, end)
            except Exception as again:
                raise StorageIOError(f"cannot read {self.path}: {again}") from again
        if not _holds_exactly(table, start, end):
            if not view.ordered:
                raise CorruptValueError(f"{self.path}: offsets {start}..{end} are not all there")
            self._mark_unordered(view)
            return self.read(replace(view, ordered=False), start, end)
        return self._decoder(view.dataset.schema).decode_table(table)

    def _mark_unordered(self, view: DatasetView) -> None:
        logger.warning("%s: rows are out of offset order; reading by filter", self.path)
        with self._view_lock:
            if self.view.dataset is view.dataset:
                self.view = replace(self.view, ordered=False)

    def _decoder(self, schema: pa.Schema) -> RecordDecoder:
        cached = self._decoder_cache
        if cached is not None and cached[0].equals(schema, check_metadata=True):
            return cached[1]
        decoder = RecordDecoder(schema)
        self._decoder_cache = (schema, decoder)
        return decoder

    def refresh_due(self) -> bool:
        """A reader looks for new versions at most every ``poll_interval_s``."""
        elapsed = time.monotonic() - self._last_refresh
        return not self.writer and elapsed >= self._poll_interval_s

    def refresh(self, force: bool = False) -> None:
        """Move to the newest committed version.

        A reader does it to see new flushes (at most every ``poll_interval_s`` unless
        forced); a writer only when forced, after the files of the version it read were
        cleaned up by a compaction run elsewhere (``persisting compact``).
        """
        if not force and not self.refresh_due():
            return
        self._last_refresh = time.monotonic()
        if not self.writer:
            if not self._checkout_newest() and not force:
                return
            view, _ = self.load_view()
            with self._view_lock:
                self.view = view
            return
        with self.flush_lock:  # no flush may commit between the reload and the swap
            self._checkout_newest()
            view, _ = self.load_view()
            with self._view_lock:
                self.view = view

    def _checkout_newest(self) -> bool:
        """The table moved to the newest version (True if that changed it). The version seen
        as newest may be cleaned up before it is opened, when a newer one followed: retry."""
        for attempt in range(_CHECKOUT_ATTEMPTS):
            try:
                return self.table.refresh()
            except Exception as exc:
                if attempt == _CHECKOUT_ATTEMPTS - 1:
                    raise StorageIOError(f"cannot open the newest version of {self.path}") from exc
        return False  # not reached


def _scan(view: DatasetView, start: int, end: int) -> pa.Table:
    # Every column, unprojected: a projection list would parse a user's column named "*".
    if view.ordered:
        return view.dataset.to_table(offset=start - view.first, limit=end - start)
    found = view.dataset.to_table(filter=f"{OFFSET} >= {start} AND {OFFSET} < {end}")
    return found.sort_by(OFFSET)


def _holds_exactly(table: pa.Table, start: int, end: int) -> bool:
    """True if ``table``'s offsets are exactly ``start, start + 1, ..., end - 1``."""
    offsets = table.column(OFFSET).to_numpy()
    return len(offsets) == end - start and bool(np.array_equal(offsets, np.arange(start, end)))


__all__ = ["TRIMMED_BEFORE", "DatasetView", "QueueDataset", "trimmed_error"]
