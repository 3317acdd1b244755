"""One disk budget for the whole root: a namespace per layout or weights version cannot
grow it past what the operator set (issue 40). Idle namespaces give way, oldest first;
live ones never evict each other."""

from __future__ import annotations

import os
from pathlib import Path

from persisting.kv import open_kv_store
from persisting.lance_store import disk_usage

MiB = 1 << 20
BUDGET = 16 * MiB


def fill(store, model: str, count: int, start: int = 0) -> None:
    for i in range(start, start + count):
        store.put(f"{model}@1@0@{i:x}@bfloat16", os.urandom(MiB), fmt="binary")
    store.flush()


def open_ns(root: Path, model: str):
    return open_kv_store(root, model, memory_bytes=0, disk_bytes=BUDGET)


def kv_bytes(root: Path) -> int:
    return disk_usage(root / "kv")


def test_an_idle_namespace_gives_way_to_a_live_one(root: Path) -> None:
    """An engine restarted with another dtype: the old namespace is idle, and the new one
    may use the whole budget -- the old is dropped once it is in the way, not before."""
    with open_ns(root, "old-layout") as old:
        fill(old, "old-layout", 10)
    with open_ns(root, "new-layout") as new:
        fill(new, "new-layout", 4)
        assert (root / "kv" / "old-layout").is_dir()  # room enough: nothing dropped yet
        fill(new, "new-layout", 10, start=4)
        assert not (root / "kv" / "old-layout").exists()
        assert new.stats()["disk_items"] == 14
        assert kv_bytes(root) <= 1.05 * BUDGET


def test_the_oldest_idle_namespace_goes_first(root: Path) -> None:
    for name in ("first", "second"):
        with open_ns(root, name) as store:
            fill(store, name, 6)
    with open_ns(root, "third") as store:
        fill(store, "third", 6)
    assert not (root / "kv" / "first").exists()
    assert (root / "kv" / "second").is_dir() and (root / "kv" / "third").is_dir()
    assert kv_bytes(root) <= 1.05 * BUDGET


def test_live_namespaces_never_evict_each_other(root: Path) -> None:
    """Two models served from one root: the second keeps within what the first leaves."""
    with open_ns(root, "a") as a, open_ns(root, "b") as b:
        fill(a, "a", 10)
        fill(b, "b", 12)  # only ~6 fit beside a's 10
        assert a.stats()["disk_items"] == 10
        assert 3 <= b.stats()["disk_items"] <= 6
        assert kv_bytes(root) <= 1.05 * BUDGET
        # b's newest chunks are the ones kept (it evicted its own oldest)
        assert b.contains("b@1@0@b@bfloat16")
