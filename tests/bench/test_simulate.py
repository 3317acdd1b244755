"""The replay's references (LRU and Belady's MIN, in blocks) against a plain reimplementation.

The reimplementations below are written for obviousness, not speed: a list for LRU and a
scan of the future for MIN, straight from the definitions in ``persisting.bench.simulate``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from persisting.bench.simulate import belady_run, lru_run, policy_run


def plain_lru(requests: Sequence[Sequence[int]], capacity: int) -> tuple[int, int]:
    cache: list[int] = []  # least recently used first
    hits = total = 0
    for blocks in requests:
        run = 0
        while run < len(blocks) and blocks[run] in cache:
            run += 1
        hits += run
        total += len(blocks)
        for block in blocks:
            if capacity <= 0:
                continue
            if block in cache:
                cache.remove(block)
            elif len(cache) >= capacity:
                cache.pop(0)
            cache.append(block)
    return hits, total


def plain_min(requests: Sequence[Sequence[int]], capacity: int) -> tuple[int, int]:
    flat = [block for blocks in requests for block in blocks]
    cache: set[int] = set()
    hits = total = 0
    position = 0
    for blocks in requests:
        run = 0
        while run < len(blocks) and blocks[run] in cache:
            run += 1
        hits += run
        total += len(blocks)
        for block in blocks:
            position += 1
            if block in cache or capacity <= 0:
                continue
            if len(cache) >= capacity:
                later = flat[position:]
                # farthest next use first; among blocks never used again, any (the hit
                # count cannot depend on which)
                cache.remove(
                    max(sorted(cache), key=lambda b: later.index(b) if b in later else 1e18)
                )
            cache.add(block)
    return hits, total


def chains(seed: int, requests: int = 60) -> list[list[int]]:
    """Prefix-chained requests: a few shared roots, each grown or branched at random."""
    rng = random.Random(seed)
    made: list[list[int]] = []
    next_id = 0
    for _ in range(requests):
        if made and rng.random() < 0.7:
            base = rng.choice(made)
            keep = rng.randint(1, len(base))
            tail = list(range(next_id, next_id + rng.randint(0, 4)))
            next_id += len(tail)
            made.append(base[:keep] + tail)
        else:
            fresh = list(range(next_id, next_id + rng.randint(1, 5)))
            next_id += len(fresh)
            made.append(fresh)
    return made


HAND = [[1, 2, 3], [1, 2], [4, 5], [1, 2]]


def test_hand_worked_trace() -> None:
    # capacity 2, worked by hand: LRU never keeps 1 long enough; MIN (every block
    # admitted, so 3 and then 4 are inserted though never used again) keeps 1 for R2, R4
    assert (lru_run(HAND, 2).hit_blocks, lru_run(HAND, 2).blocks) == (0, 9)
    assert belady_run(HAND, 2).hit_blocks == 2
    assert belady_run(HAND, 2).token_hit_rate == pytest.approx(2 / 9)
    # a hit is the leading run only: block 2 cached without 1 does not count
    assert lru_run([[1, 2], [9, 2], [3, 2]], 3).hit_blocks == 0
    # every block is admitted: MIN cannot decline 6 to keep 5
    assert belady_run([[5], [5], [6], [5]], 1).hit_blocks == 1
    assert lru_run([[5], [5], [6], [5]], 1).hit_blocks == 1


@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 5, 8, 13, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_and_min_match_the_plain_reimplementation(seed: int, capacity: int) -> None:
    trace = chains(seed)
    assert (lru_run(trace, capacity).hit_blocks, lru_run(trace, capacity).blocks) == plain_lru(
        trace, capacity
    )
    assert belady_run(trace, capacity).hit_blocks == plain_min(trace, capacity)[0]


def test_min_is_never_below_lru_and_both_reach_the_unbounded_best() -> None:
    trace = chains(7, 200)
    distinct = len({b for r in trace for b in r})
    for capacity in (2, 10, 30, distinct):
        assert belady_run(trace, capacity).hit_blocks >= lru_run(trace, capacity).hit_blocks
    seen: set[int] = set()
    best = 0
    for blocks in trace:
        run = 0
        while run < len(blocks) and blocks[run] in seen:
            run += 1
        best += run
        seen.update(blocks)
    assert lru_run(trace, distinct).hit_blocks == best == belady_run(trace, distinct).hit_blocks


def test_the_stores_lru_tier_is_the_reference_lru() -> None:
    # the store's memory tier with eviction="lru", fed as a replay feeds it, hits what the
    # reference LRU hits (the replay's store never touches a block after a miss, which a
    # prefix-chained trace never needs)
    for seed in range(3):
        trace = chains(seed, 120)
        for capacity in (3, 10, 25):
            store = policy_run(trace, capacity, "lru").hit_blocks
            assert store == lru_run(trace, capacity).hit_blocks
