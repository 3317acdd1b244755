"""Replay a request trace against a KV target the way a serving engine would use it.

For each request: hash its tokens into prefix-chained chunk keys, ask the target for the
longest stored prefix (``lookup``), load those chunks (``get``), then store the chunks it
did not have (``put``). Each call is timed, and every loaded value is checked against the
bytes that were stored for its key, so a store that returns the wrong chunk is caught.

:func:`replay_blocks` does the same for a block trace (Mooncake's format,
:mod:`persisting.bench.mooncake`): block ``i`` of a record is its key, no tokens are hashed,
and with ``tp`` ranks each block is ``tp`` objects (one per rank, each its share of the
block's bytes), as a tensor-parallel engine stores it.

The target is anything with the small :class:`Target` protocol, so the same replay drives
a local :mod:`persisting.kv` store or a running server through its client
(:mod:`persisting.bench.targets`). Two more figures per request say what the cache could
have done and where hits came from: the hits an unbounded cache would have had (every chunk
seen before), and, when the target can tell, how many hit chunks each tier served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from persisting.bench.mooncake import BlockTrace
from persisting.bench.trace import SegmentTokens, Trace
from persisting.errors import InvalidValueError
from persisting.kv import ChunkKey, TokenHasher

OPS = ("lookup", "get", "put")


class Target(Protocol):
    """The slice of the KV store API a replay needs (``parents[i]`` is the chunk before
    ``keys[i]`` in its prompt, for prefix-aware eviction)."""

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int: ...

    def batched_get(self, keys: Sequence[ChunkKey]) -> Sequence[Any | None]: ...

    def batched_put(
        self,
        keys: Sequence[ChunkKey],
        values: Sequence[Any],
        *,
        fmt: str,
        parents: Sequence[ChunkKey | None] | None = None,
    ) -> Any: ...

    def close(self) -> None: ...


#: A target's cumulative memory-tier hits (chunks), read between requests; a hit the
#: memory tier did not serve came from disk.
TierHits = Callable[[], int]


@dataclass(frozen=True)
class ReplayOptions:
    """How requests become chunks and chunk values.

    Values are ``KV_2LTD`` bfloat16 tensors ``[2, layers, tokens, hidden]`` with
    ``bytes_per_token`` bytes per token: small by default so a library replay runs in
    seconds; :meth:`for_model` takes a real model's figure (``persisting bench replay``
    does by default). ``realtime`` paces requests at their trace times instead of sending
    them back to back. ``kv_model`` names the model whose KV size the values have. With
    ``tp`` ranks each chunk is stored as ``tp`` objects of ``1 / tp`` of its bytes (block
    traces only).
    """

    chunk_size: int = 256
    bytes_per_token: int = 1024
    layers: int = 1
    save_unfull_chunk: bool = False
    realtime: bool = False
    verify: bool = True
    kv_model: str | None = None
    tp: int = 1

    @classmethod
    def for_model(cls, name: str, **options: Any) -> ReplayOptions:
        """Options whose values weigh what ``name``'s KV weighs per token (a planner preset
        or its Hugging Face id): ``[2, layers, tokens, bytes / (4 x layers)]`` in bfloat16."""
        from persisting.planner import find_preset, kv_bytes_per_token

        preset = find_preset(name)
        per_token = kv_bytes_per_token(
            preset.layers, preset.kv_heads, preset.head_dim, "bf16", mla=preset.mla
        )
        return cls(bytes_per_token=per_token, layers=preset.layers, kv_model=preset.name, **options)

    def validate(self) -> None:
        if self.chunk_size < 1:
            raise InvalidValueError(f"chunk_size must be >= 1, got {self.chunk_size}").about(
                "chunk_size"
            )
        if self.layers < 1:
            raise InvalidValueError(f"layers must be >= 1, got {self.layers}").about("layers")
        if self.tp < 1:
            raise InvalidValueError(f"tp must be >= 1, got {self.tp}").about("tp")
        per_hidden = 2 * self.layers * 2 * self.tp  # K and V, layers, bfloat16 bytes, ranks
        if self.bytes_per_token < per_hidden or self.bytes_per_token % per_hidden:
            raise InvalidValueError(
                f"bytes_per_token must be a positive multiple of {per_hidden} "
                f"(2 x layers x 2 bytes x tp), got {self.bytes_per_token}"
            ).about("bytes_per_token", "layers", "tp")

    @property
    def hidden(self) -> int:
        """Hidden width of one rank's share of a value."""
        return self.bytes_per_token // (2 * self.layers * 2 * self.tp)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one whole chunk, all ranks."""
        return self.bytes_per_token * self.chunk_size

    @property
    def object_bytes(self) -> int:
        """Bytes of one rank's object of a whole chunk."""
        return self.chunk_bytes // self.tp


@dataclass
class RequestRecord:
    """What happened to one request."""

    id: str
    arrival_s: float
    start_s: float
    tokens: int
    chunks: int
    hit_chunks: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    mismatches: int = 0
    latency_s: dict[str, float] = field(default_factory=dict)
    #: Hit chunks the memory and disk tiers served (None: the target cannot tell).
    memory_hit_chunks: int | None = None
    disk_hit_chunks: int | None = None
    #: Tokens an unbounded cache would have served: the prefix of chunks seen before.
    best_hit_tokens: int = 0
    #: The request's chunks in order (block ids, or chunk hashes), for reference policies.
    blocks: tuple[int, ...] = ()


@dataclass
class ReplayResult:
    """Every request's record and every operation's latencies, in replay order."""

    model: str
    target: str
    options: ReplayOptions
    records: list[RequestRecord] = field(default_factory=list)
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})
    wall_s: float = 0.0


class ChunkValues:
    """Deterministic chunk tensors: each filled with a small stamp derived from its key.

    Stamps are integers 1..251, exact in bfloat16, so a loaded value can be checked
    against its key without keeping the stored bytes around.
    """

    fmt = "KV_2LTD"

    def __init__(self, options: ReplayOptions) -> None:
        self.layers = options.layers
        self.hidden = options.hidden

    def shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (2, self.layers, tokens, self.hidden)

    @staticmethod
    def stamp(key: ChunkKey) -> int:
        return key.chunk_hash % 251 + 1

    def make(self, key: ChunkKey, tokens: int) -> torch.Tensor:
        return torch.full(self.shape(tokens), self.stamp(key), dtype=torch.bfloat16)

    def check(self, key: ChunkKey, tokens: int, value: Any) -> bool:
        """True if ``value`` is what :meth:`make` stored for ``key`` (shape, dtype, ends)."""
        if not isinstance(value, torch.Tensor) or value.dtype != torch.bfloat16:
            return False
        if tuple(value.shape) != self.shape(tokens):
            return False
        flat = value.reshape(-1)
        stamp = float(self.stamp(key))
        return float(flat[0]) == stamp and float(flat[-1]) == stamp


def replay(
    trace: Trace,
    target: Target,
    options: ReplayOptions | None = None,
    *,
    target_name: str = "target",
    on_request: Callable[[RequestRecord], None] | None = None,
    tier_hits: TierHits | None = None,
) -> ReplayResult:
    """Send every request of ``trace`` to ``target`` in order and record what happened.

    ``tier_hits`` (read before and after each request) splits hits by tier.
    """
    options = options or ReplayOptions()
    options.validate()
    hasher = TokenHasher(
        model=trace.header.model,
        chunk_size=options.chunk_size,
        save_unfull_chunk=options.save_unfull_chunk,
    )
    tokens_of = SegmentTokens(trace.header.vocab_size)
    values = ChunkValues(options)
    result = ReplayResult(model=trace.header.model, target=target_name, options=options)
    seen: set[ChunkKey] = set()
    start = time.perf_counter()
    for request in trace.requests:
        if options.realtime:
            delay = request.t - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
        chunks = hasher.process_tokens(tokens_of.prompt(request))
        record = RequestRecord(
            id=request.id,
            arrival_s=request.t,
            start_s=time.perf_counter() - start,
            tokens=request.num_tokens,
            chunks=len(chunks),
        )
        record.best_hit_tokens = _best_hit_tokens(chunks, seen)
        record.blocks = tuple(key.chunk_hash for _s, _e, key in chunks)
        before = tier_hits() if tier_hits is not None and chunks else None
        if chunks:
            _serve_request(target, chunks, values, options.verify, record)
        _record(result, record, tier_hits, before, 1, on_request)
    result.wall_s = time.perf_counter() - start
    return result


def replay_blocks(
    trace: BlockTrace,
    target: Target,
    options: ReplayOptions,
    *,
    model: str,
    target_name: str = "target",
    on_request: Callable[[RequestRecord], None] | None = None,
    tier_hits: TierHits | None = None,
) -> ReplayResult:
    """Send every request of the block trace to ``target`` in order (``options.chunk_size``
    is the trace's tokens per block); see :func:`replay` for what is recorded."""
    options.validate()
    if options.chunk_size != trace.block_tokens:
        raise InvalidValueError(
            f"chunk_size {options.chunk_size} is not the trace's {trace.block_tokens} "
            "tokens per block"
        ).about("chunk_size")
    values = ChunkValues(options)
    tokens = trace.block_tokens
    result = ReplayResult(model=model, target=target_name, options=options)
    seen: set[int] = set()
    start = time.perf_counter()
    first_t = trace.requests[0].t if trace.requests else 0.0
    for request in trace.requests:
        arrival = request.t - first_t
        if options.realtime:
            delay = arrival - (time.perf_counter() - start)
            if delay > 0:
                time.sleep(delay)
        blocks = request.blocks
        record = RequestRecord(
            id=f"line {request.line}",
            arrival_s=arrival,
            start_s=time.perf_counter() - start,
            tokens=len(blocks) * tokens,
            chunks=len(blocks),
            blocks=blocks,
        )
        known = 0
        for block in blocks:
            if block not in seen:
                break
            known += 1
        record.best_hit_tokens = known * tokens
        seen.update(blocks)
        ranks = [
            [ChunkKey(model, options.tp, rank, block, "bfloat16") for block in blocks]
            for rank in range(options.tp)
        ]
        before = tier_hits() if tier_hits is not None and blocks else None
        if blocks:
            _serve_ranks(target, ranks, tokens, values, options.verify, record)
        _record(result, record, tier_hits, before, options.tp, on_request)
    result.wall_s = time.perf_counter() - start
    return result


def _record(
    result: ReplayResult,
    record: RequestRecord,
    tier_hits: TierHits | None,
    before: int | None,
    per_chunk: int,
    on_request: Callable[[RequestRecord], None] | None,
) -> None:
    """File one served request: its hits split by tier (``tier_hits`` counts ``per_chunk``
    hits per chunk: one per rank), its latencies, the record."""
    if before is not None and tier_hits is not None:
        memory = min(record.hit_chunks, max(0, tier_hits() - before) // per_chunk)
        record.memory_hit_chunks = memory
        record.disk_hit_chunks = record.hit_chunks - memory
    for op, seconds in record.latency_s.items():
        result.latencies_s[op].append(seconds)
    result.records.append(record)
    if on_request is not None:
        on_request(record)


def _serve_ranks(
    target: Target,
    ranks: list[list[ChunkKey]],
    tokens: int,
    values: ChunkValues,
    verify: bool,
    record: RequestRecord,
) -> None:
    """Lookup (every rank must hold a block), load the hit blocks of every rank, store the
    rest of every rank with each object's parent; fill ``record`` in place."""
    t0 = time.perf_counter()
    found = min(target.lookup_prefix(keys) for keys in ranks)
    record.latency_s["lookup"] = time.perf_counter() - t0
    hits = 0
    if found:
        wanted = [key for keys in ranks for key in keys[:found]]
        t0 = time.perf_counter()
        loaded = list(target.batched_get(wanted))
        record.latency_s["get"] = time.perf_counter() - t0
        hits = found
        for r, keys in enumerate(ranks):
            for i, key in enumerate(keys[:found]):
                value = loaded[r * found + i]
                if value is None:
                    hits = min(hits, i)
                    break
                if verify and not values.check(key, tokens, value):
                    record.mismatches += 1
                    hits = min(hits, i)
                    break
                record.bytes_read += _nbytes(value)
        record.hit_chunks = hits
        record.hit_tokens = hits * tokens
    if hits < len(ranks[0]):
        new_keys: list[ChunkKey] = []
        parents: list[ChunkKey | None] = []
        for keys in ranks:
            new_keys += keys[hits:]
            parents += [keys[hits - 1] if hits else None, *keys[hits:-1]]
        new_values = [values.make(key, tokens) for key in new_keys]
        t0 = time.perf_counter()
        target.batched_put(new_keys, new_values, fmt=values.fmt, parents=parents)
        record.latency_s["put"] = time.perf_counter() - t0
        record.bytes_written = sum(_nbytes(v) for v in new_values)


def _best_hit_tokens(chunks: list[tuple[int, int, ChunkKey]], seen: set[ChunkKey]) -> int:
    """Tokens of the longest prefix of ``chunks`` stored before (then remember them all)."""
    best = 0
    for _start, end, key in chunks:
        if key not in seen:
            break
        best = end
    seen.update(key for _start, _end, key in chunks)
    return best


def _serve_request(
    target: Target,
    chunks: list[tuple[int, int, ChunkKey]],
    values: ChunkValues,
    verify: bool,
    record: RequestRecord,
) -> None:
    """Lookup, load the hit prefix, store the rest; fill ``record`` in place."""
    keys = [key for _start, _end, key in chunks]
    t0 = time.perf_counter()
    found = target.lookup_prefix(keys)
    record.latency_s["lookup"] = time.perf_counter() - t0
    hits = 0
    if found:
        t0 = time.perf_counter()
        loaded = target.batched_get(keys[:found])
        record.latency_s["get"] = time.perf_counter() - t0
        for (start, end, key), value in zip(chunks, loaded, strict=False):
            if value is None:
                break
            if verify and not values.check(key, end - start, value):
                record.mismatches += 1
                break
            hits += 1
            record.bytes_read += _nbytes(value)
        record.hit_chunks = hits
        record.hit_tokens = chunks[hits - 1][1] if hits else 0
    missing = chunks[hits:]
    if missing:
        new_keys = [key for _start, _end, key in missing]
        new_values = [values.make(key, end - start) for start, end, key in missing]
        parents = [keys[hits - 1] if hits else None, *new_keys[:-1]]
        t0 = time.perf_counter()
        target.batched_put(new_keys, new_values, fmt=values.fmt, parents=parents)
        record.latency_s["put"] = time.perf_counter() - t0
        record.bytes_written = sum(_nbytes(v) for v in new_values)


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(value)


__all__ = [
    "OPS",
    "ChunkValues",
    "ReplayOptions",
    "ReplayResult",
    "RequestRecord",
    "Target",
    "TierHits",
    "replay",
    "replay_blocks",
]
