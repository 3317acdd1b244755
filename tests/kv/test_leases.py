"""Read leases are counted in the store (issue 38, item 4): each ``lease`` returns a token
its ``release`` ends, so one holder giving its lease back never clears another's, and a
lease keeps its file from eviction until it is released or its TTL passes (on the store's
clock, moved by hand here)."""

from __future__ import annotations

from pathlib import Path

import torch

from persisting.kv import KVStore, open_kv_store
from tests.kv.kv_helpers import MODEL, OVERHEAD_ROOM, big, key
from tests.timing import ManualClock

MiB = 1 << 20


def small_store(root: Path, clock: ManualClock) -> KVStore:
    """Room for three 1 MiB values on disk, none in memory: a fourth evicts one (the least
    recently used: LRU, so which one goes depends on recency alone, not on reads)."""
    return open_kv_store(
        root,
        MODEL,
        memory_bytes=0,
        disk_bytes=3 * MiB + 3 * 4096 + OVERHEAD_ROOM,
        clock=clock,
        eviction="lru",
    )


def leases(store: KVStore) -> int:
    """Read leases the store holds now (one key is leased here)."""
    return int(store.stats()["disk_leases"])


def fill(store: KVStore, start: int, count: int) -> None:
    for i in range(start, start + count):
        store.put(key(i), big(i))


def test_a_release_ends_only_its_own_lease(root: Path) -> None:
    clock = ManualClock()
    with small_store(root, clock) as store:
        fill(store, 0, 3)
        first = store.lease(key(0), 30.0)
        second = store.lease(key(0), 30.0)
        assert first is not None and second is not None and first.token != second.token
        assert leases(store) == 2
        assert store.release(key(0), first.token)
        assert not store.release(key(0), first.token)  # already ended
        assert leases(store) == 1
        fill(store, 3, 3)  # evicts every value but the one still leased
        assert torch.equal(store.get(key(0)), big(0))
        assert store.release(key(0), second.token) and leases(store) == 0
        fill(store, 6, 3)
        assert not store.contains(key(0))  # no lease left: evicted like the others
        assert not store.release(key(0), second.token)


def test_a_lease_holds_until_its_ttl_and_a_renewal_pushes_it_out(root: Path) -> None:
    clock = ManualClock()
    with small_store(root, clock) as store:
        fill(store, 0, 3)
        lease = store.lease(key(0), 10.0)
        assert lease is not None
        clock.advance(8.0)
        assert store.renew(key(0), lease.token, 10.0)  # now good until 18 s from the start
        clock.advance(8.0)
        fill(store, 3, 3)
        assert store.contains(key(0)) and leases(store) == 1
        clock.advance(3.0)  # past the renewed deadline
        assert leases(store) == 0
        fill(store, 6, 3)
        assert not store.contains(key(0))
        assert not store.renew(key(0), lease.token, 10.0)


def test_a_lease_without_a_ttl_only_says_where_the_bytes_are(root: Path) -> None:
    with small_store(root, ManualClock()) as store:
        fill(store, 0, 3)
        where = store.lease(key(0), 0.0)
        assert where is not None and Path(where.path).is_file()
        assert leases(store) == 0
        fill(store, 3, 3)
        assert not store.contains(key(0))
