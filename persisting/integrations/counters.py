"""Counters an engine integration exports, safe to bump from the engine's threads."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class LockedCounters:
    """Integer fields a subclass declares, added to under one lock and read all at once."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}


__all__ = ["LockedCounters"]
