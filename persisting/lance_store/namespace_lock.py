"""Namespace locks: a live store holds its namespace, and a drop refuses to pull it away.

Every open store takes a shared ``flock`` on ``<namespace>/.namespace.lock`` and keeps it
until it closes; dropping the namespace takes the same lock exclusively *without waiting*,
so it fails at once with :class:`~persisting.errors.NamespaceInUseError` while any process
(a server, a job) has the namespace open, and the kernel lets go of a killed holder's lock.
The file's mtime says when a store last took or let go of it.

A store that opens while a drop is in progress waits for the drop to finish, then finds that
its lock file is no longer the one at the path (the drop renamed the directory away) and
starts again on a fresh directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from persisting.errors import NamespaceInUseError
from persisting.lance_store.access import CONTROL_FILE_MODE, is_open_at, open_private

LOCK_NAME = ".namespace.lock"


class NamespaceHold:
    """A shared lock on one namespace, held until :meth:`release` (or process exit)."""

    def __init__(self, directory: Path, fd: int):
        self.directory = directory
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            _mark_held(self._fd)
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0


def hold_namespace(directory: Path, make_dir: Callable[[], object]) -> NamespaceHold:
    """Take the shared lock of ``directory``, (re)creating it with ``make_dir`` as needed."""
    while True:
        make_dir()
        fd = open_private(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a drop is in progress
            if is_open_at(fd, directory / LOCK_NAME):
                _mark_held(fd)
                return NamespaceHold(directory, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the namespace was dropped while we waited: start again


def _mark_held(fd: int) -> None:
    """Set the lock file's mtime to now: when the namespace was last held (an idle
    namespace's grace period counts from it, see :mod:`persisting.kv.budget.root`)."""
    with contextlib.suppress(OSError):
        os.utime(fd)


@contextmanager
def exclusive_namespace(directory: Path, what: str, holder: str | None = None) -> Iterator[bool]:
    """Hold ``directory``'s lock exclusively for a drop; yields False if it does not
    exist. Stores opening meanwhile wait for it.

    Raises NamespaceInUseError at once if a live store holds the namespace (``holder``
    names it, when known).
    """
    if not directory.is_dir():
        yield False
        return
    fd = open_private(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = holder or "a server or job using it"
            raise NamespaceInUseError(
                f"{what} is open in a live store ({who}); stop it before dropping"
            ) from None
        yield is_open_at(fd, directory / LOCK_NAME)
    finally:
        os.close(fd)


__all__ = [
    "LOCK_NAME",
    "NamespaceHold",
    "exclusive_namespace",
    "hold_namespace",
]
