"""Key dtypes in torch's names, values checked against their key's dtype, puts that find
another layout under their key, and sizes with units -- on a real store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.errors import CapacityError, ConfigError, InvalidKeyError, InvalidValueError
from persisting.kv import ChunkKey, TokenHasher, open_kv_store, parse_key
from tests.kv.kv_helpers import MODEL, key, tensor

MiB = 1 << 20


@pytest.mark.parametrize(
    ("given", "spelled"),
    [
        ("float32", "float"),
        ("float16", "half"),
        ("float64", "double"),
        ("bfloat16", "bfloat16"),
        ("float", "float"),
        ("torch.float32", "float"),
        (torch.float16, "half"),
        (torch.bfloat16, "bfloat16"),
        ("float8_e4m3fn", "fp8_e4m3fn"),
    ],
)
def test_torch_dtype_names_are_spelled_as_lmcache_spells_them(given: object, spelled: str) -> None:
    hasher = TokenHasher(MODEL, dtype=given)
    assert hasher.dtype == spelled
    (_s, _e, chunk), *_ = hasher.process_tokens(range(256))
    assert str(chunk).endswith(f"@{spelled}")
    assert ChunkKey(MODEL, 1, 0, 5, given).dtype == spelled  # type: ignore[arg-type]


def test_unknown_dtypes_list_the_valid_names() -> None:
    with pytest.raises(InvalidKeyError, match=r"unknown key dtype 'fp32'; valid: bfloat16, .*"):
        TokenHasher(MODEL, dtype="fp32")
    with pytest.raises(InvalidKeyError, match=r"float \(float32\)"):
        TokenHasher(MODEL, dtype="fp32")
    # A key string is kept verbatim, so it must be spelled as keys are.
    with pytest.raises(InvalidKeyError, match="keys spell float32 'float'"):
        parse_key(f"{MODEL}@1@0@ab@float32")


def test_a_value_whose_dtype_is_not_its_keys_is_refused(root: Path) -> None:
    for durability in ("sync", "async", "write_back"):
        with open_kv_store(
            root / durability,
            MODEL,
            memory_bytes=8 * MiB,
            disk_bytes=64 * MiB,
            durability=durability,
        ) as store:
            f32 = torch.randn(2, 4, 16, 64)
            with pytest.raises(InvalidValueError, match=r"a float value under key .*@bfloat16"):
                store.put(key(1), f32)
            with pytest.raises(InvalidValueError):  # a batch: nothing stored from it
                store.batched_put([key(2), key(3)], [tensor(2), f32])
            assert not store.contains(key(1)) and not store.contains(key(2))
            assert store.put(key(1, dtype="float32"), f32).stored  # its own dtype's key
            assert store.put(key(4, dtype="half"), np.zeros((2, 3, 4), np.float16), fmt="KV_2TD")
            assert store.put(key(5), b"opaque bytes", fmt="binary").stored  # bytes: exempt
            # Layouts another system defines (LMCache's objects) opt out with the shape rule.
            assert store.put(key(6), f32, check_shape=False).stored


def test_a_put_of_a_key_held_with_another_layout_is_a_conflict_not_already_stored(
    root: Path,
) -> None:
    for durability in ("sync", "async", "write_back"):
        with open_kv_store(
            root / durability,
            MODEL,
            memory_bytes=8 * MiB,
            disk_bytes=64 * MiB,
            durability=durability,
        ) as store:
            first = store.put(key(1), tensor(1))
            assert first.stored and not first.conflict
            same = store.put(key(1), tensor(2))  # same layout: already stored, kept
            assert (same.stored, same.conflict) == (False, False)
            other = store.put(key(1), tensor(3, tokens=32))  # another layout: kept, told
            assert (other.stored, other.conflict) == (False, True)
            store.flush()
            assert torch.equal(store.get(key(1)), tensor(1))
            batch = store.batched_put([key(1), key(2)], [tensor(4, hidden=32), tensor(5)])
            assert [(r.stored, r.conflict) for r in batch] == [(False, True), (True, False)]
    with open_kv_store(root / "sync", MODEL, memory_bytes=0, disk_bytes=64 * MiB) as reopened:
        again = reopened.put(key(1), tensor(6, tokens=8))  # from the disk tier's record
        assert (again.tier, again.stored, again.conflict) == ("disk", False, True)


def test_sizes_take_units_as_the_settings_do(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes="64 MB", disk_bytes="1GiB") as store:
        stats = store.stats()
        assert stats["memory_capacity"] == 64_000_000 and stats["disk_capacity"] == 1 << 30
    with (
        open_kv_store(
            root, MODEL, memory_bytes="8MiB", disk_bytes=64 * MiB, max_value_bytes="1 MiB"
        ) as store,
        pytest.raises(CapacityError, match="exceeds the 1048576-byte limit"),
    ):
        store.put(key(1), tensor(1, tokens=1024, hidden=1024))
    with pytest.raises(ConfigError, match=r"memory_bytes must be a size .* got .64 furlongs."):
        open_kv_store(root, MODEL, memory_bytes="64 furlongs", disk_bytes="1GiB")
