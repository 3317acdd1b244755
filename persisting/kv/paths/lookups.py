"""Lookups of a KV store: which leading chunks of a prefix are stored, how many tokens they
cover, and how many of those are worth loading rather than recomputing.

Lookups read the tiers' indexes only (no payload); :class:`~persisting.kv.store.KVStore`
delegates to :class:`Lookups` after checking it is open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from persisting.kv.keys import ChunkKey, HashScheme, TokenHasher
from persisting.kv.paths.load_plan import HitChunk, LoadPlan
from persisting.kv.paths.tiers import Indexes, KeyLike, Tiers


class Lookups:
    """Prefix and token lookups over one store's tiers."""

    def __init__(
        self,
        tiers: Tiers,
        chunk_size: int,
        hash_scheme: HashScheme = "persisting",
        key_dtype: str = "bfloat16",
    ):
        self._t = tiers
        self.chunk_size = chunk_size
        self.hash_scheme: HashScheme = hash_scheme
        self.key_dtype = key_dtype

    def _hasher(self, hasher: TokenHasher | None) -> TokenHasher:
        """``hasher``, or the store's: its chunk size, hash scheme and key dtype."""
        return hasher or self.default_hasher()

    def default_hasher(self, dtype: Any = None) -> TokenHasher:
        """The store's hasher, with ``dtype`` (any spelling) instead of its key dtype."""
        return TokenHasher(
            self._t.model,
            chunk_size=self.chunk_size,
            scheme=self.hash_scheme,
            dtype=self.key_dtype if dtype is None else dtype,
        )

    def contains(self, key: KeyLike) -> bool:
        text = self._t.key_text(key)
        with self._t.indexes() as held:
            return text in held

    def lookup_prefix(self, keys: Sequence[KeyLike] | Sequence[Sequence[KeyLike]]) -> int:
        if not keys:
            return 0
        per_rank = isinstance(keys[0], list | tuple)
        ranks = cast("list[Sequence[KeyLike]]", list(keys) if per_rank else [keys])
        length = min(len(r) for r in ranks)
        hits = 0
        with self._t.indexes() as held:
            for i in range(length):
                if not all(self._present(r[i], held) for r in ranks):
                    break
                hits += 1
        self._t.op_stats.count("lookup_hit_chunks", hits)
        return hits

    def _present(self, key: KeyLike, held: Indexes) -> bool:
        """Membership on the hot path: a stored string was validated when it was stored, so
        only a miss pays for parsing (which raises for a malformed key)."""
        text = key.to_string() if isinstance(key, ChunkKey) else key
        if isinstance(text, str) and text in held:
            return True
        self._t.key_text(key)
        return False

    def lookup_tokens(self, tokens: Sequence[int] | np.ndarray, hasher: TokenHasher | None) -> int:
        chunks = self._hasher(hasher).process_tokens(tokens)
        n = self.lookup_prefix([key for _s, _e, key in chunks])
        hit_tokens = chunks[n - 1][1] if n else 0
        self._t.op_stats.count("lookup_hit_tokens", hit_tokens)
        return hit_tokens

    def plan_tokens(
        self,
        tokens: Sequence[int] | np.ndarray,
        recompute_tokens_per_s: float,
        hasher: TokenHasher | None,
        min_saving_s: float,
    ) -> LoadPlan:
        """Each hit chunk priced by the tier it would be read from now (memory first)."""
        t = self._t
        chunks = self._hasher(hasher).process_tokens(tokens)
        n = self.lookup_prefix([key for _s, _e, key in chunks])
        hits: list[HitChunk] = []
        with t.indexes() as held:
            for start, end, key in chunks[:n]:
                text = t.key_text(key)
                entry = held.memory.get(text)
                if entry is not None:
                    hits.append(HitChunk("memory", end - start, entry.layout.nbytes))
                    continue
                disk_entry = held.disk.get(text) if held.disk is not None else None
                if disk_entry is None:  # removed since the lookup: the prefix ends here
                    break
                hits.append(HitChunk("disk", end - start, disk_entry.layout.nbytes))
        plan = t.bandwidth.plan(hits, recompute_tokens_per_s, min_saving_s)
        t.op_stats.count("lookup_hit_tokens", plan.hit_tokens)
        t.op_stats.count("load_plan_load_tokens", plan.load_tokens)
        t.op_stats.count("load_plan_recompute_tokens", plan.recompute_tokens)
        t.op_stats.count("load_plan_load_chunks", plan.load_chunks)
        t.op_stats.count("load_plan_recompute_chunks", len(hits) - plan.load_chunks)
        return plan


__all__ = ["Lookups"]
