"""Payload files hashed as they are written and read: the checksum a write-through put
records, and the one a read computes piece by piece, are xxh3 of the whole payload."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.kv import open_kv_store
from persisting.kv.disk.payload_files import HASH_PIECE, HEADER_BYTES
from persisting.kv.disk.range_reads import READ_PIECE, read_file_range
from persisting.kv.layout import checksum
from tests.kv.kv_helpers import MODEL, disk_tier, key

MiB = 1 << 20
#: Sizes around the hashing pieces of writes and of reads: smaller, exactly one, one and a
#: bit, several.
SIZES = [2, HASH_PIECE, HASH_PIECE + 2, 3 * HASH_PIECE + 10, READ_PIECE + 2, 3 * READ_PIECE + 10]


@pytest.mark.parametrize("nbytes", SIZES)
def test_a_write_through_put_records_the_payload_checksum(root: Path, nbytes: int) -> None:
    value = torch.from_numpy(np.random.default_rng(nbytes).integers(0, 255, nbytes, np.uint8))
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.put(key(1), value, fmt="KV_2LTD", check_shape=False)
        disk = disk_tier(store)
        assert disk is not None
        text = str(key(1))
        entry = disk.entry(text)
        assert entry is not None and entry.checksum == checksum(value.numpy())
        path = disk.files.path(text, entry.tag)
        header = disk.files.read_header(path)
        assert header.checksum == entry.checksum  # the header was written after the payload
        out = np.zeros(nbytes, np.uint8)
        assert read_file_range(path, HEADER_BYTES, memoryview(out), hashed=True) == entry.checksum
        assert np.array_equal(out, value.numpy())
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        assert torch.equal(store.get(key(1)), value)  # reopened: verified on the way in


def test_a_damaged_byte_past_the_first_piece_is_caught(root: Path) -> None:
    nbytes = 2 * max(HASH_PIECE, READ_PIECE) + 100
    value = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        store.put(key(2), value, fmt="KV_2LTD", check_shape=False)
        disk = disk_tier(store)
        assert disk is not None
        text = str(key(2))
        entry = disk.entry(text)
        assert entry is not None
        path = disk.files.path(text, entry.tag)
        with open(path, "r+b") as f:  # flip one byte in the last piece
            f.seek(HEADER_BYTES + nbytes - 1)
            byte = f.read(1)
            f.seek(HEADER_BYTES + nbytes - 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert store.get(key(2)) is None
        assert store.stats()["corruptions"] == 1
