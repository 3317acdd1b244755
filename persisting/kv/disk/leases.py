"""Read leases, counted: each lease is a token with a deadline, and releasing one ends it
alone -- never another holder's lease on the same key.

A key is leased while any of its tokens' deadlines lies ahead on the owner's clock; the
disk tier does not evict it meanwhile. Not thread-safe: the disk tier holds its index lock
around every call (a lease lives and dies with its index entry).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from persisting.kv.layout import Layout

#: A monotonic clock in seconds (``time.monotonic``; tests pass one they advance).
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Location:
    """Where a chunk's payload bytes are on disk (for same-host readers under a lease), and
    the ``token`` of the lease that keeps them there: releasing that token ends this lease
    only, never another holder's."""

    path: str
    offset: int
    nbytes: int
    layout: Layout
    checksum: int
    token: int = 0


class Leases:
    """Key -> {token: deadline}."""

    def __init__(self, clock: Clock = time.monotonic):
        self.clock = clock
        self._held: dict[str, dict[int, float]] = {}
        self._tokens = itertools.count(1)

    def take(self, key: str, ttl_s: float) -> int:
        """A new token for ``key``, held ``ttl_s`` seconds (not held at all for ``<= 0``)."""
        token = next(self._tokens)
        if ttl_s > 0:
            self._held.setdefault(key, {})[token] = self.clock() + ttl_s
        return token

    def renew(self, key: str, token: int, ttl_s: float) -> bool:
        """Push ``token`` out to ``ttl_s`` seconds from now; False if it is not held."""
        held = self._held.get(key)
        if held is None or token not in held:
            return False
        held[token] = max(held[token], self.clock() + ttl_s)
        return True

    def release(self, key: str, token: int) -> bool:
        """End ``token`` (other tokens of ``key`` stay); False if it was not held."""
        held = self._held.get(key)
        if held is None or held.pop(token, None) is None:
            return False
        if not held:
            del self._held[key]
        return True

    def total(self) -> int:
        """Leases of every key whose deadline lies ahead."""
        now = self.clock()
        return sum(d > now for held in self._held.values() for d in held.values())

    def held(self, key: str, now: float | None = None) -> bool:
        """Whether a lease of ``key`` holds at ``now`` (default: the clock's now); the
        expired ones are forgotten."""
        held = self._held.get(key)
        if not held:
            return False
        now = self.clock() if now is None else now
        for token in [t for t, deadline in held.items() if deadline <= now]:
            del held[token]
        if not held:
            del self._held[key]
            return False
        return True

    def drop(self, key: str) -> None:
        """Forget every lease of ``key`` (its entry left the index)."""
        self._held.pop(key, None)


__all__ = ["Clock", "Leases", "Location"]
