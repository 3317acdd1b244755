"""Memory-tier buffers in one shared-memory file, so same-host readers copy values out
themselves.

A store that serves other processes allocates its memory-tier buffers from a
:class:`SharedPool`: a sparse file in ``/dev/shm``. A reader on the same host maps that file
read-only (:class:`SharedPoolReader`) and, told a value's offset, copies it out with one
memcpy: the serving process does no copy, and the reader cannot change what is stored.

No lease is taken for such a read. Every page of the pool has a generation number that is
bumped when the buffer over it is freed, before the range can be handed out again. The
server reports the generation of the value's first page with its offset; a reader that
finds the same number there after its copy knows no byte it copied was rewritten (a
seqlock). This relies on x86-64's ordering of loads and stores (TSO), so
:func:`seqlock_safe` gates the whole path.

Pages are committed with ``posix_fallocate`` before a range over them is handed out, so a
full ``/dev/shm`` is a failed allocation (the store then falls back to private memory)
rather than a SIGBUS. Files are named ``<prefix><pid>-<random>``; those of dead processes
are removed by :func:`remove_orphaned_files`.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import platform
import secrets
import stat
import struct
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from persisting.errors import StorageIOError
from persisting.kv.layout import copy_bytes, loaded_torch
from persisting.lance_store import pid_alive

PAGE = mmap.PAGESIZE
DEFAULT_SHM_DIR = Path("/dev/shm")
POOL_PREFIX = "persisting-pool-"
_MAGIC = b"PKVPOOL1"
#: One per page; 64-bit, so a remembered generation can never come round again.
_GENERATION = np.dtype(np.uint64)
#: magic, file size, offset of the generation table, offset of the data area, page size
_HEADER = struct.Struct("<8sQQQQ")


def round_to_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def seqlock_safe() -> bool:
    """Whether lease-free reads of a pool are sound on this CPU (x86-64 ordering)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def owning_array(
    mapping: mmap.mmap, offset: int, nbytes: int, release: Callable[..., None], *args: Any
) -> np.ndarray:
    """``nbytes`` of ``mapping`` at ``offset`` as a uint8 array that owns them:
    ``release(*args)`` runs once the array and every view or tensor made from it are
    garbage (how every range handed out of a page allocator goes back to it)."""
    array = np.frombuffer(mapping, np.uint8, count=nbytes, offset=offset)
    weakref.finalize(array, release, *args)
    return array


class PageAllocator:
    """First-fit allocation of page-aligned ranges of ``[start, end)`` of a file (``fd``),
    whose pages are committed (``posix_fallocate``) before a range reaching them is handed
    out; with ``fd=None``, of anonymous memory (nothing to commit).

    Thread-safe; free ranges are kept sorted and coalesced.
    """

    #: Pages are committed in steps of at least this many bytes.
    COMMIT_STEP = 16 << 20

    def __init__(self, fd: int | None, start: int, end: int):
        self._fd = fd
        self._end = end
        self._committed = start
        self._lock = threading.Lock()
        self._closed = False
        self._offsets: list[int] = [start]
        self._lengths: list[int] = [end - start]

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, capacity) of a free range of at least ``nbytes``, or None."""
        want = round_to_page(max(nbytes, 1))
        with self._lock:
            if self._closed:
                return None
            for i, length in enumerate(self._lengths):
                if length < want:
                    continue
                offset = self._offsets[i]
                if not self._commit(offset + want):
                    return None
                if length == want:
                    del self._offsets[i], self._lengths[i]
                else:
                    self._offsets[i] += want
                    self._lengths[i] -= want
                return offset, want
        return None

    def _commit(self, end: int) -> bool:
        if end <= self._committed or self._fd is None:
            return True
        target = min(self._end, max(end, self._committed + self.COMMIT_STEP))
        try:
            os.posix_fallocate(self._fd, self._committed, target - self._committed)
        except OSError:
            return False
        self._committed = target
        return True

    def free(self, offset: int, length: int) -> None:
        """Give back ``length`` bytes at ``offset`` (page-aligned; any part of a range)."""
        if length <= 0:
            return
        with self._lock:
            i = bisect.bisect_left(self._offsets, offset)
            self._offsets.insert(i, offset)
            self._lengths.insert(i, length)
            if i + 1 < len(self._offsets) and offset + length == self._offsets[i + 1]:
                self._lengths[i] += self._lengths.pop(i + 1)
                self._offsets.pop(i + 1)
            if i > 0 and self._offsets[i - 1] + self._lengths[i - 1] == self._offsets[i]:
                self._lengths[i - 1] += self._lengths.pop(i)
                self._offsets.pop(i)

    def close(self) -> None:
        """Refuse further allocations (frees are still taken)."""
        with self._lock:
            self._closed = True

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._lengths)


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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
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
    """Unlink ``<prefix><pid>-*`` files whose process is gone (a killed process leaves its
    file in ``/dev/shm``, where it holds memory); returns how many were removed."""
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


class SharedPool:
    """The serving side: memory-tier buffers carved out of one shared-memory file.

    :meth:`allocate` returns a uint8 array that owns its range: when the array and every
    view of it are garbage (the tier dropped the entry and no write-behind or reader still
    holds it), the range's generations are bumped and it returns to the free list.
    """

    def __init__(self, capacity: int, directory: Path = DEFAULT_SHM_DIR):
        data_pages = max(1, round_to_page(capacity) // PAGE)
        gen_offset = PAGE
        data_offset = gen_offset + round_to_page(_GENERATION.itemsize * data_pages)
        self.size = data_offset + data_pages * PAGE
        self.data_offset = data_offset
        self.path, fd = create_shm_file(POOL_PREFIX, self.size, directory)
        try:
            os.posix_fallocate(fd, 0, data_offset)  # header and generations: always there
            self._map = mmap.mmap(fd, self.size)
        except OSError:
            os.close(fd)
            self.unlink()
            raise
        self._fd = fd
        self._map[: _HEADER.size] = _HEADER.pack(_MAGIC, self.size, gen_offset, data_offset, PAGE)
        self._gens = np.frombuffer(self._map, _GENERATION, count=data_pages, offset=gen_offset)
        self._address = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
        self._pages = PageAllocator(fd, data_offset, self.size)
        # Removes the file at interpreter exit too, should the owner never call close().
        self._unlinker = weakref.finalize(self, _unlink_quietly, self.path)

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes`` in the pool, or None when it has no room (or is closed)."""
        got = self._pages.allocate(nbytes)
        if got is None:
            return None
        offset, capacity = got
        return owning_array(self._map, offset, nbytes, self._release, offset, capacity)

    def _release(self, offset: int, capacity: int) -> None:
        first = (offset - self.data_offset) // PAGE
        self._gens[first : first + capacity // PAGE] += 1  # before the range can be reused
        self._pages.free(offset, capacity)

    def locate(self, buffer: np.ndarray) -> tuple[int, int] | None:
        """(offset, generation) of a live buffer of this pool; None for other memory."""
        offset = buffer.ctypes.data - self._address
        if not self.data_offset <= offset < self.size:
            return None
        return offset, int(self._gens[(offset - self.data_offset) // PAGE])

    @property
    def free_bytes(self) -> int:
        return self._pages.free_bytes

    def unlink(self) -> None:
        _unlink_quietly(self.path)

    def close(self) -> None:
        """Remove the file and stop allocating; the mapping lives on while buffers do."""
        self._pages.close()
        self._unlinker()
        with contextlib.suppress(OSError):
            os.close(self._fd)


class RecycledBuffers:
    """Page-aligned buffers whose pages stay mapped from one use to the next.

    A fresh multi-MiB array costs a page fault (and the kernel zeroing the page) per 4 KiB
    on first touch, which makes copying a value out of the memory tier into a new array
    2-5x slower than the copy itself. :meth:`take` hands out ranges of one private
    anonymous mapping instead; a range returns when its array (and every tensor or view
    made from it) is garbage, and the next value reuses its already-mapped pages. Private,
    so a fork gets copy-on-write pages, as with any other array.
    """

    def __init__(self, capacity: int):
        self.capacity = round_to_page(capacity)
        self._map: mmap.mmap | None = None
        self._pages: PageAllocator | None = None
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes``, or None when there is no room left (use another)."""
        if nbytes > self.capacity:
            return None
        if self._pages is None:
            with self._lock:  # mapped on first use: a store that is never read pays nothing
                if self._pages is None:
                    self._map = mmap.mmap(
                        -1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                    )
                    self._pages = PageAllocator(None, 0, self.capacity)
        got = self._pages.allocate(nbytes)
        if got is None:
            return None
        assert self._map is not None
        return owning_array(self._map, got[0], nbytes, self._pages.free, *got)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedPoolReader:
    """The reading side: another process's pool mapped read-only."""

    def __init__(self, path: str, size: int):
        self._map = open_shm_file(path, POOL_PREFIX, size, writable=False)
        magic, total, gen_offset, data_offset, page = _HEADER.unpack_from(self._map)
        if magic != _MAGIC or total != size or page != PAGE or not 0 < data_offset < size:
            self._map.close()
            raise StorageIOError(f"{path} is not a Persisting memory pool")
        self.size = size
        self.data_offset = data_offset
        pages = (size - data_offset) // PAGE
        self._gens = np.frombuffer(self._map, _GENERATION, count=pages, offset=gen_offset)
        self._copy = _copier(np.frombuffer(self._map, np.uint8))

    def read_into(self, offset: int, nbytes: int, generation: int, out: np.ndarray) -> bool:
        """Copy the value at ``offset`` into ``out``; False if it was freed meanwhile (the
        copy may then hold other bytes and must be dropped)."""
        if not self.data_offset <= offset <= offset + nbytes <= self.size or out.nbytes != nbytes:
            raise StorageIOError(f"range ({offset}, {nbytes}) is not inside the pool")
        page = (offset - self.data_offset) // PAGE
        if int(self._gens[page]) != generation:
            return False
        self._copy(out, offset, nbytes)
        return int(self._gens[page]) == generation

    def close(self) -> None:
        self._gens = self._copy = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self._map.close()


def _copier(source: np.ndarray) -> Callable[[np.ndarray, int, int], None]:
    """``copy(out, offset, nbytes)`` from the read-only ``source``; through a torch view of
    it when torch is loaded (its copy is multi-threaded), else numpy.

    torch warns (once per process) that it cannot make a read-only tensor writable; we
    never write through it, so that warning is silenced here, at setup.
    """
    torch = loaded_torch()
    if torch is None:

        def copy(out: np.ndarray, offset: int, nbytes: int) -> None:
            copy_bytes(out, source[offset : offset + nbytes])

        return copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(source)

    def copy_parallel(out: np.ndarray, offset: int, nbytes: int) -> None:
        torch.from_numpy(out).copy_(tensor[offset : offset + nbytes])

    return copy_parallel


__all__ = [
    "DEFAULT_SHM_DIR",
    "POOL_PREFIX",
    "PageAllocator",
    "RecycledBuffers",
    "SharedPool",
    "SharedPoolReader",
    "create_shm_file",
    "open_shm_file",
    "owning_array",
    "remove_orphaned_files",
    "round_to_page",
    "seqlock_safe",
]
