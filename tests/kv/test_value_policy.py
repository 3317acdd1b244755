"""The ``value`` eviction policy: what it keeps, what it costs, and the state it keeps."""

from __future__ import annotations

import random

import numpy as np
import pytest

from persisting.kv import open_kv_store
from persisting.kv.eviction.duel import RecencyDuel
from persisting.kv.eviction.policy import LRUEviction, ValueEviction
from persisting.kv.eviction.reuse import ReuseStats
from persisting.kv.index import Entry, LruIndex
from persisting.kv.keys import key_hash
from persisting.kv.layout import Layout
from persisting.kv.memory_tier import MemoryTier
from tests.kv.kv_helpers import key, memory_tier, tensor

ONE = Layout((1,), "uint8", "binary", 1, "bytes")
EMPTY = np.empty(1, dtype=np.uint8)


def tier(capacity: int, policy: object) -> MemoryTier:
    """A memory tier of ``capacity`` one-byte chunks."""
    return MemoryTier(capacity, policy)  # type: ignore[arg-type]


def put(t: MemoryTier, name: str, parent: str | None = None) -> None:
    if name not in t.index:
        t.insert(name, ONE, EMPTY, 0, parent, dirty=False)


def chain(t: MemoryTier, names: list[str]) -> int:
    """A request for the chain ``names``: read the stored leading run, put the rest;
    returns the hit length."""
    run = 0
    while run < len(names) and names[run] in t.index:
        t.index.get(names[run], touch=True)
        run += 1
    for i in range(run, len(names)):
        put(t, names[i], names[i - 1] if i else None)
    return run


def test_reuse_stats_count_sightings_and_remember_evicted_keys() -> None:
    stats = ReuseStats.in_memory(1 << 12)
    a = key_hash("a")
    assert stats.state(a) == (0, 0)
    for _ in range(3):
        stats.sighted(a)
    refs, last = stats.state(a)
    assert (refs, last, stats.now) == (3, 3, 3)
    t = tier(2, ValueEviction())
    put(t, "x")
    t.index.get("x", touch=True)
    put(t, "y")
    put(t, "z")  # one of x, y goes; the counts stay (a ghost)
    reuse = t.index.reuse
    assert reuse is not None
    assert reuse.state(key_hash("x"))[0] == 2 and reuse.state(key_hash("y"))[0] == 1


def test_a_full_bucket_forgets_the_key_sighted_longest_ago() -> None:
    stats = ReuseStats.in_memory(1 << 12)
    bucket = {}
    for i in range(200_000):  # five keys of one bucket (1,024 buckets of four slots)
        h = key_hash(f"k{i}")
        bucket.setdefault((h & (stats.slots - 1)) >> 2, []).append(h)
        found = next((b for b in bucket.values() if len(b) == 5), None)
        if found:
            break
    assert found is not None
    for h in found[:4]:
        stats.sighted(h)
    stats.sighted(found[0])  # the oldest is now found[1]
    stats.sighted(found[4])
    assert [stats.state(h)[0] for h in found] == [2, 0, 1, 1, 1]


def test_reused_chains_outlive_one_off_traffic_that_flushes_lru() -> None:
    hot = [[f"h{c}-{i}" for i in range(2)] for c in range(4)]
    kept = {}
    for name, policy in (("value", ValueEviction()), ("lru", LRUEviction())):
        t = tier(24, policy)
        for n in range(60):  # each hot chain, then one-off prompts: more than the tier holds
            for c, names in enumerate(hot):
                chain(t, names)
                for r in range(2):
                    chain(t, [f"once{n}-{c}-{r}-{i}" for i in range(4)])
        for r in range(7):  # and a burst of one-off prompts larger than the tier
            chain(t, [f"burst{r}-{i}" for i in range(4)])
        kept[name] = sum(chain(t, names) for names in hot)
        if name == "value":  # frequency was turned on: its shadow kept the chains
            assert t.index.duel.weight == 1.0
    assert kept == {"value": 8, "lru": 0}


def test_eviction_never_leaves_a_suffix_without_its_prefix() -> None:
    rng = random.Random(1)
    t = tier(40, ValueEviction())
    parent_of: dict[str, str] = {}
    for _ in range(400):
        root = f"r{rng.randrange(12)}"
        names = [root] + [f"{root}-{rng.randrange(3)}-{d}" for d in range(rng.randrange(1, 8))]
        names = [n if i < 2 else f"{names[1]}/{i}" for i, n in enumerate(names)]
        before = set(t.index.keys())
        chain(t, names)
        for i in range(1, len(names)):
            if names[i] not in before:  # stored now: a child of its parent if that stayed
                parent_of.pop(names[i], None)
                if names[i - 1] in t.index:
                    parent_of[names[i]] = names[i - 1]
        for child, parent in parent_of.items():
            if child in t.index and parent not in t.index:
                pytest.fail(f"{parent} evicted while its child {child} stays")


class CountingValue(ValueEviction):
    """Counts how many chunks each eviction looks at."""

    looked = 0

    def density(self, index: LruIndex, entry: Entry) -> float:  # type: ignore[type-arg]
        CountingValue.looked += 1
        return super().density(index, entry)


@pytest.mark.parametrize("capacity", [100, 20_000])
def test_an_eviction_looks_at_a_fixed_number_of_chunks(capacity: int) -> None:
    t = tier(capacity, CountingValue())
    for i in range(capacity):
        put(t, f"k{i}")
    CountingValue.looked = 0
    for i in range(50):
        put(t, f"new{i}")
    assert t.evictions == 50
    assert CountingValue.looked <= 50 * ValueEviction.SAMPLES


def test_the_ranks_of_a_chunk_are_evicted_together(root) -> None:  # type: ignore[no-untyped-def]
    value_bytes = tensor(0).numel() * 2
    world = 4
    with open_kv_store(root, "m", memory_bytes=10 * world * value_bytes, disk_bytes=0) as store:
        for r in range(30):
            blocks = [r * 100 + i for i in range(3)]
            for w in range(world):
                ks = [key(b, worker=w, world=world, model="m") for b in blocks]
                store.batched_put(ks, [tensor(b) for b in blocks], chain=True)
            stored = set(memory_tier(store).index.keys())
            whole = {k.split("@")[3] for k in stored}
            current = {key(b, model="m").chunk_hash_hex for b in blocks}
            for b in whole - current:  # the block being put may be partly stored yet
                ranks = [k for k in stored if k.split("@")[3] == b]
                assert len(ranks) == world, ranks


def _sight(duel: RecencyDuel, reuse: ReuseStats, name: str, entries: int) -> None:
    khash = key_hash(name)
    reuse.sighted(khash)
    duel.sighted(khash, entries, reuse)


def test_the_duel_turns_frequency_on_where_it_hits_more_and_off_where_lru_does() -> None:
    entries = 100
    duel, reuse = RecencyDuel(), ReuseStats.in_memory(1 << 12)
    assert duel.weight == 0.0  # recency until frequency shows it would hit more
    # a hot set of 50 keys, each between keys used once: LRU loses the hot set to the
    # one-off keys, the value shadow keeps it
    for r in range(30):
        for i in range(50):
            _sight(duel, reuse, f"hot{i}", entries)
            for j in range(7):
                _sight(duel, reuse, f"once{r}-{i}-{j}", entries)
    assert duel.weight == 1.0
    # then a working set that fits, over and over (with a key used once now and then):
    # LRU keeps it all, the value shadow keeps the old hot set for a while instead
    for r in range(20):
        for i in range(70):
            _sight(duel, reuse, f"work{i}", entries)
            if i % 3 == 2:
                _sight(duel, reuse, f"now{r}-{i}", entries)
    assert duel.weight == 0.0
    # both hit alike (a small set used over and over): the weight stays where it is
    for _ in range(20):
        for i in range(entries):
            _sight(duel, reuse, f"small{i % 10}", entries)
    assert duel.weight == 0.0


def test_hits_that_come_as_one_prompt_count_as_one_event() -> None:
    """A lead of one long prompt is not evidence: the duel weighs runs of hits, not
    chunks, so one prompt that one shadow kept does not switch the policy."""
    entries = 100
    duel, reuse = RecencyDuel(), ReuseStats.in_memory(1 << 12)
    prompt = [f"p{i}" for i in range(40)]
    for name in prompt:
        for _ in range(3):  # seen often: the value shadow keeps it longest
            _sight(duel, reuse, name, entries)
    for i in range(150):  # then traffic used once pushes it out of LRU
        _sight(duel, reuse, f"once{i}", entries)
    for name in prompt:  # it comes back: 40 hits for the value shadow, none for LRU
        _sight(duel, reuse, name, entries)
    for i in range(200):
        _sight(duel, reuse, f"later{i}", entries)
    assert duel.weight == 0.0
