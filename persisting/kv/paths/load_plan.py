"""Load or recompute: whether a stored prefix is worth reading, given how fast it reads.

A prefix hit saves the prefill of its tokens but costs the time to read its chunks and move
them to the device. From memory that is a few milliseconds per chunk and always worth it;
from a slow disk it can take longer than recomputing (an 8B model prefills ~23k tokens/s on
an H200, while its disk read 0.6-1.2 GB/s: a 32 MiB chunk of 256 tokens costs 11 ms to
compute and 27-55 ms to read). A disk hit slower than recomputing is not loaded.

:class:`TierBandwidth` keeps the read bandwidth each tier achieved, a moving average fed
by the store (``record(tier, nbytes, seconds)`` after each timed read).
:func:`plan_load` (or :meth:`TierBandwidth.plan`) turns a lookup's hit chunks (tier, tokens
and bytes of each, in prefix order) and the engine's prefill rate into a :class:`LoadPlan`:
how many leading tokens to load, and what that is expected to save.

The model is linear on purpose: loading chunk i costs ``bytes_i / bandwidth(tier_i)`` and
saves ``tokens_i / recompute_tokens_per_s``. The plan loads the prefix with the largest
total saving (chunks after it are recomputed), so a slow disk chunk is only loaded when
the chunks after it (memory hits, say) pay for it. A tier never measured is assumed
worth loading: loading it is how it gets measured.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from persisting.errors import ConfigError, InvalidValueError

#: The moving average forgets half of what it knew per this many bytes read from the tier.
DEFAULT_HALF_LIFE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class HitChunk:
    """One stored chunk of a prefix: the tier it would be read from, its size in tokens
    and in bytes."""

    tier: str
    tokens: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What to do with a prefix hit of ``hit_tokens`` tokens.

    ``load_tokens`` leading tokens (``load_chunks`` chunks) are to be loaded; the rest of
    the hit, ``recompute_tokens``, is cheaper to prefill. ``load_s`` is the expected time to
    load them and ``saved_s`` the prefill time that saves net of it (>= 0).
    """

    hit_tokens: int
    load_tokens: int
    load_chunks: int
    load_s: float
    saved_s: float

    @property
    def recompute_tokens(self) -> int:
        return self.hit_tokens - self.load_tokens


class TierBandwidth:
    """Read bandwidth per tier (bytes/s), a moving average of what reads achieved.

    Each tier keeps decayed sums of bytes and seconds; the estimate is their ratio, so a
    large read counts for its size (averaging per-read rates would let many small fast
    reads hide a slow large one). The sums decay by half per ``half_life_bytes`` read from
    that tier: the estimate follows the recent gigabyte, not the whole history.

    Thread-safe; :meth:`record` is a few arithmetic operations under a lock.
    """

    def __init__(
        self,
        half_life_bytes: int = DEFAULT_HALF_LIFE_BYTES,
        initial: dict[str, float] | None = None,
    ):
        if half_life_bytes <= 0:
            raise ConfigError(f"half_life_bytes must be positive, not {half_life_bytes}")
        self.half_life_bytes = half_life_bytes
        self._lock = threading.Lock()
        #: tier -> [decayed bytes, decayed seconds]
        self._sums: dict[str, list[float]] = {}
        for tier, rate in (initial or {}).items():
            if rate > 0:  # a prior worth one half-life of reads at that rate
                self._sums[tier] = [float(half_life_bytes), half_life_bytes / rate]

    def record(self, tier: str, nbytes: int, seconds: float) -> None:
        """One read from ``tier``: ``nbytes`` in ``seconds`` (non-positive ones are ignored)."""
        if nbytes <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        keep = 0.5 ** (nbytes / self.half_life_bytes)
        with self._lock:
            sums = self._sums.setdefault(tier, [0.0, 0.0])
            sums[0] = sums[0] * keep + nbytes
            sums[1] = sums[1] * keep + seconds

    def bytes_per_s(self, tier: str) -> float | None:
        """The tier's read bandwidth, or None before its first read."""
        with self._lock:
            sums = self._sums.get(tier)
            return sums[0] / sums[1] if sums is not None and sums[1] > 0 else None

    def snapshot(self) -> dict[str, float]:
        """Every measured tier's bandwidth (bytes/s), e.g. for stats or metrics."""
        with self._lock:
            return {tier: b / s for tier, (b, s) in self._sums.items() if s > 0}

    def load_seconds(self, tier: str, nbytes: int) -> float | None:
        """Expected time to read ``nbytes`` from ``tier``; None if it was never measured."""
        rate = self.bytes_per_s(tier)
        return nbytes / rate if rate is not None else None

    def plan(
        self, hits: Sequence[HitChunk], recompute_tokens_per_s: float, min_saving_s: float = 0.0
    ) -> LoadPlan:
        return plan_load(hits, recompute_tokens_per_s, self, min_saving_s=min_saving_s)


def plan_load(
    hits: Iterable[HitChunk],
    recompute_tokens_per_s: float,
    bandwidth: TierBandwidth,
    *,
    min_saving_s: float = 0.0,
) -> LoadPlan:
    """The leading chunks of ``hits`` (in prefix order) worth loading at a prefill rate of
    ``recompute_tokens_per_s``: the prefix whose loading saves the most time, if that saves
    more than ``min_saving_s``; none otherwise. Never-measured tiers count as free to load.
    """
    if not recompute_tokens_per_s > 0:
        raise InvalidValueError(
            f"recompute_tokens_per_s must be positive, not {recompute_tokens_per_s}"
        )
    chunks = list(hits)
    hit_tokens = sum(c.tokens for c in chunks)
    best_saving, best_index, best_load = 0.0, 0, 0.0
    saving = load = 0.0
    for i, chunk in enumerate(chunks, start=1):
        seconds = bandwidth.load_seconds(chunk.tier, chunk.nbytes) or 0.0
        load += seconds
        saving += chunk.tokens / recompute_tokens_per_s - seconds
        if saving > best_saving:
            best_saving, best_index, best_load = saving, i, load
    if best_saving <= min_saving_s:
        best_saving, best_index, best_load = 0.0, 0, 0.0
    return LoadPlan(
        hit_tokens=hit_tokens,
        load_tokens=sum(c.tokens for c in chunks[:best_index]),
        load_chunks=best_index,
        load_s=best_load,
        saved_s=best_saving,
    )


__all__ = [
    "DEFAULT_HALF_LIFE_BYTES",
    "HitChunk",
    "LoadPlan",
    "TierBandwidth",
    "plan_load",
]
