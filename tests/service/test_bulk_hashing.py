"""Payload checksums made on a helper thread: the same xxh3-64 as the binding's, for any
buffer a caller hands to a put, with or without the C function."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import xxhash

from persisting.service.bulk import hashing


@pytest.mark.parametrize("size", [0, 1, 255, 4096, (1 << 20) + 3, 9 << 20])
def test_the_checksum_is_the_bindings_xxh3_for_every_size(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    view = data.data
    assert hashing.checksum(view) == xxhash.xxh3_64_intdigest(view)
    assert hashing.checksum_beside(view).result(timeout=10) == xxhash.xxh3_64_intdigest(view)


def test_read_only_and_tensor_buffers_hash_as_their_bytes() -> None:
    raw = bytes(range(256)) * 5000
    assert hashing.checksum(memoryview(raw)) == xxhash.xxh3_64_intdigest(raw)
    value = torch.randn(2, 8, 256, 128).to(torch.bfloat16)
    view = value.view(-1).view(torch.uint8).numpy().data.cast("B")
    assert hashing.checksum(view) == xxhash.xxh3_64_intdigest(view)


def test_the_c_function_is_found_so_hashes_run_without_the_gil() -> None:
    """python-xxhash's wheel exports its C functions; if a release stops doing so, puts
    still check their values (through the binding) but hash on the loop's thread again."""
    assert hashing.releases_gil()


def test_without_the_c_function_the_binding_gives_the_same_checksums(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = np.arange(3 << 20, dtype=np.uint8).data
    expected = xxhash.xxh3_64_intdigest(data)
    monkeypatch.setattr(hashing, "_XXH3", None)
    assert not hashing.releases_gil()
    assert hashing.checksum(data) == expected
    assert asyncio.run(hashing.result(hashing.checksum_beside(data))) == expected
