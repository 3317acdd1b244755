"""PersistingL2Adapter against LMCache 0.5.6's L2AdapterInterface contract.

Adapters come from LMCache's own config parsing and plugin factory; objects are LMCache
``TensorMemoryObj``s; completion is observed through the event fds, as LMCache's store
and prefetch controllers observe it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

from persisting.errors import ConfigError
from persisting.integrations.lmcache import PersistingL2Adapter, PersistingL2AdapterConfig
from persisting.integrations.lmcache.l2_io import layout_of
from persisting.integrations.lmcache.object_keys import object_key_of, object_key_text
from persisting.kv import key_string
from persisting.kv.disk.payload_files import file_size
from tests.lmcache.l2_harness import (
    MODEL,
    Recorder,
    adapter_json,
    bytes_of,
    du_bytes,
    l2_adapter,
    l2_config,
    load,
    lookup,
    object_key,
    payload,
    store,
    tensor_obj,
)
from tests.timing import ManualClock, wait_until

pytestmark = pytest.mark.timeout(120)
CHUNK_BYTES = 2 * 4 * 16 * 256 * 2


def test_lmcache_builds_the_adapter_from_its_plugin_config(root: Path) -> None:
    entry = adapter_json(root, capacity="1GiB", durability="sync", fsync=False)
    (config,) = l2_config(entry).adapters
    adapter = create_l2_adapter_from_registry(config)
    try:
        assert isinstance(adapter, PersistingL2Adapter)
        assert isinstance(adapter, L2AdapterInterface)
        assert isinstance(config.adapter_params, dict)  # LMCache's plugin config...
        params = adapter.params  # ...whose params went through our config class
        assert params.storage_path == root and params.capacity == 1 << 30
        assert params.fsync is False and params.namespace == "lmcache"
        assert adapter.supports_global_eviction
        assert adapter.get_usage().total_capacity_bytes == 1 << 30
        fds = {
            adapter.get_store_event_fd(),
            adapter.get_lookup_and_lock_event_fd(),
            adapter.get_load_event_fd(),
        }
        assert len(fds) == 3
    finally:
        adapter.close()
    assert PersistingL2AdapterConfig.help()


@pytest.mark.parametrize(
    "params",
    [
        {"capacity": "lots"},
        {"durability": "sometimes"},
        {"durability": "async"},  # needs a memory tier
        {"no_such_param": 1},
        {"io_threads": 0},
        {"namespace": "a@b"},
        {"fsync": "maybe"},  # "yes" and "no" are read as pydantic reads a bool
    ],
)
def test_bad_adapter_params_fail_loudly(root: Path, params: dict) -> None:
    (config,) = l2_config(adapter_json(root, **params)).adapters
    with pytest.raises(ConfigError):
        create_l2_adapter_from_registry(config)


def test_store_lookup_load_unlock_delete_round_trip(root: Path) -> None:
    with l2_adapter(root, capacity="16MiB") as adapter:
        listener = Recorder()
        adapter.register_listener(listener)
        keys = [object_key(i) for i in range(4)]
        objs = [tensor_obj(i) for i in range(4)]
        result = store(adapter, keys, objs)
        assert result.is_successful() and result.bytes_transferred() == 4 * CHUNK_BYTES
        assert listener.stored == [(k, file_size(CHUNK_BYTES)) for k in keys]
        # Storing again writes nothing and still succeeds.
        again = store(adapter, keys[:2], objs[:2])
        assert again.is_successful() and again.bytes_transferred() == 0

        missing = object_key(99)
        assert lookup(adapter, [keys[0], missing, keys[2], keys[3]]) == [0, 2, 3]
        assert adapter.report_status()["locked_key_count"] == 3
        dest = [tensor_obj(None) for _ in range(4)]
        assert load(adapter, [keys[0], missing, keys[2], keys[3]], dest) == [0, 2, 3]
        for i, obj in zip([0, 2, 3], [dest[0], dest[2], dest[3]], strict=True):
            assert torch.equal(bytes_of(obj), payload(i, CHUNK_BYTES))
        assert not torch.any(bytes_of(dest[1]))
        assert listener.accessed == [keys[0], keys[2], keys[3]]

        # A locked chunk is not deleted; once unlocked it is.
        adapter.delete([keys[0]])
        adapter.submit_unlock([keys[2], keys[3]])
        wait_until(lambda: adapter.report_status()["locked_key_count"] == 1, "unlock")
        assert adapter.debug_has_key(keys[0])
        adapter.submit_unlock([keys[0]])
        adapter.delete([keys[0], keys[2], missing])
        wait_until(lambda: not adapter.debug_has_key(keys[2]), "delete")
        wait_until(lambda: len(listener.deleted) == 2, "deleted notification")
        assert sorted(k.chunk_hash for k in listener.deleted) == sorted(
            k.chunk_hash for k in (keys[0], keys[2])
        )
        assert lookup(adapter, keys) == [1, 3]
        adapter.submit_unlock(keys)
        adapter.store.flush()  # commits the deletes' metadata, which the total then counts
        usage = adapter.get_usage()
        # The total is everything on disk (metadata included); per salt, the payload files.
        assert usage.total_bytes_used == du_bytes(adapter.store.directory)
        assert dict(usage.bytes_by_cache_salt) == {"": 2 * file_size(CHUNK_BYTES)}


def test_a_load_into_an_object_of_another_layout_is_a_miss(root: Path) -> None:
    with l2_adapter(root, capacity="16MiB") as adapter:
        key = object_key(1)
        assert store(adapter, [key], [tensor_obj(1)]).is_successful()
        same_size_other_shape = tensor_obj(None, shape=(2, 4, 32, 128))
        other_dtype = tensor_obj(None, shape=(2, 4, 16, 128), dtype=torch.float32)
        assert load(adapter, [key, key], [same_size_other_shape, other_dtype]) == []
        assert not torch.any(bytes_of(same_size_other_shape))
        assert adapter.report_status()["layout_mismatches"] == 2
        right = tensor_obj(None)
        assert load(adapter, [key], [right]) == [0]
        assert torch.equal(bytes_of(right), payload(1, CHUNK_BYTES))


def test_objects_of_several_layer_groups_round_trip_as_bytes(root: Path) -> None:
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    def grouped(seed: int | None) -> TensorMemoryObj:
        shapes = [torch.Size([2, 16, 64]), torch.Size([16, 32])]
        dtypes = [torch.bfloat16, torch.float32]
        nbytes = 2 * 16 * 64 * 2 + 16 * 32 * 4
        raw = payload(seed, nbytes) if seed is not None else torch.zeros(nbytes, dtype=torch.uint8)
        meta = MemoryObjMetadata(
            shape=shapes[0],
            dtype=dtypes[0],
            address=0,
            phy_size=nbytes,
            fmt=MemoryFormat.UNDEFINED,
            ref_count=1,
            shapes=shapes,
            dtypes=dtypes,
        )
        return TensorMemoryObj(raw, meta, parent_allocator=None)

    with l2_adapter(root, capacity="16MiB") as adapter:
        key = object_key(5)
        assert store(adapter, [key], [grouped(5)]).is_successful()
        dest = grouped(None)
        assert load(adapter, [key], [dest]) == [0]
        assert torch.equal(bytes_of(dest), bytes_of(grouped(5)))


def test_the_layout_a_load_expects_is_the_one_its_store_recorded(root: Path) -> None:
    """A load's expected layout comes from the object's metadata (no tensor views) for a
    plain one-group object, and from its tensor otherwise; either way it is exactly what a
    store of the same object recorded, so a load into it hits."""
    from lmcache.v1.memory_management import MemoryFormat

    narrowed = tensor_obj(7)
    narrowed.set_used_size(1000)  # a byte view of the used bytes, not its meta shape
    mla = tensor_obj(8, shape=(4, 16, 64), dtype=torch.float16)
    mla.meta.fmt = MemoryFormat.KV_MLA_FMT
    objs = [
        tensor_obj(1),
        tensor_obj(2, shape=(2, 4, 16, 128), dtype=torch.float32),
        tensor_obj(3, shape=(2, 1, 1, 1), dtype=torch.uint8),
        mla,
        narrowed,
    ]
    keys = [object_key(40 + i) for i in range(len(objs))]
    with l2_adapter(root, capacity="16MiB") as adapter:
        assert store(adapter, keys, objs).is_successful()
        for key, obj in zip(keys, objs, strict=True):
            text = key_string(object_key_text(adapter.params.namespace, key))
            assert layout_of(obj) == adapter.store.layout(text)
        assert layout_of(narrowed).shape == (1000,)
        assert layout_of(mla).fmt == "KV_MLA_FMT"
        dest = [tensor_obj(None, shape=tuple(o.meta.shape), dtype=o.meta.dtype) for o in objs]
        dest[3].meta.fmt = MemoryFormat.KV_MLA_FMT
        dest[4].set_used_size(1000)
        assert load(adapter, keys, dest) == list(range(len(objs)))
        for obj, got in zip(objs, dest, strict=True):
            assert torch.equal(bytes_of(got), bytes_of(obj))


def test_every_object_key_field_maps_reversibly() -> None:
    odd = [
        ObjectKey(b"", "m", 0),
        ObjectKey(b"\x00\x00\x01", "org/model-7B", 0x04010401, 3, "tenant-1"),
        ObjectKey(bytes(range(32)), "weird %model%:+,=~ é", -5, 0, "salt with space%"),
        ObjectKey(b"\xff" * 8, "m", 1 << 40, 1 << 20, "\x01ctrl"),
    ]
    texts = set()
    for key in odd:
        text = object_key_text("ns", key)
        assert key_string(text) == text  # a valid Persisting key, kept verbatim
        assert object_key_of(text) == key
        texts.add(text)
    assert len(texts) == len(odd)
    # Leading zero bytes, rank, group and salt all tell keys apart.
    base = ObjectKey(b"\x01", "m", 0)
    variants = [
        base,
        ObjectKey(b"\x00\x01", "m", 0),
        ObjectKey(b"\x01", "m", 1),
        ObjectKey(b"\x01", "m", 0, 1),
        ObjectKey(b"\x01", "m", 0, 0, "s"),
        ObjectKey(b"\x01", "n", 0),
    ]
    assert len({object_key_text("ns", k) for k in variants}) == len(variants)


def test_a_cache_salt_is_a_boundary(root: Path) -> None:
    with l2_adapter(root, capacity="16MiB") as adapter:
        alice = object_key(7, salt="alice")
        bob, nobody = object_key(7, salt="bob"), object_key(7)
        assert store(adapter, [alice], [tensor_obj(7)]).is_successful()
        assert lookup(adapter, [bob, nobody, alice]) == [2]
        dest = [tensor_obj(None), tensor_obj(None)]
        assert load(adapter, [bob, nobody], dest) == []
        assert not torch.any(bytes_of(dest[0])) and not torch.any(bytes_of(dest[1]))
        adapter.submit_unlock([alice])
        usage = adapter.get_usage().bytes_by_cache_salt
        assert dict(usage) == {"alice": file_size(CHUNK_BYTES)}
        # Bob storing the same chunk hash gets his own copy, counted to him.
        assert store(adapter, [bob], [tensor_obj(8)]).is_successful()
        got = tensor_obj(None)
        assert load(adapter, [alice], [got]) == [0]
        assert torch.equal(bytes_of(got), payload(7, CHUNK_BYTES))
        assert set(adapter.get_usage().bytes_by_cache_salt) == {"alice", "bob"}


def test_list_l2_keys_pages_through_every_key(root: Path) -> None:
    with l2_adapter(root, capacity="16MiB") as adapter:
        keys = [object_key(i, model=MODEL if i % 2 else "other/model") for i in range(7)]
        assert store(adapter, keys, [tensor_obj(i) for i in range(7)]).is_successful()
        seen, cursor = [], None
        while True:
            page = adapter.list_l2_keys(page_size=3, cursor=cursor)
            assert len(page.entries) <= 3
            seen += [entry.key.to_object_key() for entry in page.entries]
            assert all(entry.size_bytes == CHUNK_BYTES for entry in page.entries)
            cursor = page.next_page_token
            if cursor is None:
                break
        assert sorted(seen, key=repr) == sorted(keys, key=repr)
        mine = adapter.list_l2_keys(model_name=MODEL).entries
        assert {e.key.to_object_key() for e in mine} == {k for k in keys if k.model_name == MODEL}
        with pytest.raises(ValueError):
            adapter.list_l2_keys(page_size=0)


def test_a_lock_lmcache_never_releases_expires(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with l2_adapter(root, capacity="16MiB", lock_ttl_s=60) as adapter:
        clock = ManualClock()  # the locks' clock: moved past the TTL, not waited through
        monkeypatch.setattr(adapter._locks, "_clock", clock)
        key = object_key(3)
        assert store(adapter, [key], [tensor_obj(3)]).is_successful()
        assert lookup(adapter, [key]) == [0]
        adapter.delete([key])  # locked: kept
        assert adapter.debug_has_key(key)
        wait_until(lambda: adapter.report_status()["locked_key_count"] == 1, "the lock")
        clock.advance(61)
        assert lookup(adapter, [object_key(4)]) == []  # the next lookup reaps it
        status = adapter.report_status()
        assert status["locked_key_count"] == 0 and status["expired_locks"] == 1
        adapter.delete([key])
        wait_until(lambda: not adapter.debug_has_key(key), "delete after expiry")
        adapter.submit_unlock([key])  # a late unlock releases nothing twice


def test_tasks_from_many_threads_never_mix_bytes(root: Path) -> None:
    with l2_adapter(root, capacity="64MiB", io_threads=3) as adapter:
        errors: list[BaseException] = []
        wrong: list[int] = []

        def worker(t: int) -> None:
            try:
                mine = list(range(t * 10, t * 10 + 10))
                keys = [object_key(i) for i in mine]
                for j in range(0, 10, 5):
                    result = adapter.submit_store_task(
                        keys[j : j + 5], [tensor_obj(i) for i in mine[j : j + 5]]
                    )
                    assert isinstance(result, int)
                wait_until(lambda: all(adapter.debug_has_key(k) for k in keys), "stores")
                dest = [tensor_obj(None) for _ in keys]
                got = load(adapter, keys, dest)
                assert got == list(range(10))
                for i, obj in zip(mine, dest, strict=True):
                    if not torch.equal(bytes_of(obj), payload(i, CHUNK_BYTES)):
                        wrong.append(i)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=90)
        adapter.pop_completed_store_tasks()
        assert not errors and not wrong
        assert adapter.report_status()["stored_object_count"] == 40


def test_write_behind_stores_complete_from_memory_and_survive_a_clean_restart(
    root: Path,
) -> None:
    keys = [object_key(i) for i in range(3)]
    with l2_adapter(root, capacity="16MiB", memory_bytes="4MiB", durability="async") as adapter:
        assert store(adapter, keys, [tensor_obj(i) for i in range(3)]).is_successful()
        dest = [tensor_obj(None) for _ in keys]
        assert load(adapter, keys, dest) == [0, 1, 2]
        assert all(torch.equal(bytes_of(d), payload(i, CHUNK_BYTES)) for i, d in enumerate(dest))
    with l2_adapter(root, capacity="16MiB") as adapter:  # close wrote everything behind
        dest = [tensor_obj(None) for _ in keys]
        assert load(adapter, keys, dest) == [0, 1, 2]
        assert all(torch.equal(bytes_of(d), payload(i, CHUNK_BYTES)) for i, d in enumerate(dest))
        usage = adapter.get_usage()
        assert dict(usage.bytes_by_cache_salt) == {"": 3 * file_size(CHUNK_BYTES)}
        assert usage.total_bytes_used == du_bytes(adapter.store.directory)
