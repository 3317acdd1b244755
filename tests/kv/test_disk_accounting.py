"""The disk budget covers what the store puts on disk (issue 13, item 12): payload files,
the Lance metadata table, the ``payload/<hh>`` directories and the small files, so ``du``
of a model directory stays within it and ``stats()`` says what ``du`` says."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from persisting.errors import CapacityError
from persisting.kv import open_kv_store
from tests.kv.kv_helpers import MODEL, key

MiB = 1 << 20


def du_bytes(path: Path) -> int:
    out = subprocess.run(
        ["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[0])


def value(i: int) -> torch.Tensor:
    return torch.full((2, 4, 8, 512), i, dtype=torch.bfloat16)  # 64 KiB


def test_du_of_a_small_budget_store_stays_within_the_budget(root: Path) -> None:
    capacity = 4 * MiB
    peak = 0
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=capacity) as store:
        for i in range(240):  # ~15 MiB of puts through a 4 MiB budget, ~100 payload dirs
            store.put(key(i), value(i))
            if i % 24 == 23:
                store.flush()
                peak = max(peak, du_bytes(store.directory))
        store.flush()
        du = du_bytes(store.directory)
        assert peak <= capacity and du <= capacity, (peak, du)
        stats = store.stats()
        assert stats["disk_evictions"] > 150
        assert stats["disk_overhead_bytes"] > 256 << 10  # directories and metadata counted
        assert stats["disk_bytes"] == du  # the store's figure is what du says
        assert torch.equal(store.get(key(239)), value(239))
    assert du_bytes(store.directory) <= capacity


def test_a_value_that_fits_only_without_the_overhead_is_refused(root: Path) -> None:
    capacity = 96 << 10  # a 68 KiB payload file fits, but not beside the metadata
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=capacity) as store:
        with pytest.raises(CapacityError, match="metadata and directories"):
            store.put(key(1), value(1))
        store.flush()
        assert du_bytes(store.directory) <= capacity
        assert not store.contains(key(1))
