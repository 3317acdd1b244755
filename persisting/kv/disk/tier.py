"""The disk tier: payload files plus a Lance metadata table, under one byte budget.

A hot read costs one index lookup and one positioned read into the destination buffer, then
a checksum check; Lance is off the read path.

The budget covers everything in the model directory, for all processes sharing it, and
every byte is reserved before it lands (:mod:`persisting.kv.budget.disk`); this tier's
eviction makes the room, unlinking payload files before the bytes they make room for are
written. On open the index is rebuilt from the metadata table and reconciled with the
payload files actually present.

Over 500 lines on purpose: the index, the files and the eviction that keeps both within the
budget change together under one lock, and that invariant reads best in one class.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from persisting.errors import CapacityError, CorruptValueError, PersistingError, StorageIOError
from persisting.kv.budget.disk import DiskBudget
from persisting.kv.budget.root import RootUsage
from persisting.kv.budget.shared_usage import SharedUsage
from persisting.kv.disk.leases import Clock, Leases, Location
from persisting.kv.disk.metadata import MetadataTable, MetaRow, quarantine
from persisting.kv.disk.payload_files import (
    HEADER_BYTES,
    FileHeader,
    Pause,
    PayloadFiles,
    Reservation,
    file_size,
)
from persisting.kv.disk.quarantine import Quarantine
from persisting.kv.disk.reconcile import FileJudge, index_rows
from persisting.kv.eviction.batch_fit import heads_that_fit
from persisting.kv.eviction.policy import EvictionPolicy
from persisting.kv.eviction.remembered import EvictionMemory
from persisting.kv.eviction.sighting_counter import SightingCounter
from persisting.kv.index import DiskEntry, LruIndex
from persisting.kv.keys import key_hash
from persisting.kv.layout import Layout, Payload
from persisting.kv.lock_order import Rank, ordered
from persisting.lance_store.access import OWNER_ONLY, FileModes, storage_error
from persisting.lance_store.durable import makedirs_durable
from persisting.lance_store.root_keys import RootKeys

log = logging.getLogger(__name__)


#: Metadata commits a flush runs at most (see :meth:`DiskTier.flush`).
FLUSH_ROUNDS = 4

#: Told which chunks eviction removed, as ``(key, bytes on disk)``.
EvictionListener = Callable[[list[tuple[str, int]]], None]


@dataclass(slots=True)
class WriteItem:
    """One value to write. ``cancelled`` (set by a remove) makes the write lose: an item
    cancelled before its batch starts is skipped, one cancelled while being written is
    unlinked instead of published. ``checksum`` None: hash ``data`` while writing it (the
    tier fills it in). ``data`` is one buffer, or a value's parts written end to end."""

    key: str
    layout: Layout
    data: Payload
    checksum: int | None
    parent: str | None
    cancelled: bool = False


class DiskTier:
    """Thread-safe; several processes may share one directory.

    ``_lock`` guards the index (every read and change of it, and of its entries' pins,
    readers and leases); see :mod:`persisting.kv.lock_order` for where it comes.

    ``on_evict`` is called after each eviction with the chunks it removed, on the writing
    thread and with the directory's usage lock held: it must be quick and must not call
    back into the tier. ``clock`` times leases.
    """

    def __init__(
        self,
        directory: Path,
        capacity: int,
        policy: EvictionPolicy,
        on_evict: EvictionListener | None = None,
        modes: FileModes = OWNER_ONLY,
        *,
        keys: RootKeys,
        root_usage: RootUsage | None = None,
        clock: Clock = time.monotonic,
    ):
        self.directory = directory
        self.capacity = capacity
        self.policy = policy
        self.on_evict = on_evict
        self.modes = modes
        makedirs_durable(directory, modes)
        self.files = PayloadFiles(directory, keys, modes)
        self.usage = SharedUsage(directory)
        #: Unknown payload files: adopted, or quarantined if they do not verify.
        self.judge = FileJudge(self.files, Quarantine(directory, modes), self._released)
        self._budget = DiskBudget(
            directory,
            capacity,
            self.files,
            self.usage,
            evict=self._evict,
            refresh=self.refresh,
            root_usage=root_usage,
        )
        self.index: LruIndex[DiskEntry] = LruIndex()
        #: The eviction order and reuse counts kept beside the metadata.
        self.remembered = EvictionMemory(directory, self.index, self._budget)
        #: Counts reads' sightings off the read (a write counts its own and those queued).
        self._sightings = SightingCounter(self.index.count_sightings)
        # The index, its entries, their leases and the keys being written: every reader and
        # writer of them holds it. Lock order (persisting.kv.lock_order): taken under the
        # usage lock (eviction) or Tiers.lock (lookups, pins), never the other way round.
        self._lock = ordered(Rank.DISK_INDEX, threading.RLock())
        self._writing: set[str] = set()
        #: Read leases by token (under the index lock): a leased key is not evicted.
        self.leases = Leases(clock)
        self._closed = False
        self.evictions = 0
        #: Payload files this process wrote, and their bytes on disk (header, block-rounded).
        self.files_written = 0
        self.bytes_written = 0
        self.corruptions = 0
        self.recovered_files = 0
        try:
            self.meta = self._open_metadata()
        except OSError as exc:  # e.g. a read-only filesystem
            self.usage.close()
            _raise_opening_error(directory, exc)
        #: Held while open: this store's proof of life (see PayloadFiles).
        self._alive: Reservation | None = None
        try:
            with self.usage.metadata_locked(), self.usage.locked(), self._lock:
                self._alive = self.files.register_writer()
                # the side files judged before anything (a commit in _load_index) counts them
                self.remembered.prepare(self.policy, self.capacity)
                self.judge.put_back_verified()
                self._load_index()
                self.usage.recount(self.files)
                self._budget.account_overhead()
                self.remembered.restore(self.policy, self.capacity)
        except BaseException as exc:
            self.meta.close()
            if self._alive is not None:
                self.files.release_file(self._alive)
            self.usage.close()
            if isinstance(exc, OSError):
                _raise_opening_error(directory, exc)
            raise

    # -- opening and reconciling --------------------------------------------------------

    def _new_metadata(self, path: Path) -> MetadataTable:
        return MetadataTable(
            path,
            modes=self.modes,
            max_bytes=max(self.capacity // 16, 128 << 10),
            guard=self._budget.metadata_growth,
        )

    def _open_metadata(self) -> MetadataTable:
        path = self.directory / "meta.lance"
        try:
            return self._new_metadata(path)
        except Exception as exc:  # a damaged manifest or data file: rebuild from headers
            log.warning(
                "metadata table %s is damaged (%s); rebuilding from payload files", path, exc
            )
            self.corruptions += 1
            if path.exists():
                quarantine(path)
            return self._new_metadata(path)

    def _load_index(self) -> None:
        try:
            rows = list(self.meta.load(self.files.path))
        except Exception as exc:
            log.warning(
                "cannot read metadata of %s (%s); rebuilding from payload files",
                self.directory,
                exc,
            )
            self.corruptions += 1
            self.meta.discard()  # only read: nothing to commit (and the locks are held)
            quarantine(self.meta.path)
            self.meta = self._new_metadata(self.meta.path)
            rows = []
        on_disk = {(h, tag): path for path, h, tag in self.files.scan()}
        stale = index_rows(rows, on_disk, self.index)  # evicted/removed before their rows
        if stale:
            self.meta.delete(stale)
        self._adopt_unknown_files(on_disk, record=True)

    def _adopt_unknown_files(self, on_disk: dict[tuple[int, int], Path], *, record: bool) -> int:
        """Index payload files the metadata does not know (written by a process that died
        before its metadata commit, or by another live process), as the judge rules
        (:mod:`~persisting.kv.disk.reconcile`). With ``record`` their rows are committed
        too (on open); on refresh the writer's own commit will add them."""
        judging = not self.files.keys.changed()
        adopted = self.judge.adopt(on_disk, self.index, judging=judging)
        if adopted and record:
            self.meta.add(adopted)
            self.recovered_files += len(adopted)
        return len(adopted)

    @property
    def reclaimed_bytes(self) -> int:
        """Bytes of dead writers' reservations this store gave back while open."""
        return self.usage.reclaimed_bytes

    def flush(self) -> None:
        """Commit pending metadata now and account for what it occupies.

        A commit reserves its room first, which may evict chunks and so queue the deletion
        of their rows: those are committed too (a few rounds at most, each smaller), so
        nothing is left reserved or pending when this returns.
        """
        if self._closed:
            return
        self.index.count_sightings()
        self.remembered.save(self._lock)
        for _ in range(FLUSH_ROUNDS):
            if not self.meta.flush():
                break
        self._budget.account_overhead()

    def refresh(self) -> int:
        """Pick up chunks other processes wrote and forget those they removed."""
        with self.usage.locked(), self._lock:
            on_disk = {(h, tag): path for path, h, tag in self.files.scan()}
            gone = [
                k
                for k, e in self.index.items()
                if (key_hash(k), e.tag) not in on_disk and not e.busy
            ]
            for key in gone:
                self._drop_entry(key)
            return self._adopt_unknown_files(on_disk, record=False) + len(gone)

    # -- queries ------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.index

    def present(self, key: str) -> DiskEntry | None:
        """``key``'s entry while its file is there: one removed behind the index (a writer of
        another namespace made room in the root) before a refresh saw it is forgotten, so a
        put writes it again."""
        with self._lock:
            entry = self.index.get(key)
            if entry is None or entry.busy or os.path.exists(self.files.path_text(key, entry.tag)):
                return entry
            self._drop_entry(key)
            return None

    def entry(self, key: str) -> DiskEntry | None:
        with self._lock:
            return self.index.get(key)

    @contextmanager
    def holding(self) -> Iterator[LruIndex[DiskEntry]]:
        """Hold the index lock across several lookups (one acquisition, not one per key;
        after ``Tiers.lock`` in the lock order): yields the index, to read inside the block
        only."""
        with self._lock:
            yield self.index

    def is_writing(self, key: str) -> bool:
        """Whether a write of ``key`` is under way in this process."""
        with self._lock:
            return key in self._writing

    def used_bytes(self) -> int:
        """Bytes the directory holds: payload files (reserved) plus the measured overhead."""
        return self.usage.total()

    def overhead_bytes(self) -> int:
        return self.usage.overhead()

    def sizes(self) -> list[tuple[str, int]]:
        """Every key with its payload size, from the first eviction candidate to the last."""
        with self._lock:
            return [(key, entry.layout.nbytes) for key, entry in self.index.items()]

    def figures(self) -> dict[str, int]:
        """The tier's part of a store's ``stats()``: ``disk_bytes`` is everything the
        directory holds (payload files plus ``disk_overhead_bytes``)."""
        with self._lock:
            items, leases = len(self.index), self.leases.total()
        return {
            "disk_items": items,
            "disk_leases": leases,
            "disk_bytes": self.used_bytes(),
            "disk_overhead_bytes": self.overhead_bytes(),
            "disk_capacity": self.capacity,
            "disk_evictions": self.evictions,
            "disk_files_written": self.files_written,
            "disk_written_bytes": self.bytes_written,
            "corruptions": self.corruptions + self.judge.verdicts.damaged,
            "recovered_files": self.recovered_files,
            "foreign_files": self.judge.verdicts.foreign,
            "quarantined_files": self.judge.verdicts.quarantined,
            "restored_files": self.judge.verdicts.restored,
            "reclaimed_bytes": self.reclaimed_bytes,
        }

    # -- writing ------------------------------------------------------------------------

    def write(
        self,
        items: list[WriteItem],
        *,
        durable: bool,
        pause: Pause | None = None,
        writers: Executor | None = None,
    ) -> list[bool]:
        """Store a batch; per item True if newly stored, False if already present.
        ``pause()`` runs between the pieces of each file written and may raise to abandon
        the batch (see ``PayloadFiles.write``); ``writers`` write the files of a durable
        batch (default: the files' own threads).

        Capacity is reserved for the whole batch first (evicting as needed), so the batch
        either fits or fails with CapacityError before any file is written. A cancelled item
        (see :class:`WriteItem`) is not stored.
        """
        with self._lock:
            first_of_key: dict[str, WriteItem] = {}
            for it in items:
                if it.cancelled or self.present(it.key) is not None or it.key in self._writing:
                    continue
                first_of_key.setdefault(it.key, it)
            todo = list(first_of_key.values())
            for it in todo:
                if file_size(it.layout.nbytes) > self.capacity:
                    raise CapacityError(
                        f"a {it.layout.nbytes}-byte value cannot fit "
                        f"a {self.capacity}-byte disk tier"
                    )
            self._writing.update(it.key for it in todo)
        writing = {it.key for it in todo}
        stored: set[str] = set()
        try:
            if todo:
                stored = self._write_reserved(todo, durable, pause, writers)
        finally:
            with self._lock:
                self._writing.difference_update(writing)
        return [it.key in stored for it in items]

    def _write_reserved(
        self,
        todo: list[WriteItem],
        durable: bool,
        pause: Pause | None = None,
        writers: Executor | None = None,
    ) -> set[str]:
        sizes = [file_size(it.layout.nbytes) for it in todo]
        tags = [self.files.new_tag() for _ in todo]
        with self.usage.locked():
            subdirs = {
                self.files.path(it.key, tag).parent for it, tag in zip(todo, tags, strict=True)
            }
            headroom = self._budget.growth_of(subdirs)
            room = self._budget.payload_room(sum(sizes), headroom)
            kept = heads_that_fit([i.key for i in todo], [i.parent for i in todo], sizes, room)
            if len(kept) < len(todo):  # over the whole budget: its prefixes are kept
                log.info("a batch over the disk budget: %d of %d stored", len(kept), len(todo))
                todo[:] = [todo[i] for i in kept]
                sizes[:] = [sizes[i] for i in kept]
                tags[:] = [tags[i] for i in kept]
            self._budget.reserve(sum(sizes), headroom=headroom)
            try:
                created = self.files.create(
                    [(it.key, tag, size) for it, tag, size in zip(todo, tags, sizes, strict=True)]
                )
            except BaseException:  # nothing was written: give the whole reservation back
                self.usage.add(-sum(sizes))
                raise
            self._budget.add_overhead(created.grown)
            pending, subdir_bytes = created.pending, created.allocated
        done: list[Path] = []
        try:
            # An item without a checksum gets it made as its file is written.
            headers = [FileHeader(it.key, it.layout, it.checksum or 0, it.parent) for it in todo]
            hashed = [it.checksum is None for it in todo]
            written = self.files.write_batch(
                pending,
                headers,
                [it.data for it in todo],
                durable=durable,
                hashed=hashed,
                pause=pause,
                writers=writers,
            )
            for it, header in zip(todo, written, strict=True):
                it.checksum = header.checksum
            for p in pending:
                done.append(self.files.publish(p))
            self.files_written += len(done)
            self.bytes_written += sum(sizes)
            self._budget.account_renames(subdir_bytes)
            if durable:
                self.files.sync_dirs(done)
        except BaseException:
            for p in pending[len(done) :]:
                self.files.abort(p)
            released = sum(sizes[len(done) :])
            for path, size in zip(done, sizes, strict=False):
                if self.files.unlink(path):
                    released += size
            self.usage.add(-released)
            raise
        return self._index_written(todo, tags, done, sizes)

    def _index_written(
        self, todo: list[WriteItem], tags: list[int], done: list[Path], sizes: list[int]
    ) -> set[str]:
        """Index a batch's published files and queue their metadata rows; the files of
        items removed meanwhile are unlinked instead. Returns the keys stored."""
        rows: list[MetaRow] = []
        cancelled: list[tuple[Path, int]] = []
        with self._lock:  # a remove sets ``cancelled`` before it takes this lock
            for it, tag, path, size in zip(todo, tags, done, sizes, strict=True):
                if it.cancelled:  # removed while being written: the remove wins
                    cancelled.append((path, size))
                    continue
                assert it.checksum is not None  # set when its file was written
                self.index.add(it.key, DiskEntry(it.layout, it.checksum, it.parent, tag))
                rows.append(MetaRow(it.key, tag, it.layout, it.checksum, it.parent, path))
        self.index.count_sightings()
        released = sum(size for path, size in cancelled if self.files.unlink(path))
        if released:
            self.usage.add(-released)
        self.meta.add(rows)
        return {row.key for row in rows}

    def _evict(self, need: int) -> int:
        """Unlink victims until ``need`` bytes are freed (caller holds the usage lock).

        Only files this process actually unlinks count: one another process evicted first
        frees nothing here, so the next victims are taken until enough is freed or none
        is left.
        """
        released = 0
        evicted: list[tuple[str, DiskEntry]] = []
        while released < need:
            now = self.leases.clock()
            with self._lock:
                victims: list[tuple[str, DiskEntry]] = self.policy.victims(
                    self.index, need - released, _file_bytes, self._unleased(now)
                )
                for key, _entry in victims:
                    self._drop_entry(key)
            if not victims:
                break
            for key, entry in victims:
                if self.files.unlink(self.files.path(key, entry.tag)):
                    released += file_size(entry.layout.nbytes)
            evicted += victims
        if released:
            self.usage.set(self.usage.get() - released)
        self.evictions += len(evicted)
        if evicted:
            self.meta.delete([(k, e.tag) for k, e in evicted])
            if self.on_evict is not None:
                self.on_evict([(k, file_size(e.layout.nbytes)) for k, e in evicted])
        return released

    # -- reading ------------------------------------------------------------------------

    def read_into(
        self,
        key: str,
        out: memoryview,
        *,
        executor: Executor | None = None,
        parts: int = 1,
    ) -> Layout | None:
        """Read ``key``'s payload into ``out`` (len == nbytes) and verify its checksum; in
        ``parts`` positioned reads at once on ``executor`` when given.

        Returns None on a miss, including a file evicted by another process mid-way and a
        checksum failure (the damaged chunk is then dropped and counted).
        """
        with self._lock:
            entry = self.index.get(key, touch=True)
            if entry is None:
                return None
            if len(out) != entry.layout.nbytes:
                raise StorageIOError(
                    f"destination is {len(out)} bytes, value is {entry.layout.nbytes}"
                )
            entry.readers += 1
        self._sightings.poke()
        path = self.files.path_text(key, entry.tag)
        try:
            digest = self.files.read_into(path, out, executor=executor, parts=parts)
            ok = digest == entry.checksum
        except FileNotFoundError:
            self._forget(key, entry)
            return None
        except CorruptValueError:
            ok = False
        except OSError as exc:
            raise StorageIOError(f"reading {key!r} failed: {exc}") from exc
        finally:
            with self._lock:
                entry.readers -= 1
        if not ok:
            self.corruptions += 1
            self._set_aside(key, entry, "its payload fails its checksum")
            return None
        return entry.layout

    def _set_aside(self, key: str, entry: DiskEntry, why: str) -> None:
        """Quarantine ``key``'s file (never served again, not deleted)."""
        with self._lock:
            if self.index.get(key) is not entry:
                return
            self._drop_entry(key)
        self.judge.set_aside(self.files.path(key, entry.tag), why)
        self.meta.delete([(key, entry.tag)])

    def _released(self, nbytes: int) -> None:
        self.usage.add(-nbytes)

    def _forget(self, key: str, entry: DiskEntry) -> None:
        with self._lock:
            if self.index.get(key) is entry:
                self._drop_entry(key)

    def _unleased(self, now: float) -> Callable[[str, DiskEntry], bool]:
        """Whether an entry may be evicted at ``now``: not busy, no read lease held."""
        return lambda key, entry: not entry.busy and not self.leases.held(key, now)

    def _drop_entry(self, key: str) -> DiskEntry | None:
        """Take ``key`` out of the index, with its leases (caller holds ``_lock``)."""
        self.leases.drop(key)
        return self.index.pop(key)

    # -- removal, pins and leases -------------------------------------------------------

    def remove(self, key: str, *, force: bool = True) -> bool:
        with self._lock:
            entry = self.index.get(key)
            if entry is None or (not force and (entry.pins > 0 or self.leases.held(key))):
                return False
            self._drop_entry(key)
        path = self.files.path(key, entry.tag)
        if self.files.unlink(path):
            self.usage.add(-file_size(entry.layout.nbytes))
        self.meta.delete([(key, entry.tag)])
        return True

    def pin(self, key: str) -> bool:
        with self._lock:
            entry = self.index.get(key)
            if entry is None:
                return False
            entry.pins += 1
            return True

    def unpin(self, key: str) -> bool:
        with self._lock:
            entry = self.index.get(key)
            if entry is None or entry.pins == 0:
                return False
            entry.pins -= 1
            return True

    def lease(self, key: str, ttl_s: float) -> Location | None:
        """Protect ``key`` from eviction for ``ttl_s`` seconds (none: ``ttl_s <= 0``) and say
        where its bytes are; the location's ``token`` names this lease alone."""
        with self._lock:
            entry = self.index.get(key, touch=True)
            if entry is None:
                return None
            location = Location(
                str(self.files.path(key, entry.tag)),
                HEADER_BYTES,
                entry.layout.nbytes,
                entry.layout,
                entry.checksum,
                self.leases.take(key, ttl_s),
            )
        self._sightings.poke()
        return location

    def close(self) -> None:
        self._sightings.close()
        self.remembered.save(self._lock)
        self.meta.close()  # its last commit may evict, which reads the reuse stats
        self.remembered.close()
        self._closed = True
        if self._alive is not None:
            self.files.release_file(self._alive)
        self.usage.close()
        self.files.close()


def _file_bytes(entry: DiskEntry) -> int:
    return file_size(entry.layout.nbytes)


def _raise_opening_error(directory: Path, exc: OSError) -> NoReturn:
    """Raise an OS error met while opening (a read-only filesystem, a root we may not
    write) as a StorageIOError; a Persisting error as it is."""
    if isinstance(exc, PersistingError):
        raise exc
    raise storage_error(f"cannot open the disk tier in {directory}", exc) from exc


__all__ = ["DiskTier", "EvictionListener", "Location", "WriteItem"]
