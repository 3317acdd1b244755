"""The scheduler's answers from memory (BlockCatalog), over real KV stores sharing a root:
what another store (another engine) writes is found by a rescan, and a block whose load
failed is a miss until stored afresh, by this engine or another."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from persisting.integrations.vllm.catalog import BlockCatalog
from persisting.integrations.vllm.namespace import block_key
from persisting.kv import KVStore, open_kv_store

NAMESPACE = "vllm.test.0123456789abcdef"


def key(i: int) -> str:
    return block_key(NAMESPACE, i.to_bytes(32, "big"), 0, "bfloat16")


def store_of(root: Path) -> KVStore:
    return open_kv_store(root, NAMESPACE, memory_bytes=0, disk_bytes="64MiB", fsync=False)


def put(store: KVStore, i: int, fill: int = 1) -> None:
    store.put(key(i), np.full(4096, fill, np.uint8), fmt="binary", check_shape=False)


def test_stores_are_hits_and_rescans_find_another_engines_blocks(tmp_path: Path) -> None:
    mine, theirs = store_of(tmp_path), store_of(tmp_path)
    catalog = BlockCatalog(mine, refresh_interval_s=3600)
    try:
        assert catalog.claim_stores([key(1), key(1), key(2)]) == [key(1), key(2)]
        assert catalog.lookup(key(1)) == "pending"  # being stored by this engine
        assert catalog.claim_stores([key(1)]) == []
        put(mine, 1)
        catalog.stored([key(1)])
        catalog.stored([key(2)], ok=False)
        assert (catalog.lookup(key(1)), catalog.lookup(key(2))) == ("hit", "miss")
        put(theirs, 3)
        assert catalog.lookup(key(3)) == "miss"
        catalog.refresh()
        assert catalog.lookup(key(3)) == "hit"
    finally:
        catalog.close()
        mine.close()
        theirs.close()


def test_a_failed_block_is_a_miss_until_stored_afresh(tmp_path: Path) -> None:
    mine, theirs = store_of(tmp_path), store_of(tmp_path)
    gone: list[str] = []
    put(mine, 1)
    put(mine, 2)
    catalog = BlockCatalog(mine, refresh_interval_s=3600, on_gone=gone.extend)
    try:
        catalog.fail([key(1), key(2)])
        assert gone == [key(1), key(2)]
        catalog.refresh()  # its file is still there: still a miss
        assert catalog.lookup(key(1)) == "miss"
        # Stored afresh by this engine: offered again.
        catalog.stored([key(1)])
        assert catalog.lookup(key(1)) == "hit"
        # Stored afresh by another engine (a new file for the key): offered after a rescan.
        theirs.refresh()
        assert theirs.remove(key(2))
        put(theirs, 2, fill=2)
        catalog.refresh()
        assert catalog.lookup(key(2)) == "hit"
    finally:
        catalog.close()
        mine.close()
        theirs.close()


def test_blocks_removed_elsewhere_are_told_gone(tmp_path: Path) -> None:
    mine, theirs = store_of(tmp_path), store_of(tmp_path)
    put(mine, 1)
    put(mine, 2)
    gone: list[str] = []
    catalog = BlockCatalog(mine, refresh_interval_s=3600, on_gone=gone.extend)
    try:
        theirs.refresh()
        assert theirs.remove(key(1))
        catalog.refresh()
        catalog.forget([key(2), key(9)])  # an evict event (9 was never here)
        assert gone == [key(1), key(2)]
        assert catalog.lookup(key(1)) == catalog.lookup(key(2)) == "miss"
    finally:
        catalog.close()
        mine.close()
        theirs.close()
