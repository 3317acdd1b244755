"""Shared test data for the KV tests: keys and deterministic tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from persisting.kv import ChunkKey, KVStore
from persisting.kv.disk.tier import DiskTier
from persisting.kv.memory_tier import MemoryTier

MODEL = "meta-llama/Llama-3-8B"
#: Room a disk budget needs beside its payload files for the metadata table and the
#: directories (the budget covers them too); less than one ``big`` value.
OVERHEAD_ROOM = 512 << 10


def disk_tier(store: KVStore) -> DiskTier:
    """``store``'s disk tier, for tests of its files, index and byte accounting. White-box:
    the store keeps its tiers private, and no caller but such a test needs them."""
    disk = store._tiers.disk
    assert disk is not None, "the store has no disk tier"
    return disk


def memory_tier(store: KVStore) -> MemoryTier:
    """``store``'s memory tier (white-box, as :func:`disk_tier`)."""
    return store._tiers.memory


def key(
    i: int, *, worker: int = 0, world: int = 1, model: str = MODEL, dtype: str = "bfloat16"
) -> ChunkKey:
    """Chunk ``i``'s key; ``dtype`` must be its value's (a put checks it)."""
    return ChunkKey(model, world, worker, i * 7919 - 50_000, dtype)


def tensor(seed: int, tokens: int = 16, hidden: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, tokens, hidden, generator=g).to(torch.bfloat16)


def big(seed: int) -> torch.Tensor:
    """A 1 MiB value: large enough that the metadata and directories are small beside it."""
    return tensor(seed, tokens=64, hidden=1024)


def shared_dir_worker(root: str, worker: int, capacity: int, rounds: int, barrier, results) -> None:
    """One of several processes hammering one model directory (see test_multiprocess)."""
    import random

    from persisting.kv import open_kv_store

    rng = random.Random(worker)
    wrong = misses = hits = 0
    with open_kv_store(root, MODEL, memory_bytes=0, disk_bytes=capacity) as store:
        barrier.wait()
        for r in range(rounds):
            i = rng.randrange(40)
            store.put(key(i), big(i))
            j = rng.randrange(40)
            got = store.get(key(j))
            if got is None:
                misses += 1
            elif torch.equal(got, big(j)):
                hits += 1
            else:
                wrong += 1
            if r % 10 == 0:
                store.refresh()
            if r % 7 == worker:
                store.remove(key(rng.randrange(40)))
        store.refresh()
        seen = sum(store.contains(key(i)) for i in range(40))
    results.put((worker, wrong, hits, misses, seen))


def in_flight(directory: Path) -> list[Path]:
    """The in-flight payload files of a model directory (written beside their final place,
    ``payload/<hh>/*.tmp``, and renamed within it)."""
    return sorted(directory.glob("payload/*/*.tmp"))


def make_uncreatable(directory: Path, key_text: str) -> None:
    """Make creating the payload file of ``key_text`` fail with ENOTDIR: its
    ``payload/<hh>`` directory becomes a plain file (it must hold no file yet)."""
    from persisting.kv.keys import key_hash

    subdir = directory / "payload" / f"{key_hash(key_text) >> 56:02x}"
    if subdir.is_dir():
        subdir.rmdir()  # fails if a stored chunk lives there: pick another key
    subdir.write_bytes(b"not a directory")
