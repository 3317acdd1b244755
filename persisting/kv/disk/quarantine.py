"""Payload files a store cannot verify, moved aside instead of deleted.

A file whose header is not sealed with a key of the root (planted, copied in without its
root's key, or written while the root's key was replaced), whose header or length is
damaged, or whose payload fails its checksum is never served. It is not deleted either: a
file that fails only because its key is missing is whole, and comes back once the key is
among the root's (:mod:`persisting.lance_store.root_keys`). So such a file is renamed into
``<namespace>/quarantine/``, where:

- every store that opens the namespace tries each file again, and puts back those that now
  verify (a header read per file: cheap next to the payload it saves);
- ``persisting inspect`` and the ``quarantined_files`` figure report it;
- only an operator deletes it (``persisting quarantine --delete``).

Quarantined bytes are outside the namespace's disk budget (they are not the store's to
evict), and stated as such wherever the budget is reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from persisting.lance_store.access import FileModes, make_dir
from persisting.lance_store.durable import fsync_dir

log = logging.getLogger(__name__)

DIR_NAME = "quarantine"


class Quarantine:
    """The ``quarantine/`` directory of one namespace."""

    def __init__(self, namespace: Path, modes: FileModes):
        self.directory = namespace / DIR_NAME
        self._modes = modes

    def take(self, path: Path, why: str) -> bool:
        """Move payload file ``path`` aside; False if it was gone already."""
        make_dir(self.directory, self._modes)
        target = self.directory / path.name
        if target.exists():  # one with that name is there already: keep both
            target = self.directory / f"{path.name}.{time.time_ns()}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return False
        log.warning("quarantined %s (%s): kept in %s, never served", path, why, self.directory)
        with contextlib.suppress(OSError):
            fsync_dir(self.directory)
        return True

    def files(self) -> Iterator[Path]:
        """The files held aside now."""
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith("."):
                yield self.directory / name

    def put_back(self, path: Path, target: Path) -> bool:
        """Move quarantined ``path`` back to ``target`` (a payload file's name) unless a file
        is there; True if it moved."""
        try:
            os.link(path, target)
        except (FileExistsError, FileNotFoundError):
            return False
        os.unlink(path)
        with contextlib.suppress(OSError):
            fsync_dir(target.parent)
        return True

    def summary(self) -> tuple[int, int]:
        """``(files, bytes)`` held aside."""
        count = size = 0
        for path in self.files():
            with contextlib.suppress(FileNotFoundError):
                size += os.stat(path).st_size
                count += 1
        return count, size

    def delete_all(self) -> tuple[int, int]:
        """Delete every quarantined file (an operator's decision); ``(files, bytes)`` freed."""
        count = size = 0
        for path in self.files():
            with contextlib.suppress(FileNotFoundError):
                nbytes = os.stat(path).st_size
                os.unlink(path)
                count += 1
                size += nbytes
        return count, size


__all__ = ["DIR_NAME", "Quarantine"]
