"""Pluggable eviction and admission policies for both tiers."""

from __future__ import annotations

import functools
import math
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from persisting.errors import ConfigError
from persisting.kv.eviction.reuse import TICK_MASK, ReuseStats
from persisting.kv.index import Entry, LruIndex
from persisting.kv.keys import key_hash, rank_keys
from persisting.kv.layout import Layout, token_count

#: Whether a tier may evict an entry now (not pinned, not being read, not leased).
Evictable = Callable[[str, Any], bool]


class EvictionPolicy(ABC):
    """Orders a tier's keys from first to last eviction candidate."""

    name: str
    #: Whether the tiers must keep :class:`~persisting.kv.eviction.reuse.ReuseStats` for it.
    uses_reuse_stats: bool = False

    @abstractmethod
    def candidates(self, index: LruIndex[Any], evictable: Evictable | None = None) -> Iterator[str]:
        """Distinct keys, best victim first, each ``evictable`` (when given). Lazy: the
        caller takes what it needs, then removes them (not while iterating)."""

    def groups(
        self, index: LruIndex[Any], evictable: Evictable | None = None
    ) -> Iterator[list[str]]:
        """The candidates in groups that go together (one key each, unless the policy
        keeps a chunk's tensor-parallel ranks together)."""
        return ([key] for key in self.candidates(index, evictable))

    def victims(
        self,
        index: LruIndex[Any],
        need: int,
        size_of: Callable[[Any], int],
        evictable: Evictable | None = None,
    ) -> list[tuple[str, Any]]:
        """Whole groups of victims, best first, until they free ``need`` bytes (an entry
        frees ``size_of(entry)``); fewer when nothing more may go. Chosen before any is
        removed: the caller removes them."""
        chosen: list[tuple[str, Any]] = []
        freed = 0
        for group in self.groups(index, evictable):
            for key in group:
                entry = index.get(key)
                if entry is not None:
                    chosen.append((key, entry))
                    freed += size_of(entry)
            if freed >= need:
                break
        return chosen


def _usable(
    index: LruIndex[Any], keys: Iterable[str], evictable: Evictable | None
) -> Iterator[str]:
    for key in keys:
        entry = index.get(key)
        if entry is not None and (evictable is None or evictable(key, entry)):
            yield key


class LRUEviction(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def candidates(self, index: LruIndex[Any], evictable: Evictable | None = None) -> Iterator[str]:
        return _usable(index, index.lru_order(), evictable)


class PrefixAwareEviction(EvictionPolicy):
    """Chain suffixes before prefixes: a chunk with a stored child is kept while the child
    lives, because a suffix without its prefix is worthless but a prefix alone still hits.
    Chunks whose parent is gone go first (a lookup never reaches them), then the oldest
    leaf (a chain's tip that just lost its child counts as old)."""

    name = "prefix"

    def candidates(self, index: LruIndex[Any], evictable: Evictable | None = None) -> Iterator[str]:
        return _oldest_first(index, evictable)


class ValueEviction(EvictionPolicy):
    """Keep the chunks worth the most per byte: evict the leaf of least *value density*,
    ``sightings x tokens per byte / (age + 2 x entries)``, among ``SAMPLES`` leaves drawn
    at random -- while frequency pays; else the oldest leaf.

    - ``sightings``: puts and hits of the key, remembered after it is evicted (ghosts:
      :class:`~persisting.kv.eviction.reuse.ReuseStats`), so a chunk used often stays longer and
      one that comes back is known again: frequency.
    - Whether frequency pays is the tier's :class:`~persisting.kv.eviction.duel.RecencyDuel`'s
      call: it plays LRU and this density beside the tier on keys alone and turns
      frequency on only while the density would have hit clearly more. Off, the tier
      evicts its oldest leaf, exactly (LRU among the chains' tips): the policy does not
      fall behind LRU where frequency predicts nothing.
    - ``age``: sightings of any key since this one's last, against the tier's size in
      chunks: recency (untouched for two tier-fulls of traffic, a chunk is worth half).
    - ``tokens per byte``: what a miss costs to recompute per byte the chunk holds.
    - Only leaves (chunks without a stored child) are candidates: a chain is eaten from its
      tip, so what stays is always a usable prefix, and a prefix many chains share stays
      while any of them lives. A chunk whose parent is not stored is worth nothing (a
      lookup never reaches it) and goes first. A chunk's other tensor-parallel ranks go
      with it.

    Each eviction costs ``SAMPLES`` table lookups, whatever the tier's size. The counts are
    the tier's :class:`~persisting.kv.eviction.reuse.ReuseStats`: shared by the processes writing a
    namespace and kept across restarts for a disk tier. The draws are seeded, so a replay
    evicts the same chunks every run.
    """

    name = "value"
    uses_reuse_stats = True
    #: Leaves drawn per eviction. The least dense of ``k`` random leaves lies, on average,
    #: in the least dense ``1/(k + 1)`` of them (about 3% for 32), whatever the tier's size,
    #: for ``k`` table lookups: close to the exact minimum at a cost that does not grow with
    #: the tier (sampled eviction, as Redis's approximated LRU/LFU).
    SAMPLES = 32
    #: The age at which a chunk's worth halves, in tier-fulls of sightings (the tier's
    #: entries). Under LRU a chunk lives about one tier-full of traffic after its last use;
    #: with a half-life of two, a chunk sighted ``r`` times outranks a fresh one sighted
    #: once until it is ``2 x (r - 1)`` tier-fulls old -- long enough to bridge reuse that
    #: comes back after more traffic than the tier holds (where frequency beats LRU), short
    #: enough that what was hot long ago goes.
    HALF_LIFE = 2

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def density(self, index: LruIndex[Any], entry: Entry) -> float:
        """The value per byte of keeping ``entry`` (higher: keep longer)."""
        reuse = index.reuse
        assert reuse is not None
        if index.cut_off(entry):
            return 0.0  # its prefix was evicted: a lookup never reaches it
        refs, last = reuse.state(entry.khash)
        if refs == 0:  # forgotten (its slot was taken): what this process saw of it
            refs, last = 1, entry.tick
        age = (reuse.now - last) & TICK_MASK
        horizon = self.HALF_LIFE * max(1, len(index))
        return float(refs) * miss_cost_per_byte(entry.layout) / (age + horizon)

    def candidates(self, index: LruIndex[Any], evictable: Evictable | None = None) -> Iterator[str]:
        for group in self.groups(index, evictable):
            yield from group

    def groups(
        self, index: LruIndex[Any], evictable: Evictable | None = None
    ) -> Iterator[list[str]]:
        if index.reuse is None:  # stats not kept: the oldest leaves first
            yield from PrefixAwareEviction().groups(index, evictable)
            return
        # Recency alone (the duel has frequency off): the oldest leaf, exactly.
        oldest = None if index.duel.weight else _oldest_first(index, evictable)
        taken: set[str] = set()
        # Parents whose every stored child was taken: leaves once those go.
        became_leaves: list[str] = []
        gone_children: dict[str, int] = {}
        while True:
            if oldest is None:
                best = self._least_dense(index, evictable, taken, became_leaves)
            else:
                best = next((key for key in oldest if key not in taken), None)
            best_entry = None if best is None else index.get(best)
            if best is None or best_entry is None:
                break
            # The chunk's other ranks go with it: a block is a hit only with all of them.
            group = [(best, best_entry)]
            for other, entry in _siblings(index, best, taken, evictable):
                if index.children(other) <= gone_children.get(other, 0):  # a leaf there too
                    group.append((other, entry))
            for key, entry in group:
                taken.add(key)
                parent = entry.parent
                if parent is not None and parent in index and parent not in taken:
                    gone = gone_children.get(parent, 0) + 1
                    gone_children[parent] = gone
                    if gone == index.children(parent):
                        became_leaves.append(parent)
            yield [key for key, _entry in group]
        # Every draw met a busy or taken key: walk the rest, oldest leaves first.
        rest = PrefixAwareEviction().candidates(index, evictable)
        yield from ([key] for key in rest if key not in taken)

    def _least_dense(
        self,
        index: LruIndex[Any],
        evictable: Evictable | None,
        taken: set[str],
        became_leaves: list[str],
    ) -> str | None:
        """The leaf of least density among ``SAMPLES`` drawn (None: every draw was busy
        or taken)."""
        best: str | None = None
        best_density = math.inf
        for _ in range(self.SAMPLES):
            pool = index.leaf_count() + len(became_leaves)
            if pool == 0:
                break
            i = self._rng.randrange(pool)
            stored = index.leaf_count()
            key = index.leaf_at(i) if i < stored else became_leaves[i - stored]
            entry = index.get(key)
            if key in taken or entry is None or (evictable and not evictable(key, entry)):
                continue
            density = self.density(index, entry)
            if density < best_density:
                best, best_density = key, density
        return best


def _oldest_first(index: LruIndex[Any], evictable: Evictable | None) -> Iterator[str]:
    """Orphans, then leaves least recently used first (in the namespace's order: see
    :meth:`~persisting.kv.index.LruIndex.oldest_leaves`), then the rest in LRU order
    (evicting those still frees space; reached only when every leaf is busy or taken).
    Lazy: the caller stops as soon as it has room, and removes what it took only after
    the walk."""
    given: set[str] = set()
    orphans = (k for k in index.orphans() if not index.children(k))
    for key in _usable(index, orphans, evictable):
        given.add(key)
        yield key
    for walk in (index.oldest_leaves(), index.lru_order()):
        for key in _usable(index, walk, evictable):
            if key not in given:
                given.add(key)
                yield key


def _siblings(
    index: LruIndex[Any], key: str, taken: set[str], evictable: Evictable | None
) -> Iterator[tuple[str, Entry]]:
    """The stored, evictable keys of ``key``'s chunk on the other tensor-parallel ranks
    (:func:`~persisting.kv.keys.rank_keys`)."""
    for other in rank_keys(key):
        if other == key or other in taken:
            continue
        entry = index.get(other)
        if entry is not None and (evictable is None or evictable(other, entry)):
            yield other, entry


@functools.lru_cache(maxsize=1024)
def miss_cost_per_byte(layout: Layout) -> float:
    """Tokens a miss of a chunk of ``layout`` recomputes, per byte it holds (a chunk of a
    format without a token axis counts as one token)."""
    return token_count(layout) / max(1, layout.nbytes)


class AdmissionPolicy(ABC):
    """Decides whether a value may enter the disk tier."""

    name: str

    @abstractmethod
    def admit(self, key: str) -> bool: ...

    def attach(self, reuse: ReuseStats | None) -> None:  # noqa: B027  # optional hook
        """Told the disk tier's reuse stats (None without them), once the tiers are open."""


class AlwaysAdmit(AdmissionPolicy):
    name = "always"

    def admit(self, key: str) -> bool:
        return True


class SecondSightingAdmit(AdmissionPolicy):
    """Admit a key to disk the second time a put offers it (lookups do not count), so
    one-off long prompts do not flush hot prefixes and are never written. Only
    write-through (``sync``) puts ask; write-behind and write-back send what memory holds
    to disk.

    The keys seen once (ghosts) are remembered in the disk tier's reuse stats when it keeps
    them (``eviction = "value"``): shared by every process writing the namespace, and kept
    across restarts. Otherwise this process remembers up to ``remember`` recent key hashes.
    """

    name = "second_sighting"

    def __init__(self, remember: int = 1 << 20):
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._remember = remember
        self._reuse: ReuseStats | None = None

    def attach(self, reuse: ReuseStats | None) -> None:
        """Remember sightings in ``reuse`` (a disk tier's stats) instead of privately."""
        self._reuse = reuse

    def sighted(self, key: str) -> bool:
        """Record a sighting; True if the key had been seen before."""
        h = key_hash(key)
        if h in self._seen:
            self._seen.move_to_end(h)
            return True
        self._seen[h] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return False

    def admit(self, key: str) -> bool:
        if self._reuse is None:
            return self.sighted(key)
        khash = key_hash(key)
        if self._reuse.state(khash)[0]:
            return True  # seen before: the write that follows counts this sighting
        self._reuse.sighted(khash)
        return False


_P = TypeVar("_P")

_EVICTION: dict[str, type[EvictionPolicy]] = {
    "lru": LRUEviction,
    "prefix": PrefixAwareEviction,
    "value": ValueEviction,
}
_ADMISSION: dict[str, type[AdmissionPolicy]] = {
    "always": AlwaysAdmit,
    "second_sighting": SecondSightingAdmit,
}


def eviction_policy(name: str | EvictionPolicy) -> EvictionPolicy:
    """The eviction policy named ``name`` (a policy object passes through)."""
    if isinstance(name, EvictionPolicy):
        return name
    return _named("eviction", _EVICTION, name)()


def admission_policy(name: str | AdmissionPolicy) -> AdmissionPolicy:
    """The admission policy named ``name`` (a policy object passes through)."""
    if isinstance(name, AdmissionPolicy):
        return name
    return _named("admission", _ADMISSION, name)()


def _named(kind: str, policies: dict[str, type[_P]], name: str) -> type[_P]:
    if name not in policies:
        raise ConfigError(f"unknown {kind} policy {name!r}; choose from {sorted(policies)}")
    return policies[name]


__all__ = [
    "AdmissionPolicy",
    "AlwaysAdmit",
    "Evictable",
    "EvictionPolicy",
    "LRUEviction",
    "PrefixAwareEviction",
    "SecondSightingAdmit",
    "ValueEviction",
    "admission_policy",
    "eviction_policy",
    "miss_cost_per_byte",
]
