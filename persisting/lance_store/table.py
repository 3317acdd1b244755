"""One Lance dataset with the operations both the queue and the KV store need.

:class:`LanceTable` wraps ``lance.LanceDataset`` with: open-or-create by schema (additive
evolution, clear errors on conflicts), append as one commit, take, column scans, blob
reads, delete, compaction, version cleanup, sizes, and an optional *durable* commit that
fsyncs every new file and directory (Lance itself never fsyncs).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeAlias

import lance
import pyarrow as pa

from persisting.errors import SchemaMismatchError, StorageIOError
from persisting.lance_store.access import OWNER_ONLY, FileModes, restrict
from persisting.lance_store.durable import fsync_dir, fsync_file, makedirs_durable

#: Lance file format with blob encoding v2 (payloads beside fragments, external references).
DATA_STORAGE_VERSION: Literal["2.2"] = "2.2"

#: Sub-directories of a dataset whose new files a durable commit must fsync.
_DATASET_SUBDIRS = ("data", "_versions", "_transactions", "_deletions", "_indices")

Rows: TypeAlias = pa.Table | pa.RecordBatch | Sequence[dict[str, Any]]


def _is_blob_field(field: pa.Field) -> bool:
    return isinstance(field.type, pa.ExtensionType) and "blob" in field.type.extension_name


def _same_type(a: pa.Field, b: pa.Field) -> bool:
    if _is_blob_field(a) or _is_blob_field(b):
        return _is_blob_field(a) and _is_blob_field(b)
    return a.type.equals(b.type)


class LanceTable:
    """A Lance dataset at ``path`` with schema ``schema`` (created on first open).

    Thread-safe for use from one process; several processes may append concurrently
    (Lance resolves concurrent appends with optimistic commits). With ``modes``, every file
    and directory of the dataset is given those permissions after each commit (Lance
    creates them with the process umask).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: pa.Schema,
        *,
        evolve: bool = True,
        modes: FileModes | None = None,
    ):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._synced: set[str] = set()
        self._modes = modes
        self._has_blobs = any(_is_blob_field(f) for f in schema)
        self._dataset = self._open_or_create(schema, evolve)
        self._apply_modes()

    # -- opening ------------------------------------------------------------------------

    def _open_or_create(self, schema: pa.Schema, evolve: bool) -> lance.LanceDataset:
        if (self.path / "_versions").is_dir():
            try:
                dataset = lance.dataset(str(self.path))
            except Exception as exc:  # lance raises OSError/ValueError variants
                raise StorageIOError(f"cannot open Lance dataset {self.path}: {exc}") from exc
            return self._reconcile(dataset, schema, evolve)
        makedirs_durable(self.path.parent, self._modes or OWNER_ONLY)
        empty = pa.Table.from_batches([], schema=schema)
        try:
            return lance.write_dataset(
                empty,
                str(self.path),
                schema=schema,
                mode="create",
                data_storage_version=DATA_STORAGE_VERSION,
            )
        except Exception as exc:
            # Another process may have created it between our check and our write.
            if (self.path / "_versions").is_dir():
                return self._reconcile(lance.dataset(str(self.path)), schema, evolve)
            raise StorageIOError(f"cannot create Lance dataset {self.path}: {exc}") from exc

    def _reconcile(
        self, dataset: lance.LanceDataset, wanted: pa.Schema, evolve: bool
    ) -> lance.LanceDataset:
        existing = dataset.schema
        missing: list[pa.Field] = []
        for field in wanted:
            index = existing.get_field_index(field.name)
            if index < 0:
                missing.append(field)
            elif not _same_type(existing.field(index), field):
                raise SchemaMismatchError(
                    f"{self.path}: column {field.name!r} is {existing.field(index).type}, "
                    f"wanted {field.type}"
                )
        if missing:
            if not evolve:
                names = ", ".join(f.name for f in missing)
                raise SchemaMismatchError(f"{self.path}: missing columns {names}")
            self._add_columns(dataset, missing)
            dataset = lance.dataset(str(self.path))
        return dataset

    @staticmethod
    def _add_columns(dataset: lance.LanceDataset, fields: list[pa.Field]) -> None:
        for field in fields:
            if not field.nullable:
                raise SchemaMismatchError(
                    f"cannot add non-nullable column {field.name!r} to existing data"
                )
        dataset.add_columns(fields)

    def _private_handle(self) -> lance.LanceDataset:
        """A fresh handle on the newest version, for one mutating call.

        Mutating calls borrow the Rust dataset exclusively; on the shared :attr:`dataset`
        they would make concurrent readers in other threads panic ("Already borrowed").
        """
        try:
            return lance.dataset(str(self.path))
        except Exception as exc:
            raise StorageIOError(f"cannot open Lance dataset {self.path}: {exc}") from exc

    # -- properties ---------------------------------------------------------------------

    @property
    def dataset(self) -> lance.LanceDataset:
        """The current ``lance.LanceDataset`` (as of the last commit or refresh)."""
        return self._dataset

    @property
    def schema(self) -> pa.Schema:
        return self._dataset.schema

    @property
    def version(self) -> int:
        return self._dataset.version

    def refresh(self) -> bool:
        """Move to the newest committed version (others' commits); True if it changed."""
        with self._lock:
            before = self._dataset.version
            latest = self._dataset.latest_version
            if latest != before:
                self._dataset = self._dataset.checkout_version(latest)
            return latest != before

    def evolve(self, fields: Iterable[pa.Field]) -> None:
        """Add nullable columns (existing rows read them as null)."""
        with self._lock:
            new = [f for f in fields if self._dataset.schema.get_field_index(f.name) < 0]
            if new:
                self._add_columns(self._private_handle(), new)
                self._dataset = lance.dataset(str(self.path))
            self._apply_modes()

    def add_fields(self, fields: Iterable[pa.Field]) -> None:
        """Add nullable columns, or new children to existing struct columns, as one commit each.

        A field named like an existing struct (or list-of-struct) column whose type names only
        new children is merged into it by Lance, so nested records can widen additively.
        """
        fields = list(fields)
        if not fields:
            return
        with self._lock:
            self._add_columns(self._private_handle(), fields)
            self._dataset = lance.dataset(str(self.path))
            self._apply_modes()

    def config(self) -> dict[str, str]:
        """The dataset's key/value config (stored in its manifest, versioned with the data)."""
        return dict(self._dataset.config())

    def set_config(self, values: dict[str, str], *, durable: bool = False) -> None:
        """Set config keys as one commit (fsynced when ``durable``)."""
        with self._lock:
            self._private_handle().update_config(dict[str, str | None](values))
            self._dataset = lance.dataset(str(self.path))
            self._apply_modes()
            if durable:
                self.sync()

    # -- writing ------------------------------------------------------------------------

    def append(self, rows: Rows, *, durable: bool = False) -> int:
        """Append ``rows`` as one commit (one new fragment); return the new version.

        With ``durable=True`` the new data files, manifest and directories are fsynced
        before returning, so the rows survive a power cut.
        """
        table = self._as_table(rows)
        if table.num_rows == 0:
            return self.version
        with self._lock:
            try:
                self._dataset = self._write(table, "append")
            except Exception as exc:  # lance raises OSError and ValueError variants
                raise StorageIOError(f"append to {self.path} failed: {exc}") from exc
            self._apply_modes()
            if durable:
                self.sync()
            return self._dataset.version

    def overwrite(self, rows: pa.Table, *, durable: bool = False) -> int:
        """Replace every row with ``rows`` (same schema) as one commit; keeps the config.

        Old files stay until :meth:`cleanup`; returns the new version.
        """
        with self._lock:
            config = dict(self._dataset.config())
            try:
                self._write(rows, "overwrite")
                if config:
                    self._private_handle().update_config(dict[str, str | None](config))
            except Exception as exc:
                raise StorageIOError(f"overwrite of {self.path} failed: {exc}") from exc
            self._dataset = lance.dataset(str(self.path))
            self._apply_modes()
            if durable:
                self.sync()
            return self._dataset.version

    def _write(self, rows: pa.Table, mode: str) -> lance.LanceDataset:
        """One ``lance.write_dataset`` commit of ``rows`` in this table's format (the caller
        holds the lock)."""
        return lance.write_dataset(
            rows,
            str(self.path),
            schema=rows.schema,
            mode=mode,
            data_storage_version=DATA_STORAGE_VERSION,
            allow_external_blob_outside_bases=self._has_blobs,
        )

    def _as_table(self, rows: Rows) -> pa.Table:
        schema = self._dataset.schema
        if isinstance(rows, pa.RecordBatch):
            rows = pa.Table.from_batches([rows])
        if isinstance(rows, pa.Table):
            if rows.schema.equals(schema, check_metadata=False):
                return rows
            try:
                return rows.select(schema.names).cast(schema) if not self._has_blobs else rows
            except (KeyError, pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as exc:
                raise SchemaMismatchError(f"rows do not fit {self.path}: {exc}") from exc
        try:
            return pa.Table.from_pylist(list(rows), schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise SchemaMismatchError(f"rows do not fit {self.path}: {exc}") from exc

    def delete(self, predicate: str, *, durable: bool = False) -> None:
        """Mark rows matching ``predicate`` (a Lance SQL filter) deleted, as one commit."""
        with self._lock:
            self._private_handle().delete(predicate)
            self._dataset = lance.dataset(str(self.path))
            self._apply_modes()
            if durable:
                self.sync()

    def _apply_modes(self) -> None:
        """Give the dataset's files and directories the table's modes (if it has any): one
        ``lstat`` per entry, a ``chmod`` only where Lance left the umask's mode."""
        if self._modes is None:
            return
        with self._lock:
            for directory, _dirs, files in os.walk(self.path):
                restrict(directory, self._modes.directory)
                for name in files:
                    restrict(os.path.join(directory, name), self._modes.file)

    def sync(self) -> None:
        """fsync every file of the dataset not yet synced, then their directories."""
        with self._lock:
            dirty_dirs: set[Path] = set()
            for sub in _DATASET_SUBDIRS:
                directory = self.path / sub
                try:
                    entries = list(os.scandir(directory))
                except FileNotFoundError:
                    continue
                for entry in entries:
                    if entry.path in self._synced or not entry.is_file():
                        continue
                    try:
                        fsync_file(entry.path)
                    except StorageIOError:
                        if not os.path.exists(entry.path):
                            continue  # removed meanwhile: a concurrent cleanup or a temp file
                        raise
                    self._synced.add(entry.path)
                    dirty_dirs.add(directory)
            for directory in sorted(dirty_dirs):
                fsync_dir(directory)
            fsync_dir(self.path)

    # -- reading ------------------------------------------------------------------------

    def count_rows(self, filter: str | None = None) -> int:
        return self._dataset.count_rows(filter)

    def take(self, indices: Sequence[int], columns: Sequence[str] | None = None) -> pa.Table:
        """Rows at positions ``indices`` of the current version."""
        return self._dataset.take(list(indices), columns=list(columns) if columns else None)

    def scan(
        self,
        columns: Sequence[str] | None = None,
        filter: str | None = None,
        *,
        with_row_id: bool = False,
        limit: int | None = None,
        offset: int | None = None,
    ) -> pa.Table:
        """Selected columns of matching rows; blob columns come back as descriptors only."""
        return self._dataset.to_table(
            columns=list(columns) if columns else None,
            filter=filter,
            with_row_id=with_row_id,
            limit=limit,
            offset=offset,
        )

    def scan_batches(
        self, columns: Sequence[str] | None = None, filter: str | None = None
    ) -> Iterator[pa.RecordBatch]:
        scanner = self._dataset.scanner(columns=list(columns) if columns else None, filter=filter)
        yield from scanner.to_batches()

    def read_blobs(self, column: str, indices: Sequence[int]) -> list[bytes]:
        """Payload bytes of blob column ``column`` at row positions ``indices``."""
        files = self._dataset.take_blobs(column, indices=list(indices))
        out: list[bytes] = []
        for blob in files:
            if blob is None:
                raise StorageIOError(f"{self.path}: missing blob in column {column!r}")
            with blob:
                out.append(blob.read())
        return out

    # -- maintenance --------------------------------------------------------------------

    def num_fragments(self) -> int:
        return len(self._dataset.get_fragments())

    def compact(self, *, target_rows_per_fragment: int = 1 << 20, **options: Any) -> Any:
        """Merge small fragments and drop deleted rows; returns Lance's compaction metrics.

        ``options`` go to Lance's ``compact_files`` (e.g. ``excluded_fragment_ids`` to leave
        large fragments alone, ``compaction_mode``).
        """
        with self._lock:
            metrics = self._private_handle().optimize.compact_files(
                target_rows_per_fragment=target_rows_per_fragment, **options
            )
            self._dataset = lance.dataset(str(self.path))
            self._apply_modes()
            return metrics

    def cleanup(self, older_than: timedelta = timedelta(0), *, keep_versions: int = 1) -> int:
        """Delete files only referenced by old versions; returns bytes removed."""
        with self._lock:
            stats = self._private_handle().cleanup_old_versions(
                older_than=older_than, retain_versions=keep_versions
            )
            self._synced = {p for p in self._synced if os.path.exists(p)}
            return int(stats.bytes_removed)

    def remove_versions(self, versions: Sequence[int]) -> int:
        """Delete exactly these versions (never the newest) and the files only they list;
        returns bytes removed. Versions that no longer exist are skipped."""
        if not versions:
            return 0
        with self._lock:
            stats = self._private_handle().cleanup_old_versions(versions=list(versions))
            self._synced = {p for p in self._synced if os.path.exists(p)}
            return int(stats.bytes_removed)

    def forget_removed_files(self) -> None:
        """Drop files deleted since they were synced (by a cleanup through another handle)
        from what :meth:`sync` remembers, so that memory stays bounded."""
        with self._lock:
            self._synced = {p for p in self._synced if os.path.exists(p)}

    def num_versions(self) -> int:
        return len(self._dataset.versions())

    def size_bytes(self) -> int:
        """Bytes the dataset's files use on disk (allocated blocks, like ``du``)."""
        return disk_usage(self.path)


def disk_usage(path: str | os.PathLike[str], *, directories: bool = False) -> int:
    """Allocated bytes of every file under ``path``, and with ``directories`` of every
    directory too (then exactly what ``du -s`` reports)."""
    total = 0
    for directory, _dirs, files in os.walk(path):
        names = [os.path.join(directory, n) for n in files]
        if directories:
            names.append(directory)
        for name in names:
            try:
                total += os.lstat(name).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


__all__ = ["DATA_STORAGE_VERSION", "LanceTable", "disk_usage"]
