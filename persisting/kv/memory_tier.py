"""The memory tier: page-aligned copies of chunks under a byte budget, policy-evicted.

Pinned chunks and chunks being read are never evicted. :meth:`MemoryTier.insert` returns
the entries it evicted to make room; the caller writes those still ``dirty`` (not yet on
disk: a write-behind in flight, or write-back mode) to disk instead of losing them.
"""

from __future__ import annotations

import numpy as np

from persisting.kv.eviction.policy import EvictionPolicy
from persisting.kv.eviction.reuse import ReuseStats, slots_for
from persisting.kv.index import LruIndex, MemoryEntry
from persisting.kv.layout import Layout

#: The memory tier's reuse stats remember at least this many keys (a 2 MiB table): reuse in real
#: traces comes back after far more chunks than a small tier holds.
MIN_MEMORY_SLOTS = 1 << 17


class MemoryTier:
    """Not thread-safe by itself: the store serialises calls under its lock."""

    def __init__(self, capacity: int, policy: EvictionPolicy):
        self.capacity = capacity
        self.policy = policy
        reuse = (
            ReuseStats.in_memory(slots_for(capacity, MIN_MEMORY_SLOTS))
            if policy.uses_reuse_stats
            else None
        )
        self.index: LruIndex[MemoryEntry] = LruIndex(reuse)
        self.evictions = 0

    @property
    def used(self) -> int:
        return self.index.bytes

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def sizes(self) -> list[tuple[str, int]]:
        """Every key with its payload size, least recently used first."""
        return [(key, entry.layout.nbytes) for key, entry in self.index.items()]

    def figures(self) -> dict[str, int]:
        """The tier's part of a store's ``stats()``."""
        return {
            "memory_items": len(self.index),
            "memory_bytes": self.used,
            "memory_capacity": self.capacity,
            "memory_evictions": self.evictions,
        }

    def pin(self, key: str) -> bool:
        """Count a pin of ``key`` (False: not here)."""
        entry = self.index.get(key)
        if entry is not None:
            entry.pins += 1
        return entry is not None

    def unpin(self, key: str) -> bool:
        """Take back a pin of ``key`` (False: not here, or not pinned)."""
        entry = self.index.get(key)
        if entry is None or entry.pins == 0:
            return False
        entry.pins -= 1
        return True

    def removable(self, key: str, *, force: bool) -> bool:
        """Whether a remove may drop ``key`` now: not being read, and unpinned unless
        ``force`` (True when it is not here)."""
        entry = self.index.get(key)
        return entry is None or not ((entry.pins > 0 and not force) or entry.readers > 0)

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity

    def make_room(self, nbytes: int) -> list[tuple[str, MemoryEntry]]:
        """Evict until ``nbytes`` more fit; returns the evicted entries (empty if impossible).

        Victims are chosen before any is removed, so a tier full of pinned chunks is left
        untouched when room cannot be made.
        """
        need = self.index.bytes + nbytes - self.capacity
        if need <= 0:
            return []
        victims = self.policy.victims(self.index, need, _nbytes, _evictable)
        if sum(entry.layout.nbytes for _key, entry in victims) < need:
            return []
        evicted = []
        for key, _entry in victims:
            entry = self.index.pop(key)
            if entry is not None:
                evicted.append((key, entry))
        self.evictions += len(evicted)
        return evicted

    def insert(
        self,
        key: str,
        layout: Layout,
        buffer: np.ndarray,
        checksum: int,
        parent: str | None,
        *,
        dirty: bool,
    ) -> tuple[bool, list[tuple[str, MemoryEntry]]]:
        """Adopt ``buffer`` (a private copy the caller made outside any lock); returns
        (inserted, evicted entries)."""
        if key in self.index or not self.fits(layout.nbytes):
            return False, []
        if self.index.bytes + layout.nbytes > self.capacity:
            evicted = self.make_room(layout.nbytes)
            if not evicted:
                return False, []
        else:
            evicted = []
        self.index.add(key, MemoryEntry(layout, checksum, parent, buffer, dirty))
        return True, evicted

    def remove(self, key: str) -> MemoryEntry | None:
        return self.index.pop(key)


def _evictable(_key: str, entry: MemoryEntry) -> bool:
    return not entry.busy


def _nbytes(entry: MemoryEntry) -> int:
    return entry.layout.nbytes


__all__ = ["MemoryTier"]
