"""Counters and per-operation timings of a KV store, with optional listeners (metrics)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

#: listener(op, tier, seconds, nbytes, outcome) -- e.g. a Prometheus exporter.
Listener = Callable[[str, str, float, int, str], None]


class StoreStats:
    """Thread-safe counters; ``listeners`` see every timed operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.listeners: list[Listener] = []

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def record(self, op: str, tier: str, seconds: float, nbytes: int, outcome: str) -> None:
        with self._lock:
            self.counters[f"{op}_{outcome}"] += 1
            if tier:
                self.counters[f"{op}_{outcome}_{tier}"] += 1
            if nbytes:
                self.counters[f"{op}_bytes_{tier or 'any'}"] += nbytes
        for listener in self.listeners:
            listener(op, tier, seconds, nbytes, outcome)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)


__all__ = ["Listener", "StoreStats"]
