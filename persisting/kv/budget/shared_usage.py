"""Disk usage of a model directory, shared by every process that writes it.

Capacity holds for the directory as a whole, not per process: each writer reserves bytes
in a small counter file under an exclusive ``flock`` before it writes, and gives them back
when it unlinks a payload file. The counter has three slots: payload bytes (reserved before
a write, exact), overhead bytes (the metadata table, directories and small files, as
measured after each metadata commit and grown by the directory blocks each new file adds),
and metadata reservations (what commits in progress may still add). It is recomputed from
the files on open, and a dead writer's reservations are reclaimed when a writer finds the
directory full (see ``DiskTier``).

A second lock, ``.metadata.lock``, is held around each metadata commit with its
reservation and measurement: commits of all processes take turns, so a measurement never
catches another process's commit half-way (which would count its growth twice, once
measured and once reserved).

The files are mode 0600 whatever the store's access setting: whoever can open a lock file
can ``flock`` it and stall every writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from persisting.kv.disk.payload_files import PayloadFiles, payload_subdirs, round_to_block
from persisting.kv.disk.quarantine import DIR_NAME as QUARANTINE_DIR
from persisting.kv.lock_order import Rank, ordered
from persisting.lance_store import disk_usage
from persisting.lance_store.access import CONTROL_FILE_MODE, open_private

log = logging.getLogger(__name__)

_SLOT = struct.Struct("<q")
PAYLOAD_SLOT = 0
OVERHEAD_SLOT = _SLOT.size
RESERVED_SLOT = 2 * _SLOT.size
_SLOTS = struct.Struct("<3q")


class _FileLock:
    """An exclusive ``flock`` on a file, re-entrant within the thread that holds it: a
    thread lock is taken first and held as long as the ``flock`` (``rank`` places the pair
    in the store's lock order)."""

    def __init__(self, path: Path, rank: Rank):
        self.fd = open_private(path, os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
        self._thread_lock = ordered(rank, threading.RLock())
        self._depth = 0

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._thread_lock:
            if self._depth == 0:
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class SharedUsage:
    """A two-slot byte counter and two locks shared across processes through small files."""

    def __init__(self, directory: Path):
        # Lock order (persisting.kv.lock_order): the metadata lock before the usage lock,
        # both before the store's thread locks (Tiers.lock, DiskTier._lock).
        self._lock = _FileLock(directory / ".lock", Rank.USAGE_FLOCK)
        try:
            self._metadata_lock = _FileLock(directory / ".metadata.lock", Rank.METADATA_FLOCK)
        except BaseException:
            self._lock.close()
            raise
        try:
            self._counter_fd = open_private(
                directory / "usage.bin", os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE
            )
        except BaseException:
            self._lock.close()
            self._metadata_lock.close()
            raise
        #: Bytes of dead writers' reservations given back (see :meth:`reclaim_abandoned`).
        self.reclaimed_bytes = 0

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Hold the directory's exclusive usage lock (re-entrant within this thread)."""
        return self._lock.held()

    def metadata_locked(self) -> contextlib.AbstractContextManager[None]:
        """Hold the directory's metadata lock (take it before :meth:`locked`, never after)."""
        return self._metadata_lock.held()

    def _read(self, slot: int) -> int:
        raw = os.pread(self._counter_fd, _SLOT.size, slot)
        return _SLOT.unpack(raw)[0] if len(raw) == _SLOT.size else 0

    def _write(self, slot: int, value: int) -> None:
        os.pwrite(self._counter_fd, _SLOT.pack(max(0, value)), slot)

    def get(self) -> int:
        """Payload bytes reserved or stored (block-rounded payload and in-flight files)."""
        return max(0, self._read(PAYLOAD_SLOT))

    def set(self, value: int) -> None:
        self._write(PAYLOAD_SLOT, value)

    def add(self, delta: int) -> int:
        with self.locked():
            value = max(0, self.get() + delta)
            self.set(value)
            return value

    def overhead(self) -> int:
        """Bytes of everything else in the directory, as last measured."""
        return max(0, self._read(OVERHEAD_SLOT))

    def set_overhead(self, value: int) -> None:
        self._write(OVERHEAD_SLOT, value)

    def reserved(self) -> int:
        """Bytes reserved for metadata commits in progress (see ``DiskTier``)."""
        return max(0, self._read(RESERVED_SLOT))

    def set_reserved(self, value: int) -> None:
        self._write(RESERVED_SLOT, value)

    def total(self) -> int:
        """What the directory holds on disk, or may hold once the metadata commits in
        progress land: payload plus overhead plus their reservations."""
        raw = os.pread(self._counter_fd, _SLOTS.size, 0)  # the three slots at once
        if len(raw) != _SLOTS.size:
            return self.get() + self.overhead() + self.reserved()
        return sum(max(0, value) for value in _SLOTS.unpack(raw))

    # -- keeping the counter true -------------------------------------------------------

    def recount(self, files: PayloadFiles) -> None:
        """Set the payload and reservation slots from the files actually present (caller
        holds the lock); abandoned in-flight files and reservations (their writer died) are
        removed on the way, and so are the ``writers/`` files of the dead."""
        dead = files.dead_writers()
        total = 0
        for tmp, reserved in files.tmp_files():
            if not files.remove_if_abandoned(tmp):
                total += reserved
        for path, in_flight in files.census():
            if in_flight is None:
                with contextlib.suppress(FileNotFoundError):
                    total += round_to_block(os.stat(path).st_size)
            elif not files.remove_if_abandoned(path):
                total += in_flight
        self.set(total)
        live = 0
        for path, reserved in files.reservation_files():
            if not files.remove_if_abandoned(path):
                live += reserved
        self.set_reserved(live)
        for path in dead:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def reclaim_abandoned(self, files: PayloadFiles) -> int:
        """Give back the reservations of writers that died mid-batch or mid-commit (their
        in-flight and reservation files are no longer locked); returns the bytes reclaimed.
        The caller holds the lock.

        Cheap unless a writer died: ``reservations/`` and ``writers/`` hold a few files,
        and the ``payload/<hh>`` directories are searched for in-flight files only when a
        ``writers/`` file is found unlocked. So a writer runs it whenever the directory
        looks full, before it evicts anything.
        """
        payload = metadata = 0
        for path, reserved in files.reservation_files():
            if files.remove_if_abandoned(path):
                metadata += reserved
        for tmp, reserved in files.tmp_files():  # whole in-flight files of older versions
            if files.remove_if_abandoned(tmp):
                payload += reserved
        dead = files.dead_writers()
        if dead:
            for path, in_flight in files.census():
                if in_flight is not None and files.remove_if_abandoned(path):
                    payload += in_flight
            for path in dead:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        freed = payload + metadata
        if freed:
            log.warning("reclaimed %d bytes reserved by dead writers in %s", freed, files.directory)
            self.set(self.get() - payload)
            self.set_reserved(self.reserved() - metadata)
            self.reclaimed_bytes += freed
        return freed

    @staticmethod
    def measure_overhead(directory: Path) -> int:
        """Allocated bytes of everything in ``directory`` but payload and in-flight files (those
        are counted exactly as they are reserved) and quarantined files (not the store's to
        evict, see :mod:`~persisting.kv.disk.quarantine`): directories, metadata, small files."""
        total = _allocated(directory)
        for entry in os.scandir(directory):
            if entry.name == "payload":
                total += _allocated(entry.path)
                total += sum(_allocated(sub) for sub in payload_subdirs(directory))
            elif entry.name in ("tmp", QUARANTINE_DIR):  # quarantine: outside the budget
                total += _allocated(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                total += disk_usage(entry.path, directories=True)
            else:
                total += _allocated(entry.path)
        return total

    def close(self) -> None:
        self._lock.close()
        self._metadata_lock.close()
        with contextlib.suppress(OSError):
            os.close(self._counter_fd)


def _allocated(path: str | os.PathLike[str]) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


__all__ = ["SharedUsage"]
