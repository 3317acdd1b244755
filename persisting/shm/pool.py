"""The memory tier's buffers in one shared-memory file, so same-host readers copy values
out themselves.

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
rather than a SIGBUS.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import struct
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from persisting.errors import StorageIOError
from persisting.shm.files import (
    DEFAULT_SHM_DIR,
    create_shm_file,
    open_shm_file,
    unlink_quietly,
)
from persisting.shm.pages import (
    PAGE,
    PageAllocator,
    Prefault,
    PrefaultedMemory,
    copy_bytes,
    loaded_torch,
    owning_array,
    round_to_page,
)

POOL_PREFIX = "persisting-pool-"
_MAGIC = b"PKVPOOL1"
#: One per page; 64-bit, so a remembered generation can never come round again.
_GENERATION = np.dtype(np.uint64)
#: magic, file size, offset of the generation table, offset of the data area, page size
_HEADER = struct.Struct("<8sQQQQ")


def seqlock_safe() -> bool:
    """Whether lease-free reads of a pool are sound on this CPU (x86-64 ordering)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SharedPool(PrefaultedMemory):
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
        self._prefault = Prefault()
        # Removes the file at interpreter exit too, should the owner never call close().
        self._unlinker = weakref.finalize(self, unlink_quietly, self.path)

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes`` in the pool, or None when it has no room (or is closed)."""
        got = self._pages.allocate(nbytes)
        if got is None:
            return None
        offset, capacity = got
        return owning_array(self._map, offset, nbytes, self._release, offset, capacity)

    def start_prefault(self, nbytes: int) -> threading.Thread | None:
        """Commit and map the lowest ``nbytes`` of the data area on a background thread
        (:class:`~persisting.shm.pages.Prefault`), so the first values put there land in
        mapped pages: committed but unmapped, each 4 KiB page of a fresh put would fault on
        the way in, one fault per page on the put's path; populating maps them ahead of
        time, off that path. Returns the thread (None if one already ran)."""
        end = min(round_to_page(nbytes), self.size - self.data_offset)
        return self._prefault.start(
            self._address + self.data_offset,
            end,
            lambda reached: self._pages.commit(self.data_offset + reached),
        )

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

    @property
    def mapping(self) -> mmap.mmap:
        """The pool's whole mapping (to page-lock its data area for DMA; never to write)."""
        return self._map

    def unlink(self) -> None:
        unlink_quietly(self.path)

    def close(self) -> None:
        """Remove the file and stop allocating; the mapping lives on while buffers do."""
        self._prefault.stop()
        self._pages.close()
        self._unlinker()
        with contextlib.suppress(OSError):
            os.close(self._fd)


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


__all__ = ["POOL_PREFIX", "SharedPool", "SharedPoolReader", "seqlock_safe"]
