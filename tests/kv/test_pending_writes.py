"""Values on their way to disk: a remove wins over them, results never claim what did not
happen, the write-behind thread survives every failure, and write-back mode reports what
is not yet durable (issue 13, items 4, 5, 7 and 14)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from persisting.kv import KVStore, PutResult, open_kv_store
from tests.kv.kv_helpers import MODEL, disk_tier, in_flight, key, tensor
from tests.timing import finishes, wait_until

MiB = 1 << 20
VALUE_BYTES = tensor(0).numel() * 2


# -- item 4: a remove wins over a write in progress --------------------------------------


@pytest.mark.parametrize("batched", [False, True], ids=["remove", "batched_remove"])
def test_remove_after_async_put_stays_removed_also_after_reopen(root: Path, batched) -> None:
    keys = [key(i) for i in range(50)]
    with open_kv_store(
        root, MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as store:
        for i, k in enumerate(keys):
            store.put(k, tensor(i))
            if not batched:
                store.remove(k)
        if batched:
            assert store.batched_remove(keys) == len(keys)
        store.flush()
        assert not any(store.contains(k) for k in keys)
        assert not any(store.exists_in_put_tasks(k) for k in keys)
        assert store.stats()["disk_items"] == 0
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as again:
        assert not any(again.contains(k) for k in keys)
        assert again.stats()["disk_bytes"] == again.stats()["disk_overhead_bytes"]


def test_remove_wins_over_a_write_behind_already_writing(root: Path) -> None:
    """The writer is inside the disk write (waiting for the usage lock) when the remove
    comes: the file it then writes must not be published."""
    told: list[PutResult] = []
    with open_kv_store(
        root, MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as store:
        with disk_tier(store).usage.locked():  # the writer blocks at its reservation
            store.put(key(1), tensor(1), on_complete=told.append)
            wait_until(lambda: disk_tier(store).is_writing(str(key(1))), "inside the write")
            assert store.remove(key(1))
        store.flush()
        assert not store.contains(key(1))
        assert told == [PutResult(str(key(1)), "memory", False, stored=False)]
        assert in_flight(store.directory) == []
        payload_bytes = disk_tier(store).usage.get()
        assert payload_bytes == 0  # the unpublished file's reservation was given back
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as again:
        assert not again.contains(key(1))


def test_remove_wins_over_a_write_back_of_an_evicted_value(root: Path) -> None:
    with open_kv_store(
        root, MODEL, memory_bytes=2 * VALUE_BYTES, disk_bytes=64 * MiB, durability="write_back"
    ) as store:
        store.put(key(1), tensor(1))
        store.put(key(2), tensor(2))
        putter = threading.Thread(target=store.put, args=(key(3), tensor(3)))
        with disk_tier(store).usage.locked():  # key 1's write-back blocks at its reservation
            putter.start()
            # Key 1 has left memory: it is being written back, blocked at the reservation.
            wait_until(lambda: not store.in_memory(key(1)), "key 1 evicted")
            store.remove(key(1))
        putter.join(60)
        store.flush()
        assert not store.contains(key(1))
        assert store.contains(key(2)) and store.contains(key(3))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as again:
        assert not again.contains(key(1))
        assert torch.equal(again.get(key(2)), tensor(2))


def test_a_key_put_again_after_its_remove_is_stored(root: Path) -> None:
    with open_kv_store(
        root, MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    ) as store:
        store.put(key(1), tensor(1))
        store.remove(key(1))
        store.put(key(1), tensor(2))
        store.flush()
        assert torch.equal(store.get(key(1)), tensor(2))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as again:
        assert torch.equal(again.get(key(1)), tensor(2))


# -- item 5: stored=True only when something was stored -----------------------------------


@pytest.mark.parametrize("durability", ["async", "write_back"])
def test_put_into_a_memory_tier_full_of_pinned_chunks_says_not_stored(root, durability) -> None:
    told: list[PutResult] = []
    with open_kv_store(
        root, MODEL, memory_bytes=2 * VALUE_BYTES, disk_bytes=0, durability=durability
    ) as store:
        for i in (1, 2):
            assert store.put(key(i), tensor(i)).stored
            assert store.pin(key(i))
        result = store.put(key(3), tensor(3), on_complete=told.append)
        assert result.stored is False and result.durable is False
        assert not store.contains(key(3)) and store.get(key(3)) is None
        assert told == [result]
        assert store.stats()["put_not_stored"] == 1
        store.unpin(key(1))
        assert store.put(key(3), tensor(3)).stored  # room once a pin is gone
        assert torch.equal(store.get(key(3)), tensor(3))


# -- item 7: the write-behind thread survives --------------------------------------------


def test_a_raising_on_complete_does_not_kill_the_write_behind(root: Path) -> None:
    def explode(_result: PutResult) -> None:
        raise RuntimeError("a careless callback")

    good: list[PutResult] = []
    store = open_kv_store(
        root, MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    )
    try:
        store.put(key(1), tensor(1), on_complete=explode)
        assert finishes(store.flush), "flush hung: the write-behind thread died"
        store.put(key(2), tensor(2), on_complete=good.append)
        assert finishes(store.flush)
        assert [r.durable for r in good] == [True]
        stats = store.stats()
        assert stats["on_complete_errors"] == 1 and stats["disk_items"] == 2
    finally:
        assert finishes(store.close), "close hung"
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as again:
        assert torch.equal(again.get(key(1)), tensor(1))


def test_an_unexpected_write_error_fails_only_its_value(root: Path) -> None:
    told: list[PutResult] = []
    store = open_kv_store(
        root, MODEL, memory_bytes=64 * MiB, disk_bytes=64 * MiB, durability="async"
    )
    try:
        real_write = disk_tier(store).write
        broken = str(key(1))

        def write(items, *, durable, pause=None):  # a bug deep in the write path, one key only
            if any(it.key == broken for it in items):
                raise RuntimeError("unexpected failure")
            return real_write(items, durable=durable, pause=pause)

        disk_tier(store).write = write  # type: ignore[method-assign]
        store.batched_put([key(1), key(2)], [tensor(1), tensor(2)], on_complete=told.append)
        assert finishes(store.flush), "flush hung: the write-behind thread died"
        outcome = {r.key: (r.stored, r.durable) for r in told}
        assert outcome == {str(key(1)): (False, False), str(key(2)): (True, True)}
        assert store.stats()["writer_errors"] >= 1
        store.put(key(3), tensor(3))  # the writer is still there
        assert finishes(store.flush)
        assert store.stats()["disk_items"] == 2
        assert torch.equal(store.get(key(1)), tensor(1))  # still served from memory
    finally:
        assert finishes(store.close), "close hung"


# -- item 14: write-back mode says what is not yet durable ---------------------------------


def test_write_back_mode_reports_values_not_yet_on_disk(root: Path) -> None:
    told: list[PutResult] = []
    store: KVStore
    with open_kv_store(
        root, MODEL, memory_bytes=2 * VALUE_BYTES, disk_bytes=64 * MiB, durability="write_back"
    ) as store:
        for i in (1, 2):
            result = store.put(key(i), tensor(i), on_complete=told.append)
            assert (result.tier, result.durable, result.stored) == ("memory", False, True)
            assert store.exists_in_put_tasks(key(i))
        assert told == []  # nothing is on disk yet
        store.put(key(3), tensor(3), on_complete=told.append)  # evicts key 1: written back
        store.flush()  # by the write-behind, not on the putting thread
        assert told == [PutResult(str(key(1)), "disk", True, True)]
        assert not store.exists_in_put_tasks(key(1))
        assert store.exists_in_put_tasks(key(2)) and store.exists_in_put_tasks(key(3))
    assert sorted(r.key for r in told) == sorted(str(key(i)) for i in (1, 2, 3))
    assert all(r.durable and r.tier == "disk" for r in told)  # close wrote back the rest


def test_removing_a_dirty_write_back_value_tells_its_callback(root: Path) -> None:
    told: list[PutResult] = []
    with open_kv_store(
        root, MODEL, memory_bytes=4 * VALUE_BYTES, disk_bytes=64 * MiB, durability="write_back"
    ) as store:
        store.put(key(1), tensor(1), on_complete=told.append)
        assert store.remove(key(1))
        assert told == [PutResult(str(key(1)), "memory", False, stored=False)]
        assert not store.exists_in_put_tasks(key(1))
    assert len(told) == 1
