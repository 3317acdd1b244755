"""Hit ratio against capacity for a trace: the store's policy, LRU and the offline optimum.

The answer to "how much memory and disk does my workload need": for each capacity (in
blocks: a budget divided by what a block takes, :func:`blocks_in`) the token hit ratio the
store's eviction policy reaches on the trace, and LRU's and Belady's MIN's
(:mod:`persisting.bench.simulate`), all worked out in blocks without storing a byte, so a
capacity far beyond this machine costs nothing. With a :class:`~persisting.planner.ttft.
TtftModel`, each point also says what its hits save in time to first token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from persisting.bench.simulate import Requests, run
from persisting.kv.disk.payload_files import file_size
from persisting.planner.ttft import TtftModel


@dataclass(frozen=True)
class TierBlocks:
    """Whole blocks each tier holds, and the capacity the references are run at: the
    larger tier's (every chunk in memory is also written to disk, so the tiers are
    inclusive and the disk tier holds all a two-tier store holds)."""

    memory: int
    disk: int

    @property
    def reference(self) -> int:
        return max(self.memory, self.disk)


def blocks_in(memory_bytes: int, disk_bytes: int, object_bytes: int, objects: int) -> TierBlocks:
    """Blocks the tiers hold when a block is ``objects`` objects of ``object_bytes`` (one
    per rank): memory counts payload bytes; disk counts a payload file each (a 4 KiB
    header, then 4 KiB blocks) and is an upper bound, as the disk budget also pays for
    the namespace's metadata."""
    memory = memory_bytes // (objects * object_bytes) if memory_bytes > 0 else 0
    disk = disk_bytes // (objects * file_size(object_bytes)) if disk_bytes > 0 else 0
    return TierBlocks(memory, disk)


@dataclass(frozen=True)
class CurvePoint:
    """One capacity's hit ratios (``policies`` maps a name to its token hit ratio) and,
    with a TTFT model, each one's mean TTFT saving per request, in ms."""

    capacity_blocks: int
    capacity_bytes: int
    policies: dict[str, float]
    ttft_saving_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "capacity_bytes": self.capacity_bytes,
            **{f"{name}_token_hit_rate": rate for name, rate in self.policies.items()},
            **{f"{name}_ttft_saving_ms": ms for name, ms in self.ttft_saving_ms.items()},
        }


def default_capacities(requests: Requests, points: int = 8) -> list[int]:
    """``points`` capacities spaced evenly on a log scale from 1% of the trace's distinct
    blocks to all of them (where every policy reaches the trace's best)."""
    distinct = len({block for blocks in requests for block in blocks})
    return log_spaced(max(1, distinct // 100), max(1, distinct), points)


def hit_curve(
    requests: Requests,
    capacities: Sequence[int],
    *,
    eviction: str,
    block_bytes: int,
    block_tokens: int,
    ttft: TtftModel | None = None,
    on_point: Callable[[], None] | None = None,
) -> list[CurvePoint]:
    """The hit ratios of the store's ``eviction`` policy, LRU and MIN at each capacity;
    ``on_point`` is called after each (policy, capacity) run, for progress."""
    names = {eviction: f"store:{eviction}", "lru": "lru", "min": "min"}
    requests_n = max(1, len(requests))
    out = []
    for capacity in capacities:
        rates: dict[str, float] = {}
        savings: dict[str, float] = {}
        for name, policy in names.items():
            result = run(requests, capacity, policy)
            rates[name] = result.token_hit_rate
            if ttft is not None:
                hit_tokens = result.hit_blocks * block_tokens
                savings[name] = ttft.saving_s_per_hit_token * hit_tokens / requests_n * 1e3
            if on_point is not None:
                on_point()
        out.append(CurvePoint(capacity, capacity * block_bytes, rates, savings))
    return out


def smallest_capacity_reaching(
    points: Sequence[CurvePoint], policy: str, share: float
) -> int | None:
    """The smallest capacity at which ``policy`` reaches ``share`` of the best ratio seen
    (None when no point does)."""
    best = max((p.policies[policy] for p in points), default=0.0)
    for point in sorted(points, key=lambda p: p.capacity_blocks):
        if best and point.policies[policy] >= share * best - 1e-12:
            return point.capacity_blocks
    return None


def log_spaced(low: int, high: int, points: int) -> list[int]:
    """``points`` integers from ``low`` to ``high`` spaced evenly on a log scale."""
    if points < 2 or high <= low:
        return [max(1, high)]
    step = math.log(high / low) / (points - 1)
    return sorted({max(1, round(low * math.exp(step * i))) for i in range(points)})


__all__ = [
    "CurvePoint",
    "TierBlocks",
    "blocks_in",
    "default_capacities",
    "hit_curve",
    "log_spaced",
    "smallest_capacity_reaching",
]
