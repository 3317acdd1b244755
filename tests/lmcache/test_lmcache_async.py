"""The asynchronous loading path: get_non_blocking, batched_async_contains, prefetch."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from lmcache.v1.event_manager import EventType
from lmcache.v1.storage_backend.storage_manager import StorageManager

from tests.lmcache.lmcache_harness import (
    CHUNK,
    PLUGIN,
    filled,
    key,
    make_config,
    payload,
    plugin_of,
    same_bytes,
    storage_manager,
)
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(120)


def on_loop(manager: StorageManager, coro):  # type: ignore[no-untyped-def]
    """Run a plugin coroutine on the StorageManager's event loop, as LMCache does."""
    return asyncio.run_coroutine_threadsafe(coro, manager.loop).result(timeout=30)


def store_chunks(manager: StorageManager, indices: list[int]) -> None:
    plugin = plugin_of(manager)
    objs = [filled(manager, i) for i in indices]
    plugin.batched_submit_put_task([key(i) for i in indices], objs)
    plugin.flush()
    for obj in objs:
        obj.ref_count_down()
    manager.clear(locations=["LocalCPUBackend"])


def test_get_non_blocking_returns_a_future_of_the_chunk(manager: StorageManager) -> None:
    store_chunks(manager, [1])
    plugin = plugin_of(manager)
    future = plugin.get_non_blocking(key(1))
    assert future is not None
    obj = future.result(timeout=30)
    assert same_bytes(obj.tensor, payload(1, obj.tensor.shape, obj.tensor.dtype))
    obj.ref_count_down()
    assert plugin.get_non_blocking(key(2)) is None


def test_lookup_pins_are_released_by_the_load_of_the_same_lookup(
    manager: StorageManager,
) -> None:
    store_chunks(manager, [0, 1, 2, 4])
    plugin = plugin_of(manager)
    keys = [key(i) for i in range(5)]
    assert on_loop(manager, plugin.batched_async_contains("req-1", keys, pin=True)) == 3
    assert not plugin.remove(keys[0], force=False)  # pinned by the lookup
    objs = on_loop(manager, plugin.batched_get_non_blocking("req-1", keys[:3]))
    assert len(objs) == 3
    for i, obj in enumerate(objs):
        assert same_bytes(obj.tensor, payload(i, obj.tensor.shape, obj.tensor.dtype))
        assert obj.get_ref_count() == 1  # the caller's reference only
        obj.ref_count_down()
    assert plugin.remove(keys[0], force=False)  # the lookup's pins are gone
    assert on_loop(manager, plugin.batched_async_contains("req-2", keys[1:], pin=False)) == 2
    assert on_loop(manager, plugin.batched_get_non_blocking("req-2", keys[3:])) == []


class SchedulerInbox:
    """Stand-in for the scheduler side of LMCache's async lookup channel (a ZMQ server)."""

    def __init__(self) -> None:
        self.responses: dict[str, int] = {}

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        self.responses[lookup_id] = retrieved_length


def test_storage_manager_prefetches_the_hit_prefix_from_the_plugin(root: Path) -> None:
    config = make_config(root)
    config.enable_async_loading = True
    with storage_manager(config) as manager:
        inbox = SchedulerInbox()
        manager.async_lookup_server = inbox  # type: ignore[assignment]
        store_chunks(manager, [0, 1, 2, 4])
        keys = [key(i) for i in range(5)]
        lengths = [CHUNK * i for i in range(6)]
        on_loop(manager, manager.async_lookup_and_prefetch("req-9", keys, lengths, pin=True))
        wait_until(lambda: "req-9" in inbox.responses, "prefetch")
        assert inbox.responses["req-9"] == 3 * CHUNK
        (tier,) = manager.event_manager.pop_event(EventType.LOADING, "req-9").result()
        assert [k for k, _obj in tier] == keys[:3]
        for i, (_k, obj) in enumerate(tier):
            assert same_bytes(obj.tensor, payload(i, obj.tensor.shape, obj.tensor.dtype))
            obj.ref_count_down()
        assert plugin_of(manager).remove(keys[0], force=False)  # no pin left behind
        assert manager.contains(keys[1]) == PLUGIN
