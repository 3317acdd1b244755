"""Hit ratios of a block trace at a capacity in blocks, without storing a byte.

Definitions (the ones the published figures use, and the replay's references):

- Requests are taken in trace order; each is its blocks (prefix-chained ids), every block
  holding the same number of tokens.
- A request's **hit** is the leading run of its blocks already cached when it arrives (it
  stops at the first block not cached: a later block is useless without the ones before
  it). The **token hit ratio** is hit blocks over all blocks, summed over the requests.
- After the hit is counted, every block of the request is used in order: a cached one is
  used again, one not cached is inserted -- **every block is admitted** -- evicting first
  when the cache holds ``capacity`` blocks.
- **LRU** evicts the least recently used block. **MIN** (Belady's offline optimum) evicts
  the cached block whose next use is farthest in the future (never used again: first),
  never the block being inserted. With prefix hits MIN is a reference, not a proven bound:
  a policy that declines blocks, or keeps whole prefixes, may beat it.

:func:`policy_run` plays the same requests through a real memory tier and eviction
policy (:mod:`persisting.kv`) holding one byte per block, the calls a store's replay makes:
a lookup of the leading run, a read of the hits, a put of the rest with each block's
parent. So the planner's figure for a policy is the store's own, at any capacity.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from persisting.kv.eviction.policy import eviction_policy
from persisting.kv.layout import Layout
from persisting.kv.memory_tier import MemoryTier

Requests = Sequence[Sequence[Hashable]]
#: The reference policies, and the store's (any eviction policy name).
REFERENCES = ("lru", "min")


@dataclass(frozen=True)
class CacheRun:
    """What one policy hit at one capacity."""

    policy: str
    capacity_blocks: int
    hit_blocks: int
    blocks: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0


def lru_run(requests: Requests, capacity: int) -> CacheRun:
    """LRU at ``capacity`` blocks (see the module's definitions)."""
    cache: OrderedDict[Hashable, None] = OrderedDict()
    hits = total = 0
    for blocks in requests:
        hits += _leading(blocks, cache)
        total += len(blocks)
        for block in blocks:
            if block in cache:
                cache.move_to_end(block)
                continue
            if capacity <= 0:
                continue
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[block] = None
    return CacheRun("lru", capacity, hits, total)


def belady_run(requests: Requests, capacity: int) -> CacheRun:
    """Belady's MIN at ``capacity`` blocks (see the module's definitions)."""
    flat = [block for blocks in requests for block in blocks]
    never = len(flat)
    next_use = [never] * len(flat)
    seen: dict[Hashable, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        next_use[i] = seen.get(flat[i], never)
        seen[flat[i]] = i
    cached: dict[Hashable, int] = {}  # block -> its next use
    farthest: list[tuple[int, int, Hashable]] = []  # (-next use, tie-break, block), lazy
    hits = total = i = 0
    for blocks in requests:
        hits += _leading(blocks, cached)
        total += len(blocks)
        for block in blocks:
            upcoming = next_use[i]
            i += 1
            if block not in cached:
                if capacity <= 0:
                    continue
                while len(cached) >= capacity:
                    negative, _tie, victim = heapq.heappop(farthest)
                    if cached.get(victim) == -negative:
                        del cached[victim]
            cached[block] = upcoming
            heapq.heappush(farthest, (-upcoming, i, block))
    return CacheRun("min", capacity, hits, total)


def policy_run(
    requests: Requests,
    capacity: int,
    eviction: str = "value",
    *,
    per_request: list[int] | None = None,
    tick: Callable[[], None] | None = None,
) -> CacheRun:
    """A store's memory tier of ``capacity`` blocks with the ``eviction`` policy, fed as a
    replay feeds a store (no bytes: each block is a one-byte entry). Each request's hit
    blocks are appended to ``per_request`` when given; ``tick`` is called per request."""
    tier = MemoryTier(max(0, capacity), eviction_policy(eviction))
    layout = Layout((1,), "uint8", "binary", 1, "bytes")
    empty = np.empty(1, dtype=np.uint8)
    index = tier.index
    hits = total = 0
    for blocks in requests:
        keys = [_key(block) for block in blocks]
        found = _leading(keys, index)
        for key in keys[:found]:
            index.get(key, touch=True)
        parent = keys[found - 1] if found else None
        for key in keys[found:]:
            if key not in index:
                tier.insert(key, layout, empty, 0, parent, dirty=False)
            parent = key
        hits += found
        total += len(keys)
        if per_request is not None:
            per_request.append(found)
        if tick is not None:
            tick()
    return CacheRun(eviction, capacity, hits, total)


def run(requests: Requests, capacity: int, policy: str) -> CacheRun:
    """``policy`` at ``capacity``: ``"lru"`` or ``"min"`` (the references), or a store's
    eviction policy by name prefixed ``store:`` (e.g. ``store:value``)."""
    if policy == "lru":
        return lru_run(requests, capacity)
    if policy == "min":
        return belady_run(requests, capacity)
    if policy.startswith("store:"):
        return policy_run(requests, capacity, policy.removeprefix("store:"))
    raise ValueError(f"unknown policy {policy!r}")


def block_key(block: Hashable) -> str:
    """The store key a replay gives a trace's block (one rank): what :func:`policy_run`
    uses too, so the two draw the same samples."""
    return _key(block)


def _key(block: Hashable) -> str:
    return f"trace@1@0@{block:x}@bfloat16" if isinstance(block, int) else f"trace@1@0@{block}"


def _leading(blocks: Iterable[Hashable], cache: object) -> int:
    found = 0
    for block in blocks:
        if block not in cache:  # type: ignore[operator]
            break
        found += 1
    return found


__all__ = [
    "REFERENCES",
    "CacheRun",
    "Requests",
    "belady_run",
    "block_key",
    "lru_run",
    "policy_run",
    "run",
]
