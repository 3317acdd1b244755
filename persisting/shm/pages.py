"""Page-granular memory: the page size, aligned buffers, a page allocator, bulk copies.

Every fast path of Persisting hands out page-aligned ranges of one big mapping rather than
fresh arrays: the memory tier's shared pool, a client's arena, the recycled result pages of
``get``. They all use :class:`PageAllocator`, and each range goes back to it through
:func:`owning_array` once the last array or tensor over it is garbage.

``PAGE`` is this host's memory page size (4 KiB on x86-64, 16/64 KiB on some ARM servers).
It is the only page-size constant for memory; the on-disk payload format has its own
host-independent block size (:data:`persisting.kv.disk.payload_files.BLOCK`).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import errno
import functools
import logging
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def round_to_page(n: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return -(-n // PAGE) * PAGE


#: From this size numpy advises the kernel to back a new array with transparent huge
#: pages (its ``hugepage`` default on Linux): :func:`aligned_buffer` maps such buffers
#: itself instead.
NUMPY_HUGE_PAGE_BYTES = 4 << 20


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 array of ``nbytes`` starting on a page boundary (faster I/O, memcpy).

    Buffers of :data:`NUMPY_HUGE_PAGE_BYTES` or more get a private anonymous mapping of
    their own, in 4 KiB pages: an array numpy allocates that large is advised to use huge
    pages, and a buffer filled once on a request's path (a value read for a caller that
    keeps it) is where a fresh huge page costs most: its first touch makes the kernel find
    and zero 2 MiB of contiguous memory, and in a VM that hands freed memory back to its
    host (free page reporting) such a block is exactly what the host took back, so the
    touch faults on the host as well. 4 KiB pages come from any free fragment and cost
    the same every time. The mapping goes when the last array or tensor over it does.
    """
    if nbytes >= NUMPY_HUGE_PAGE_BYTES:
        mapping = mmap.mmap(-1, round_to_page(nbytes), flags=mmap.MAP_PRIVATE)
        return np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start : start + nbytes]


def loaded_torch() -> Any:
    """torch if the process already imported it (a caller holding a tensor has), else None.

    Persisting does not import torch itself on these paths: start-up stays light for
    numpy-only users.
    """
    return sys.modules.get("torch")


#: Copies at least this large go through torch (multi-threaded) when torch is loaded.
_PARALLEL_COPY_BYTES = 1 << 20


def copy_bytes(dst: np.ndarray, src: Any) -> None:
    """Copy the bytes of ``src`` into the uint8 array ``dst`` (same length).

    Large copies use torch's parallel copy when torch is already loaded (it spreads the
    copy over the cores, where numpy's runs on one); numpy-only processes keep numpy.
    """
    source = src if isinstance(src, np.ndarray) else np.frombuffer(src, dtype=np.uint8)
    torch = loaded_torch()
    if torch is not None and dst.nbytes >= _PARALLEL_COPY_BYTES:
        torch.from_numpy(dst).copy_(torch.from_numpy(source))
    else:
        dst[:] = source


#: madvise(2) advice that faults a range in writable without changing it (Linux >= 5.14).
MADV_POPULATE_WRITE = 23
#: Linux's advice to fault pages in for reading (5.14+): a file's pages read into the page
#: cache, none of them dirtied.
MADV_POPULATE_READ = 22


@functools.cache
def _libc_function(name: str, third: Any) -> Any:
    """libc's ``name(void *addr, size_t length, <third>)`` returning int, through ctypes,
    which lets go of the GIL while it runs (the mmap module's ``madvise`` makes no such
    promise, and a prefault runs for seconds). Loaded once per name."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, third]
    fn.restype = ctypes.c_int
    return fn


def _page_span(array: np.ndarray) -> tuple[int, int]:
    """(start, length) of the whole pages under ``array``."""
    address = array.ctypes.data
    start = address - address % PAGE
    return start, address + array.nbytes - start


def pages_resident(array: np.ndarray) -> bool:
    """Whether every page under ``array`` is resident (``mincore``): a copy into such pages
    faults none in, so several threads may copy into them at once. False where it cannot
    be told (not Linux, or the call fails)."""
    if not sys.platform.startswith("linux") or array.nbytes == 0:
        return False
    mincore = _libc_function("mincore", ctypes.c_void_p)
    start, length = _page_span(array)
    vector = np.empty((length + PAGE - 1) // PAGE, np.uint8)
    if mincore(start, length, vector.ctypes.data) != 0:
        return False
    return bool(np.all(vector & 1))


def populate(array: np.ndarray) -> bool:
    """Fault every page under ``array`` in, writable, in one call (``MADV_POPULATE_WRITE``,
    Linux >= 5.14), changing no byte; False where that cannot be done (another OS, an
    older kernel, memory that cannot be populated): the pages then fault in as written.

    Why: a first write to a fresh page costs a fault, and the kernel zeroes the page. Taken
    one page at a time from user space (a copy) or from several threads at once (a read
    split across threads, all faulting in one address space), those faults cost far more
    than the same pages populated by one call on one thread: populating 28 MiB fresh
    destinations took 20-25% less CPU here than letting the copy fault them. Only whole
    pages under ``array`` are populated; bytes of the first and last page outside it belong
    to the same mapping and are left as they are."""
    if not sys.platform.startswith("linux") or array.nbytes == 0:
        return False
    madvise = _libc_function("madvise", ctypes.c_int)
    start, length = _page_span(array)
    return madvise(start, length, MADV_POPULATE_WRITE) == 0


def copy_into(dst: np.ndarray, src: Any) -> None:
    """Copy ``src`` into ``dst`` (uint8, same length), the cheapest way for ``dst``'s pages:
    in parallel (:func:`copy_bytes`) when they are already resident (recycled result pages,
    an engine's preallocated buffer), else populated in one call (:func:`populate`) and
    copied on this thread.

    Several threads faulting fresh pages in at once serialize on the process's page tables,
    so a parallel copy into fresh memory is no faster than one thread's and often slower,
    while one populate call maps the pages without a fault per page; into resident pages
    nothing faults and the parallel copy gains what the cores give. Checking costs one
    ``mincore`` call, small beside the copy.
    """
    source = src if isinstance(src, np.ndarray) else np.frombuffer(src, dtype=np.uint8)
    if dst.nbytes < _PARALLEL_COPY_BYTES:
        dst[:] = source
    elif pages_resident(dst):
        copy_bytes(dst, source)
    else:
        populate(dst)
        dst[:] = source


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

    Thread-safe. Frees never wait for the lock: they usually run in a garbage-collection
    finalizer (:func:`owning_array`), which may fire on a thread that is inside
    :meth:`allocate` holding it. A free that cannot take the lock at once is parked and
    merged by the next call that holds it.
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
        #: Frees that arrived while the lock was held (deque appends are atomic).
        self._parked: collections.deque[tuple[int, int]] = collections.deque()

    def allocate(self, nbytes: int) -> tuple[int, int] | None:
        """(offset, capacity) of a free range of at least ``nbytes``, or None."""
        want = round_to_page(max(nbytes, 1))
        with self._lock:
            self._merge_parked()
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

    def commit(self, end: int) -> bool:
        """Commit the pages below ``end`` ahead of any allocation reaching them (a
        prefault's step); False when that failed or the allocator is closed."""
        with self._lock:
            return not self._closed and self._commit(end)

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
        self._parked.append((offset, length))
        if self._lock.acquire(blocking=False):
            try:
                self._merge_parked()
            finally:
                self._lock.release()

    def _merge_parked(self) -> None:
        """Put parked frees back into the sorted, coalesced free list (lock held)."""
        while self._parked:
            offset, length = self._parked.popleft()
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
            self._merge_parked()
            return sum(self._lengths)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free list as ``(offset, length)`` pairs, ascending (for checks and tests)."""
        with self._lock:
            self._merge_parked()
            return list(zip(self._offsets, self._lengths, strict=True))


#: The transparent huge page size on x86-64 and most arm64 kernels (4 KiB base pages).
HUGE_PAGE = 2 << 20


def advise_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask the kernel to back ``mapping`` (anonymous) with transparent huge pages.

    A first touch of a 4 KiB page costs one fault and a zeroed page, so filling fresh
    memory costs more than the copy into it; with huge pages one fault maps 2 MiB, 512
    times fewer faults for the same bytes. Hosts whose THP setting is ``never`` (or
    without ``madvise``) keep 4 KiB pages; nothing breaks.
    """
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is None:
        return False
    try:
        mapping.madvise(advise)
    except OSError:
        return False
    return True


#: Bytes one prefault step populates (a stop request is seen between steps).
PREFAULT_STEP = 32 << 20


class Prefault:
    """Faults the first bytes of a mapping in ahead of use, lowest first (where first-fit
    allocation looks first), on a background thread, :data:`PREFAULT_STEP` bytes per
    ``MADV_POPULATE_WRITE`` call. Populating never changes a page's contents, so it is
    safe beside buffers in use. Before Linux 5.14 (no such advice) nothing is faulted."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        #: Bytes faulted in so far (from the start).
        self.done = 0

    def start(
        self,
        address: int,
        nbytes: int,
        before_step: Callable[[int], bool] | None = None,
        *,
        advice: int = MADV_POPULATE_WRITE,
    ) -> threading.Thread | None:
        """Fault ``[address, address + nbytes)`` in; ``before_step(end)`` (given) runs
        before each step and stops the prefault by returning False (a pool commits the
        step's pages there); ``advice`` :data:`MADV_POPULATE_READ` reads a file's pages in
        without dirtying them. Returns the thread; None if one already ran or runs."""
        with self._lock:
            if self._thread is not None:
                return None
            self._thread = threading.Thread(
                target=self._run,
                args=(address, nbytes, before_step, advice),
                name="persisting-prefault",
                daemon=True,
            )
        self._thread.start()
        return self._thread

    def _run(
        self,
        address: int,
        nbytes: int,
        before_step: Callable[[int], bool] | None,
        advice: int,
    ) -> None:
        if not sys.platform.startswith("linux"):
            return  # the advice's number (and meaning) is Linux's
        madvise = _libc_function("madvise", ctypes.c_int)
        while self.done < nbytes and not self._stop.is_set():
            step = min(PREFAULT_STEP, nbytes - self.done)
            if before_step is not None and not before_step(self.done + step):
                return
            if madvise(address + self.done, step, advice) != 0:
                err = ctypes.get_errno()
                if err != errno.EINTR:
                    log.info(
                        "memory prefault stopped after %d bytes: %s", self.done, os.strerror(err)
                    )
                    return
                continue
            self.done += step

    def wait(self) -> None:
        """Wait until a prefault in progress has faulted every page (or given up)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    def stop(self) -> None:
        """Stop a prefault in progress (at its next step) and wait for it."""
        self._stop.set()
        self.wait()


class PrefaultedMemory:
    """What a mapping with a :class:`Prefault` tells and offers about it."""

    _prefault: Prefault

    @property
    def prefaulted(self) -> int:
        """Bytes the prefault has faulted in so far (from the start of the ranges)."""
        return self._prefault.done

    def wait_prefault(self) -> None:
        """Wait until a prefault in progress has faulted every page (or given up)."""
        self._prefault.wait()

    def stop_prefault(self) -> None:
        """Stop a prefault in progress (at its next step) and wait for it."""
        self._prefault.stop()


class RecycledBuffers(PrefaultedMemory):
    """Page-aligned buffers whose pages stay mapped from one use to the next.

    A fresh multi-MiB array costs a page fault (and the kernel zeroing the page) per page
    on first touch, which costs more than copying the value into it. :meth:`take` hands
    out ranges of one private anonymous mapping instead, aligned to huge pages and, with
    ``huge_pages`` (the default), advised to use them (:func:`advise_huge_pages`: the
    first use of a range faults 2 MiB at a time); a range returns when its array (and
    every tensor or view made from it) is garbage, and the next value reuses its
    already-mapped pages (first fit: freed ranges low in the mapping before fresh ones).
    :meth:`start_prefault` faults the whole mapping in ahead of use, in the background.
    Mapped pages are kept, so the resident size stays at the high-water mark (at most
    ``capacity``). Private, so a fork gets copy-on-write pages, as with any other array.

    Huge pages pay off for memory faulted once and reused (the memory tier, prefaulted in
    the background). A range used once, on a request's path, may do better without: in a
    VM that gives free memory back to its host (free page reporting, as on the
    development machine), a fresh huge page comes from exactly the blocks given back, and
    its first touch faults on the host as well as in the guest; 4 KiB pages come from
    smaller free fragments and cost the same every time.
    """

    def __init__(self, capacity: int, *, huge_pages: bool = True):
        self.capacity = round_to_page(capacity)
        self._advise_huge = huge_pages
        self._map: mmap.mmap | None = None
        self._pages: PageAllocator | None = None
        self._start = 0
        self._address = 0
        self._lock = threading.Lock()
        #: Whether the kernel took the huge-page advice (known once mapped).
        self.huge_pages = False
        self._prefault = Prefault()

    def _mapped(self) -> PageAllocator:
        """The allocator over the mapping, made on first use (a store never written or read
        pays nothing)."""
        with self._lock:
            if self._pages is None:
                # One huge page more than asked, so the ranges can start on a huge page.
                self._map = mmap.mmap(
                    -1, self.capacity + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                )
                self.huge_pages = self._advise_huge and advise_huge_pages(self._map)
                self._address = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
                self._start = (-self._address) % HUGE_PAGE
                self._pages = PageAllocator(None, self._start, self._start + self.capacity)
            return self._pages

    def take(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes``, or None when there is no room left (use another)."""
        if nbytes > self.capacity:
            return None
        pages = self._pages if self._pages is not None else self._mapped()
        got = pages.allocate(nbytes)
        if got is None:
            return None
        assert self._map is not None
        return owning_array(self._map, got[0], nbytes, pages.free, *got)

    def start_prefault(self, nbytes: int | None = None) -> threading.Thread | None:
        """Fault the lowest ``nbytes`` of the mapping in (all of it by default) on a
        background thread (:class:`Prefault`); returns it (None if one already ran or runs).

        Costs those bytes of resident memory from now on instead of as values arrive, and
        the CPU time of the faults (a fault and a zeroed page per page, more in a VM,
        where a fault can reach the host), spent before the first put rather than
        inside it.
        """
        self._mapped()
        end = self.capacity if nbytes is None else min(round_to_page(nbytes), self.capacity)
        return self._prefault.start(self._address + self._start, end)


__all__ = [
    "HUGE_PAGE",
    "MADV_POPULATE_READ",
    "MADV_POPULATE_WRITE",
    "PAGE",
    "PageAllocator",
    "Prefault",
    "PrefaultedMemory",
    "RecycledBuffers",
    "advise_huge_pages",
    "aligned_buffer",
    "copy_bytes",
    "copy_into",
    "loaded_torch",
    "owning_array",
    "pages_resident",
    "populate",
    "round_to_page",
]
