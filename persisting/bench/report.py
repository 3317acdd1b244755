"""What a replay measured, summed up: hit rates, bytes moved, latency percentiles.

Percentiles use numpy's default (linear interpolation between order statistics), in
milliseconds. ``get`` and ``put`` latencies are per request, i.e. per batch of that
request's chunks, because that is what a serving engine waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from persisting.bench.replay import OPS, ReplayResult, RequestRecord

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class OpStats:
    """Latency distribution of one operation, in milliseconds (``None`` when never run)."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    max_ms: float | None


@dataclass(frozen=True)
class ReplayReport:
    """The headline figures of one replay."""

    model: str
    target: str
    #: What the values weigh: the model whose KV size they have (None: a size given
    #: directly), its bytes per token and the bytes of one full chunk.
    kv_model: str | None
    bytes_per_token: int
    chunk_bytes: int
    requests: int
    tokens: int
    hit_tokens: int
    token_hit_rate: float
    chunks: int
    hit_chunks: int
    chunk_hit_rate: float
    #: What an unbounded cache would have served: every chunk seen before is a hit.
    best_hit_tokens: int
    best_token_hit_rate: float
    #: Hit chunks by the tier that served them (None when the target cannot tell).
    memory_hit_chunks: int | None
    disk_hit_chunks: int | None
    requests_with_hits: int
    bytes_read: int
    bytes_written: int
    #: payload bytes over the time spent in ``get`` / ``put`` calls (0.0 when none ran)
    get_bytes_per_s: float
    put_bytes_per_s: float
    mismatches: int
    wall_s: float
    requests_per_s: float
    ops: dict[str, OpStats]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def op_stats(samples_s: Sequence[float]) -> OpStats:
    """Count, mean, p50/p95/p99 and max of latencies given in seconds."""
    if not samples_s:
        return OpStats(0, None, None, None, None, None)
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    p50, p95, p99 = (float(x) for x in np.percentile(ms, PERCENTILES))
    return OpStats(len(ms), float(ms.mean()), p50, p95, p99, float(ms.max()))


def summarize(result: ReplayResult) -> ReplayReport:
    records = result.records
    tokens = sum(r.tokens for r in records)
    hit_tokens = sum(r.hit_tokens for r in records)
    chunks = sum(r.chunks for r in records)
    hit_chunks = sum(r.hit_chunks for r in records)
    bytes_read = sum(r.bytes_read for r in records)
    bytes_written = sum(r.bytes_written for r in records)
    best = sum(r.best_hit_tokens for r in records)
    split = all(r.memory_hit_chunks is not None for r in records if r.chunks)
    options = result.options
    return ReplayReport(
        model=result.model,
        target=result.target,
        kv_model=options.kv_model,
        bytes_per_token=options.bytes_per_token,
        chunk_bytes=options.bytes_per_token * options.chunk_size,
        requests=len(records),
        tokens=tokens,
        hit_tokens=hit_tokens,
        token_hit_rate=hit_tokens / tokens if tokens else 0.0,
        chunks=chunks,
        hit_chunks=hit_chunks,
        chunk_hit_rate=hit_chunks / chunks if chunks else 0.0,
        best_hit_tokens=best,
        best_token_hit_rate=best / tokens if tokens else 0.0,
        memory_hit_chunks=sum(r.memory_hit_chunks or 0 for r in records) if split else None,
        disk_hit_chunks=sum(r.disk_hit_chunks or 0 for r in records) if split else None,
        requests_with_hits=sum(1 for r in records if r.hit_chunks),
        bytes_read=bytes_read,
        bytes_written=bytes_written,
        get_bytes_per_s=_rate(bytes_read, result.latencies_s.get("get", [])),
        put_bytes_per_s=_rate(bytes_written, result.latencies_s.get("put", [])),
        mismatches=sum(r.mismatches for r in records),
        wall_s=result.wall_s,
        requests_per_s=len(records) / result.wall_s if result.wall_s > 0 else 0.0,
        ops={op: op_stats(result.latencies_s.get(op, [])) for op in OPS},
    )


def _rate(nbytes: int, seconds: Sequence[float]) -> float:
    total = float(sum(seconds))
    return nbytes / total if total > 0 else 0.0


def hit_rate_over_time(
    records: Sequence[RequestRecord], bins: int = 20
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token hit rate per arrival-time bin, and cumulative, at each bin's end time.

    Returns ``(bin_end_s, windowed_rate, cumulative_rate)``; a bin with no tokens repeats
    the previous bin's windowed rate so the curve has no holes.
    """
    ends, (windowed,), (cumulative,) = _binned(records, [[r.hit_tokens for r in records]], bins)
    return ends, windowed, cumulative


@dataclass(frozen=True)
class HitRates:
    """Token hit rates per arrival-time bin (ending at ``ends``): the share served from
    memory and from disk, the cumulative rate, and the best an unbounded cache reaches,
    cumulatively. ``split`` is False when the target could not tell the tiers apart (then
    every hit counts as ``memory``)."""

    ends: np.ndarray
    memory: np.ndarray
    disk: np.ndarray
    cumulative: np.ndarray
    best_cumulative: np.ndarray
    split: bool


def hit_rates_over_time(records: Sequence[RequestRecord], bins: int = 20) -> HitRates:
    """Per-bin token hit rates by tier. A request's hit tokens are split between the tiers
    in proportion to the chunks each served."""
    split = all(r.memory_hit_chunks is not None for r in records if r.chunks)
    memory = [_tier_share(r, 0) * r.hit_tokens if split else r.hit_tokens for r in records]
    disk = [_tier_share(r, 1) * r.hit_tokens if split else 0 for r in records]
    best = [r.best_hit_tokens for r in records]
    ends, (mem, dsk, _), (_, _, best_cum) = _binned(records, [memory, disk, best], bins)
    _, _, (cumulative,) = _binned(records, [[r.hit_tokens for r in records]], bins)
    return HitRates(ends, mem, dsk, cumulative, best_cum, split)


def _tier_share(record: RequestRecord, tier: int) -> float:
    counts = (record.memory_hit_chunks or 0, record.disk_hit_chunks or 0)
    return counts[tier] / sum(counts) if sum(counts) else 0.0


def _binned(
    records: Sequence[RequestRecord], series: Sequence[Sequence[float]], bins: int
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """``(bin ends, windowed rates, cumulative rates)`` of each hit-token ``series`` over
    the records' tokens, binned by arrival time."""
    if not records:
        empty = np.zeros(0)
        return empty, [empty for _ in series], [empty for _ in series]
    arrivals = np.array([r.arrival_s for r in records], dtype=np.float64)
    tokens = np.array([r.tokens for r in records], dtype=np.float64)
    end = float(arrivals.max())
    edges = np.linspace(0.0, end, bins + 1) if end > 0 else np.array([0.0, 0.0])
    index = np.clip(np.searchsorted(edges, arrivals, side="right") - 1, 0, len(edges) - 2)
    bin_tokens = np.bincount(index, weights=tokens, minlength=len(edges) - 1)
    cum_tokens = np.cumsum(bin_tokens)
    windowed_out, cumulative_out = [], []
    for hits in series:
        bin_hits = np.bincount(
            index, weights=np.asarray(hits, dtype=np.float64), minlength=len(edges) - 1
        )
        windowed = np.zeros_like(bin_tokens)
        previous = 0.0
        for i, (t, h) in enumerate(zip(bin_tokens, bin_hits, strict=True)):
            previous = h / t if t else previous
            windowed[i] = previous
        windowed_out.append(windowed)
        cumulative_out.append(
            np.divide(
                np.cumsum(bin_hits), cum_tokens, out=np.zeros_like(cum_tokens), where=cum_tokens > 0
            )
        )
    return edges[1:], windowed_out, cumulative_out


__all__ = [
    "PERCENTILES",
    "HitRates",
    "OpStats",
    "ReplayReport",
    "hit_rate_over_time",
    "hit_rates_over_time",
    "op_stats",
    "summarize",
]
