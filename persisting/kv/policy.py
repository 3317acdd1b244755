"""Pluggable eviction and admission policies for both tiers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from typing import TypeVar

import xxhash

from persisting.errors import ConfigError
from persisting.kv.index import LruIndex


class EvictionPolicy(ABC):
    """Orders a tier's keys from first to last eviction candidate."""

    name: str

    @abstractmethod
    def candidates(self, index: LruIndex) -> Iterator[str]: ...


class LRUEviction(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def candidates(self, index: LruIndex) -> Iterator[str]:
        return index.lru_order()


class PrefixAwareEviction(EvictionPolicy):
    """Chain suffixes before prefixes: a chunk with a stored child is kept while the child
    lives, because a suffix without its prefix is worthless but a prefix alone still hits."""

    name = "prefix"

    def candidates(self, index: LruIndex) -> Iterator[str]:
        deferred: list[str] = []
        for key in index.lru_order():
            if index.has_children(key):
                deferred.append(key)
            else:
                yield key
        # Everything left has children; evicting those in LRU order still frees space.
        yield from deferred


class AdmissionPolicy(ABC):
    """Decides whether a value may enter the disk tier."""

    name: str

    @abstractmethod
    def admit(self, key: str) -> bool: ...


class AlwaysAdmit(AdmissionPolicy):
    name = "always"

    def admit(self, key: str) -> bool:
        return True


class SecondSightingAdmit(AdmissionPolicy):
    """Admit a key to disk the second time a put offers it (lookups do not count), so
    one-off long prompts do not flush hot prefixes. Remembers up to ``remember`` recent
    64-bit key hashes. Only write-through (``sync``) puts ask; write-behind and write-back
    send what memory holds to disk."""

    name = "second_sighting"

    def __init__(self, remember: int = 1 << 20):
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._remember = remember

    def sighted(self, key: str) -> bool:
        """Record a sighting; True if the key had been seen before."""
        h = xxhash.xxh3_64_intdigest(key.encode())
        if h in self._seen:
            self._seen.move_to_end(h)
            return True
        self._seen[h] = None
        if len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        return False

    def admit(self, key: str) -> bool:
        return self.sighted(key)


_P = TypeVar("_P")

_EVICTION: dict[str, type[EvictionPolicy]] = {"lru": LRUEviction, "prefix": PrefixAwareEviction}
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
    "EvictionPolicy",
    "LRUEviction",
    "PrefixAwareEviction",
    "SecondSightingAdmit",
    "admission_policy",
    "eviction_policy",
]
