"""The in-memory index both tiers keep: entries in LRU order plus prefix-chain links.

Each entry remembers its chain parent (the previous chunk of the same prefix), so the
index knows which chunks still have a stored child; the prefix-aware eviction policy uses
that to drop a chain's suffix before its prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

import numpy as np

from persisting.kv.layout import Layout


class Entry:
    """What a tier knows about one stored chunk."""

    __slots__ = ("checksum", "layout", "parent", "pins", "readers")

    def __init__(self, layout: Layout, checksum: int, parent: str | None):
        self.layout = layout
        self.checksum = checksum
        self.parent = parent
        self.pins = 0
        self.readers = 0

    @property
    def busy(self) -> bool:
        """Pinned or being read: not evictable now."""
        return self.pins > 0 or self.readers > 0


class MemoryEntry(Entry):
    """A chunk held in memory; ``dirty`` until its bytes are also on disk."""

    __slots__ = ("buffer", "dirty")

    def __init__(
        self, layout: Layout, checksum: int, parent: str | None, buffer: np.ndarray, dirty: bool
    ):
        super().__init__(layout, checksum, parent)
        self.buffer = buffer
        self.dirty = dirty


class DiskEntry(Entry):
    """A chunk on disk: its payload file is named by the key's hash and ``tag``."""

    __slots__ = ("tag",)

    def __init__(self, layout: Layout, checksum: int, parent: str | None, tag: int):
        super().__init__(layout, checksum, parent)
        self.tag = tag


E = TypeVar("E", bound=Entry)


class LruIndex(Generic[E]):
    """Key -> entry in least-recently-used order, with byte totals and child counts."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, E] = OrderedDict()
        self._children: dict[str, int] = {}
        self._layouts: dict[Layout, Layout] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str, *, touch: bool = False) -> E | None:
        entry = self._entries.get(key)
        if entry is not None and touch:
            self._entries.move_to_end(key)
        return entry

    def add(self, key: str, entry: E) -> None:
        """Insert as most recently used (the caller made sure the key is new)."""
        entry.layout = self._layouts.setdefault(entry.layout, entry.layout)  # share layouts
        self._entries[key] = entry
        self.bytes += entry.layout.nbytes
        if entry.parent is not None:
            self._children[entry.parent] = self._children.get(entry.parent, 0) + 1

    def pop(self, key: str) -> E | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry.layout.nbytes
        if entry.parent is not None:
            left = self._children.get(entry.parent, 0) - 1
            if left > 0:
                self._children[entry.parent] = left
            else:
                self._children.pop(entry.parent, None)
        return entry

    def has_children(self, key: str) -> bool:
        return key in self._children

    def reorder(self, rank: dict[str, int]) -> None:
        """Put the keys in ``rank`` order (lowest first = least recently used); keys without
        a rank follow them, in their current order. Used to restore a saved eviction order."""
        last = len(rank)
        ordered = sorted(
            enumerate(self._entries), key=lambda item: (rank.get(item[1], last), item[0])
        )
        self._entries = OrderedDict((key, self._entries[key]) for _i, key in ordered)

    def lru_order(self) -> Iterator[str]:
        """Keys from least to most recently used (lazy: do not mutate while iterating)."""
        return iter(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def items(self) -> list[tuple[str, E]]:
        return list(self._entries.items())


__all__ = ["DiskEntry", "Entry", "LruIndex", "MemoryEntry"]
