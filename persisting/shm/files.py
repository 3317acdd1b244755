"""Files in ``/dev/shm`` that two processes on one host map, and the liveness check that
tells whose files are orphaned.

A file is named ``<prefix><pid>-<random>`` and created mode 0600, so only its owner's user
can map it. A process killed before it removed its file leaves it in ``/dev/shm`` holding
memory; the next process that creates a file of the same prefix removes those of dead
owners.

Plain files are used instead of ``multiprocessing.shared_memory`` because in Python < 3.13
a process that merely attaches a segment registers it with its resource tracker, which
unlinks it (and warns) when that process exits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import stat
from pathlib import Path

from persisting.errors import StorageIOError
from persisting.shm.pages import PAGE

DEFAULT_SHM_DIR = Path("/dev/shm")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (files named after a dead writer may be cleaned up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shm_available(directory: Path = DEFAULT_SHM_DIR) -> bool:
    """Whether shared-memory files can be made here (a writable ``/dev/shm``)."""
    return directory.is_dir() and os.access(directory, os.W_OK)


def create_shm_file(prefix: str, size: int, directory: Path = DEFAULT_SHM_DIR) -> tuple[Path, int]:
    """A new sparse file ``<prefix><pid>-<random>`` of ``size`` bytes, mode 0600: (path, fd).

    Files of the same prefix left by dead processes are removed first.
    """
    remove_orphaned_files(prefix, directory)
    path = Path(directory) / f"{prefix}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        unlink_quietly(path)
        raise
    return path, fd


def open_shm_file(path: str, prefix: str, size: int, writable: bool) -> mmap.mmap:
    """Map another process's file made by :func:`create_shm_file`, after checking that it
    is one (right folder and prefix, a regular file, the size its owner announced)."""
    resolved = Path(path)
    if resolved.parent != DEFAULT_SHM_DIR or not resolved.name.startswith(prefix):
        raise StorageIOError(f"{path} is not a Persisting shared-memory file")
    flags = (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(resolved, flags)
    except OSError as exc:
        raise StorageIOError(f"cannot open {path}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size or size < 2 * PAGE:
            raise StorageIOError(f"{path} has {info.st_size} bytes, its owner said {size}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, prot=prot)
    finally:
        os.close(fd)


def _owner(name: str, prefix: str) -> int | None:
    parts = name[len(prefix) :].split("-")
    if not name.startswith(prefix) or len(parts) != 2 or not parts[0].isdigit():
        return None
    return int(parts[0])


def remove_orphaned_files(
    prefix: str, directory: Path = DEFAULT_SHM_DIR, only: str | None = None
) -> int:
    """Unlink ``<prefix><pid>-*`` files whose process is gone; returns how many were removed."""
    try:
        names = [only] if only is not None else os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        pid = _owner(name, prefix)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(Path(directory) / name)
            removed += 1
    return removed


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


__all__ = [
    "DEFAULT_SHM_DIR",
    "create_shm_file",
    "open_shm_file",
    "pid_alive",
    "remove_orphaned_files",
    "shm_available",
    "unlink_quietly",
]
