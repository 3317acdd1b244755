"""The same-host data path: payload bytes that never ride in actor messages.

Actor messages carry large byte strings at only ~60-250 MB/s, so a client on the server's
host moves payloads another way:

* **Reads of stored bytes**: the server grants a read lease (the payload file cannot be
  evicted while it is held) and replies with the file's path, offset, size and checksum;
  the client reads the bytes itself with one positioned read (:func:`read_file_into`) and
  verifies the checksum. A payload file is immutable once written, and eviction unlinks
  it, so a file the client managed to open is always whole.
* **The server's memory tier** (:class:`~persisting.shm.SharedPool`): the
  server keeps memory-tier values in a shared-memory file that the client maps
  read-only; for a memory hit the server replies with an offset and a generation, and the
  client copies the value out itself (the generation tells it whether the buffer was
  freed during its copy).
* **The client's arena** (:class:`ClientArena` / :class:`ServerArenaMapping`): one file
  in ``/dev/shm`` that the client creates and both processes map. Puts are copied into it
  and stored by the server from there; memory-tier values outside the shared pool are
  copied out into it. The client proves the mapping works (the server must read back a
  random nonce) before either side relies on it, which is also the same-host test.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from persisting.errors import ProtocolError, StorageIOError
from persisting.kv.range_reads import read_file_range
from persisting.shm import (
    DEFAULT_SHM_DIR,
    PAGE,
    PageAllocator,
    create_shm_file,
    open_shm_file,
    owning_array,
    remove_orphaned_files,
    round_to_page,
)

#: The first page of an arena holds the nonce that proves a mapping; data starts after it.
NONCE_BYTES = 16
ARENA_PREFIX = "persisting-arena-"


@dataclass(frozen=True, slots=True)
class Region:
    """A page-aligned range of an arena, owned by one request until freed."""

    offset: int
    nbytes: int
    capacity: int


class ClientArena:
    """A client's shared-memory arena and a first-fit allocator over it.

    Pages are committed before a region that reaches them is handed out, so a full
    ``/dev/shm`` shows up here as a failed allocation (and the client uses another path)
    instead of a SIGBUS in the server that writes into the page.

    :meth:`hand_out` turns a region the server filled into a numpy array that owns it: the
    region returns to the allocator when the array (and every tensor or view made from it)
    is garbage. Allocation and freeing are thread-safe, since that can happen on any thread.
    """

    def __init__(self, size: int, directory: Path = DEFAULT_SHM_DIR):
        if size < 2 * PAGE:
            raise ProtocolError(f"a shared-memory arena needs at least {2 * PAGE} bytes")
        self.size = round_to_page(size)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.path, self._fd = create_shm_file(ARENA_PREFIX, self.size, Path(directory))
        try:
            os.posix_fallocate(self._fd, 0, PAGE)
            self._map = mmap.mmap(self._fd, self.size)
        except OSError:
            os.close(self._fd)
            self.unlink()
            raise
        self._map[:NONCE_BYTES] = self.nonce
        self.view = memoryview(self._map)
        self._pages = PageAllocator(self._fd, PAGE, self.size)
        self._closed = False

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); done once the server has attached."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def allocate(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes``, or None when the arena has no room for it."""
        got = self._pages.allocate(nbytes)
        return None if got is None else Region(got[0], nbytes, got[1])

    def free(self, region: Region) -> None:
        """Give back a region."""
        self._pages.free(region.offset, region.capacity)

    def free_range(self, offset: int, length: int) -> None:
        """Give back any page-aligned part of a region."""
        self._pages.free(offset, length)

    def hand_out(self, offset: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` at ``offset`` as an array that frees their pages when it dies."""
        capacity = round_to_page(max(nbytes, 1))
        return owning_array(self._map, offset, nbytes, self.free_range, offset, capacity)

    @property
    def free_bytes(self) -> int:
        return self._pages.free_bytes

    def region_view(self, region: Region) -> memoryview:
        return self.view[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pages.close()
        self.unlink()
        self.view.release()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        # Values handed out still use the mapping; it then lives until they are gone.
        with contextlib.suppress(BufferError):
            self._map.close()


class ServerArenaMapping:
    """The server's mapping of one client's arena, checked against the client's nonce."""

    def __init__(self, path: str, size: int, nonce: bytes):
        self.path = Path(path)
        try:
            self._map = open_shm_file(path, ARENA_PREFIX, size, writable=True)
        except StorageIOError as exc:
            raise ProtocolError(f"cannot use the client's arena: {exc}") from exc
        if bytes(self._map[:NONCE_BYTES]) != nonce:
            self._map.close()
            raise ProtocolError(f"arena {path} does not hold the client's nonce")
        self.size = size
        self.view = memoryview(self._map)

    def region(self, offset: object, nbytes: object) -> memoryview:
        """The bytes ``[offset, offset + nbytes)``, refused unless inside the data area."""
        if (
            not isinstance(offset, int)
            or not isinstance(nbytes, int)
            or offset < PAGE
            or nbytes < 0
            or offset + nbytes > self.size
        ):
            raise ProtocolError(f"region ({offset!r}, {nbytes!r}) is outside the arena")
        return self.view[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap; and if the client died without cleaning up, remove its arena file too."""
        self.view.release()
        # A store call still holds a view; the mapping dies with it.
        with contextlib.suppress(BufferError):
            self._map.close()
        remove_orphaned_arenas(self.path.parent, only=self.path.name)


def remove_orphaned_arenas(directory: Path = DEFAULT_SHM_DIR, only: str | None = None) -> int:
    """Unlink arena files whose client process is gone; returns how many were removed."""
    return remove_orphaned_files(ARENA_PREFIX, directory, only)


def read_file_into(path: str, offset: int, out: memoryview) -> None:
    """Read exactly ``len(out)`` bytes at ``offset`` of ``path`` into ``out`` (the client's
    read of a leased payload; see :func:`persisting.kv.range_reads.read_file_range`)."""
    read_file_range(path, offset, out)


__all__ = [
    "ClientArena",
    "Region",
    "ServerArenaMapping",
    "read_file_into",
    "remove_orphaned_arenas",
]
