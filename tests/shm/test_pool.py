"""The memory tier's shared pool: generations, read-only readers, fallback, cleanup."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.errors import StorageIOError
from persisting.kv import ChunkKey, KVStore
from persisting.shm import (
    DEFAULT_SHM_DIR,
    PAGE,
    POOL_PREFIX,
    SharedPool,
    SharedPoolReader,
    open_shm_file,
    pages_resident,
    remove_orphaned_files,
)

MODEL = "pool/test"


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_a_reader_copies_live_values_and_detects_freed_ones() -> None:
    pool = SharedPool(1 << 20)
    reader = SharedPoolReader(str(pool.path), pool.size)
    try:
        first = pool.allocate(3 * PAGE + 5)
        assert first is not None
        first[:] = _bytes(first.nbytes, 1)
        offset, generation = pool.locate(first)  # type: ignore[misc]
        out = np.empty(first.nbytes, np.uint8)
        assert reader.read_into(offset, first.nbytes, generation, out)
        assert np.array_equal(out, first)

        del first  # the tier dropped it: its pages get a new generation...
        gc.collect()
        second = pool.allocate(3 * PAGE + 5)  # ...before they are handed out again
        assert second is not None and pool.locate(second)[0] == offset  # type: ignore[index]
        second[:] = _bytes(second.nbytes, 2)
        assert not reader.read_into(offset, second.nbytes, generation, out)
        assert pool.locate(second)[1] != generation  # type: ignore[index]
    finally:
        reader.close()
        pool.close()


def test_a_view_of_a_pool_buffer_keeps_its_range_allocated() -> None:
    """A write-behind or a reader holding a view keeps the bytes from being reused."""
    pool = SharedPool(4 * PAGE)
    try:
        buffer = pool.allocate(4 * PAGE)
        assert buffer is not None
        view = memoryview(buffer)
        del buffer
        gc.collect()
        assert pool.allocate(PAGE) is None  # still taken through the view
        view.release()
        del view
        gc.collect()
        assert pool.allocate(PAGE) is not None
    finally:
        pool.close()


def test_the_reader_cannot_write_and_foreign_files_are_refused(tmp_path: Path) -> None:
    pool = SharedPool(1 << 20)
    try:
        mapping = open_shm_file(str(pool.path), POOL_PREFIX, pool.size, writable=False)
        with pytest.raises(TypeError):
            mapping[PAGE] = 1  # read-only: a client cannot change what is stored
        mapping.close()
        with pytest.raises(StorageIOError, match="its owner said"):
            SharedPoolReader(str(pool.path), pool.size + PAGE)
        outside = tmp_path / f"{POOL_PREFIX}1-ab"
        outside.write_bytes(b"\0" * pool.size)
        with pytest.raises(StorageIOError, match="not a Persisting"):
            SharedPoolReader(str(outside), pool.size)
        reader = SharedPoolReader(str(pool.path), pool.size)
        with pytest.raises(StorageIOError, match="not inside"):
            reader.read_into(pool.size - PAGE, 2 * PAGE, 0, np.empty(2 * PAGE, np.uint8))
        reader.close()
    finally:
        pool.close()
    assert not pool.path.exists()


def test_files_of_dead_processes_are_removed() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    pid = int(dead.stdout)
    orphan = DEFAULT_SHM_DIR / f"{POOL_PREFIX}{pid}-0123456789abcdef"
    mine = DEFAULT_SHM_DIR / f"{POOL_PREFIX}{os.getpid()}-0123456789abcdef"
    unrelated = DEFAULT_SHM_DIR / f"{POOL_PREFIX}notapid"
    for path in (orphan, mine, unrelated):
        path.write_bytes(b"x")
    try:
        assert remove_orphaned_files(POOL_PREFIX) >= 1
        assert not orphan.exists() and mine.exists() and unrelated.exists()
    finally:
        for path in (orphan, mine, unrelated):
            path.unlink(missing_ok=True)


def _key(i: int) -> ChunkKey:
    return ChunkKey(MODEL, 1, 0, i, "bfloat16")


def _value(i: int) -> torch.Tensor:
    return torch.full((2, 2, 16, 1024), float(i), dtype=torch.bfloat16)  # 128 KiB


def test_store_memory_tier_in_the_pool_read_by_place(tmp_path: Path) -> None:
    nbytes = _value(0).numel() * 2
    with KVStore(
        tmp_path, MODEL, memory_bytes=3 * nbytes, disk_bytes=64 * nbytes, shared_memory=True
    ) as store:
        pool = store.shared_pool
        assert pool is not None and pool.path.exists()
        reader = SharedPoolReader(str(pool.path), pool.size)
        for i in range(3):
            store.put(_key(i), _value(i))
        location = store.shared_location(_key(0))
        assert location is not None and location.layout.nbytes == nbytes
        out = np.empty(nbytes, np.uint8)
        assert reader.read_into(location.offset, nbytes, location.generation, out)
        assert torch.equal(
            torch.from_numpy(out).view(torch.bfloat16).reshape(2, 2, 16, 1024), _value(0)
        )
        other = store.layout(_key(0))
        assert other is not None
        wrong = type(other)((4, 2, 16, 512), other.dtype, other.fmt, other.nbytes, other.kind)
        assert store.shared_location(_key(0), expect=wrong) is None  # a layout mismatch

        # Reads reported with touch() count for LRU: key 1 was never read, so it goes first.
        assert store.touch([_key(0), _key(2), _key(99)]) == 2
        store.put(_key(3), _value(3))
        assert store.in_memory(_key(0)) and not store.in_memory(_key(1))
        assert store.shared_location(_key(1)) is None  # evicted to disk: no location in memory
        assert torch.equal(store.get(_key(1)), _value(1))

        # Evicting key 0 frees its pages: a reader still holding its old location notices.
        first = store.shared_location(_key(0))
        assert first is not None
        store.remove(_key(0))
        gc.collect()
        store.put(_key(4), _value(4))
        assert not reader.read_into(first.offset, nbytes, first.generation, out)
        reader.close()
        path = pool.path
    assert not path.exists()  # closing the store removes the pool file


def test_a_full_pool_falls_back_to_private_memory(tmp_path: Path) -> None:
    nbytes = _value(0).numel() * 2
    with KVStore(
        tmp_path, MODEL, memory_bytes=4 * nbytes, disk_bytes=64 * nbytes, shared_memory=True
    ) as store:
        assert store.shared_pool is not None
        hog = store.allocate(3 * nbytes)  # in the pool (it has room): e.g. held by readers
        for i in range(3):
            store.put(_key(i), _value(i))
        assert store.stats().get("pool_full", 0) >= 1
        for i in range(3):
            assert torch.equal(store.get(_key(i)), _value(i))
        placed = [store.shared_location(_key(i)) is not None for i in range(3)]
        assert placed.count(True) == 1  # one fit beside the hog; the others are private
        del hog


def test_a_process_that_never_closes_its_pool_still_removes_it_at_exit(tmp_path: Path) -> None:
    code = (
        "from persisting.shm import SharedPool\n"
        "pool = SharedPool(1 << 20)\n"
        "print(pool.path, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert not Path(done.stdout.strip()).exists()


def test_recycled_buffers_reuse_the_pages_of_dead_values() -> None:
    from persisting.shm import RecycledBuffers

    buffers = RecycledBuffers(4 * PAGE)
    first = buffers.take(2 * PAGE)
    assert first is not None and first.ctypes.data % PAGE == 0
    address = first.ctypes.data
    view = torch.from_numpy(first)  # a tensor made from it keeps the range taken
    del first
    gc.collect()
    second = buffers.take(2 * PAGE)
    assert second is not None and second.ctypes.data != address
    assert buffers.take(PAGE) is None  # full: the caller falls back to a fresh array
    del view, second
    gc.collect()
    again = buffers.take(4 * PAGE)
    assert again is not None and again.ctypes.data == address  # the same, mapped pages
    assert buffers.take(8 * PAGE) is None  # larger than the whole capacity


def test_store_gets_come_from_recycled_pages_and_fall_back_when_they_run_out(
    tmp_path: Path,
) -> None:
    nbytes = _value(0).numel() * 2
    with KVStore(
        tmp_path,
        MODEL,
        memory_bytes=8 * nbytes,
        disk_bytes=64 * nbytes,
        result_buffer_bytes=2 * nbytes,
    ) as store:
        for i in range(4):
            store.put(_key(i), _value(i))
        got = store.batched_get([_key(i) for i in range(4)])  # two recycled, two fresh
        assert all(torch.equal(g, _value(i)) for i, g in enumerate(got))
        got[0].fill_(-1.0)  # a returned value is the caller's copy
        assert torch.equal(store.get(_key(0)), _value(0))
        addresses = {g.data_ptr() for g in got}
        del got
        gc.collect()
        again = store.get(_key(3))
        assert again.data_ptr() in addresses  # pages of an earlier, dropped value
    with KVStore(
        tmp_path, MODEL, memory_bytes=8 * nbytes, disk_bytes=64 * nbytes, result_buffer_bytes=0
    ) as store:
        assert torch.equal(store.get(_key(1)), _value(1))


def test_a_pool_prefault_commits_and_maps_the_lowest_pages_and_keeps_values() -> None:
    """The served memory tier's pages, mapped ahead: values already in the pool are
    untouched, later ones land in the prefaulted range, and close stops the thread."""
    pool = SharedPool(8 << 20)
    try:
        first = pool.allocate(1 << 20)
        assert first is not None
        first[:] = 7
        thread = pool.start_prefault(6 << 20)
        assert thread is not None and pool.start_prefault(6 << 20) is None  # once per pool
        pool.wait_prefault()
        assert pool.prefaulted == 6 << 20
        later = pool.allocate(2 << 20)
        assert later is not None and pages_resident(later)  # mapped before it was written
        later[:] = 9
        assert (first == 7).all() and (later == 9).all()
    finally:
        pool.close()
    assert not thread.is_alive()


def test_closing_a_pool_stops_its_prefault() -> None:
    pool = SharedPool(256 << 20)
    thread = pool.start_prefault(256 << 20)
    assert thread is not None
    pool.close()  # stops at the next step and waits for it
    assert not thread.is_alive() and pool.prefaulted <= 256 << 20
