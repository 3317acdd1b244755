"""Files whose lock is their writer's proof of life: a namespace's in-flight payload files,
metadata reservations and open stores' ``writers/`` files.

A writer creates such a file and holds an exclusive ``flock`` on it for as long as the file
means something (until an in-flight file is renamed into place, while a reservation
stands, while a store is open). A lock another process can take says the writer died (the
kernel dropped its lock) or gave the file up, whatever process, store or pid namespace it
was (a pid in a name would prove nothing across pid namespaces). Names of in-flight and
reservation files carry the bytes they reserve: ``<random>-<tag>-<reserved bytes>.tmp``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from persisting.errors import CapacityError, StorageIOError
from persisting.lance_store.access import restrict


@dataclass(slots=True)
class Reservation:
    """An empty file its holder keeps locked: a metadata reservation, whose name carries
    the reserved bytes (``PayloadFiles.reserve_file``), or a store's proof of life
    (``PayloadFiles.register_writer``)."""

    fd: int
    path: Path
    nbytes: int


def create_locked(path: Path, mode: int, flags: int = 0) -> int:
    """Create ``path`` (it must not exist) with exactly ``mode``, exclusively locked, open
    for writing with ``flags`` added (O_DIRECT: an in-flight payload file)."""
    flags |= os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        raise io_error(f"cannot create {path}", exc) from exc
    restrict(path, mode, fd=fd)  # exactly its mode, whatever the umask
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new and unseen: never blocks
    except OSError as exc:
        os.close(fd)
        unlink_quietly(path)
        raise io_error(f"cannot lock {path}", exc) from exc
    return fd


def remove_if_abandoned(path: Path, *, keep: bool = False) -> bool:
    """Unlink tmp file ``path`` if no live writer holds its lock (with ``keep``, only
    say so); True if it did.

    Its writer holds the lock until the file has its final name, so a lock we can take
    means the writer died (the kernel dropped its lock) or gave the file up.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return False  # finished meanwhile
    except OSError:
        return False  # not ours to judge
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its writer is alive
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            return False
        if same and not keep:
            unlink_quietly(path)
        return same
    finally:
        os.close(fd)


def reservations_in(directory: Path) -> Iterator[tuple[Path, int]]:
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        reserved = reserved_of(entry.name)
        if reserved is not None:
            yield Path(entry.path), reserved


def reserved_of(name: str) -> int | None:
    """The reserved bytes in a ``<random>-<tag>-<bytes>.tmp`` name (None: not such a name)."""
    if not name.endswith(".tmp"):
        return None
    parts = name.removesuffix(".tmp").split("-")
    if len(parts) != 3 or not parts[2].isdigit():
        return None
    return int(parts[2])


def io_error(what: str, exc: OSError) -> StorageIOError | CapacityError:
    """A full filesystem is a capacity problem the caller can act on, not a broken disk."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CapacityError(f"{what}: the filesystem is full ({exc.strerror})")
    return StorageIOError(f"{what}: {exc}")


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


__all__ = [
    "Reservation",
    "create_locked",
    "io_error",
    "remove_if_abandoned",
    "reservations_in",
    "reserved_of",
    "unlink_quietly",
]
