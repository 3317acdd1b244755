"""The in-memory index both tiers keep: entries in LRU order plus prefix-chain links.

Each entry remembers its chain parent (the previous chunk of the same prefix), so the
index knows which chunks still have a stored child. A chunk without one is a *leaf*: the
tip of a stored chain. Evicting leaves only keeps every stored chain whole from its
start, which is what a prefix lookup can use (a suffix whose prefix is gone never hits).
The leaves are kept two ways, each O(1) to maintain: in least-recently-used order (the
``prefix`` policy takes the oldest) and in a list the ``value`` policy samples at random.

With :class:`~persisting.kv.eviction.reuse.ReuseStats` attached, the index reports every sighting
of a key -- an entry added by a put or a read that finds it (``get(touch=True)``) -- to
them and to its :class:`~persisting.kv.eviction.duel.RecencyDuel`, so they count uses, not copies:
loading what is already stored (on open, or files another process wrote) passes
``sighting=False``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, TypeVar

import numpy as np

from persisting.kv.eviction.duel import RecencyDuel
from persisting.kv.eviction.reuse import TICK_MASK, ReuseStats
from persisting.kv.keys import key_hash
from persisting.kv.layout import Layout


class Entry:
    """What a tier knows about one stored chunk. ``khash`` is the key's hash in the reuse
    stats and ``tick`` the clock at its last sighting in this process (0 without stats)."""

    __slots__ = ("checksum", "khash", "layout", "parent", "pins", "readers", "tick")

    def __init__(self, layout: Layout, checksum: int, parent: str | None):
        self.layout = layout
        self.checksum = checksum
        self.parent = parent
        self.pins = 0
        self.readers = 0
        self.khash = 0
        self.tick = 0

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

#: How many removed keys an index remembers to tell a chunk cut off from its prefix.
GONE_MEMORY = 1 << 16


class LruIndex(Generic[E]):
    """Key -> entry in least-recently-used order, with byte totals, child counts, leaves
    and (optionally) the reuse stats its sightings feed."""

    def __init__(self, reuse: ReuseStats | None = None) -> None:
        self._entries: OrderedDict[str, E] = OrderedDict()
        self._children: dict[str, int] = {}
        self._layouts: dict[Layout, Layout] = {}
        #: Leaves in LRU order, and the same leaves in a list (with each one's position)
        #: for sampling at random.
        self._leaf_order: OrderedDict[str, None] = OrderedDict()
        self._leaf_list: list[str] = []
        self._leaf_at: dict[str, int] = {}
        #: Stored chunks added while their parent was not stored, by parent. Such a parent
        #: may still be on its way (written by another thread or job of the same batch), so
        #: they count as orphans only once it is ``gone``.
        self._orphans: dict[str, set[str]] = {}
        #: The keys removed most recently (up to ``GONE_MEMORY``): a chunk whose parent is
        #: among them is cut off from its prefix (a lookup never reaches it) until the
        #: parent is stored again; one whose parent is merely absent may be racing it.
        self._gone: OrderedDict[str, None] = OrderedDict()
        self.reuse = reuse
        self.duel = RecencyDuel()
        self.bytes = 0
        #: Sightings waiting for :meth:`count_sightings` (None: counted at once).
        self._deferred: deque[tuple[E, int]] | None = None
        self._counting = threading.Lock()
        #: The newest clock a counted sighting returned: a queued entry's clock meanwhile.
        self._latest_tick = 0

    def __len__(self) -> int:
        return len(self._entries)

    def attach(self, reuse: ReuseStats, *, deferred: bool = False) -> None:
        """Report sightings to ``reuse`` from now on (entries already here are looked up
        in it, not counted). With ``deferred``, :meth:`get` and :meth:`add` only queue
        their sightings and the caller counts them with :meth:`count_sightings` once it
        let go of its lock: a shared table's sighting is system calls (four alone, two in
        a batch), and every reader of the tier waited for them under the tier's lock."""
        self.reuse = reuse
        self._deferred = deque() if deferred else None
        for key, entry in self._entries.items():
            entry.khash = key_hash(key)
            entry.tick = reuse.state(entry.khash)[1]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str, *, touch: bool = False) -> E | None:
        """The entry of ``key``; ``touch`` marks it used (most recent, and a sighting)."""
        entry = self._entries.get(key)
        if entry is not None and touch:
            self._entries.move_to_end(key)
            if key in self._leaf_order:
                self._leaf_order.move_to_end(key)
            if self.reuse is not None:
                self._sighted(entry)
        return entry

    def _sighted(self, entry: E) -> None:
        """Count a sighting of ``entry`` now, or queue it (see :meth:`attach`)."""
        assert self.reuse is not None
        if self._deferred is not None:
            entry.tick = max(entry.tick, self._latest_tick)  # recent, not "forgotten"
            self._deferred.append((entry, len(self._entries)))
            return
        entry.tick = self.reuse.sighted(entry.khash)
        self.duel.sighted(entry.khash, len(self._entries), self.reuse)

    def count_sightings(self) -> None:
        """Count the queued sightings, in one batch of the shared table's (thread-safe;
        call it holding none of the tier's locks). A count under way in another thread
        is waited for: when this returns, every sighting queued before the call is in the
        table. Until then an entry keeps its previous sighting's clock: at worst an
        eviction choice made in between is a little off, never data."""
        deferred, reuse = self._deferred, self.reuse
        if deferred is None or reuse is None:
            return
        with self._counting:
            batch: list[tuple[E, int]] = []
            while deferred:
                try:
                    batch.append(deferred.popleft())
                except IndexError:
                    break
            if not batch:
                return
            ticks = reuse.sighted_many([entry.khash for entry, _size in batch])
            for (entry, size), tick in zip(batch, ticks, strict=True):
                entry.tick = tick
                self.duel.sighted(entry.khash, size, reuse)
            self._latest_tick = ticks[-1]

    def add(self, key: str, entry: E, *, sighting: bool = True) -> None:
        """Insert as most recently used (the caller made sure the key is new); a
        ``sighting`` unless the entry is only being loaded (stored earlier)."""
        entry.layout = self._layouts.setdefault(entry.layout, entry.layout)  # share layouts
        self._entries[key] = entry
        self.bytes += entry.layout.nbytes
        if self.reuse is not None:
            entry.khash = key_hash(key)
            if sighting:
                self._sighted(entry)
            else:
                entry.tick = self.reuse.state(entry.khash)[1]
        if key not in self._children:
            self._add_leaf(key)
        self._orphans.pop(key, None)  # its stored children have their parent back
        self._gone.pop(key, None)
        parent = entry.parent
        if parent is not None:
            count = self._children.get(parent, 0)
            self._children[parent] = count + 1
            if count == 0:
                self._drop_leaf(parent)
            if parent not in self._entries:
                self._orphans.setdefault(parent, set()).add(key)

    def pop(self, key: str) -> E | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.bytes -= entry.layout.nbytes
        self._drop_leaf(key)
        self._gone[key] = None
        if len(self._gone) > GONE_MEMORY:
            self._gone.popitem(last=False)
        parent = entry.parent
        if parent is not None:
            orphans = self._orphans.get(parent)
            if orphans is not None:
                orphans.discard(key)
                if not orphans:
                    del self._orphans[parent]
            left = self._children.get(parent, 0) - 1
            if left > 0:
                self._children[parent] = left
            else:
                self._children.pop(parent, None)
                if parent in self._entries:  # the tip of its chain now: oldest leaf first
                    self._add_leaf(parent, oldest=True)
        return entry

    def _add_leaf(self, key: str, *, oldest: bool = False) -> None:
        self._leaf_order[key] = None
        if oldest:
            self._leaf_order.move_to_end(key, last=False)
        self._leaf_at[key] = len(self._leaf_list)
        self._leaf_list.append(key)

    def _drop_leaf(self, key: str) -> None:
        at = self._leaf_at.pop(key, None)
        if at is None:
            return
        del self._leaf_order[key]
        last = self._leaf_list.pop()
        if last != key:
            self._leaf_list[at] = last
            self._leaf_at[last] = at

    def _sighted_since(self, key: str) -> int | None:
        """The clock at a sighting of ``key`` newer than its place in the LRU order (one
        another process counted in a shared table), or None."""
        entry = self._entries.get(key)
        if entry is None or self.reuse is None or not entry.khash:
            return None
        last = self.reuse.state(entry.khash)[1]
        ahead = (last - entry.tick) & TICK_MASK
        return last if 0 < ahead <= TICK_MASK >> 1 else None

    def _catch_up(self, key: str, tick: int) -> None:
        """Move ``key`` to most recently used for a sighting at ``tick`` counted elsewhere
        (not a sighting here: it is counted already)."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.tick = tick
        self._entries.move_to_end(key)
        if key in self._leaf_order:
            self._leaf_order.move_to_end(key)

    def has_children(self, key: str) -> bool:
        return key in self._children

    def children(self, key: str) -> int:
        """How many stored chunks name ``key`` as their parent."""
        return self._children.get(key, 0)

    def oldest_leaves(self) -> Iterator[str]:
        """The leaves least recently used first, in the namespace's order: a leaf another
        process sighted since this one did (its clock in shared reuse stats is newer) is
        moved up to most recently used when the walk reaches it, and the walk goes on over
        the leaves not given yet (once per such sighting; never without shared stats).
        Lazy: do not add or pop while iterating."""
        given: set[str] = set()
        while True:
            moved: tuple[str, int] | None = None
            for key in self._leaf_order:
                if key in given:
                    continue
                tick = self._sighted_since(key)
                if tick is not None:
                    moved = (key, tick)
                    break
                given.add(key)
                yield key
            if moved is None:
                return
            self._catch_up(*moved)  # not while iterating the leaves

    def cut_off(self, entry: Entry) -> bool:
        """Whether ``entry``'s parent was removed lately (so a lookup never reaches it); a
        parent not stored yet -- still being written by another thread -- does not count."""
        parent = entry.parent
        return parent is not None and parent in self._gone

    def orphans(self) -> Iterator[str]:
        """Stored keys added while their parent was not stored, whose parent has since
        been removed (lazy: do not mutate while iterating)."""
        return (
            key
            for parent, children in self._orphans.items()
            if parent in self._gone
            for key in children
        )

    def leaf_count(self) -> int:
        return len(self._leaf_list)

    def leaf_at(self, i: int) -> str:
        """The ``i``-th leaf in no particular order (``0 <= i < leaf_count()``): draw ``i``
        at random to sample the leaves."""
        return self._leaf_list[i]

    def reorder(self, rank: dict[str, int]) -> None:
        """Put the keys in ``rank`` order (lowest first = least recently used); keys without
        a rank follow them, in their current order. Used to restore a saved eviction order."""
        last = len(rank)
        ordered = sorted(
            enumerate(self._entries), key=lambda item: (rank.get(item[1], last), item[0])
        )
        self._entries = OrderedDict((key, self._entries[key]) for _i, key in ordered)
        self._leaf_order = OrderedDict(
            (key, None) for key in self._entries if key in self._leaf_order
        )

    def lru_order(self) -> Iterator[str]:
        """Keys from least to most recently used (lazy: do not mutate while iterating)."""
        return iter(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    def items(self) -> list[tuple[str, E]]:
        return list(self._entries.items())


__all__ = ["DiskEntry", "Entry", "LruIndex", "MemoryEntry"]
