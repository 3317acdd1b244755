"""Disk usage of a model directory, shared by every process that writes it.

Capacity holds for the directory as a whole, not per process: each writer reserves bytes
in one 8-byte counter file under an exclusive ``flock`` before it writes, and gives them
back when it unlinks a payload file. The counter is recomputed from the files on open, so a
crashed writer's reservations do not leak.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_COUNTER = struct.Struct("<q")


class SharedUsage:
    """A byte counter and a lock shared across processes through two small files."""

    def __init__(self, directory: Path):
        self._lock_fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        self._counter_fd = os.open(directory / "usage.bin", os.O_RDWR | os.O_CREAT, 0o644)
        self._thread_lock = threading.RLock()
        self._depth = 0

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

    def get(self) -> int:
        raw = os.pread(self._counter_fd, _COUNTER.size, 0)
        return _COUNTER.unpack(raw)[0] if len(raw) == _COUNTER.size else 0

    def set(self, value: int) -> None:
        os.pwrite(self._counter_fd, _COUNTER.pack(max(0, value)), 0)

    def add(self, delta: int) -> int:
        with self.locked():
            value = max(0, self.get() + delta)
            self.set(value)
            return value

    def close(self) -> None:
        for fd in (self._lock_fd, self._counter_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


__all__ = ["SharedUsage"]
