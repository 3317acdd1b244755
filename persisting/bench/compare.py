"""A replay's figures beside the references, and replays that store nothing.

:func:`references` runs LRU and Belady's MIN (:mod:`persisting.bench.simulate`) on the
blocks a replay sent, at the capacity the store had, so a report shows the store's token
hit ratio beside theirs in the same run. :func:`simulated_replay` is the replay of a store
whose budgets this machine does not have: its policy over one-byte entries, at the
capacity in blocks the budgets make (:func:`~persisting.bench.curve.blocks_in`).
:func:`machine_shortfall` says when that is.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from persisting.bench.curve import TierBlocks
from persisting.bench.mooncake import BlockRequest, BlockTrace
from persisting.bench.replay import RequestRecord
from persisting.bench.simulate import belady_run, lru_run, policy_run
from persisting.bench.trace import SegmentTokens, Trace
from persisting.kv import TokenHasher
from persisting.planner.ttft import TtftModel


@dataclass(frozen=True)
class References:
    """LRU's and MIN's token hit ratios on the replayed blocks at ``capacity_blocks``
    (the larger tier's blocks: see :class:`~persisting.bench.curve.TierBlocks`)."""

    capacity_blocks: int
    memory_blocks: int
    disk_blocks: int
    lru_token_hit_rate: float
    belady_token_hit_rate: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def references(requests: Sequence[Sequence[int]], tiers: TierBlocks) -> References:
    capacity = tiers.reference
    return References(
        capacity,
        tiers.memory,
        tiers.disk,
        lru_run(requests, capacity).token_hit_rate,
        belady_run(requests, capacity).token_hit_rate,
    )


@dataclass(frozen=True)
class Ttft:
    """Mean prefill-bound TTFT per request with the hits a replay had, and without any."""

    model: TtftModel
    mean_ms_without_cache: float
    mean_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.model.to_dict(),
            "mean_ttft_ms_without_cache": self.mean_ms_without_cache,
            "mean_ttft_ms": self.mean_ms,
            "saving_ms_per_request": self.mean_ms_without_cache - self.mean_ms,
        }


def ttft(model: TtftModel, records: Sequence[RequestRecord]) -> Ttft:
    n = max(1, len(records))
    cold = sum(model.ttft_s(r.tokens, 0) for r in records) / n * 1e3
    warm = sum(model.ttft_s(r.tokens, r.hit_tokens) for r in records) / n * 1e3
    return Ttft(model, cold, warm)


def token_blocks(trace: Trace, chunk_size: int) -> BlockTrace:
    """A token trace as blocks: each request's whole chunks, by their chained hashes (a
    tail shorter than a chunk is not a block)."""
    hasher = TokenHasher(trace.header.model, chunk_size=chunk_size)
    tokens_of = SegmentTokens(trace.header.vocab_size)
    requests = tuple(
        BlockRequest(
            r.t,
            tuple(key.chunk_hash for _s, _e, key in hasher.process_tokens(tokens_of.prompt(r))),
            line=i + 2,
        )
        for i, r in enumerate(trace.requests)
    )
    return BlockTrace(requests, chunk_size, trace.header.model)


@dataclass(frozen=True)
class SimulatedReplay:
    """What a store with these tiers would hit, worked out in blocks."""

    eviction: str
    requests: int
    blocks: int
    hit_blocks: int
    #: Hit blocks the memory tier alone would have held (tiers are inclusive).
    memory_hit_blocks: int
    block_tokens: int
    records: list[RequestRecord]

    @property
    def token_hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tokens": self.blocks * self.block_tokens,
            "hit_tokens": self.hit_blocks * self.block_tokens,
            "token_hit_rate": self.token_hit_rate,
            "chunks": self.blocks,
            "hit_chunks": self.hit_blocks,
            "memory_token_hit_rate": self.memory_hit_blocks / self.blocks if self.blocks else 0.0,
        }


def simulated_replay(
    trace: BlockTrace,
    tiers: TierBlocks,
    eviction: str,
    on_request: Callable[[], None] | None = None,
) -> SimulatedReplay:
    """The store's ``eviction`` policy on ``trace`` at the tiers' capacities in blocks."""
    requests = [r.blocks for r in trace.requests]
    hits: list[int] = []
    whole = policy_run(requests, tiers.reference, eviction, per_request=hits, tick=on_request)
    memory = (
        policy_run(requests, tiers.memory, eviction).hit_blocks
        if tiers.memory < tiers.reference
        else whole.hit_blocks
    )
    records = [
        RequestRecord(
            id=f"line {r.line}",
            arrival_s=r.t,
            start_s=0.0,
            tokens=len(r.blocks) * trace.block_tokens,
            chunks=len(r.blocks),
            hit_chunks=hit,
            hit_tokens=hit * trace.block_tokens,
            blocks=r.blocks,
        )
        for r, hit in zip(trace.requests, hits, strict=True)
    ]
    return SimulatedReplay(
        eviction,
        len(requests),
        whole.blocks,
        whole.hit_blocks,
        memory,
        trace.block_tokens,
        records,
    )


def machine_shortfall(memory_bytes: int, disk_bytes: int, root: Path | None) -> str | None:
    """Why a replay cannot run through a real store here (None when it can): a memory tier
    over half this machine's memory (its budget is mapped whole), or more bytes to write to
    disk (``disk_bytes``: what the replay would write at most) than are free where its root
    would be."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 0
    if physical and memory_bytes > physical // 2:
        return f"a {memory_bytes:,}-byte memory tier is over half this machine's {physical:,}"
    where = root if root is not None else Path.cwd()
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if disk_bytes > free:
        return f"{disk_bytes:,} bytes to write to disk are over the {free:,} free at {where}"
    return None


__all__ = [
    "References",
    "SimulatedReplay",
    "Ttft",
    "machine_shortfall",
    "references",
    "simulated_replay",
    "token_blocks",
    "ttft",
]
