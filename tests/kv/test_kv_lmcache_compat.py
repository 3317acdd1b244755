"""What the LMCache plugin needs from the KV layer: foreign layouts, cheap repeated key checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from persisting.errors import InvalidKeyError, InvalidValueError
from persisting.kv import MEMORY_FORMATS, Layout, open_kv_store

MODEL = "meta-llama/Llama-3-8B"
KEY = f"{MODEL}@1@0@-2a@bfloat16"


def test_every_lmcache_memory_format_name_is_known() -> None:
    lmcache_names = {
        "UNDEFINED", "KV_2LTD", "KV_T2D", "KV_2TD", "BINARY", "BINARY_BUFFER",
        "KV_MLA_FMT", "EC_TD", "HS_TD",
    }  # fmt: skip
    assert lmcache_names <= set(MEMORY_FORMATS)


def test_check_shape_false_keeps_a_foreign_layout_exactly(root: Path) -> None:
    # LMCache's own tests and I/O benchmark label [2, 16, 8, 128] blobs KV_T2D.
    value = torch.arange(2 * 16 * 8 * 128, dtype=torch.float32).to(torch.bfloat16)
    value = value.reshape(2, 16, 8, 128)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 26) as store:
        with pytest.raises(InvalidValueError):
            store.put(KEY, value, fmt="KV_T2D")
        assert not store.contains(KEY)
        result = store.put(KEY, value, fmt="KV_T2D", check_shape=False)
        assert result.stored and result.durable
        want = Layout((2, 16, 8, 128), "bfloat16", "KV_T2D", value.numel() * 2)
        assert store.layout(KEY) == want
        assert torch.equal(store.get(KEY, expect=want), value)
        with pytest.raises(InvalidValueError):  # an unknown name is still refused
            store.put(KEY.replace("-2a", "-2b"), value, fmt="KV_9D", check_shape=False)


def test_key_strings_are_validated_every_time_even_when_remembered() -> None:
    from persisting.kv import key_string

    good = f"{MODEL}@2@1@-7f@half@7@t%v"
    assert key_string(good) is good and key_string(good) is good  # verbatim, cached
    for bad in (f"{MODEL}@2@-2@1f@half", f"{MODEL}@1@0@xyz@half", "short@1"):
        for _ in range(2):
            with pytest.raises(InvalidKeyError):
                key_string(bad)
    with pytest.raises(InvalidKeyError):
        key_string(12345)


# -- LMCache's token hashes, without LMCache ------------------------------------------------


def test_the_lmcache_scheme_gives_lmcache_s_keys_for_known_tokens() -> None:
    # What LMCache 0.5.6's ChunkedTokenDatabase gives for torch.arange(600), chunk 256.
    from persisting.kv import TokenHasher

    hasher = TokenHasher(MODEL, chunk_size=256, scheme="lmcache")
    keys = [str(k) for _s, _e, k in hasher.process_tokens(range(600))]
    assert keys == [
        f"{MODEL}@1@0@2b763dd00afa89c8@bfloat16",
        f"{MODEL}@1@0@79e62c807b48385b@bfloat16",
    ]
    # Persisting's own scheme is another hash family (seeded by the model name).
    ours = TokenHasher(MODEL, chunk_size=256).chunk_hashes(range(600))
    assert [h for _s, _e, h in ours] != [0x2B763DD00AFA89C8, 0x79E62C807B48385B]
    with pytest.raises(InvalidKeyError):
        TokenHasher(MODEL, scheme="vllm")  # type: ignore[arg-type]


@given(
    prefix=st.integers(-(2**63), 2**63 - 1),
    tokens=st.lists(st.integers(-(2**62), 2**62), max_size=40),
)
def test_the_lmcache_hash_is_cpython_s_tuple_hash_computed_anywhere(
    prefix: int, tokens: list[int]
) -> None:
    # The pure-Python algorithm (used off CPython 64-bit) equals the built-in hash here.
    from persisting.kv.keys import _MASK64, _int_hash, _tuple_hash

    inner = _tuple_hash([_int_hash(t) for t in tokens]) & _MASK64
    portable = _tuple_hash([_int_hash(prefix), inner, _tuple_hash(()) & _MASK64])
    assert portable == hash((prefix, tuple(tokens), ()))


# -- what the L2 adapter needs: eviction order, eviction reports, listing, no-fsync puts ---


def _chunk(i: int) -> torch.Tensor:
    return torch.full((2, 1, 4, 512), float(i), dtype=torch.bfloat16)  # 8 KiB


def test_eviction_order_survives_a_reopen(root: Path) -> None:
    keys = [f"{MODEL}@1@0@{i + 1:x}@bfloat16" for i in range(6)]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 20) as store:
        for i, k in enumerate(keys):
            store.put(k, _chunk(i))
        for k in (keys[0], keys[2]):  # read: now the most recently used
            assert store.get(k) is not None
        before = [k for k, _n in store.stored_keys()]
    assert before == [keys[1], *keys[3:], keys[0], keys[2]]
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 20) as store:
        assert [k for k, _n in store.stored_keys()] == before
        late = f"{MODEL}@1@0@ff@bfloat16"
        store.put(late, _chunk(9))  # stored after the snapshot: most recent
        assert [k for k, _n in store.stored_keys()] == [*before, late]


def test_disk_evictions_are_reported_with_their_bytes_on_disk(root: Path) -> None:
    from persisting.kv.disk.payload_files import file_size

    evicted: list[tuple[str, int]] = []
    keys = [f"{MODEL}@1@0@{i + 1:x}@bfloat16" for i in range(4)]
    big = [torch.full((2, 8, 16, 512), float(i), dtype=torch.bfloat16) for i in range(4)]
    per_chunk = file_size(big[0].numel() * 2)  # 256 KiB and a header block
    # The budget counts everything on disk: three chunks plus room for the metadata table
    # and directories (well under 192 KiB here), not four chunks.
    with open_kv_store(
        root,
        MODEL,
        memory_bytes=0,
        disk_bytes=3 * per_chunk + (192 << 10),
        on_disk_evict=evicted.extend,
    ) as store:
        for k, value in zip(keys, big, strict=True):
            store.put(k, value)
        assert evicted == [(keys[0], per_chunk)]
        assert [k for k, _n in store.stored_keys()] == keys[1:]
        store.flush()  # else a metadata commit may still hold its reservation, counted too
        stats = store.stats()
        assert stats["disk_bytes"] == 3 * per_chunk + stats["disk_overhead_bytes"]


def test_puts_without_fsync_are_whole_and_found_after_reopen(root: Path) -> None:
    key = f"{MODEL}@1@0@abc@bfloat16"
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 20, fsync=False) as store:
        assert store.put(key, _chunk(3)).durable  # on disk (in the page cache)
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 20) as store:
        assert torch.equal(store.get(key), _chunk(3))


def test_a_put_that_cannot_create_its_file_gives_its_reservation_back(root: Path) -> None:
    from persisting.errors import StorageIOError
    from tests.kv.kv_helpers import make_uncreatable

    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=1 << 20) as store:
        store.put(f"{MODEL}@1@0@1@bfloat16", _chunk(1))
        used = store.stats()["disk_bytes"]
        for i in range(2, 5):  # creating their in-flight files fails (ENOTDIR)
            make_uncreatable(store.directory, f"{MODEL}@1@0@{i}@bfloat16")
        for i in range(2, 5):
            with pytest.raises(StorageIOError):
                store.put(f"{MODEL}@1@0@{i}@bfloat16", _chunk(i))
        assert store.stats()["disk_bytes"] == used
