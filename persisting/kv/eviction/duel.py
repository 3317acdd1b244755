"""Whether frequency counts in a tier: the duel between recency and the value density.

The ``value`` policy ranks a tier's leaves by reuse density, which weighs how often a
chunk was sighted (:mod:`persisting.kv.eviction.reuse`). Frequency only pays where reuse is
repeated; elsewhere LRU's recency hits more. :class:`RecencyDuel` runs both beside the
tier on key hashes alone and tells the policy which to follow.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

from persisting.kv.eviction.reuse import TICK_MASK, ReuseStats


class RecencyDuel:
    """Whether frequency counts in a tier: ``weight`` 1 (the ``value`` policy's density
    weighs a chunk's sighting count) or 0 (recency alone: LRU's order among the leaves).

    Beside the tier it runs two caches on key hashes alone, each as large as the tier is
    in chunks and admitting every sighting: one evicting LRU, one evicting by the value
    density at full weight (the least of ``SAMPLES`` keys drawn at random). Per window of
    as many sightings as the tier holds chunks, each adds its hits to a score that halves
    every window (``DECAY``: the last few windows count). Frequency goes on when the
    density's shadow leads by ``Z_ON`` standard deviations, off when LRU's leads by
    ``Z_OFF``, and stays as it is in between. Hits come in runs (a prompt's chunks hit
    together), so the deviation is that of a count of runs: the runs' squares summed, not
    the hits -- one long prompt that one shadow happened to keep is not evidence. It starts
    on recency: frequency must first show it would have hit more. So the tier does not
    fall behind LRU where frequency predicts nothing (a tier large for its workload, a
    stretch with little reuse), and keeps frequency where it pays. Turning it off is the
    quicker: falling behind LRU is what a user of the default must not see.

    Per process and tier, in memory: two integers per chunk in each shadow, and
    ``SAMPLES`` table lookups per sighting once the shadows are full.
    """

    #: How much of a window's score the next window keeps. A half makes the verdict rest
    #: on about the last two windows (the weights sum to 2), that is on the last two
    #: tier-fulls of sightings: the same horizon over which the density halves a chunk's
    #: worth (``ValueEviction.HALF_LIFE``), so the duel judges frequency over the stretch
    #: frequency itself remembers, and follows a workload that changes within a few windows.
    DECAY = 0.5
    #: The lead, in standard deviations of the count of runs, that turns frequency on, and
    #: the lead of LRU that turns it off. Between the two the tier keeps what it does, so
    #: noise around a tie does not flap it. On needs more than off because the default must
    #: not fall behind LRU: a lead of chance alone passes 1.5 deviations in about one window
    #: of fifteen, 1 deviation in one of six -- with nothing to learn, the tier stays LRU.
    Z_ON, Z_OFF = 1.5, 1.0
    #: Keys drawn per eviction in the value shadow. The least dense of ``k`` random keys
    #: lies, on average, in the least dense ``1/(k + 1)`` of them; the shadow runs on every
    #: sighting, and its verdict only compares two hit counts, so it takes half the policy's
    #: draws (``ValueEviction.SAMPLES``) for half the cost.
    SAMPLES = 16

    def __init__(self, seed: int = 0) -> None:
        self.weight = 0.0
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._value: list[int] = []
        self._value_at: dict[int, int] = {}
        self._rng = random.Random(seed)
        self._lru_hits = self._value_hits = self._seen = 0
        self._lru_score = self._value_score = 0.0
        #: Hits come in runs (a prompt's chunks hit together): the current run of each
        #: shadow, and the runs' squares summed -- the variance of a count of runs.
        self._lru_run = self._value_run = 0
        self._squares = self._spread = 0.0

    def sighted(self, khash: int, entries: int, reuse: ReuseStats) -> None:
        """A sighting of the key hashed ``khash`` (already counted in ``reuse``); the
        tier holds ``entries`` chunks."""
        size = max(1, entries)
        lru = self._lru
        if khash in lru:
            lru.move_to_end(khash)
            self._lru_hits += 1
            self._lru_run += 1
        else:
            self._squares += self._lru_run**2
            self._lru_run = 0
            lru[khash] = None
            while len(lru) > size:
                lru.popitem(last=False)
        if khash in self._value_at:
            self._value_hits += 1
            self._value_run += 1
        else:
            self._squares += self._value_run**2
            self._value_run = 0
            self._value_at[khash] = len(self._value)
            self._value.append(khash)
            while len(self._value) > size:
                self._evict_value(reuse, size)
        self._seen += 1
        if self._seen >= size:
            self._decide()

    def _evict_value(self, reuse: ReuseStats, size: int) -> None:
        """Drop the value shadow's least dense of ``SAMPLES`` random keys (never the one
        just added, the last)."""
        keys = self._value
        now, horizon = reuse.now, 2 * size
        victim, least = -1, math.inf
        for _ in range(self.SAMPLES):
            i = self._rng.randrange(len(keys) - 1)
            refs, last = reuse.state(keys[i])
            density = max(1, refs) / (((now - last) & TICK_MASK) + horizon)
            if density < least:
                victim, least = i, density
        gone, tail = keys[victim], keys.pop()
        del self._value_at[gone]
        if victim < len(keys):
            keys[victim] = tail
            self._value_at[tail] = victim

    def _decide(self) -> None:
        lru = self._lru_score = self.DECAY * self._lru_score + self._lru_hits
        value = self._value_score = self.DECAY * self._value_score + self._value_hits
        self._squares += self._lru_run**2 + self._value_run**2
        self._lru_run = self._value_run = 0
        self._spread = self.DECAY**2 * self._spread + self._squares
        spread = math.sqrt(self._spread + 1)
        if value - lru > self.Z_ON * spread:
            self.weight = 1.0
        elif lru - value > self.Z_OFF * spread:
            self.weight = 0.0
        self._lru_hits = self._value_hits = self._seen = 0
        self._squares = 0.0


__all__ = ["RecencyDuel"]
