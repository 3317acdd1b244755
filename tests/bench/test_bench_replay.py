"""Replays against a real local KV store (Lance disk tier on disk) count what they should."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from persisting.bench.replay import ChunkValues, ReplayOptions, RequestRecord, replay
from persisting.bench.report import summarize
from persisting.bench.targets import open_local_target
from persisting.bench.trace import (
    Trace,
    TraceHeader,
    TraceRequest,
    TraceSpec,
    generate_trace,
)
from persisting.errors import InvalidValueError
from persisting.kv import TokenHasher

MODEL = "bench/test"
# chunks of 4 tokens, 16 bytes per token -> every full chunk is a 64-byte value
OPTIONS = ReplayOptions(chunk_size=4, bytes_per_token=16)


def tokens_trace(*prompts: list[int]) -> Trace:
    requests = tuple(
        TraceRequest(id=f"r{i}", t=i * 0.01, tokens=tuple(p)) for i, p in enumerate(prompts)
    )
    return Trace(TraceHeader(model=MODEL, vocab_size=1000), requests)


def local(root: Path, memory_bytes: int = 1 << 20):
    return open_local_target(
        root, MODEL, memory_bytes=memory_bytes, disk_bytes=64 << 20, durability="sync"
    )


def test_hits_follow_the_shared_prefix_exactly(tmp_path: Path) -> None:
    a = list(range(1, 13))  # 3 full chunks
    trace = tokens_trace(
        a,  # cold: 3 puts
        a,  # warm: 3 hits
        [*a[:8], 99, 98, 97, 96],  # shares 2 chunks, then 1 new chunk
        [*a, 5, 5],  # 3 hits; the 2-token tail is not a full chunk, never stored
        [7, 7, 7],  # shorter than a chunk: no store calls at all
    )
    target = local(tmp_path)
    try:
        result = replay(trace, target, OPTIONS, target_name="local")
    finally:
        target.close()
    got = [
        (r.chunks, r.hit_chunks, r.hit_tokens, r.bytes_read, r.bytes_written)
        for r in result.records
    ]
    assert got == [
        (3, 0, 0, 0, 3 * 64),
        (3, 3, 12, 3 * 64, 0),
        (3, 2, 8, 2 * 64, 64),
        (3, 3, 12, 3 * 64, 0),
        (0, 0, 0, 0, 0),
    ]
    assert [sorted(r.latency_s) for r in result.records] == [
        ["lookup", "put"],
        ["get", "lookup"],
        ["get", "lookup", "put"],
        ["get", "lookup"],
        [],
    ]
    assert {op: len(v) for op, v in result.latencies_s.items()} == {"lookup": 4, "get": 3, "put": 2}
    report = summarize(result)
    assert report.tokens == 12 + 12 + 12 + 14 + 3
    assert report.hit_tokens == 32
    assert report.token_hit_rate == pytest.approx(32 / 53)
    assert report.chunk_hit_rate == pytest.approx(8 / 12)
    assert report.requests_with_hits == 3
    assert report.bytes_read == 8 * 64 and report.bytes_written == 4 * 64
    assert report.mismatches == 0
    assert report.ops["get"].count == 3


def test_a_second_replay_on_the_same_root_hits_what_the_first_stored(tmp_path: Path) -> None:
    trace = generate_trace(
        TraceSpec(requests=40, documents=5, doc_tokens=64, suffix_tokens=8, model=MODEL)
    )
    first_target = local(tmp_path)
    try:
        first = summarize(replay(trace, first_target, OPTIONS))
    finally:
        first_target.close()
    # a fresh process-level store with no memory tier: every hit comes from Lance on disk
    second_target = open_local_target(tmp_path, MODEL, memory_bytes=0, disk_bytes=64 << 20)
    try:
        second = summarize(replay(trace, second_target, OPTIONS))
    finally:
        second_target.close()
    assert 0 < first.hit_chunks < first.chunks
    assert second.hit_chunks == second.chunks == first.chunks
    assert second.bytes_written == 0
    assert second.bytes_read == second.chunks * 4 * 16
    assert second.mismatches == 0


def test_values_of_another_layout_are_caught_not_counted(tmp_path: Path) -> None:
    trace = tokens_trace(list(range(8)))
    target = local(tmp_path)
    try:
        replay(trace, target, OPTIONS)
        wider = replay(trace, target, ReplayOptions(chunk_size=4, bytes_per_token=32))
    finally:
        target.close()
    record = wider.records[0]
    assert record.mismatches == 1
    assert record.hit_chunks == 0 and record.bytes_read == 0


def test_chunk_values_check_their_key() -> None:
    values = ChunkValues(ReplayOptions(bytes_per_token=16))
    a, b = (key for _s, _e, key in TokenHasher(MODEL, chunk_size=4).process_tokens(range(8)))
    if values.stamp(a) == values.stamp(b):  # 1 in 251: pick a different second key
        b = TokenHasher(MODEL, chunk_size=4).process_tokens(range(100, 108))[1][2]
    value = values.make(a, 4)
    assert value.shape == (2, 1, 4, 4) and value.dtype == torch.bfloat16
    assert values.check(a, 4, value)
    assert not values.check(b, 4, value)
    assert not values.check(a, 3, value)
    assert not values.check(a, 4, value.float())
    assert not values.check(a, 4, b"raw")


def test_realtime_replay_keeps_to_the_trace_clock(tmp_path: Path) -> None:
    trace = generate_trace(
        TraceSpec(
            requests=10, rate=50, arrival="uniform", doc_tokens=8, suffix_tokens=4, model=MODEL
        )
    )
    seen: list[RequestRecord] = []
    target = local(tmp_path)
    try:
        result = replay(
            trace,
            target,
            ReplayOptions(chunk_size=4, bytes_per_token=16, realtime=True),
            on_request=seen.append,
        )
    finally:
        target.close()
    assert seen == result.records
    assert result.wall_s >= trace.duration_s == pytest.approx(0.18)
    for record in result.records:
        assert record.start_s >= record.arrival_s


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (ReplayOptions(chunk_size=0), "chunk_size"),
        (ReplayOptions(bytes_per_token=6), "multiple of 4"),
        (ReplayOptions(layers=2, bytes_per_token=12), "multiple of 8"),
        (ReplayOptions(layers=0), "layers"),
    ],
)
def test_impossible_options_are_rejected(
    tmp_path: Path, options: ReplayOptions, message: str
) -> None:
    target = local(tmp_path)
    try:
        with pytest.raises(InvalidValueError, match=message):
            replay(tokens_trace([1, 2, 3, 4]), target, options)
    finally:
        target.close()


def test_hits_are_split_by_tier_and_bounded_by_the_best(tmp_path: Path) -> None:
    from persisting.bench.targets import store_tier_hits

    trace = generate_trace(
        TraceSpec(requests=30, documents=4, doc_tokens=32, suffix_tokens=4, model=MODEL)
    )
    # 64-byte chunks in a 256-byte memory tier: 4 chunks fit, the rest are read from disk
    target = local(tmp_path, memory_bytes=256)
    try:
        result = replay(trace, target, OPTIONS, tier_hits=store_tier_hits(target))
    finally:
        target.close()
    report = summarize(result)
    assert report.memory_hit_chunks is not None and report.disk_hit_chunks is not None
    assert report.memory_hit_chunks + report.disk_hit_chunks == report.hit_chunks
    assert report.disk_hit_chunks > 0 and report.memory_hit_chunks > 0
    for record in result.records:
        assert record.memory_hit_chunks + record.disk_hit_chunks == record.hit_chunks
    # nothing was evicted from disk, so the store served what an unbounded cache would
    assert report.hit_tokens == report.best_hit_tokens > 0


def test_the_best_achievable_counts_chunks_seen_before(tmp_path: Path) -> None:
    a = list(range(1, 13))
    trace = tokens_trace(a, a, [*a[:8], 99, 98, 97, 96], [*a[:4], 50, 51, 52, 53])
    target = local(tmp_path)
    try:
        result = replay(trace, target, OPTIONS)
    finally:
        target.close()
    assert [r.best_hit_tokens for r in result.records] == [0, 12, 8, 4]
    assert [r.memory_hit_chunks for r in result.records] == [None] * 4  # no tier reader
