"""The value policy's state -- counts, ghosts, recency -- is one per namespace: shared by the
processes writing it, and kept across restarts (real processes on one root)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from persisting.kv import open_kv_store
from persisting.kv.eviction.reuse import FILE_NAME, ReuseStats, file_bytes
from persisting.kv.keys import key_hash
from tests import child_env
from tests.kv.kv_helpers import MODEL, OVERHEAD_ROOM, big, disk_tier, key
from tests.timing import wait_until

MiB = 1 << 20
HOT = 3  # the chunk read over and over

#: A writer of the namespace: stores chunks 0..5, reads chunk HOT twenty times, says so,
#: and waits (holding the store open) until told to read it once more and leave.
WRITER = """
import sys
from persisting.kv import open_kv_store
from tests.kv.kv_helpers import big, key
store = open_kv_store(sys.argv[1], sys.argv[2], memory_bytes=0, disk_bytes=int(sys.argv[3]))
for i in range(6):
    store.put(key(i), big(i))
for _ in range(20):
    assert store.get(key(3)) is not None
store.flush()  # the reads' sightings counted now, not a moment later
print("ready", flush=True)
sys.stdin.readline()
print("got", store.get(key(3)) is not None, flush=True)
store.close()
"""


def capacity(chunks: int) -> int:
    from persisting.kv.disk.payload_files import file_size

    return chunks * file_size(big(0).numel() * 2) + OVERHEAD_ROOM


def start(script: str, root: Path, budget: int) -> subprocess.Popen[str]:
    """Another process on the namespace running ``script``, once it said "ready"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(root), MODEL, str(budget)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise AssertionError(f"the other process did not start: {line!r}")
    return proc


def hot_count(root: Path) -> int:
    """Sightings of chunk HOT, read in a fresh process from the namespace's file."""
    script = (
        "import sys; from persisting.kv import open_kv_store\n"
        "from persisting.kv.keys import key_hash\n"
        "from tests.kv.kv_helpers import key, disk_tier\n"
        f"s = open_kv_store(sys.argv[1], {MODEL!r}, memory_bytes=0, disk_bytes=64 << 20)\n"
        "print(disk_tier(s).index.reuse.state(key_hash(key(3).to_string()))[0])\n"
        "s.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.split()[-1])


def test_counts_survive_a_restart_in_another_process(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        for i in range(6):
            store.put(key(i), big(i))
        for _ in range(4):
            store.get(key(HOT))
        path = disk_tier(store).directory / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert hot_count(root) == 5  # its put and four reads
    # the restarted process counted into the same file: its open is not a sighting
    assert hot_count(root) == 5


def test_a_damaged_file_costs_the_history_only(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.put(key(HOT), big(HOT))
        path = disk_tier(store).directory / FILE_NAME
    path.write_bytes(b"not a table")
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        assert store.get(key(HOT)) is not None  # the chunk is there; its count starts over
        store.flush()
        reuse = disk_tier(store).index.reuse
        assert isinstance(reuse, ReuseStats)
        assert reuse.state(key_hash(key(HOT).to_string()))[0] == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_processes_share_counts_and_evict_by_them(root: Path) -> None:
    budget = capacity(8)
    writer = start(WRITER, root, budget)
    try:
        assert writer.stdout is not None and writer.stdin is not None
        with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
            reuse = disk_tier(store).index.reuse
            assert reuse is not None
            # the writer's puts and reads, seen live through the shared file
            assert reuse.state(key_hash(key(HOT).to_string()))[0] == 21
            assert reuse.state(key_hash(key(0).to_string()))[0] == 1
            for i in range(10, 16):  # six more chunks into room for eight: four go
                store.put(key(i), big(i))
            # this process never read chunk HOT, yet keeps it: the writer's reads count
            assert store.contains(key(HOT))
            gone = [i for i in range(6) if not store.contains(key(i))]
            assert len(gone) >= 3 and HOT not in gone
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "got True"
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
    assert hot_count(root) == 22


@pytest.mark.parametrize("reopened", [False, True])
def test_the_table_is_in_memory_before_the_puts_need_it(tmp_path: Path, reopened: bool) -> None:
    # each sighting writes a page picked by a hash: faulted in on first write, a new
    # file's page cost a journaled write fault inside the put; the table is faulted in at
    # open, in the background, new (written) or existing (read)
    slots = 1 << 16
    if reopened:
        ReuseStats.open_file(tmp_path, slots).close()
        fd = os.open(tmp_path / FILE_NAME, os.O_RDONLY)  # its pages out of the page cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    stats = ReuseStats.open_file(tmp_path, slots)
    try:
        stats.wait_prefault()
        assert stats.resident()
        assert stats.state(key_hash("k")) == (0, 0)  # nothing counted by faulting it in
        stats.sighted(key_hash("k"))
        assert stats.state(key_hash("k"))[0] == 1
    finally:
        stats.close()


#: A writer that stores chunks 0..5, then reads chunk 0 when told (after the other process
#: opened the namespace), says so, and leaves when told.
LATE_READER = """
import sys
from persisting.kv import open_kv_store
from tests.kv.kv_helpers import big, key
store = open_kv_store(sys.argv[1], sys.argv[2], memory_bytes=0, disk_bytes=int(sys.argv[3]))
for i in range(6):
    store.put(key(i), big(i))
print("ready", flush=True)
sys.stdin.readline()
found = store.get(key(0)) is not None
store.flush()  # its sighting counted now, not a moment later
print("read", found, flush=True)
sys.stdin.readline()
store.close()
"""


def test_a_read_in_another_process_counts_as_recent_for_eviction(root: Path) -> None:
    """Recency is the namespace's: a chunk another process read after this one opened
    the namespace is not evicted as this process's oldest."""
    budget = capacity(8)
    other = start(LATE_READER, root, budget)
    try:
        assert other.stdout is not None and other.stdin is not None
        with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=budget) as store:
            assert disk_tier(store).index.lru_order().__next__() == key(0).to_string()
            other.stdin.write("read\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == "read True"
            for i in range(10, 14):  # four more chunks into room for eight: two go
                store.put(key(i), big(i))
            kept = [i for i in range(6) if store.contains(key(i))]
            assert 0 in kept and len(kept) < 6, kept
        other.stdin.write("leave\n")
        other.stdin.flush()
        assert other.wait(timeout=60) == 0
    finally:
        if other.poll() is None:
            other.kill()


def test_a_batch_of_sightings_counts_as_the_same_sightings_one_by_one(tmp_path: Path) -> None:
    hashes = [key_hash(f"k{i % 5}") for i in range(12)]  # repeats, in one bucket or not
    for d in ("one", "batch"):
        (tmp_path / d).mkdir()
    one, batch = (ReuseStats.open_file(tmp_path / d, 1024) for d in ("one", "batch"))
    try:
        for khash in hashes[:3]:  # both tables start from the same counts
            one.sighted(khash)
        batch.sighted_many(hashes[:3])
        ticks = [one.sighted(khash) for khash in hashes[3:]]
        assert batch.sighted_many(hashes[3:]) == ticks
        assert batch.now == one.now == len(hashes)
        assert all(batch.state(h) == one.state(h) for h in set(hashes))
    finally:
        one.close()
        batch.close()


def test_a_batch_moves_the_clock_on_from_another_processs_counts(tmp_path: Path) -> None:
    mine = ReuseStats.open_file(tmp_path, 1024)
    other = ReuseStats.open_file(tmp_path, 1024)  # the same file, its own descriptor
    try:
        for i in range(3):
            other.sighted(key_hash(f"o{i}"))
        mine.sighted_many([key_hash(f"m{i}") for i in range(5)])
        assert other.now == mine.now == 8
        assert mine.state(key_hash("o0"))[0] == 1 and other.state(key_hash("m4"))[0] == 1
    finally:
        mine.close()
        other.close()


def test_a_read_reaches_the_shared_table_without_a_flush(root: Path) -> None:
    """A read does not count its own sighting: a thread of the store counts it a moment
    later, where every process sees it."""
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.put(key(HOT), big(HOT))
        store.flush()
        directory = disk_tier(store).directory
        seen = ReuseStats.open_file(directory, 1024)  # another handle, as another process
        try:
            khash = key_hash(key(HOT).to_string())
            assert seen.state(khash)[0] == 1
            assert store.get(key(HOT)) is not None
            wait_until(lambda: seen.state(khash)[0] == 2, "the read's sighting counted")
        finally:
            seen.close()


@pytest.mark.parametrize("allocates", [True, False], ids=["fallocate", "no-fallocate"])
def test_a_new_table_is_allocated_whole_and_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, allocates: bool
) -> None:
    """With ``posix_fallocate`` or without (a filesystem that lacks it), a new table takes
    its whole size on the disk at once (the budget counted it) and starts empty."""
    if not allocates:

        def refuse(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.EOPNOTSUPP, "no fallocate here")

        monkeypatch.setattr(os, "posix_fallocate", refuse)
    slots = 1 << 16
    stats = ReuseStats.open_file(tmp_path, slots)
    try:
        st = os.stat(tmp_path / FILE_NAME)
        assert st.st_size == file_bytes(slots) and 512 * st.st_blocks >= st.st_size
        words = np.fromfile(tmp_path / FILE_NAME, dtype="<u8")
        assert words[1] == slots and not words[3:].any()
        assert stats.state(key_hash("k")) == (0, 0)
        stats.sighted(key_hash("k"))
        assert stats.state(key_hash("k"))[0] == 1
    finally:
        stats.close()
