"""Who may write a queue bucket, and closing every backend a process opened.

* Across processes one writer per bucket: an exclusive ``flock`` on ``<bucket>/writer.lock``,
  which the kernel releases when the holder dies, even by ``kill -9``.
* Within a process the newest writer wins: Pulsing never closes a bucket's backend (entry
  5 of :mod:`persisting.pulsing_compat`), so an actor system restarted in the same process
  must be able to open the bucket again; the previous writer is flushed and closed first.
* Every open backend is closed (so flushed) at interpreter exit, or by :func:`close_all`
  before ``os._exit``.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Protocol

from persisting.errors import StorageIOError
from persisting.lance_store.access import CONTROL_FILE_MODE, open_private

logger = logging.getLogger(__name__)

LOCK_FILE = "writer.lock"


class Closable(Protocol):
    bucket_dir: Path

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


def acquire_writer_lock(bucket_dir: Path, timeout_s: float) -> int:
    """The descriptor holding an exclusive lock on ``bucket_dir``'s lock file.

    Waits up to ``timeout_s`` for another process to let go, then raises StorageIOError
    naming the holder's pid.
    """
    # 0600 whatever the access setting (an older one's 0644 file is tightened): whoever
    # can open the lock file can hold the lock and stall the bucket's writer.
    fd = open_private(bucket_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise StorageIOError(
                    f"queue bucket {bucket_dir} is being written by another process "
                    f"(pid {holder}); open it with read_only=True to read it"
                ) from None
            time.sleep(0.05)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def release_writer_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


_OPEN: weakref.WeakSet = weakref.WeakSet()
_WRITERS: dict[Path, weakref.ref] = {}
_WRITERS_LOCK = threading.Lock()


def close_previous_writer(bucket_dir: Path) -> None:
    """Flush and close this process's open writer of ``bucket_dir``, if any."""
    with _WRITERS_LOCK:
        ref = _WRITERS.get(bucket_dir)
    previous = ref() if ref is not None else None
    if previous is not None and not previous.closed:
        logger.warning("closing the previous writer of %s in this process", bucket_dir)
        previous.close()


def track(backend: Closable, *, writer: bool) -> None:
    """Remember an open backend (to close at exit; as its bucket's writer if ``writer``)."""
    _OPEN.add(backend)
    if writer:
        with _WRITERS_LOCK:
            _WRITERS[backend.bucket_dir] = weakref.ref(backend)


def untrack(backend: Closable) -> None:
    _OPEN.discard(backend)


def close_all() -> None:
    """Flush and close every backend open in this process (call before ``os._exit``)."""
    for backend in list(_OPEN):
        try:
            backend.close()
        except Exception:
            logger.exception("closing %r failed", backend)


atexit.register(close_all)


__all__ = [
    "LOCK_FILE",
    "acquire_writer_lock",
    "close_all",
    "close_previous_writer",
    "release_writer_lock",
    "track",
    "untrack",
]
