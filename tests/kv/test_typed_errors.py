"""Bad input and a bad environment get typed errors, and never touch stored data
(issue 13, item 16): meta-device and sparse tensors, strided memoryviews, tokens that are
not 64-bit integers, stats() after close(), a read-only storage root."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.errors import (
    InvalidValueError,
    PersistingError,
    StorageIOError,
    StoreClosedError,
)
from persisting.kv import KVStore, open_kv_store
from tests.kv.kv_helpers import MODEL, key, tensor

MiB = 1 << 20


@pytest.fixture
def store(root: Path) -> Iterator[KVStore]:
    with open_kv_store(root, MODEL, memory_bytes=8 * MiB, disk_bytes=64 * MiB) as s:
        s.put(key(0), tensor(0))
        yield s


def intact(store: KVStore) -> bool:
    return store.stats()["disk_items"] == 1 and torch.equal(store.get(key(0)), tensor(0))


@pytest.mark.parametrize(
    ("make", "fmt"),
    [
        (lambda: torch.empty(2, 2, 4, 4, device="meta"), "KV_2LTD"),
        (lambda: torch.zeros(2, 2, 4, 4).to_sparse(), "KV_2LTD"),
        (lambda: torch.eye(4).to_sparse_csr(), "KV_MLA_FMT"),
        (lambda: memoryview(bytearray(64))[::2], "binary"),
        (lambda: memoryview(np.zeros((8, 8), dtype=np.uint8)[:, ::2]), "binary"),
    ],
    ids=["meta", "sparse_coo", "sparse_csr", "strided_1d", "strided_2d"],
)
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_values_without_plain_bytes_are_invalid(store: KVStore, make, fmt: str) -> None:
    with pytest.raises(InvalidValueError):
        store.put(key(1), make(), fmt=fmt)
    assert not store.contains(key(1))
    assert intact(store)


def test_a_strided_destination_is_invalid(store: KVStore) -> None:
    out = memoryview(bytearray(2 * tensor(0).numel() * 2))[::2]
    with pytest.raises(InvalidValueError):
        store.get_into(key(0), out)
    assert intact(store)


@pytest.mark.parametrize(
    "tokens",
    ["abc", b"abc", [2**70], [-(2**70)], [1.5, 2.0], [True, False], [[1, 2], [3]], None],
    ids=["text", "bytes", "huge", "huge_negative", "floats", "bools", "ragged", "none"],
)
def test_tokens_that_are_not_64_bit_ids_are_invalid(store: KVStore, tokens) -> None:
    with pytest.raises(InvalidValueError):
        store.lookup_tokens(tokens)
    assert intact(store)


def test_good_tokens_of_every_integer_kind_still_work(store: KVStore) -> None:
    for tokens in ([1, 2, 3], np.arange(600, dtype=np.int32), torch.arange(600), iter(range(9))):
        assert store.lookup_tokens(tokens) == 0
    assert store.lookup_tokens(np.array([2**63 - 1], dtype=np.uint64)) == 0
    with pytest.raises(InvalidValueError):
        store.lookup_tokens(np.array([2**63], dtype=np.uint64))


def test_stats_after_close_is_a_closed_store_error(root: Path) -> None:
    store = open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=8 * MiB)
    store.close()
    with pytest.raises(StoreClosedError):
        store.stats()
    with pytest.raises(StoreClosedError):
        store.lookup_tokens([1, 2, 3])
    store.flush()  # harmless once closed


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of our own that can be remounted read-only (needs root, as CI has)."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)


@pytest.mark.parametrize("existing", [True, False], ids=["existing_model", "new_model"])
def test_a_read_only_root_is_a_storage_error_and_loses_nothing(small_fs: Path, existing) -> None:
    with open_kv_store(small_fs, MODEL, memory_bytes=0, disk_bytes=32 * MiB) as store:
        store.put(key(1), tensor(1))
    model = MODEL if existing else "another/model"
    remount(small_fs, "ro")
    try:
        with pytest.raises(StorageIOError, match="read-only"):
            open_kv_store(small_fs, model, memory_bytes=0, disk_bytes=32 * MiB)
    finally:
        remount(small_fs, "rw")
    with open_kv_store(small_fs, MODEL, memory_bytes=0, disk_bytes=32 * MiB) as again:
        assert torch.equal(again.get(key(1)), tensor(1))
        assert again.stats()["corruptions"] == 0


def test_every_error_here_is_one_persisting_type() -> None:
    for error in (InvalidValueError, StorageIOError, StoreClosedError):
        assert issubclass(error, PersistingError)
