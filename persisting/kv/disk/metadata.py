"""The Lance metadata table of a model namespace: keys, layouts, checksums, references.

Payload files are the durable record of a chunk (self-describing, fsynced before a sync put
is acknowledged); this table is the queryable index over them, so opening a store reads
metadata columns only, never payloads. Rows are appended and deleted in batches by a
background thread (one Lance commit per batch), and the table is compacted and old
versions cleaned up every ``compact_every`` commits or as soon as it outgrows ``max_bytes``,
so its size stays bounded.

Each change runs inside a ``guard`` (the disk tier's): room for what the change can add on
disk is reserved in the directory's budget before Lance writes anything, and what it really
added is measured after. The bound comes from what a Lance commit writes: its rows' data
file, a manifest and a transaction file (each no larger than the largest manifest so far
plus what the commit adds), one deletion file per fragment a delete touches, and for a
compaction a rewrite of the data files.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pyarrow as pa

from persisting.errors import PersistingError
from persisting.kv import at_exit
from persisting.kv.disk.payload_files import BLOCK, HEADER_BYTES, round_to_block
from persisting.kv.layout import Layout
from persisting.kv.lock_order import Rank, ordered
from persisting.lance_store import LanceTable, blob_field
from persisting.lance_store.access import FileModes
from persisting.lance_store.blobs import blob_references

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("tag", pa.int64(), nullable=False),
        pa.field("nbytes", pa.int64(), nullable=False),
        pa.field("shape", pa.list_(pa.int64()), nullable=False),
        pa.field("dtype", pa.string(), nullable=False),
        pa.field("fmt", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("checksum", pa.int64(), nullable=False),
        pa.field("parent", pa.string()),
        pa.field("created_ns", pa.int64(), nullable=False),
        blob_field("payload"),
    ]
)
#: Columns read on open: everything but the payload reference.
INDEX_COLUMNS = [f.name for f in SCHEMA if f.name != "payload"]

_SIGN = 1 << 64

#: Rows deleted per Lance commit.
DELETE_CHUNK = 256
#: What any commit may write besides its manifest, transaction file and rows: file footers,
#: version hints, and the block each file is rounded up to (measured 8-16 KiB here).
COMMIT_BYTES = 32 << 10
#: A row's bytes in an appended data file besides its key and parent (numbers, shape,
#: dtype, format, blob reference; ~100 measured).
ROW_BYTES = 256
#: A deletion file: a header, then an Arrow list of 4-byte row ids up to some thousands of
#: rows (11 KiB seen at most), or a roaring bitmap of at most 8 KiB per 64Ki rows.
DELETION_HEADER_BYTES = 1 << 10
DELETION_LIST_BYTES = 16 << 10
DELETION_BYTES_PER_64KI_ROWS = 8 << 10
#: The fewest bytes a row takes in a data file (two int64 columns), to bound row counts.
_MIN_ROW_BYTES = 16

#: ``guard(bound)``: a context in which a change that may add up to ``bound()`` bytes runs
#: (``bound`` is called once the guard holds the directory's metadata lock: no other
#: process's commit then changes the table it looks at).
Guard = Callable[[Callable[[], int]], AbstractContextManager[None]]


@dataclass(frozen=True, slots=True)
class MetaRow:
    key: str
    tag: int
    layout: Layout
    checksum: int
    parent: str | None
    path: Path


def _sql_quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class MetadataTable:
    """Batched writer and reader of ``<model dir>/meta.lance``.

    ``guard`` wraps every change (see the module's docstring); without one, changes run
    unguarded. ``over_reservation`` counts changes that grew the table by more than the
    bound they ran under (none expected).
    """

    def __init__(
        self,
        path: Path,
        *,
        flush_interval_s: float = 0.2,
        compact_every: int = 64,
        max_bytes: int | None = None,
        modes: FileModes | None = None,
        guard: Guard | None = None,
    ):
        self.path = path
        self.table = LanceTable(path, SCHEMA, modes=modes)
        self._max_bytes = max_bytes
        self._size_after_maintenance = 0
        self._guard = guard
        self.over_reservation = 0
        self._pending_rows: list[MetaRow] = []
        self._pending_deletes: list[tuple[str, int]] = []
        # Lock order (persisting.kv.lock_order): the commit lock comes first of all the
        # store's locks (a commit takes the directory's metadata and usage locks), the
        # pending-rows lock last (nothing is taken under it).
        self._lock = ordered(Rank.METADATA_PENDING, threading.Lock())
        self._commit_lock = ordered(Rank.METADATA_COMMIT, threading.Lock())
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._commits = 0
        self._compact_every = compact_every
        self._interval = flush_interval_s
        self.errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="persisting-kv-meta", daemon=True)
        self._thread.start()
        at_exit.track(self, at_exit.METADATA)  # stopped at exit: never inside Lance then

    # -- reading ------------------------------------------------------------------------

    def load(self, path_of: Callable[[str, int], Path]) -> Iterator[MetaRow]:
        """Every indexed row (metadata columns only; no payload bytes are read)."""
        for batch in self.table.scan_batches(INDEX_COLUMNS):
            cols = batch.to_pydict()
            for i, key in enumerate(cols["key"]):
                tag = cols["tag"][i]
                layout = Layout(
                    tuple(cols["shape"][i]),
                    cols["dtype"][i],
                    cols["fmt"][i],
                    cols["nbytes"][i],
                    cols["kind"][i],
                )
                yield MetaRow(
                    key,
                    tag,
                    layout,
                    cols["checksum"][i] % _SIGN,
                    cols["parent"][i],
                    path_of(key, tag),
                )

    # -- writing (batched in the background) --------------------------------------------

    def add(self, rows: list[MetaRow]) -> None:
        with self._lock:
            self._pending_rows.extend(rows)
        self._wake.set()

    def delete(self, items: list[tuple[str, int]]) -> None:
        """Drop the rows of ``(key, tag)`` pairs (a key re-put later has a new tag)."""
        with self._lock:
            self._pending_deletes.extend(items)
        self._wake.set()

    def flush(self) -> bool:
        """Commit everything pending now, in the caller's thread; True if anything was."""
        with self._commit_lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        with self._lock:
            rows, self._pending_rows = self._pending_rows, []
            deletes, self._pending_deletes = self._pending_deletes, []
        if not rows and not deletes:
            return False
        # Metadata is an index over self-describing files: a failed commit costs a header
        # scan on the next open, never data. Failed steps keep their work for the next try.
        if rows and not self._attempt("append", self._append, rows):
            with self._lock:
                self._pending_rows[:0] = rows
        for start in range(0, len(deletes), DELETE_CHUNK):
            chunk = deletes[start : start + DELETE_CHUNK]
            if not self._attempt("delete", self._delete, chunk):
                with self._lock:
                    self._pending_deletes[:0] = deletes[start:]
                break
        if self._commits >= self._compact_every or self._too_big():
            self._commits = 0
            self._attempt("maintenance", self._maintain)
        return True

    def _too_big(self) -> bool:
        """Over ``max_bytes``, and twice what the last maintenance left (so a table whose
        live rows alone exceed the limit is not rewritten on every commit)."""
        if self._max_bytes is None:
            return False
        return self.table.size_bytes() > max(self._max_bytes, 2 * self._size_after_maintenance)

    def _attempt(self, what: str, fn: Callable[..., None], *args: object) -> bool:
        try:
            fn(*args)
            return True
        except (PersistingError, OSError, ValueError, RuntimeError) as exc:
            self.errors += 1
            log.warning("metadata %s on %s failed (will retry): %s", what, self.path, exc)
            return False

    # -- bounds on what a change adds on disk --------------------------------------------

    def _files(self, subdir: str) -> list[os.stat_result]:
        """The stat of each file in ``subdir`` of the table (one gone meanwhile is left out)."""
        try:
            entries = list(os.scandir(self.path / subdir))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            try:
                if entry.is_file():
                    found.append(entry.stat())
            except FileNotFoundError:
                continue
        return found

    def _commit_bound(self) -> int:
        """A manifest and a transaction file, each at most the largest manifest so far (a
        manifest lists every fragment; the new one adds the commit's few), plus the rest."""
        manifests = [round_to_block(st.st_size) for st in self._files("_versions")]
        return COMMIT_BYTES + 2 * max(manifests, default=BLOCK)

    def _data_files(self) -> tuple[int, int, int]:
        """Allocated bytes of the data files, their count (at least one per fragment) and
        the largest one's bytes."""
        sizes = [st.st_blocks * 512 for st in self._files("data")]
        return sum(sizes), len(sizes), max(sizes, default=0)

    def _append_bound(self, rows: list[MetaRow]) -> int:
        strings = sum(len(r.key.encode()) + len((r.parent or "").encode()) for r in rows)
        return self._commit_bound() + round_to_block(strings + ROW_BYTES * len(rows))

    def _delete_bound(self, count: int) -> int:
        """One deletion file per fragment the delete touches, each as large as one of the
        largest fragment's rows can need."""
        _total, fragments, largest = self._data_files()
        rows = largest // _MIN_ROW_BYTES
        per_fragment = round_to_block(
            DELETION_HEADER_BYTES
            + min(4 * rows, DELETION_LIST_BYTES)
            + DELETION_BYTES_PER_64KI_ROWS * (rows >> 16)
        )
        return self._commit_bound() + per_fragment * min(count, max(fragments, 1))

    def _maintenance_bound(self) -> int:
        """A compaction rewrites at most every data file (deleted rows dropped)."""
        total, count, _largest = self._data_files()
        return self._commit_bound() + total + BLOCK * count

    @contextmanager
    def _reserving(self, bound_of: Callable[[], int], what: str) -> Iterator[None]:
        """Run a change inside the guard; count it if it grew the table beyond its bound."""
        if self._guard is None:
            yield
            return
        bounds: list[int] = []

        def bound() -> int:
            bounds.append(bound_of())
            return bounds[-1]

        with self._guard(bound):
            before = self.table.size_bytes()
            try:
                yield
            finally:
                grew = self.table.size_bytes() - before
        if bounds and grew > bounds[0]:
            self.over_reservation += 1
            log.warning(
                "metadata %s on %s grew %d bytes, over its bound %d",
                what,
                self.path,
                grew,
                bounds[0],
            )

    # -- the changes ------------------------------------------------------------------------

    def _delete(self, chunk: list[tuple[str, int]]) -> None:
        where = " OR ".join(f"(key = {_sql_quote(k)} AND tag = {t})" for k, t in chunk)
        with self._reserving(lambda: self._delete_bound(len(chunk)), "delete"):
            self.table.delete(where)
        self._commits += 1

    def _append(self, rows: list[MetaRow]) -> None:
        now = time.time_ns()
        table = pa.table(
            {
                "key": [r.key for r in rows],
                "tag": [r.tag for r in rows],
                "nbytes": [r.layout.nbytes for r in rows],
                "shape": [list(r.layout.shape) for r in rows],
                "dtype": [r.layout.dtype for r in rows],
                "fmt": [r.layout.fmt for r in rows],
                "kind": [r.layout.kind for r in rows],
                "checksum": [
                    r.checksum - _SIGN if r.checksum >= 1 << 63 else r.checksum for r in rows
                ],
                "parent": [r.parent for r in rows],
                "created_ns": [now] * len(rows),
                "payload": blob_references(
                    [r.path for r in rows],
                    [HEADER_BYTES] * len(rows),
                    [r.layout.nbytes for r in rows],
                ),
            },
            schema=SCHEMA,
        )
        with self._reserving(lambda: self._append_bound(rows), "append"):
            self.table.append(table)
        self._commits += 1

    def _maintain(self) -> None:
        """Compact and clean up under one reservation: the table is largest after the
        compaction and before the cleanup."""
        with self._reserving(self._maintenance_bound, "maintenance"):
            if self.table.num_fragments() > 8:
                self.table.compact()
            self.table.cleanup(timedelta(seconds=0), keep_versions=2)
        self._size_after_maintenance = self.table.size_bytes()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._wake.wait(1.0):
                continue
            self._wake.clear()
            self._stop.wait(self._interval)  # let a burst of puts collect into one commit
            try:
                self.flush()
            except Exception:  # never stop the commits that later puts rely on
                log.exception("metadata commit of %s failed", self.path)

    def close(self) -> None:
        """Stop the background thread and commit what is pending (once)."""
        if self._stop_thread():
            self.flush()

    def discard(self) -> None:
        """Stop the background thread without committing: for a table that is being
        quarantined while the directory's locks are held (a commit takes the commit lock,
        which comes before them in the lock order). A table that was only read has
        nothing to commit."""
        self._stop_thread()

    def _stop_thread(self) -> bool:
        """Stop the background thread; False if it was stopped already."""
        if self._closed:
            return False
        self._closed = True
        at_exit.untrack(self, at_exit.METADATA)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        return True


def quarantine(path: Path) -> Path:
    """Move a damaged metadata table aside (kept for inspection) so a fresh one can start."""
    target = path.with_name(f"{path.name}.damaged-{time.time_ns()}")
    os.rename(path, target)
    return target


__all__ = ["INDEX_COLUMNS", "SCHEMA", "Guard", "MetaRow", "MetadataTable", "quarantine"]
