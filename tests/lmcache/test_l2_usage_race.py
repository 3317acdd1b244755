"""Per-salt usage stays true when a delete lands between a store adding a key to the
adapter's books and telling LMCache of it (issue 25, item 4).

The interleaving is forced: the store's notification to LMCache waits until a delete of the
same key has run on the control thread. Before, the delete told LMCache first; LMCache's
accounting clamped that salt at zero, then the store's notification added the key back: the
salt stayed overstated by a chunk that was gone, and listeners saw it stored after its
deletion.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from lmcache.v1.distributed.internal_api import L2AdapterListener

from persisting.kv.disk.payload_files import file_size
from tests.lmcache.l2_harness import l2_adapter, load, object_key, store, tensor_obj

pytestmark = pytest.mark.timeout(120)
CHUNK_BYTES = 2 * 4 * 16 * 256 * 2


class Events(L2AdapterListener):
    """What LMCache's listeners are told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_l2_keys_stored(self, keys: list[Any], sizes: list[int]) -> None:
        self.events += [("stored", k) for k in keys]

    def on_l2_keys_accessed(self, keys: list[Any]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[Any]) -> None:
        self.events += [("deleted", k) for k in keys]


def test_a_delete_between_a_store_and_its_notification_leaves_no_usage_behind(
    root: Path,
) -> None:
    with l2_adapter(root, capacity="64MiB") as adapter:
        listener = Events()
        adapter.register_listener(listener)
        other = object_key(1, salt="someone else")
        assert store(adapter, [other], [tensor_obj(1)]).is_successful()
        doomed = object_key(2, salt="tenant")
        real = adapter._notify_keys_stored
        raced = threading.Event()

        def notify_after_a_delete(keys: list[Any], sizes: list[int]) -> None:
            if doomed in keys and not raced.is_set():
                raced.set()
                adapter.delete([doomed])
                adapter._control.submit(lambda: None).result(30)  # the delete has run
                assert not adapter.debug_has_key(doomed)
            real(keys, sizes)

        adapter._notify_keys_stored = notify_after_a_delete  # type: ignore[method-assign]
        assert store(adapter, [doomed], [tensor_obj(2)]).is_successful()
        assert raced.is_set()
        usage = adapter.get_usage()
        assert dict(usage.bytes_by_cache_salt) == {"someone else": file_size(CHUNK_BYTES)}
        with adapter._usage_lock:
            assert adapter._total_bytes_used == file_size(CHUNK_BYTES)
        # Listeners heard of the doomed key's store, then of its deletion: it is gone.
        told = [event for event, key in listener.events if key == doomed]
        assert told == ["stored", "deleted"]
        assert load(adapter, [doomed], [tensor_obj(None)]) == []


def test_an_eviction_between_a_store_and_its_notification_leaves_no_usage_behind(
    root: Path,
) -> None:
    """The same race through the store's own eviction (reported by ``_report_evictions``,
    which any thread may run)."""
    with l2_adapter(root, capacity="64MiB") as adapter:
        doomed = object_key(3, salt="solo")
        real = adapter._notify_keys_stored
        raced = threading.Event()

        def notify_after_an_eviction(keys: list[Any], sizes: list[int]) -> None:
            if doomed in keys and not raced.is_set():
                raced.set()
                text = adapter._text(doomed)
                assert text is not None
                assert adapter.store.remove(text)
                adapter._evicted.append((text, file_size(CHUNK_BYTES)))  # as on_disk_evict
                threading.Thread(target=adapter._report_evictions).start()
                threading.Event().wait(0.2)
            real(keys, sizes)

        adapter._notify_keys_stored = notify_after_an_eviction  # type: ignore[method-assign]
        assert store(adapter, [doomed], [tensor_obj(3)]).is_successful()
        assert raced.is_set()
        assert dict(adapter.get_usage().bytes_by_cache_salt) == {}
