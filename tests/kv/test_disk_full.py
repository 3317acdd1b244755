"""A store on a filesystem that fills up: clean CapacityError, reads go on, then recovery.

The test mounts its own small tmpfs (it needs root, as CI has); it fails, never skips,
when it cannot.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from persisting.errors import CapacityError
from persisting.kv import open_kv_store
from tests.kv.kv_helpers import MODEL, in_flight, key

MiB = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def value(i: int) -> torch.Tensor:
    return torch.full((2, 2, 256, 512), i, dtype=torch.bfloat16)  # 1 MiB


def test_full_filesystem_fails_puts_cleanly_and_recovers(small_fs: Path) -> None:
    # The store believes it has 64 MiB; the filesystem has 12.
    with open_kv_store(small_fs, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as store:
        stored: list[int] = []
        with pytest.raises(CapacityError):
            for i in range(64):
                store.put(key(i), value(i))
                stored.append(i)
        assert 4 <= len(stored) < 12
        failed = len(stored)
        assert not store.contains(key(failed))
        # Reads keep working, bit-exact, and nothing half-written is visible.
        for i in stored:
            assert torch.equal(store.get(key(i)), value(i))
        assert in_flight(store.directory) == []
        with pytest.raises(CapacityError):
            store.put(key(failed), value(failed))
        # Space comes back (the operator grows the filesystem): puts work again.
        subprocess.run(["mount", "-o", "remount,size=48m", str(small_fs)], check=True)
        store.put(key(failed), value(failed))
        assert torch.equal(store.get(key(failed)), value(failed))
        # Space also comes back by removing chunks.
        subprocess.run(["mount", "-o", "remount,size=12m", str(small_fs)], check=False)
        store.batched_remove([key(i) for i in stored[:4]])
        store.put(key(100), value(100))
        assert store.contains(key(100))
    with open_kv_store(small_fs, MODEL, memory_bytes=0, disk_bytes=64 * MiB) as reopened:
        assert all(torch.equal(reopened.get(key(i)), value(i)) for i in stored[4:])
