"""What LMCache's own L2 disk adapters lack, each checked inside LMCache's StorageManager:
capacity in bytes on disk, a failed store never visible, I/O errors counted with their
errno and reported, damage found by checksum and turned into a counted miss.

Faults are real: a ``tmp`` directory that is a file makes writes fail with ENOTDIR, a
payload file that is a directory makes reads fail with EISDIR, a flipped byte is damage.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from persisting.integrations.lmcache import PersistingL2Adapter
from persisting.integrations.lmcache.object_keys import object_key_text
from persisting.kv.disk.payload_files import file_size
from tests.kv.kv_helpers import make_uncreatable
from tests.lmcache.l2_harness import (
    LAYOUT,
    Recorder,
    adapter_json,
    adapter_of,
    bytes_of,
    du_bytes,
    files_bytes,
    l2_adapter,
    load,
    lookup,
    object_key,
    payload,
    prefetch,
    storage_manager,
    store,
    tensor_obj,
    write_through_l1,
)
from tests.timing import wait_until

pytestmark = pytest.mark.timeout(180)
CHUNK_BYTES = 2 * 4 * 16 * 256 * 2
ON_DISK = file_size(CHUNK_BYTES)


def namespace_dir(root: Path) -> Path:
    return root / "kv" / "lmcache"


def payload_path(adapter: PersistingL2Adapter, key) -> Path:  # type: ignore[no-untyped-def]
    text = object_key_text(adapter.params.namespace, key)
    where = adapter.store.lease(text, 1.0)
    assert where is not None
    adapter.store.release(text, where.token)
    return Path(where.path)


def test_capacity_holds_in_bytes_on_disk(root: Path) -> None:
    """The capacity covers everything the namespace puts on disk (payload files, metadata,
    directories), so du never exceeds it; LMCache is told of every chunk evicted."""
    capacity = 6 * ON_DISK
    with storage_manager(adapter_json(root, capacity=capacity)) as manager:
        adapter = adapter_of(manager)
        listener = Recorder()
        manager.register_l2_listener(listener)
        keys = [object_key(i) for i in range(12)]
        for start in range(0, 12, 3):
            write_through_l1(manager, keys[start : start + 3], seed=start)
            assert du_bytes(namespace_dir(root)) <= capacity
            assert adapter.get_usage().total_bytes_used <= capacity
        # A flush's metadata commits reserve their room first: in a budget this small that
        # may evict one more chunk, so the books are read after it.
        adapter.store.flush()
        kept = [k for k in keys if adapter.debug_has_key(k)]
        evicted = len(keys) - len(kept)
        assert 3 <= len(kept) < len(keys)
        adapter.get_usage()  # LMCache hears of evictions the next time it asks the adapter
        wait_until(lambda: len(listener.deleted) == evicted, "eviction notices")
        assert set(listener.deleted) == set(keys) - set(kept)
        assert du_bytes(namespace_dir(root)) == adapter.get_usage().total_bytes_used
        assert files_bytes(namespace_dir(root)) == len(kept) * ON_DISK
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {"": len(kept) * ON_DISK}
        assert adapter.report_status()["evictions"] == evicted
        # The most recent request's chunks are the ones kept, its first chunk included.
        assert set(keys[-3:]) <= set(kept)
        manager.clear()
        assert prefetch(manager, keys[-3:]).l2_hit_count == 3
        manager.finish_read_prefetched(keys[-3:])


def test_a_failed_store_is_never_visible_and_its_errno_is_reported(root: Path) -> None:
    with storage_manager(adapter_json(root, capacity="16MiB")) as manager:
        adapter = adapter_of(manager)
        write_through_l1(manager, [object_key(0)])
        failed = [object_key(i) for i in range(1, 4)]
        for k in failed:  # their new payload files cannot be created: ENOTDIR
            text = adapter._text(k)
            assert text is not None
            make_uncreatable(namespace_dir(root), text)
        reserved = manager.reserve_write(failed, LAYOUT)
        manager.finish_write(list(reserved))
        wait_until(lambda: adapter.report_status()["io_errors"] >= 1, "the failed store")
        status = manager.report_status()["l2_adapters"][0]  # LMCache's own status API
        assert status["type"] == "PersistingL2Adapter" and not status["is_healthy"]
        assert status["store_failures"] >= 1
        assert status["last_io_error"]["errno"] == errno.ENOTDIR
        assert status["last_io_error"]["op"] == "store"
        manager.clear()
        assert not any(adapter.debug_has_key(k) for k in failed)
        assert prefetch(manager, failed).l2_hit_count == 0
        assert files_bytes(namespace_dir(root)) == ON_DISK  # only the chunk stored before
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {"": ON_DISK}


def test_a_read_error_is_a_counted_miss_with_its_errno(root: Path) -> None:
    with l2_adapter(root, capacity="16MiB") as adapter:
        keys = [object_key(i) for i in range(3)]
        assert store(adapter, keys, [tensor_obj(i) for i in range(3)]).is_successful()
        path = payload_path(adapter, keys[1])
        os.unlink(path)
        os.mkdir(path)  # reads of it fail with EISDIR
        dest = [tensor_obj(None) for _ in keys]
        assert load(adapter, keys, dest) == [0, 2]
        status = adapter.report_status()
        assert status["io_errors"] == 1 and status["load_failures"] == 1
        assert status["last_io_error"]["errno"] == errno.EISDIR
        assert status["last_io_error"]["op"] == "load" and not status["is_healthy"]


def test_damage_is_found_by_checksum_counted_and_forgotten(root: Path) -> None:
    with l2_adapter(root, capacity="16MiB") as adapter:
        listener = Recorder()
        adapter.register_listener(listener)
        keys = [object_key(i) for i in range(3)]
        assert store(adapter, keys, [tensor_obj(i) for i in range(3)]).is_successful()
        path = payload_path(adapter, keys[1])
        with open(path, "r+b") as f:  # one flipped bit in the middle of the payload
            f.seek(4096 + CHUNK_BYTES // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        assert lookup(adapter, keys) == [0, 1, 2]  # the index cannot know yet
        dest = [tensor_obj(None) for _ in keys]
        assert load(adapter, keys, dest) == [0, 2]
        adapter.submit_unlock(keys)
        assert torch.equal(bytes_of(dest[2]), payload(2, CHUNK_BYTES))
        status = adapter.report_status()
        assert status["checksum_failures"] == 1 and status["load_misses"] == 1
        assert status["io_errors"] == 0  # damage is not an I/O error
        assert not adapter.debug_has_key(keys[1]) and not path.exists()
        assert keys[1] in listener.deleted  # LMCache's books drop it too
        listed = {e.key.to_object_key() for e in adapter.list_l2_keys().entries}
        assert listed == {keys[0], keys[2]}
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {"": 2 * ON_DISK}


def test_one_damaged_chunk_of_a_task_read_on_several_threads_is_its_only_miss(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load task's chunks are spread over the io threads; one damaged chunk (a bit
    flipped in its last read piece) is a miss at its own index, every other chunk is a hit
    with its own bytes, and the damage is counted once."""
    from persisting.kv.disk import payload_files

    shape = (2, 4, 160, 1024)  # 2.5 MiB: several read pieces per chunk
    nbytes = 2 * 4 * 160 * 1024 * 2
    readers: list[str] = []
    real = payload_files.read_file_range

    def traced(*args: Any, **kwargs: Any) -> Any:
        readers.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(payload_files, "read_file_range", traced)
    with l2_adapter(root, capacity="64MiB", io_threads=4) as adapter:
        keys = [object_key(i) for i in range(8)]
        objs = [tensor_obj(i, shape=shape) for i in range(8)]
        assert store(adapter, keys, objs).is_successful()
        with open(payload_path(adapter, keys[5]), "r+b") as f:
            f.seek(4096 + nbytes - 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        dest = [tensor_obj(None, shape=shape) for _ in keys]
        assert load(adapter, keys, dest) == [0, 1, 2, 3, 4, 6, 7]
        assert len(readers) == 8 and len(set(readers)) >= 2
        assert all(name.startswith("persisting-l2-io") for name in readers)
        for i, (obj, got) in enumerate(zip(objs, dest, strict=True)):
            if i != 5:
                assert torch.equal(bytes_of(got), bytes_of(obj))
        status = adapter.report_status()
        assert status["checksum_failures"] == 1 and status["load_misses"] == 1
        assert not adapter.debug_has_key(keys[5])


def test_a_task_larger_than_the_capacity_keeps_the_books_right(root: Path) -> None:
    with l2_adapter(root, capacity=4 * ON_DISK) as adapter:  # metadata takes some of it
        listener = Recorder()
        adapter.register_listener(listener)
        keys = [object_key(i) for i in range(5)]
        assert store(adapter, keys, [tensor_obj(i) for i in range(5)]).is_successful()
        adapter.store.flush()  # its metadata commits reserve room first: read the books after
        present = {k for k in keys if adapter.debug_has_key(k)}
        assert 1 <= len(present) < len(keys)
        assert present == set(keys[: len(present)])  # a request's first chunks are kept longest
        listed = {e.key.to_object_key() for e in adapter.list_l2_keys().entries}
        assert listed == present
        told = {k for k, _n in listener.stored} - set(listener.deleted)
        assert told == present
        assert adapter.get_usage().total_bytes_used == du_bytes(namespace_dir(root))
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {"": len(present) * ON_DISK}
