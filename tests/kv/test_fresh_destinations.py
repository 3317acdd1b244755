"""Reads into memory nobody touched yet (issue 27): populating pages in one call, copying
into fresh or resident memory from the memory tier, and disk reads (whole, in parts, side
by side) into fresh or resident destinations, all bit-exact."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.kv import open_kv_store
from persisting.shm import PAGE, copy_into, pages_resident, populate
from tests.kv.kv_helpers import MODEL, key

MiB = 1 << 20


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


def fresh_array(nbytes: int) -> np.ndarray:
    """Anonymous memory no one has touched (its pages are not resident)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, np.uint8)


def test_populate_maps_fresh_pages_without_changing_a_byte() -> None:
    array = fresh_array(64 * PAGE)
    assert not pages_resident(array)
    array[5 * PAGE + 3] = 7  # one page touched and written before
    assert populate(array[PAGE + 1 : 40 * PAGE])  # unaligned: whole pages under it
    assert pages_resident(array[PAGE : 40 * PAGE])
    assert not pages_resident(array[41 * PAGE :])
    assert array[5 * PAGE + 3] == 7 and int(array.sum()) == 7
    assert not populate(np.empty(0, np.uint8))


def test_copy_into_fresh_memory_populates_then_copies() -> None:
    source = np.arange(4 * MiB, dtype=np.uint32).view(np.uint8)[: 4 * MiB]
    fresh = fresh_array(4 * MiB)
    copy_into(fresh, source)
    assert np.array_equal(fresh, source) and pages_resident(fresh)


def test_a_split_read_into_fresh_pages_is_bit_exact(root: Path) -> None:
    """A lone value is read in parts on the reader threads at once, into result pages
    nobody touched yet (each kept) or into a caller's resident buffer."""
    value = torch.arange(3 * MiB + 4096, dtype=torch.int32).view(torch.uint8).reshape(1, -1)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=256 * MiB, read_threads=4) as s:
        s.put(key(0), value, fmt="binary", check_shape=False)
        kept = [s.get(key(0)) for _ in range(3)]  # each kept: fresh result pages
        assert all(torch.equal(got, value) for got in kept)
        resident = torch.zeros_like(value)  # written: its pages are resident
        assert s.get_into(key(0), resident) is not None and torch.equal(resident, value)
        fresh = torch.from_numpy(fresh_array(value.numel())).reshape(1, -1)
        assert s.get_into(key(0), fresh) is not None and torch.equal(fresh, value)


def test_a_batch_read_side_by_side_into_fresh_pages_is_bit_exact(root: Path) -> None:
    values = [
        torch.arange(3 * MiB + 4096 * i, dtype=torch.int32).view(torch.uint8).reshape(1, -1)
        for i in range(6)
    ]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=256 * MiB, read_threads=4) as s:
        for i, value in enumerate(values):
            s.put(key(10 + i), value, fmt="binary", check_shape=False)
        got = s.batched_get([key(10 + i) for i in range(6)])  # 6 * 2 > 4 threads: side by side
        assert all(g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True))


def test_a_read_on_one_thread_into_fresh_pages_is_bit_exact(root: Path) -> None:
    value = torch.full((1, 3 * MiB), 9, dtype=torch.uint8)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB, read_threads=1) as s:
        s.put(key(1), value, fmt="binary", check_shape=False)
        out = torch.from_numpy(fresh_array(3 * MiB)).reshape(1, -1)
        assert s.get_into(key(1), out) is not None and torch.equal(out, value)


def test_a_memory_hit_into_a_fresh_destination_is_bit_exact(root: Path) -> None:
    # Every bit pattern of a bfloat16 (the dtype key() names) appears: bit-exact, not close.
    value = torch.arange(2 * MiB, dtype=torch.int16).view(torch.bfloat16).reshape(2, 1, -1, 1024)
    with open_kv_store(root, MODEL, memory_bytes=64 * MiB, disk_bytes=0) as s:
        s.put(key(2), value)
        out = torch.from_numpy(fresh_array(value.numel() * 2)).view(torch.bfloat16)
        assert s.get_into(key(2), out.reshape(value.shape)) is not None
        # Compared as bits (NaN patterns are among them).
        assert torch.equal(out.view(torch.int16), value.reshape(-1).view(torch.int16))
        assert s.stats()["get_hit_memory"] == 1
