"""The page allocator every fast path carves its ranges from."""

from __future__ import annotations

import gc
import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from persisting.shm import PAGE, PageAllocator, RecycledBuffers

SPAN = 64 * PAGE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9 * PAGE)), max_size=60))
def test_allocated_ranges_never_overlap_and_frees_return_exactly_what_was_taken(
    steps: list[tuple[bool, int]],
) -> None:
    pages = PageAllocator(None, PAGE, PAGE + SPAN)
    held: list[tuple[int, int]] = []
    for allocate, nbytes in steps:
        if allocate or not held:
            got = pages.allocate(nbytes)
            if got is None:
                assert pages.free_bytes < -(-nbytes // PAGE) * PAGE or held
                continue
            offset, capacity = got
            assert offset % PAGE == 0 and capacity % PAGE == 0 and capacity >= nbytes
            assert offset >= PAGE and offset + capacity <= PAGE + SPAN
            for other, other_capacity in held:
                assert offset + capacity <= other or other + other_capacity <= offset
            held.append(got)
        else:
            pages.free(*held.pop(nbytes % len(held)))
        assert pages.free_bytes + sum(c for _o, c in held) == SPAN
    for got in held:
        pages.free(*got)
    assert pages.free_ranges() == [(PAGE, SPAN)]  # everything back, coalesced into one


def test_a_free_from_a_finalizer_inside_allocate_does_not_deadlock() -> None:
    """A garbage collection can start inside allocate() and run a finalizer that frees
    pages on the same thread; the allocator's lock is not re-entrant."""
    pages = PageAllocator(None, 0, SPAN)
    got = pages.allocate(PAGE)
    assert got is not None
    done = threading.Event()

    def free_while_allocating() -> None:
        with pages._lock:  # what a finalizer sees when it fires inside allocate()
            pages.free(*got)
        done.set()

    thread = threading.Thread(target=free_while_allocating, daemon=True)
    thread.start()
    assert done.wait(5), "free() blocked on the allocator's own lock"
    assert pages.free_bytes == SPAN


def test_recycled_buffers_come_back_when_their_arrays_die() -> None:
    buffers = RecycledBuffers(4 * PAGE)
    first = buffers.take(4 * PAGE)
    assert first is not None and buffers.take(PAGE) is None
    view = first[PAGE:]
    del first
    gc.collect()
    assert buffers.take(PAGE) is None  # a view keeps the whole range
    del view
    gc.collect()
    again = buffers.take(4 * PAGE)
    assert again is not None
    np.copyto(again, 7)


def _resident_bytes(address: int) -> int:
    """Rss of the mapping that holds ``address`` (from /proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            found = low <= address < high
        elif found and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_recycled_buffers_start_on_a_huge_page_and_reuse_the_lowest_free_range() -> None:
    buffers = RecycledBuffers(8 << 20)
    first = buffers.take(3 << 20)
    second = buffers.take(2 << 20)
    assert first is not None and second is not None
    assert first.ctypes.data % (2 << 20) == 0  # where transparent huge pages can back it
    low = first.ctypes.data
    del first
    gc.collect()
    again = buffers.take(1 << 20)  # freed pages (already mapped) before untouched ones
    assert again is not None and again.ctypes.data == low


def test_a_prefault_maps_every_page_and_never_changes_a_taken_buffer() -> None:
    capacity = 16 << 20
    buffers = RecycledBuffers(capacity)
    taken = buffers.take(5 * PAGE + 7)
    assert taken is not None
    taken[:] = np.arange(taken.nbytes, dtype=np.uint64).astype(np.uint8)
    want = taken.copy()
    thread = buffers.start_prefault()
    assert thread is not None and buffers.start_prefault() is None  # one prefault per mapping
    buffers.wait_prefault()
    assert buffers.prefaulted == capacity
    assert np.array_equal(taken, want)
    assert _resident_bytes(taken.ctypes.data) >= capacity
    buffers.stop_prefault()  # after the end: returns at once


def test_stop_prefault_ends_the_thread() -> None:
    buffers = RecycledBuffers(256 << 20)
    thread = buffers.start_prefault()
    assert thread is not None
    buffers.stop_prefault()
    assert not thread.is_alive() and buffers.prefaulted <= buffers.capacity
    assert buffers.take(PAGE) is not None  # still usable


def test_pages_resident_tells_touched_pages_from_fresh_ones() -> None:
    import mmap as _mmap

    import torch

    from persisting.shm import copy_into, loaded_torch, pages_resident

    assert loaded_torch() is torch  # so the resident copy below takes the parallel path

    mapping = _mmap.mmap(-1, 4 << 20, flags=_mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS)
    fresh = np.frombuffer(mapping, np.uint8)
    assert not pages_resident(fresh)  # never touched: a copy would fault every page
    source = np.arange(4 << 20, dtype=np.uint64).view(np.uint8)[: 4 << 20]
    copy_into(fresh, source)  # populated in one call, copied on one thread
    assert np.array_equal(fresh, source)
    assert pages_resident(fresh)
    assert pages_resident(fresh[123 : 3 << 20])  # unaligned views are checked whole
    copy_into(fresh, source[::-1].copy())  # resident: the parallel copy
    assert np.array_equal(fresh, source[::-1])
    assert not pages_resident(np.empty(0, np.uint8))
    del fresh
