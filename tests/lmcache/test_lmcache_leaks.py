"""Nothing the plugin takes is kept: lookup pins and MemoryObj references (issue 13 item 10).

References are counted by LMCache's own allocator (its active allocations); I/O errors are
real ones (a chunk's payload file replaced by a directory reads as EISDIR).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

import pytest
from lmcache.v1.storage_backend.storage_manager import StorageManager

from persisting.integrations.lmcache import PersistingKVBackend
from tests.kv.kv_helpers import make_uncreatable
from tests.lmcache.lmcache_harness import (
    cpu_of,
    filled,
    key,
    make_config,
    payload,
    plugin_of,
    same_bytes,
    storage_manager,
)
from tests.timing import ManualClock

pytestmark = pytest.mark.timeout(120)


def on_loop(manager: StorageManager, coro):  # type: ignore[no-untyped-def]
    return asyncio.run_coroutine_threadsafe(coro, manager.loop).result(timeout=30)


def active_allocations(manager: StorageManager) -> int:
    """MemoryObjs LMCache's CPU allocator has handed out and not had back."""
    return int(cpu_of(manager).get_memory_allocator().pin_allocator.num_active_allocations)


def store_chunks(manager: StorageManager, indices: list[int]) -> None:
    """Chunks in the plugin only (LMCache's CPU tier holds no copy)."""
    plugin = plugin_of(manager)
    objs = [filled(manager, i) for i in indices]
    plugin.batched_submit_put_task([key(i) for i in indices], objs)
    plugin.flush()
    for obj in objs:
        obj.ref_count_down()
    manager.clear(locations=["LocalCPUBackend"])
    assert active_allocations(manager) == 0


def break_payload_file(plugin: PersistingKVBackend, i: int) -> None:
    """Replace chunk ``i``'s payload file by a directory: reading it fails with EISDIR."""
    store = plugin.store_for(key(i))
    where = store.lease(key(i).to_string(), 1.0)
    assert where is not None
    store.release(key(i).to_string(), where.token)
    os.unlink(where.path)
    os.mkdir(where.path)


def soft_removable(plugin: PersistingKVBackend, i: int) -> bool:
    """True if nothing pins chunk ``i`` (a soft remove takes it); puts it back if so."""
    return plugin.remove(key(i), force=False)


@pytest.fixture
def disk_only(root: Path):  # type: ignore[no-untyped-def]
    """A plugin without a memory tier: every get reads the chunk's file."""
    with storage_manager(make_config(root, memory_bytes=0)) as manager:
        yield manager


# -- lookup pins ---------------------------------------------------------------------------


def test_pins_of_keys_a_lookup_did_not_load_are_released_by_its_load(
    manager: StorageManager,
) -> None:
    store_chunks(manager, [0, 1, 2])
    plugin = plugin_of(manager)
    keys = [key(i) for i in range(3)]
    assert on_loop(manager, plugin.batched_async_contains("req", keys, pin=True)) == 3
    objs = on_loop(manager, plugin.batched_get_non_blocking("req", keys[:1]))
    assert len(objs) == 1
    objs[0].ref_count_down()
    # The lookup is over: none of its three pins may outlive it.
    assert [soft_removable(plugin, i) for i in range(3)] == [True, True, True]


def test_pins_lmcache_releases_itself_are_not_released_twice(manager: StorageManager) -> None:
    store_chunks(manager, [0, 1, 2])
    plugin = plugin_of(manager)
    keys = [key(i) for i in range(3)]
    assert plugin.pin(keys[2])  # someone else's pin, held throughout
    assert on_loop(manager, plugin.batched_async_contains("req", keys, pin=True)) == 3
    # LMCache unpins a rounded-off tail itself (async_lookup_and_prefetch), then loads.
    assert plugin.unpin(keys[2])
    for obj in on_loop(manager, plugin.batched_get_non_blocking("req", keys[:2])):
        obj.ref_count_down()
    assert soft_removable(plugin, 0) and soft_removable(plugin, 1)
    assert not soft_removable(plugin, 2)  # the other pin is still there...
    assert plugin.unpin(keys[2]) and soft_removable(plugin, 2)  # ...until its owner unpins


def test_pins_of_a_lookup_that_is_never_loaded_expire(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with storage_manager(make_config(root, lookup_pin_ttl_s=60)) as manager:
        store_chunks(manager, [0, 1])
        plugin = plugin_of(manager)
        clock = ManualClock()  # the pins' clock: moved past the TTL, not waited through
        monkeypatch.setattr(plugin._lookup_pins, "_clock", clock)
        keys = [key(0), key(1)]
        assert on_loop(manager, plugin.batched_async_contains("gone", keys, pin=True)) == 2
        assert not soft_removable(plugin, 0)  # pinned while the lookup may still load
        clock.advance(61)
        # The next lookup finds the abandoned one expired and releases its pins.
        assert on_loop(manager, plugin.batched_async_contains("next", keys[1:], pin=False)) == 1
        assert soft_removable(plugin, 0) and soft_removable(plugin, 1)
        assert plugin.stats()["lookup_pins_expired"] == 2
        # A late load of the expired lookup releases nothing twice.
        assert on_loop(manager, plugin.batched_get_non_blocking("gone", keys)) == []


# -- MemoryObj references when a read fails ---------------------------------------------------


def test_a_failing_read_in_a_batch_leaks_no_memory_obj(disk_only: StorageManager) -> None:
    manager = disk_only
    store_chunks(manager, [0, 1, 2, 3])
    plugin = plugin_of(manager)
    break_payload_file(plugin, 2)
    got = plugin.batched_get_blocking([key(i) for i in range(4)])
    assert [g is not None for g in got] == [True, True, False, False]
    for i, obj in enumerate(got[:2]):
        assert obj is not None and same_bytes(
            obj.tensor, payload(i, obj.tensor.shape, obj.tensor.dtype)
        )
        obj.ref_count_down()
    assert active_allocations(manager) == 0


def test_a_failing_read_in_an_async_load_leaks_no_memory_obj(disk_only: StorageManager) -> None:
    manager = disk_only
    store_chunks(manager, [0, 1, 2, 3])
    plugin = plugin_of(manager)
    break_payload_file(plugin, 1)
    keys = [key(i) for i in range(4)]
    assert on_loop(manager, plugin.batched_async_contains("req", keys, pin=True)) == 4
    objs = on_loop(manager, plugin.batched_get_non_blocking("req", keys))
    assert len(objs) == 1 and same_bytes(
        objs[0].tensor, payload(0, objs[0].tensor.shape, objs[0].tensor.dtype)
    )
    objs[0].ref_count_down()
    assert active_allocations(manager) == 0
    assert [soft_removable(plugin, i) for i in (0, 2, 3)] == [True, True, True]


def test_an_io_error_is_a_counted_miss_logged_with_its_errno(
    disk_only: StorageManager, caplog: pytest.LogCaptureFixture
) -> None:
    manager = disk_only
    store_chunks(manager, [0])
    plugin = plugin_of(manager)
    break_payload_file(plugin, 0)
    with caplog.at_level(logging.WARNING, logger="persisting.lmcache"):
        assert plugin.get_blocking(key(0)) is None
    assert active_allocations(manager) == 0
    stats = plugin.stats()
    assert stats["io_errors"] == 1
    assert stats["last_io_error"]["errno"] == errno.EISDIR
    assert any(f"errno {errno.EISDIR}" in r.getMessage() for r in caplog.records)


def test_a_put_that_fails_with_an_io_error_is_counted_with_its_errno(
    disk_only: StorageManager,
) -> None:
    manager = disk_only
    plugin = plugin_of(manager)
    # Its new payload file cannot be created: ENOTDIR.
    make_uncreatable(plugin.store_for(key(0)).directory, key(0).to_string())
    obj = filled(manager, 0)
    (future,) = plugin.batched_submit_put_task([key(0)], [obj]) or []
    with pytest.raises(OSError):
        future.result(timeout=30)
    obj.ref_count_down()
    stats = plugin.stats()
    assert stats["put_failed"] == 1 and stats["io_errors"] == 1
    assert stats["last_io_error"]["errno"] == errno.ENOTDIR
    assert stats["last_io_error"]["op"] == "put"
    assert not plugin.contains(key(0))
