"""fsync helpers: Lance does not fsync, so a writer that promises durability must.

All fsyncs go through :func:`fsync_fd` so tests can trace them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from persisting.errors import StorageIOError
from persisting.lance_store.access import OWNER_ONLY, FileModes, restrict, storage_error


def fsync_fd(fd: int) -> None:
    """fsync one open descriptor (the single point tests trace)."""
    os.fsync(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file's data and metadata to stable storage."""
    _fsync_path(path, os.O_RDONLY, "")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (new, renamed or removed files) durable."""
    _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY, "directory ")


def _fsync_path(path: str | os.PathLike[str], flags: int, what: str) -> None:
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise StorageIOError(f"cannot open {what}{path} for fsync: {exc}") from exc
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def fsync_tree_entries(paths: Iterable[Path]) -> None:
    """fsync each file, then each distinct parent directory once."""
    parents: set[Path] = set()
    for path in paths:
        fsync_file(path)
        parents.add(path.parent)
    for parent in sorted(parents):
        fsync_dir(parent)


def makedirs_durable(path: Path, modes: FileModes = OWNER_ONLY) -> None:
    """Create ``path`` and its missing parents (mode ``modes.directory``, private by
    default), fsyncing each new entry's parent. Existing directories are left as they are."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=modes.directory)
        except FileExistsError:
            continue  # made meanwhile by another process: its mode is its maker's business
        except OSError as exc:
            raise storage_error(f"cannot create {directory}", exc) from exc
        restrict(directory, modes.directory)  # exactly, whatever the umask
        fsync_dir(directory.parent)


__all__ = ["fsync_dir", "fsync_fd", "fsync_file", "fsync_tree_entries", "makedirs_durable"]
