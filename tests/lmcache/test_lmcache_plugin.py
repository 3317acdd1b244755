"""PersistingKVBackend inside real LMCache: loading, store/lookup/get, pins, removal, puts."""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend import CreateStorageBackends
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface
from lmcache.v1.storage_backend.storage_manager import StorageManager

from persisting.kv import open_kv_store
from persisting.lance_store import StorageRoot
from persisting.lmcache_backend import PersistingKVBackend
from tests.kv.kv_helpers import disk_tier
from tests.lmcache.lmcache_harness import (
    MODEL,
    PLUGIN,
    cpu_of,
    filled,
    key,
    make_config,
    make_metadata,
    payload,
    plugin_of,
    same_bytes,
    storage_manager,
)
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(120)


def hold_writers(plugin: PersistingKVBackend, gate: threading.Event) -> None:
    """Occupy every writer thread until ``gate`` is set, so submitted puts stay in flight."""
    started = threading.Barrier(plugin.options.io_threads + 1)

    def block() -> None:
        started.wait()
        gate.wait()

    for _ in range(plugin.options.io_threads):
        plugin.puts.pool.submit(block)
    started.wait(timeout=10)


def put_and_wait(manager: StorageManager, keys, objs) -> None:  # type: ignore[no-untyped-def]
    """StorageManager.batched_put (what LMCacheEngine.store calls), then wait for the plugin."""
    manager.batched_put(keys, objs)
    plugin = plugin_of(manager)
    wait_until(lambda: not any(plugin.exists_in_put_tasks(k) for k in keys), "puts")
    plugin.flush()


def test_plugin_is_created_from_config_by_create_storage_backends(root: Path) -> None:
    config, metadata = make_config(root), make_metadata()
    loop = asyncio.new_event_loop()
    backends: OrderedDict = OrderedDict()
    try:
        backends = CreateStorageBackends(config, metadata, loop, dst_device="cpu")
        assert list(backends) == ["LocalCPUBackend", PLUGIN]
        plugin = backends[PLUGIN]
        assert isinstance(plugin, StoragePluginInterface)
        assert plugin.local_cpu_backend is backends["LocalCPUBackend"]
        assert plugin.get_allocator_backend() is backends["LocalCPUBackend"]
        assert plugin.settings.storage_path == root
        assert plugin.settings.kv.chunk_size == config.chunk_size
        # The namespace is the model name, kept whole: meta-llama/Llama-3-8B is one directory.
        assert StorageRoot(root).list_models() == [MODEL]
    finally:
        for backend in backends.values():
            backend.close()
        loop.close()


def test_a_plugin_that_fails_to_load_is_only_logged_so_presence_must_be_asserted(
    root: Path,
) -> None:
    config = make_config(root, no_such_setting=1)  # an unknown persisting.* key
    with storage_manager(config) as manager:
        assert PLUGIN not in manager.storage_backends
        with pytest.raises(AssertionError, match="plugin not loaded"):
            plugin_of(manager)


def test_store_clear_cpu_tier_then_contains_and_get_bit_exact(manager: StorageManager) -> None:
    keys = [key(i) for i in range(6)]
    objs = [filled(manager, i) for i in range(6)]
    want = [obj.tensor.clone() for obj in objs]
    put_and_wait(manager, keys, objs)
    manager.clear(locations=["LocalCPUBackend"])
    assert all(manager.contains(k) == PLUGIN for k in keys)
    hits, mapping = manager.batched_contains(keys)
    assert hits == 6 and list(mapping) == [PLUGIN]

    plugin = plugin_of(manager)
    one = manager.get(keys[0], location=PLUGIN)
    assert one is not None and same_bytes(one.tensor, want[0])
    assert one.metadata.fmt == MemoryFormat.KV_2LTD and one.get_shape() == want[0].shape
    got = manager.batched_get(keys, location=PLUGIN)
    assert all(g is not None and same_bytes(g.tensor, w) for g, w in zip(got, want, strict=True))
    for obj in [one, *got]:
        obj.ref_count_down()
    # LMCache writes plugin hits back to its CPU tier; the plugin's copies stay.
    assert manager.contains(keys[1]) == "LocalCPUBackend"
    assert plugin.batched_contains(keys) == 6
    stats = plugin.stats()["stores"][MODEL]
    assert stats["get_hit"] >= 7 and stats["corruptions"] == 0


def test_batched_contains_and_batched_get_stop_at_the_first_miss(
    manager: StorageManager,
) -> None:
    plugin = plugin_of(manager)
    keys = [key(i) for i in range(5)]
    objs = [filled(manager, i) for i in range(5)]
    put_and_wait(manager, [keys[0], keys[1], keys[3]], [objs[0], objs[1], objs[3]])
    assert plugin.batched_contains(keys) == 2
    got = plugin.batched_get_blocking(keys)
    assert [g is not None for g in got] == [True, True, False, False, False]
    assert same_bytes(got[1].tensor, payload(1, got[1].tensor.shape, torch.bfloat16))
    for obj in [*got[:2], objs[2], objs[4]]:
        obj.ref_count_down()
    assert plugin.batched_get_blocking([keys[2], keys[3]]) == [None, None]


def test_puts_are_asynchronous_hold_references_and_report_every_key(root: Path) -> None:
    with storage_manager(make_config(root, durability="sync")) as manager:
        plugin = plugin_of(manager)
        cpu = cpu_of(manager)
        keys = [key(i) for i in range(4)]
        objs = [filled(cpu, i) for i in range(4)]
        completed: list = []
        gate = threading.Event()
        hold_writers(plugin, gate)
        futures = plugin.batched_submit_put_task(keys, objs, on_complete_callback=completed.append)
        assert futures is not None and len(futures) == 4
        assert all(isinstance(f, Future) and not f.done() for f in futures)
        assert [o.get_ref_count() for o in objs] == [2, 2, 2, 2]  # caller's + in flight
        assert all(plugin.exists_in_put_tasks(k) for k in keys)
        assert not plugin.contains(keys[0])
        # A second submission of an in-flight key joins it instead of writing twice.
        again = plugin.batched_submit_put_task(
            keys[:1], objs[:1], on_complete_callback=completed.append
        )
        assert again == [futures[0]] and objs[0].get_ref_count() == 2
        gate.set()
        for f in futures:
            assert f.result(timeout=30) is None
        wait_until(lambda: len(completed) == 5, "callbacks")
        assert sorted(k.chunk_hash for k in completed) == sorted(
            [k.chunk_hash for k in keys] + [keys[0].chunk_hash]
        )
        assert [o.get_ref_count() for o in objs] == [1, 1, 1, 1]  # released on completion
        assert not any(plugin.exists_in_put_tasks(k) for k in keys)
        # Already stored: nothing to write, None returned, the callback still fires.
        late: list = []
        assert plugin.batched_submit_put_task(keys, objs, on_complete_callback=late.append) is None
        assert late == keys
        for o in objs:
            o.ref_count_down()


def test_a_failed_put_releases_its_reference_and_fires_no_callback(
    manager: StorageManager,
) -> None:
    plugin = plugin_of(manager)
    allocator = AdHocMemoryAllocator(device="cpu")
    # Two layer groups in one object: Persisting cannot describe it with one layout.
    bad = allocator.allocate(
        [torch.Size([2, 2, 16, 64]), torch.Size([2, 2, 16, 32])],
        [torch.bfloat16, torch.bfloat16],
    )
    good = filled(cpu_of(manager), 7)
    # A model name with '@' shifts every field of the key string: refused up front.
    odd = key(9, model="org@odd/model")
    completed: list = []
    futures = plugin.batched_submit_put_task(
        [key(8), key(7), odd], [bad, good, good], on_complete_callback=completed.append
    )
    assert futures is not None and len(futures) == 3
    with pytest.raises(Exception, match="layer groups"):
        futures[0].result(timeout=30)
    assert futures[1].result(timeout=30) is None
    with pytest.raises(Exception, match="key"):
        futures[2].result(timeout=30)
    wait_until(lambda: bad.get_ref_count() == 1 and good.get_ref_count() == 1, "release")
    assert [k.chunk_hash for k in completed] == [key(7).chunk_hash]
    assert not plugin.contains(key(8)) and plugin.contains(key(7))
    assert not plugin.contains(odd) and plugin.get_blocking(odd) is None
    assert plugin.stats()["put_failed"] == 2
    bad.ref_count_down()
    good.ref_count_down()


def test_pins_are_counted_and_a_pinned_chunk_survives_a_soft_remove(
    manager: StorageManager,
) -> None:
    plugin = plugin_of(manager)
    k = key(1)
    put_and_wait(manager, [k], [filled(manager, 1)])
    assert not plugin.pin(key(2)) and not plugin.unpin(key(2))
    assert plugin.contains(k, pin=True)  # lookup pin (what vLLM's lookup does)
    assert plugin.pin(k)
    assert plugin.unpin(k)
    assert not plugin.remove(k, force=False)  # still pinned once
    assert plugin.unpin(k)
    assert not plugin.unpin(k)  # no pin left to release
    assert plugin.remove(k, force=False)
    assert not plugin.contains(k) and not plugin.remove(k)
    put_and_wait(manager, [k], [filled(manager, 1)])
    assert plugin.pin(k) and plugin.remove(k, force=True)  # a forced remove ignores pins
    assert plugin.get_blocking(k) is None
    assert manager.remove(key(3)) == 0


def test_a_full_allocator_is_a_miss_not_a_hang(root: Path) -> None:
    metadata = make_metadata(kv_shape=(4, 2, 256, 8, 128))  # 4 MiB chunks
    config = make_config(root, cpu_gb=0.02, chunk_size=256)  # a ~20 MiB CPU pool
    with storage_manager(config, metadata) as manager:
        plugin = plugin_of(manager)
        cpu = cpu_of(manager)
        keys = [key(i) for i in range(3)]
        objs = [filled(cpu, i, metadata) for i in range(3)]
        want = [obj.tensor.clone() for obj in objs]
        plugin.batched_submit_put_task(keys, objs)
        plugin.flush()
        for obj in objs:
            obj.ref_count_down()
        held = []  # references we keep: the pool cannot evict these
        while extra := cpu.allocate(metadata.get_shapes(), metadata.get_dtypes(), busy_loop=False):
            held.append(extra)
        assert held
        assert plugin.get_blocking(keys[0]) is None
        assert plugin.batched_get_blocking(keys) == [None, None, None]
        assert plugin.stats()["allocation_failed"] >= 2
        for obj in held:
            obj.ref_count_down()
        got = plugin.batched_get_blocking(keys)
        assert all(
            g is not None and same_bytes(g.tensor, w) for g, w in zip(got, want, strict=True)
        )
        for obj in got:
            obj.ref_count_down()
        assert cpu.get_memory_allocator().memcheck()


def test_two_workers_sharing_a_root_are_kept_apart(root: Path) -> None:
    md0, md1 = make_metadata(worker_id=0, world_size=2), make_metadata(worker_id=1, world_size=2)
    with (
        storage_manager(make_config(root), md0) as m0,
        storage_manager(make_config(root), md1) as m1,
    ):
        k0, k1 = key(5, worker_id=0, world_size=2), key(5, worker_id=1, world_size=2)
        put_and_wait(m0, [k0], [filled(m0, 100, md0)])
        put_and_wait(m1, [k1], [filled(m1, 101, md1)])
        p0, p1 = plugin_of(m0), plugin_of(m1)
        assert p0.contains(k0) and not p0.contains(k1)
        assert p1.contains(k1) and not p1.contains(k0)
        g0, g1 = p0.get_blocking(k0), p1.get_blocking(k1)
        assert same_bytes(g0.tensor, payload(100, g0.tensor.shape, torch.bfloat16))
        assert same_bytes(g1.tensor, payload(101, g1.tensor.shape, torch.bfloat16))
        assert not same_bytes(g0.tensor, g1.tensor)
        g0.ref_count_down()
        g1.ref_count_down()


def test_a_stored_layout_that_does_not_match_the_request_is_a_miss(root: Path) -> None:
    # Another deployment of the same model name wrote chunks with 2 layers, not 4.
    other = make_metadata(kv_shape=(2, 2, 16, 2, 32))
    with storage_manager(make_config(root), other) as manager:
        put_and_wait(manager, [key(1)], [filled(manager, 1, other)])
    # A chunk whose bytes are half precision under a key that says bfloat16.
    with open_kv_store(root, MODEL) as store:
        # (written as another system would: a plain put refuses a dtype its key does not name)
        store.put(key(2).to_string(), payload(2, (2, 4, 16, 64), torch.float16), check_shape=False)
    with storage_manager(make_config(root)) as manager:
        plugin = plugin_of(manager)
        for k in (key(1), key(2)):
            assert not plugin.contains(k) and plugin.get_blocking(k) is None
        assert manager.contains(key(1)) is None
        assert plugin.batched_contains([key(1)]) == 0
        assert plugin.stats()["layout_mismatch"] >= 4
        # The engine's own chunks under the same root are hits.
        put_and_wait(manager, [key(3)], [filled(manager, 3)])
        assert plugin.contains(key(3))


def test_close_waits_for_in_flight_puts(root: Path) -> None:
    with storage_manager(make_config(root, durability="sync")) as manager:
        plugin = plugin_of(manager)
        gate = threading.Event()
        hold_writers(plugin, gate)
        objs = [filled(manager, i) for i in range(3)]
        plugin.batched_submit_put_task([key(i) for i in range(3)], objs)
        threading.Timer(0.3, gate.set).start()
        plugin.close()  # returns only once the puts are written
        assert [o.get_ref_count() for o in objs] == [1, 1, 1]
        plugin.close()  # idempotent
        for obj in objs:
            obj.ref_count_down()
    with open_kv_store(root, MODEL) as store:
        assert store.lookup_prefix([key(i).to_string() for i in range(3)]) == 3


def test_closing_lmcache_with_puts_in_flight_writes_them_before_the_pool_is_freed(
    root: Path,
) -> None:
    # StorageManager.close frees LocalCPUBackend's arena before it closes plugins.
    with storage_manager(make_config(root, durability="sync")) as manager:
        plugin = plugin_of(manager)
        gate = threading.Event()
        hold_writers(plugin, gate)
        objs = [filled(manager, 40 + i) for i in range(3)]
        keys = [key(40 + i) for i in range(3)]
        manager.batched_put(keys, objs)  # the caller's references are dropped here
        threading.Timer(0.3, gate.set).start()
    with storage_manager(make_config(root)) as manager:
        got = plugin_of(manager).batched_get_blocking(keys)
        for i, obj in enumerate(got):
            assert obj is not None
            assert same_bytes(obj.tensor, payload(40 + i, obj.tensor.shape, obj.tensor.dtype))
            obj.ref_count_down()


def test_a_batch_is_stored_as_a_chain_so_prefix_eviction_drops_suffixes_first(
    root: Path,
) -> None:
    with storage_manager(make_config(root, eviction="prefix", durability="sync")) as manager:
        keys = [key(i) for i in range(4)]
        put_and_wait(manager, keys, [filled(manager, i) for i in range(4)])
        disk = disk_tier(plugin_of(manager).store_for(keys[0]))
        parents = [disk.entry(k.to_string()).parent for k in keys]
        assert parents == [None, *[k.to_string() for k in keys[:3]]]
