"""What the put paths and the read paths of one store share.

:class:`Tiers` holds the memory tier, the optional disk tier and shared pool, the one lock
that orders every change to the tiers' indexes, and the operation statistics. The put
paths (:mod:`persisting.kv.puts`) and the read paths (:mod:`persisting.kv.reads`) work on
it; :class:`~persisting.kv.store.KVStore` is the facade over both.
"""

from __future__ import annotations

import threading

import numpy as np

from persisting.cuda.host import StoreHostMemory
from persisting.errors import InvalidKeyError
from persisting.kv.disk_tier import DiskTier
from persisting.kv.keys import ChunkKey, key_string
from persisting.kv.load_plan import TierBandwidth
from persisting.kv.memory_tier import MemoryTier
from persisting.kv.read_activity import ReadActivity
from persisting.kv.stats import StoreStats
from persisting.shm import RecycledBuffers, SharedPool, aligned_buffer

KeyLike = ChunkKey | str


class Tiers:
    """One model's tiers and the lock and counters their users share."""

    def __init__(
        self,
        model: str,
        memory: MemoryTier,
        disk: DiskTier | None,
        pool: SharedPool | None,
        op_stats: StoreStats,
        host: StoreHostMemory,
        arena: RecycledBuffers | None = None,
    ):
        self.model = model
        self.memory = memory
        self.disk = disk
        self.pool = pool
        self.op_stats = op_stats
        #: Pinned memory and device copiers (plain memory on hosts without CUDA).
        self.host = host
        #: Private memory-tier buffers whose pages are reused (and huge where the kernel
        #: allows) when neither the shared pool nor pinned memory holds the tier.
        self.arena = arena
        #: Read bandwidth each tier achieved (load-or-recompute plans use it).
        self.bandwidth = TierBandwidth()
        #: Orders index changes of both tiers (never held across disk I/O or big copies).
        self.lock = threading.RLock()
        #: Gets in flight: the write-behind waits for them before each batch it writes.
        self.reads = ReadActivity()

    def key_text(self, key: KeyLike) -> str:
        """``key`` as a string, after checking that it belongs to this store's model."""
        text = key_string(key)
        model = key.model if isinstance(key, ChunkKey) else text.split("@", 1)[0]
        if model != self.model:
            raise InvalidKeyError(f"key {text!r} belongs to model {model!r}, not {self.model!r}")
        return text

    def on_disk(self, key: str) -> bool:
        return self.disk is not None and key in self.disk

    def memory_buffer(self, nbytes: int) -> np.ndarray:
        """Room for a memory-tier value: in the shared pool while it has room, else in the
        pinned region (where CUDA is), else in the private arena, else fresh pageable
        memory.

        The arena matters most: a fresh 28 MiB array faults 7,168 zeroed 4 KiB pages on
        first touch (37 ms here, ten times the copy), the arena's pages are faulted 2 MiB
        at a time once and then reused by later values.
        """
        if self.pool is not None:
            buffer = self.pool.allocate(nbytes)
            if buffer is not None:
                return buffer
            self.op_stats.count("pool_full")
        elif self.host.pin:
            buffer = self.host.memory_buffer(nbytes)
            if buffer is not None:
                return buffer
            self.op_stats.count("pinned_full")
        if self.arena is not None:
            buffer = self.arena.take(nbytes)
            if buffer is not None:
                return buffer
            self.op_stats.count("arena_full")
        return aligned_buffer(nbytes)


__all__ = ["KeyLike", "Tiers"]
