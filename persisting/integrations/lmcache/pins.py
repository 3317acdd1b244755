"""Pins an asynchronous lookup holds until its load, and their release.

LMCache's async loading path asks ``batched_async_contains(lookup_id, keys, pin=True)``,
then loads with ``batched_get_non_blocking(lookup_id, keys)`` -- usually. It may load fewer
keys than were pinned (it unpins a rounded-off tail itself with ``unpin``), and a request
that is cancelled never loads at all. So a lookup's pins are recorded per key: an ``unpin``
from LMCache of a key a pending lookup pinned is taken as releasing that lookup's pin; the
lookup's load releases every pin it still has, loaded or not; and the pins of a lookup
that is never loaded expire after ``ttl_s`` (a late load then only finds a miss or an
evictable chunk: recompute, never wrong data).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K")


@dataclass
class _Lookup(Generic[K]):
    deadline: float
    pins: Counter[str] = field(default_factory=Counter)
    keys: dict[str, K] = field(default_factory=dict)


class LookupPins(Generic[K]):
    """Pins per lookup id; every method returns the ``(key, text)`` pins to release."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lookups: dict[str, _Lookup[K]] = {}
        self._next_deadline = float("inf")
        self.expired = 0

    def add(self, lookup_id: str, pinned: list[tuple[K, str]]) -> None:
        """Record pins ``lookup_id`` took (one per ``(key, text)``)."""
        with self._lock:
            lookup = self._lookups.get(lookup_id)
            if lookup is None:
                lookup = self._lookups[lookup_id] = _Lookup(self._clock() + self.ttl_s)
                self._next_deadline = min(self._next_deadline, lookup.deadline)
            for key, text in pinned:
                lookup.pins[text] += 1
                lookup.keys[text] = key

    def released_elsewhere(self, text: str) -> None:
        """LMCache unpinned ``text`` itself: one lookup pin of it is gone already."""
        with self._lock:
            for lookup in self._lookups.values():
                if lookup.pins.get(text, 0) > 0:
                    lookup.pins[text] -= 1
                    return

    def finish(self, lookup_id: str) -> list[tuple[K, str]]:
        """The lookup is over (loaded, or failed): every pin it still holds."""
        with self._lock:
            lookup = self._lookups.pop(lookup_id, None)
        return _pins_of(lookup) if lookup is not None else []

    def expire(self) -> list[tuple[K, str]]:
        """Pins of lookups older than ``ttl_s`` (forgotten here; the caller releases them)."""
        now = self._clock()
        if now < self._next_deadline:
            return []
        out: list[tuple[K, str]] = []
        with self._lock:
            for lookup_id in [i for i, lk in self._lookups.items() if lk.deadline <= now]:
                out.extend(_pins_of(self._lookups.pop(lookup_id)))
            self._next_deadline = min(
                (lk.deadline for lk in self._lookups.values()), default=float("inf")
            )
            self.expired += len(out)
        return out

    def clear(self) -> list[tuple[K, str]]:
        """Every pin still held (the plugin is closing)."""
        with self._lock:
            lookups, self._lookups = list(self._lookups.values()), {}
            self._next_deadline = float("inf")
        return [pin for lookup in lookups for pin in _pins_of(lookup)]


def _pins_of(lookup: _Lookup[K]) -> list[tuple[K, str]]:
    return [(lookup.keys[text], text) for text, n in lookup.pins.items() for _ in range(n)]


__all__ = ["LookupPins"]
