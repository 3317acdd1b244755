"""The disk tier on real files: capacity under storms, eviction order, damage, recovery."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lance
import numpy as np
import pytest
import torch

from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import HEADER_BYTES
from persisting.lance_store import StorageRoot
from tests.kv.kv_helpers import MODEL, OVERHEAD_ROOM, big, key, tensor

MiB = 1 << 20


def du_bytes(path: Path) -> int:
    out = subprocess.run(
        ["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[0])


def payload_files(root: Path) -> list[Path]:
    return sorted((StorageRoot(root).kv_path(MODEL) / "payload").rglob("*.kv"))


def test_du_stays_within_capacity_under_a_storm_twice_the_capacity(root: Path) -> None:
    capacity = 16 * MiB
    value = torch.zeros(2, 4, 128, 512, dtype=torch.bfloat16)  # 1 MiB
    batch = 4
    peak = 0
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=capacity) as store:
        for start in range(0, 32, batch):
            keys = [key(i) for i in range(start, start + batch)]
            store.batched_put(keys, [value + i for i in range(start, start + batch)])
            store.flush()
            peak = max(peak, du_bytes(StorageRoot(root).kv_path(MODEL)))
        stats = store.stats()
        assert stats["disk_evictions"] >= 16
        assert stats["disk_bytes"] <= capacity
        newest = key(31)
        assert torch.equal(store.get(newest), value + 31)
    # Payload within capacity; metadata, lock and counter files add well under one batch.
    assert peak <= capacity + batch * MiB, peak


def test_prefix_aware_eviction_drops_suffixes_first(root: Path) -> None:
    value_bytes = big(0).numel() * 2
    capacity = 6 * (HEADER_BYTES + value_bytes) + OVERHEAD_ROOM  # six values, not seven
    with open_kv_store(
        root, MODEL, memory_bytes=0, disk_bytes=capacity, eviction="prefix"
    ) as store:
        chain_a = [key(i) for i in range(3)]
        chain_b = [key(i) for i in range(10, 13)]
        store.batched_put(chain_a, [big(i) for i in range(3)], chain=True)
        store.batched_put(chain_b, [big(i) for i in range(3)], chain=True)
        store.put(key(99), big(9))  # room for one more: a suffix goes, not a prefix
        assert store.lookup_prefix(chain_a) + store.lookup_prefix(chain_b) == 5
        assert store.contains(chain_a[0]) and store.contains(chain_b[0])
        assert not store.contains(chain_a[2])  # the least recent chain's tail
    with open_kv_store(
        root / "lru", MODEL, memory_bytes=0, disk_bytes=capacity, eviction="lru"
    ) as lru:
        lru.batched_put(chain_a, [big(i) for i in range(3)], chain=True)
        lru.batched_put(chain_b, [big(i) for i in range(3)], chain=True)
        lru.put(key(99), big(9))
        assert not lru.contains(chain_a[0])  # plain LRU drops the head: the chain is dead
        assert lru.lookup_prefix(chain_a) == 0


READ_SCRIPT = """
import sys, torch, numpy as np
from persisting.kv import open_kv_store
store = open_kv_store(sys.argv[1], {model!r}, memory_bytes=0, disk_bytes=64 << 20)
from tests.kv.kv_helpers import key, tensor
t = store.get(key(1)); a = store.get(key(2, dtype="float64"))
want_a = np.arange(1000, dtype=np.float64).reshape(2, 10, 50)
same_t = t is not None and torch.equal(t.view(torch.int16), tensor(1).view(torch.int16))
print("T", "none" if t is None else (t.dtype if same_t else "WRONG"))
print("A", "none" if a is None else int(np.array_equal(a, want_a)))
print("C", store.stats().get("corruptions"))
store.close()
"""


def run_reader(root: Path) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent))
    out = subprocess.run(
        [sys.executable, "-c", READ_SCRIPT.format(model=MODEL), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def test_bit_exact_round_trip_through_a_fresh_process(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as store:
        store.put(key(1), tensor(1))
        array = np.arange(1000, dtype=np.float64).reshape(2, 10, 50)
        store.put(key(2, dtype="float64"), array, fmt="KV_2TD")
    lines = run_reader(root)
    assert lines[0] == "T torch.bfloat16"
    assert lines[1] == "A 1"


def test_flipped_payload_byte_is_a_miss_counted_and_dropped(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=64 * MiB) as store:
        store.put(key(1), tensor(1))
        array = np.arange(1000, dtype=np.float64).reshape(2, 10, 50)
        store.put(key(2, dtype="float64"), array, fmt="KV_2TD")
    victim = next(p for p in payload_files(root) if p.stat().st_size > HEADER_BYTES + 8000)
    with open(victim, "r+b") as f:
        f.seek(HEADER_BYTES + 1234)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 1234)
        f.write(bytes([byte[0] ^ 0x40]))
    lines = run_reader(root)
    assert lines[0] == "T none"
    assert lines[1] == "A 1"  # the rest still serves
    assert lines[2] == "C 1"
    assert not victim.exists()  # the bad object is dropped


def test_truncated_or_deleted_payload_files_are_misses(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.batched_put([key(i) for i in range(3)], [tensor(i) for i in range(3)])
        files = payload_files(root)
        os.truncate(files[0], HEADER_BYTES + 10)
        os.unlink(files[1])
        results = [store.get(key(i)) for i in range(3)]
        assert sum(r is None for r in results) == 2
        hit = next(r for r in results if r is not None)
        assert any(torch.equal(hit, tensor(i)) for i in range(3))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as reopened:
        assert reopened.stats()["disk_items"] == 1


def test_index_comes_from_metadata_and_orphans_are_adopted(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.batched_put([key(i) for i in range(4)], [tensor(i) for i in range(4)])
    meta = lance.dataset(str(StorageRoot(root).kv_path(MODEL) / "meta.lance"))
    rows = meta.to_table(columns=["key", "nbytes", "dtype", "fmt"]).to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(str(key(i)) for i in range(4))
    desc = meta.to_table(columns=["payload"]).column("payload").to_pylist()
    assert all(d["position"] == HEADER_BYTES and d["blob_uri"].startswith("file://") for d in desc)
    # A payload file whose metadata row never got committed (crash) is found again.
    meta.delete(f"key = '{key(3)}'")
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        assert store.stats()["recovered_files"] == 1
        assert torch.equal(store.get(key(3)), tensor(3))


@pytest.mark.parametrize("damage", ["delete_manifests", "garble_manifest", "delete_data"])
def test_damaged_metadata_rebuilds_from_payload_headers(root: Path, damage: str) -> None:
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.batched_put([key(i) for i in range(3)], [tensor(i) for i in range(3)])
    meta = StorageRoot(root).kv_path(MODEL) / "meta.lance"
    if damage == "delete_manifests":
        for p in (meta / "_versions").iterdir():
            p.unlink()
    elif damage == "garble_manifest":
        newest = min((meta / "_versions").glob("*.manifest"), key=lambda p: int(p.stem))
        newest.write_bytes(b"\x00garbage" * 10)
    else:
        for p in (meta / "data").iterdir():
            p.unlink()
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        assert [torch.equal(store.get(key(i)), tensor(i)) for i in range(3)] == [True] * 3
        store.put(key(5), tensor(5))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        assert store.lookup_prefix([key(0), key(1), key(2)]) == 3 and store.contains(key(5))


def test_a_chunk_removed_behind_the_index_is_written_again_by_the_next_put(root: Path) -> None:
    """Another process took the file (a writer of another namespace making room in the
    root) before this one refreshed: the next put of that key stores it, never reports it
    already stored while nothing is on disk."""
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=16 * MiB) as store:
        assert store.put(key(1), tensor(1)).stored
        (taken,) = payload_files(root)
        taken.unlink()
        assert store.put(key(1), tensor(1)).stored
        assert torch.equal(store.get(key(1)), tensor(1))
