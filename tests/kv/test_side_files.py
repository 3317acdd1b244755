"""The eviction side files -- ``reuse.bin`` (the value policy's counts) and ``recency.bin``
(the LRU snapshot) -- are bounded by the budget the namespace is opened with, judged before
they are counted, and never take a live process down (real stores, real processes)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from persisting.kv import KVStore, open_kv_store
from persisting.kv.disk.payload_files import BLOCK
from persisting.kv.eviction import recency
from persisting.kv.eviction.reuse import (
    FILE_NAME,
    MAX_SLOTS,
    ReuseStats,
    file_bytes,
    resized,
    slots_for,
)
from persisting.kv.keys import key_hash
from tests import child_env
from tests.kv.kv_helpers import MODEL, big, disk_tier, key
from tests.kv.test_reuse_shared import capacity

MiB = 1 << 20
HOT = 3


def namespace(root: Path) -> Path:
    """The namespace directory of ``MODEL`` under ``root`` (found by its side file)."""
    found = [p.parent for p in (root / "kv").rglob(FILE_NAME)]
    assert len(found) == 1, found
    return found[0]


def fill(root: Path, budget: int, chunks: int) -> Path:
    """A namespace of ``chunks`` chunks (chunk ``HOT`` read four times), closed."""
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
        for i in range(chunks):
            store.put(key(i), big(i))
        for _ in range(4):
            assert store.get(key(HOT)) is not None
    return namespace(root)


def kept(store: KVStore, chunks: int) -> list[int]:
    return [i for i in range(chunks) if store.contains(key(i))]


def test_a_lowered_budget_shrinks_the_table_before_it_is_counted(root: Path) -> None:
    """From 4 GiB (a 16 MiB table) to room for 8 chunks: the table is rebuilt at the size
    the new budget calls for, keeping its counts, before it is counted -- nothing is evicted
    for it and the namespace takes puts."""
    directory = fill(root, 4 << 30, 6)
    table = directory / FILE_NAME
    assert table.stat().st_size == file_bytes(slots_for(4 << 30)) == 16 * MiB + 24
    budget = capacity(8)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
        assert kept(store, 6) == list(range(6))
        assert table.stat().st_size == file_bytes(slots_for(budget))
        reuse = disk_tier(store).index.reuse
        assert reuse is not None
        assert reuse.state(key_hash(key(HOT).to_string()))[0] == 5  # its put and four reads
        store.put(key(6), big(6))
        store.put(key(7), big(7))
        assert kept(store, 8) == list(range(8))
        assert disk_tier(store).used_bytes() <= budget


def test_a_crafted_sparse_table_is_rebuilt_at_the_budgets_size(root: Path) -> None:
    """A table with a valid header and the largest size, sparse (a few blocks on disk):
    replaced by one of the size the budget calls for, not kept to grow as it is written."""
    budget = capacity(8)
    directory = fill(root, budget, 6)
    table = directory / FILE_NAME
    table.unlink()
    with open(table, "wb") as f:
        f.write(struct.pack("<QQ", int.from_bytes(b"PKVREUS2", "little"), MAX_SLOTS))
        f.truncate(file_bytes(MAX_SLOTS))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
        assert table.stat().st_size == file_bytes(slots_for(budget))
        assert kept(store, 6) == list(range(6))
        store.put(key(6), big(6))
        assert kept(store, 7) == list(range(7))


@pytest.mark.parametrize("name", [FILE_NAME, recency.FILE_NAME])
def test_garbage_in_a_side_file_costs_no_chunk(root: Path, name: str) -> None:
    """15 MiB of garbage in a side file of a 16 MiB namespace holding 10 chunks: judged
    damaged and dropped before anything is counted, so all 10 stay, and it is replaced."""
    budget = 16 * MiB
    directory = fill(root, budget, 10)
    (directory / name).write_bytes(os.urandom(15 * MiB))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
        assert kept(store, 10) == list(range(10))
        assert disk_tier(store).used_bytes() <= budget
    # closed: both side files as this budget makes them
    assert (directory / FILE_NAME).stat().st_size == file_bytes(slots_for(budget))
    assert (directory / recency.FILE_NAME).stat().st_size == recency.file_bytes(10)


def test_a_linked_table_is_replaced_and_its_target_left_alone(root: Path, tmp_path: Path) -> None:
    budget = 16 * MiB
    directory = fill(root, budget, 4)
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"x" * MiB)
    (directory / FILE_NAME).unlink()
    (directory / FILE_NAME).symlink_to(target)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
        assert kept(store, 4) == list(range(4))
        table = directory / FILE_NAME
        assert not table.is_symlink()
        assert table.stat().st_size == file_bytes(slots_for(budget))
    assert target.read_bytes() == b"x" * MiB


def test_an_oversized_snapshot_is_cut_to_the_bound_before_it_is_counted(root: Path) -> None:
    """A valid ``recency.bin`` of 15 MiB (a crafted header and entries) in a 16 MiB
    namespace: cut to its newest ``budget / 4 KiB`` entries (every chunk takes a block at
    least) before anything is counted, so no chunk goes for it."""
    budget = 16 * MiB
    directory = fill(root, budget, 10)
    saved = recency.load_order(directory)
    padding = [(i + 1, 7) for i in range(15 * MiB // 12)]  # older, unknown chunks
    recency.save_order(directory, padding + sorted(saved, key=saved.__getitem__))
    path = directory / recency.FILE_NAME
    assert path.stat().st_size > 15 * MiB
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
        assert kept(store, 10) == list(range(10))
        assert not path.exists() or path.stat().st_size <= recency.file_bytes(budget // BLOCK)
        assert disk_tier(store).used_bytes() <= budget
    assert path.stat().st_size == recency.file_bytes(10)


#: A store in another process (the victim): six chunks, then "ready"; told to, it puts
#: and reads more, flushes, reads chunk HOT three times, says "alive" and closes.
VICTIM = """
import sys
from persisting.kv import open_kv_store
from tests.kv.kv_helpers import big, key
store = open_kv_store(sys.argv[1], sys.argv[2], memory_bytes=0, disk_bytes=int(sys.argv[3]))
for i in range(6):
    store.put(key(i), big(i))
print("ready", flush=True)
sys.stdin.readline()
for i in range(6, 9):
    store.put(key(i), big(i))
    assert store.get(key(i)) is not None
store.flush()  # notices a table replaced under it
for _ in range(3):
    assert store.get(key(3)) is not None
store.flush()  # the reads' sightings counted now, not a moment later
print("alive", flush=True)
sys.stdin.readline()
store.close()
"""


def start_victim(root: Path, budget: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, str(root), MODEL, str(budget)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise AssertionError(f"the victim did not start: {line!r}")
    return proc


def go_on(proc: subprocess.Popen[str]) -> str:
    """Tell the victim to go on; its next line (empty if it died)."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def finish(proc: subprocess.Popen[str]) -> int:
    assert proc.stdin is not None
    try:
        proc.stdin.write("leave\n")
        proc.stdin.flush()
    except BrokenPipeError:
        pass
    return proc.wait(timeout=120)


@pytest.mark.timeout(240)
def test_a_live_store_survives_its_table_truncated_by_another_process(root: Path) -> None:
    victim = start_victim(root, 64 * MiB)
    try:
        os.truncate(namespace(root) / FILE_NAME, 0)  # an outsider, on the same inode
        assert go_on(victim) == "alive"
        assert finish(victim) == 0
    finally:
        if victim.poll() is None:
            victim.kill()
    # the next open finds the truncated table damaged and rebuilds it
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        assert kept(store, 9) == list(range(9))
        assert (namespace(root) / FILE_NAME).stat().st_size == file_bytes(slots_for(64 * MiB))


@pytest.mark.timeout(240)
def test_a_table_replaced_by_a_smaller_budget_leaves_the_live_store_alive(root: Path) -> None:
    """A damaged header byte, then a second store with a smaller budget: the table is
    replaced by a new file, not truncated under the live one, which goes on (exit 0) and
    counts into the new table once it noticed it."""
    victim = start_victim(root, 1 << 30)  # a 4 MiB table
    try:
        table = namespace(root) / FILE_NAME
        with open(table, "r+b") as f:
            f.write(b"X")
        budget = capacity(10)
        with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
            assert table.stat().st_size == file_bytes(slots_for(budget))
            assert go_on(victim) == "alive"
            reuse = disk_tier(store).index.reuse
            assert reuse is not None
            assert reuse.state(key_hash(key(HOT).to_string()))[0] == 3
        assert finish(victim) == 0
    finally:
        if victim.poll() is None:
            victim.kill()


@pytest.mark.parametrize(("old", "new"), [(4096, 1024), (1024, 8192), (2048, 2048)])
def test_a_resized_table_keeps_each_buckets_most_recent_keys(old: int, new: int) -> None:
    before = ReuseStats.in_memory(old)
    for i in range(3 * old // 4):
        for _ in range(1 + i % 3):
            before.sighted(key_hash(f"k{i}"))
    keys = [key_hash(f"k{i}") for i in range(3 * old // 4)]
    keys = [k for k in keys if before.state(k) != (0, 0)]  # not forgotten already
    table = np.frombuffer(bytes(before._owner), np.uint64)
    after = ReuseStats.in_memory(new)
    after._words[:] = memoryview(resized(table, new).tobytes()).cast("Q")
    assert after.now == before.now
    lost = [k for k in keys if after.state(k) == (0, 0)]
    assert all(after.state(k) == before.state(k) for k in keys if k not in lost)
    if new >= old:
        assert not lost
    for khash in lost:  # its new bucket is full of keys sighted since
        base = khash & (new - 1) & ~3
        newer = [after.state(int(after._words[3 + 2 * s]))[1] for s in range(base, base + 4)]
        assert min(newer) > before.state(khash)[1]
