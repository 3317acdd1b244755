"""The same-host data path: payload bytes that never ride in actor messages.

Actor messages carry large byte strings at only ~60-250 MB/s, so a client on the server's
host moves payloads another way:

* **Reads of stored bytes**: the server grants a read lease (the payload file cannot be
  evicted while it is held) and replies with the file's path, offset, size and checksum;
  the client reads the bytes itself with one positioned read (:func:`read_file_into`) and
  verifies the checksum. A payload file is immutable once written, and eviction unlinks
  it, so a file the client managed to open is always whole.
* **Shared memory** (:class:`ClientArena` / :class:`ServerArenaMapping`): one file in
  ``/dev/shm`` that the client creates and both processes map. Puts are copied into it
  and stored by the server from there; values that live only in the server's memory tier
  are copied out into it. The client proves the mapping works (the server must read back
  a random nonce) before either side relies on it, which is also the same-host test.

Plain files in ``/dev/shm`` are used instead of ``multiprocessing.shared_memory`` because
in Python < 3.13 a process that merely attaches a segment registers it with its resource
tracker, which unlinks it (and warns) when that process exits.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import secrets
import stat
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from persisting.errors import ProtocolError
from persisting.lance_store import pid_alive, read_file_range

PAGE = mmap.PAGESIZE
#: The first page of an arena holds the nonce that proves a mapping; data starts after it.
NONCE_BYTES = 16
DEFAULT_SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "persisting-arena-"


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


@dataclass(frozen=True, slots=True)
class Region:
    """A page-aligned range of an arena, owned by one request until freed."""

    offset: int
    nbytes: int
    capacity: int


class ClientArena:
    """A client's shared-memory arena and a first-fit allocator over it.

    Pages are committed with ``posix_fallocate`` before a region that reaches them is handed
    out, so a full ``/dev/shm`` shows up here as a failed allocation (and the client uses
    another path) instead of a SIGBUS in the server that writes into the page.

    :meth:`hand_out` turns a region the server filled into a numpy array that owns it: the
    region returns to the allocator when the array (and every tensor or view made from it)
    is garbage. Allocation and freeing are thread-safe, since that can happen on any thread.
    """

    #: Pages are committed in steps of at least this many bytes.
    COMMIT_STEP = 16 << 20

    def __init__(self, size: int, directory: Path = DEFAULT_SHM_DIR):
        if size < 2 * PAGE:
            raise ProtocolError(f"a shared-memory arena needs at least {2 * PAGE} bytes")
        self.size = _round_up(size)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        remove_orphaned_arenas(Path(directory))  # arenas of clients that crashed earlier
        self.path = Path(directory) / f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self._fd, self.size)  # sparse: pages cost memory once committed
            os.posix_fallocate(self._fd, 0, PAGE)
            self._map = mmap.mmap(self._fd, self.size)
        except OSError:
            os.close(self._fd)
            self.unlink()
            raise
        self._map[:NONCE_BYTES] = self.nonce
        self.view = memoryview(self._map)
        self._lock = threading.Lock()
        self._committed = PAGE
        self._closed = False
        # Free ranges as sorted (offset, length) lists, coalesced on free.
        self._free_offsets: list[int] = [PAGE]
        self._free_lengths: list[int] = [self.size - PAGE]

    def unlink(self) -> None:
        """Remove the name (mappings stay valid); done once the server has attached."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def allocate(self, nbytes: int) -> Region | None:
        """A region of at least ``nbytes``, or None when the arena has no room for it."""
        want = _round_up(max(nbytes, 1))
        with self._lock:
            if self._closed:
                return None
            for i, length in enumerate(self._free_lengths):
                if length >= want:
                    offset = self._free_offsets[i]
                    if not self._commit(offset + want):
                        return None
                    if length == want:
                        del self._free_offsets[i], self._free_lengths[i]
                    else:
                        self._free_offsets[i] += want
                        self._free_lengths[i] -= want
                    return Region(offset, nbytes, want)
        return None

    def _commit(self, end: int) -> bool:
        """Make sure every page below ``end`` exists (caller holds the lock)."""
        if end <= self._committed:
            return True
        target = min(self.size, max(end, self._committed + self.COMMIT_STEP))
        try:
            os.posix_fallocate(self._fd, self._committed, target - self._committed)
        except OSError:
            return False
        self._committed = target
        return True

    def free(self, region: Region) -> None:
        """Give back a region, or any page-aligned part of one."""
        with self._lock:
            self._free_locked(region.offset, region.capacity)

    def free_range(self, offset: int, length: int) -> None:
        if length > 0:
            with self._lock:
                self._free_locked(offset, length)

    def _free_locked(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        self._free_offsets.insert(i, offset)
        self._free_lengths.insert(i, length)
        # Merge with the next, then the previous range.
        if i + 1 < len(self._free_offsets) and (
            self._free_offsets[i] + self._free_lengths[i] == self._free_offsets[i + 1]
        ):
            self._free_lengths[i] += self._free_lengths.pop(i + 1)
            self._free_offsets.pop(i + 1)
        if i > 0 and self._free_offsets[i - 1] + self._free_lengths[i - 1] == self._free_offsets[i]:
            self._free_lengths[i - 1] += self._free_lengths.pop(i)
            self._free_offsets.pop(i)

    def hand_out(self, offset: int, nbytes: int) -> np.ndarray:
        """The ``nbytes`` at ``offset`` as an array that frees their pages when it dies."""
        array = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=offset)
        weakref.finalize(array, self.free_range, offset, _round_up(max(nbytes, 1)))
        return array

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._free_lengths)

    def region_view(self, region: Region) -> memoryview:
        return self.view[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
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
        resolved = Path(path)
        self.path = resolved
        if resolved.parent != DEFAULT_SHM_DIR or not resolved.name.startswith(ARENA_PREFIX):
            raise ProtocolError(f"{path} is not a Persisting shared-memory arena")
        try:
            fd = os.open(resolved, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise ProtocolError(f"cannot open the client's arena {path}: {exc}") from exc
        try:
            info = os.fstat(fd)
            actual = info.st_size
            if not stat.S_ISREG(info.st_mode) or actual != size or size < 2 * PAGE:
                raise ProtocolError(f"arena {path} has {actual} bytes, the client said {size}")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
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


def _arena_owner(name: str) -> int | None:
    """The pid in ``persisting-arena-<pid>-<random>``, or None for other names."""
    parts = name[len(ARENA_PREFIX) :].split("-")
    if not name.startswith(ARENA_PREFIX) or len(parts) != 2 or not parts[0].isdigit():
        return None
    return int(parts[0])


def remove_orphaned_arenas(directory: Path = DEFAULT_SHM_DIR, only: str | None = None) -> int:
    """Unlink arena files whose client process is gone (a crashed client leaves its arena
    in ``/dev/shm``, where it holds memory); returns how many were removed."""
    try:
        names = [only] if only is not None else os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        pid = _arena_owner(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(directory / name)
            removed += 1
    return removed


def read_file_into(path: str, offset: int, out: memoryview) -> None:
    """Read exactly ``len(out)`` bytes at ``offset`` of ``path`` into ``out`` (the client's
    read of a leased payload; see :func:`persisting.lance_store.read_file_range`)."""
    read_file_range(path, offset, out)


def shm_available(directory: Path = DEFAULT_SHM_DIR) -> bool:
    return directory.is_dir() and os.access(directory, os.W_OK)


__all__ = [
    "ClientArena",
    "Region",
    "ServerArenaMapping",
    "read_file_into",
    "remove_orphaned_arenas",
    "shm_available",
]
