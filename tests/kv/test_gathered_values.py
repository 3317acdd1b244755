"""A value given in parts (an engine's page spread over K and V, or over its layers) is
stored from those parts end to end, one payload file in the usual format, and read back by
place into several buffers with its checksum checked."""

from __future__ import annotations

import numpy as np
import pytest

from persisting.errors import CorruptValueError, InvalidValueError
from persisting.kv import Gathered, open_kv_store
from persisting.kv.disk.file_header import MAGIC
from persisting.kv.disk.range_reads import READ_PIECE, read_file_range
from persisting.kv.layout import checksum

KEY = "m@1@0@{:x}@uint8"


def _parts(rng: np.random.Generator, sizes: list[int]) -> list[np.ndarray]:
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


@pytest.mark.parametrize("memory_bytes", [0, 8 << 20])
def test_a_gathered_value_is_stored_end_to_end(root, memory_bytes) -> None:
    rng = np.random.default_rng(1)
    sizes = [3 * READ_PIECE + 5, 4096, 17, READ_PIECE]
    parts = _parts(rng, sizes)
    whole = np.concatenate(parts).tobytes()
    with open_kv_store(root, "m", memory_bytes=memory_bytes, disk_bytes=64 << 20) as store:
        result = store.put(KEY.format(1), Gathered(tuple(p.data for p in parts)), fmt="binary")
        assert result.stored and result.durable
        assert store.get(KEY.format(1)) == whole  # memory hit or disk read
        location = store.lease(KEY.format(1), 10.0)
        assert location is not None and location.checksum == checksum(whole)
        with open(location.path, "rb") as f:  # the usual file format: header, then payload
            assert f.read(len(MAGIC)) == MAGIC
            f.seek(location.offset)
            assert f.read()[: len(whole)] == whole
        # Read back by place into buffers of other sizes than the parts it was written from.
        outs = [np.zeros(n, np.uint8) for n in (10, len(whole) - 10 - READ_PIECE, READ_PIECE)]
        digest = read_file_range(
            location.path, location.offset, [o.data for o in outs], hashed=True
        )
        assert digest == location.checksum
        assert np.concatenate(outs).tobytes() == whole


def test_gathered_values_need_the_binary_format(root) -> None:
    part = np.ones(16, np.uint8)
    with (
        open_kv_store(root, "m", memory_bytes=0, disk_bytes=1 << 20) as store,
        pytest.raises(InvalidValueError, match="binary"),
    ):
        store.put(KEY.format(2), Gathered((part.data,)), fmt="KV_2LTD")
    with pytest.raises(InvalidValueError, match="zero-size"):
        Gathered(())


def test_a_short_file_read_into_parts_is_damage(tmp_path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    outs = [np.zeros(60, np.uint8), np.zeros(60, np.uint8)]
    with pytest.raises(CorruptValueError, match="shorter"):
        read_file_range(path, 0, [o.data for o in outs], hashed=True)
