"""Disk usage of a model directory, shared by every process that writes it.

Capacity holds for the directory as a whole, not per process: each writer reserves bytes
in a small counter file under an exclusive ``flock`` before it writes, and gives them back
when it unlinks a payload file. The counter has two slots: payload bytes (reserved before a
write, exact) and overhead bytes (the metadata table, directories and small files, measured
after each metadata commit). It is recomputed from the files on open, and a dead writer's
reservations are reclaimed when a writer finds the directory full (see ``DiskTier``).

Both files are mode 0600 whatever the store's access setting: whoever can open the lock
file can ``flock`` it and stall every writer.
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

from persisting.kv.payload_files import PayloadFiles, round_to_block
from persisting.lance_store import disk_usage
from persisting.lance_store.access import CONTROL_FILE_MODE, open_private

log = logging.getLogger(__name__)

_SLOT = struct.Struct("<q")
PAYLOAD_SLOT = 0
OVERHEAD_SLOT = _SLOT.size


class SharedUsage:
    """A two-slot byte counter and a lock shared across processes through two small files."""

    def __init__(self, directory: Path):
        self._lock_fd = open_private(directory / ".lock", os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
        try:
            self._counter_fd = open_private(
                directory / "usage.bin", os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE
            )
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._thread_lock = threading.RLock()
        self._depth = 0
        #: Bytes of dead writers' reservations given back (see :meth:`reclaim_abandoned`).
        self.reclaimed_bytes = 0

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's exclusive lock (re-entrant within this process)."""
        with self._thread_lock:
            if self._depth == 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read(self, slot: int) -> int:
        raw = os.pread(self._counter_fd, _SLOT.size, slot)
        return _SLOT.unpack(raw)[0] if len(raw) == _SLOT.size else 0

    def _write(self, slot: int, value: int) -> None:
        os.pwrite(self._counter_fd, _SLOT.pack(max(0, value)), slot)

    def get(self) -> int:
        """Payload bytes reserved or stored (block-rounded payload files and tmp files)."""
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

    def total(self) -> int:
        """What the directory holds on disk: payload plus overhead."""
        return self.get() + self.overhead()

    # -- keeping the counter true -------------------------------------------------------

    def recount(self, files: PayloadFiles) -> None:
        """Set the payload slot from the files actually present (caller holds the lock);
        abandoned tmp files (their writer died) are removed on the way."""
        total = 0
        # tmp/ before payload/: a write renamed in between is counted twice, never missed.
        for tmp, reserved in files.tmp_files():
            if not files.remove_if_abandoned(tmp):
                total += reserved
        for path, _h, _tag in files.scan():
            try:
                total += round_to_block(os.stat(path).st_size)
            except FileNotFoundError:
                continue
        self.set(total)

    def reclaim_abandoned(self, files: PayloadFiles) -> int:
        """Give back the reservations of writers that died mid-batch (their tmp files are
        no longer locked); returns the bytes reclaimed. The caller holds the lock.

        Cheap (``tmp/`` holds only writes in flight), so a writer runs it whenever the
        directory looks full, before it evicts anything.
        """
        freed = 0
        for tmp, reserved in files.tmp_files():
            if files.remove_if_abandoned(tmp):
                freed += reserved
        if freed:
            log.warning("reclaimed %d bytes reserved by dead writers in %s", freed, files.tmp_dir)
            self.set(self.get() - freed)
            self.reclaimed_bytes += freed
        return freed

    @staticmethod
    def measure_overhead(directory: Path, files: PayloadFiles) -> int:
        """Allocated bytes of everything in ``directory`` but payload and tmp files (those
        are counted exactly as they are reserved): directories, metadata, small files."""
        total = _allocated(directory)
        for entry in os.scandir(directory):
            if entry.name == "payload":
                total += _allocated(entry.path)
                total += sum(_allocated(sub) for sub in files.subdirs())
            elif entry.name == "tmp":
                total += _allocated(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                total += disk_usage(entry.path, directories=True)
            else:
                total += _allocated(entry.path)
        return total

    def close(self) -> None:
        for fd in (self._lock_fd, self._counter_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _allocated(path: str | os.PathLike[str]) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


__all__ = ["SharedUsage"]
