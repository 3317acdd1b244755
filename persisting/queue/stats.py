"""What a queue backend counts, shared by its writer, its readers and its worker."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    """Running totals since the backend opened (plain ints: read without a lock)."""

    puts: int = 0
    flushes: int = 0
    flushed_records: int = 0
    compactions: int = 0
    cleanups: int = 0
    trimmed_records: int = 0
    errors: int = 0
    flush_latency_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))

    def as_dict(self) -> dict[str, Any]:
        """The totals, and ``flush_latency_ms`` summarizing the last 256 flushes."""
        return {
            "puts": self.puts,
            "flushes": self.flushes,
            "flushed_records": self.flushed_records,
            "flush_latency_ms": latency_summary(list(self.flush_latency_s)),
            "compactions": self.compactions,
            "cleanups": self.cleanups,
            "trimmed_records": self.trimmed_records,
            "errors": self.errors,
        }


def latency_summary(latencies: list[float]) -> dict[str, float | None]:
    """``last``, ``p50`` and ``max`` of ``latencies`` (seconds) in milliseconds."""
    if not latencies:
        return {"last": None, "p50": None, "max": None}
    return {
        "last": latencies[-1] * 1000,
        "p50": statistics.median(latencies) * 1000,
        "max": max(latencies) * 1000,
    }


__all__ = ["Counters", "latency_summary"]
