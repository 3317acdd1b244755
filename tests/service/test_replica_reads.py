"""What a member's replicator reads to send as copies (``actors.replicas._read_local``): a
memory-tier value from the tier's own buffer, uncopied, once its bytes match the checksum
stored with it; a value on disk only through the store's own checked read; a damaged or
missing one is never sent."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actors.replicas import _read_local
from persisting.kv import open_kv_store
from persisting.kv.keys import key_string
from persisting.kv.layout import encode_value
from tests.service.service_helpers import MODEL, key, tensor


def _bytes(i: int) -> bytes:
    return bytes(encode_value(tensor(i), "KV_2LTD")[1])


def test_memory_values_are_sent_from_the_tiers_own_buffer_and_never_damaged(
    tmp_path: Path,
) -> None:
    store = open_kv_store(tmp_path, MODEL, memory_bytes=8 << 20, disk_bytes=64 << 20)
    try:
        for i in (1, 2):
            store.put(key(i), tensor(i))
        names = [key_string(key(i)) for i in (1, 2, 3)]  # key 3 was never stored
        got = _read_local(store, names, 1 << 30)
        assert got.keys == names[:2] and got.gone == 1 and got.taken == 3
        assert [bytes(p) for p in got.payloads] == [_bytes(1), _bytes(2)]
        held = store.memory_payload(key(1))
        assert held is not None
        assert np.shares_memory(np.frombuffer(got.payloads[0], np.uint8), held.buffer)
        damaged = store.memory_payload(key(2))
        assert damaged is not None
        damaged.buffer.view(np.uint8)[0] ^= 0xFF
        got = _read_local(store, names[1:2], 1 << 30)
        assert got.keys == [] and got.gone == 1
    finally:
        store.close()


def test_values_on_disk_only_are_read_through_the_stores_checked_read(tmp_path: Path) -> None:
    store = open_kv_store(tmp_path, MODEL, memory_bytes=0, disk_bytes=64 << 20)
    try:
        store.put(key(1), tensor(1))
        got = _read_local(store, [key_string(key(1))], 1 << 30)
        assert got.keys == [key_string(key(1))]
        assert [bytes(p) for p in got.payloads] == [_bytes(1)]
    finally:
        store.close()
