"""Synthetic traces are deterministic, Zipf-shaped, rate-controlled and round-trip as JSONL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from persisting.bench.trace import (
    Segment,
    SegmentTokens,
    Trace,
    TraceHeader,
    TraceRequest,
    TraceSpec,
    generate_trace,
    read_trace,
    write_trace,
    zipf_weights,
)
from persisting.errors import InvalidValueError


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    spec = TraceSpec(requests=50, seed=7)
    assert generate_trace(spec) == generate_trace(spec)
    other = generate_trace(TraceSpec(requests=50, seed=8))
    assert [r.meta["doc"] for r in other.requests] != [
        r.meta["doc"] for r in generate_trace(spec).requests
    ]


def test_zipf_weights_follow_one_over_rank_to_the_s() -> None:
    w = zipf_weights(4, 1.0)
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert w == pytest.approx([1 / harmonic, 1 / 2 / harmonic, 1 / 3 / harmonic, 1 / 4 / harmonic])
    assert zipf_weights(5, 0.0) == pytest.approx([0.2] * 5)


def test_document_popularity_is_zipf() -> None:
    spec = TraceSpec(requests=20_000, documents=20, zipf_s=1.2, doc_tokens=1, suffix_tokens=1)
    trace = generate_trace(spec)
    counts = np.bincount([r.meta["doc"] for r in trace.requests], minlength=20)
    expected = zipf_weights(20, 1.2) * spec.requests
    # 20,000 draws: each count within 5 standard deviations of its binomial mean
    sigma = np.sqrt(expected * (1 - expected / spec.requests))
    assert np.all(np.abs(counts - expected) < 5 * sigma)
    assert counts[0] > counts[1] > counts[4] > counts[19]


def test_poisson_arrivals_come_at_the_rate() -> None:
    trace = generate_trace(TraceSpec(requests=5000, rate=50.0, doc_tokens=1, suffix_tokens=1))
    times = np.array([r.t for r in trace.requests])
    assert times[0] == 0.0
    assert np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.1)  # exponential: std == mean


def test_uniform_arrivals_are_evenly_spaced() -> None:
    trace = generate_trace(TraceSpec(requests=11, rate=4.0, arrival="uniform"))
    assert [r.t for r in trace.requests] == pytest.approx([i / 4 for i in range(11)])
    assert trace.duration_s == pytest.approx(2.5)


def test_requests_share_system_and_document_prefix_and_differ_after() -> None:
    spec = TraceSpec(requests=400, documents=3, system_tokens=16, doc_tokens=300, suffix_tokens=40)
    trace = generate_trace(spec)
    tokens = SegmentTokens(spec.vocab_size)
    by_doc: dict[int, list[TraceRequest]] = {}
    for r in trace.requests:
        by_doc.setdefault(r.meta["doc"], []).append(r)
    a, b = by_doc[0][:2]
    c = next(r for doc, rs in by_doc.items() if doc != 0 for r in rs)
    ta, tb, tc = tokens.prompt(a), tokens.prompt(b), tokens.prompt(c)
    assert len(ta) == len(tb) == len(tc) == 16 + 300 + 40 == a.num_tokens
    assert np.array_equal(ta[:316], tb[:316])
    assert not np.array_equal(ta[316:], tb[316:])
    assert np.array_equal(ta[:16], tc[:16])
    assert not np.array_equal(ta[16:316], tc[16:316])
    assert ta.min() >= 0 and ta.max() < spec.vocab_size


def test_a_shorter_segment_is_a_prefix_of_a_longer_one() -> None:
    short = SegmentTokens(1000).segment(Segment("doc-9", 100))
    long_ = SegmentTokens(1000).segment(Segment("doc-9", 5000))
    assert np.array_equal(short, long_[:100])
    cached = SegmentTokens(1000, max_cached=2)
    for i in range(5):
        cached.segment(Segment(f"s{i}", 10))
    assert np.array_equal(
        cached.segment(Segment("s0", 10)), SegmentTokens(1000).segment(Segment("s0", 10))
    )


@pytest.mark.timeout(60)
def test_segment_tokens_are_the_same_in_another_process() -> None:
    code = (
        "from persisting.bench.trace import Segment, SegmentTokens;"
        "print(SegmentTokens(32000).segment(Segment('doc-3', 64)).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=50
    ).stdout
    here = SegmentTokens(32000).segment(Segment("doc-3", 64)).tolist()
    assert json.loads(out) == here


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trace = generate_trace(TraceSpec(requests=30, system_tokens=8, seed=3))
    explicit = TraceRequest(id="recorded", t=trace.duration_s + 1, tokens=(5, 6, 7))
    trace = Trace(trace.header, (*trace.requests, explicit))
    path = write_trace(trace, tmp_path / "t.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 32
    header = json.loads(lines[0])
    assert header["format"] == "persisting-trace" and header["version"] == 1
    assert header["generator"]["seed"] == 3
    assert json.loads(lines[-1]) == {"id": "recorded", "t": trace.duration_s, "tokens": [5, 6, 7]}
    back = read_trace(path)
    assert back == trace
    assert [r.meta for r in back.requests] == [r.meta for r in trace.requests]


HEADER = json.dumps(TraceHeader(model="m", vocab_size=100).to_json())


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([], "empty trace"),
        (['{"format": "other"}'], "header"),
        (['{"format": "persisting-trace", "version": 9, "model": "m"}'], "unsupported"),
        (['{"format": "persisting-trace", "version": 1}'], "non-empty 'model'"),
        (["{not json"], "not JSON"),
        (['{"id": "a", "t": 0, "tokens": [1]}'], "header"),
        ([HEADER, '{"id": "a", "t": -1, "tokens": [1]}'], "'t' must be"),
        ([HEADER, '{"id": "a", "t": 0}'], "exactly one of 'tokens' or 'segments'"),
        ([HEADER, '{"id": "a", "t": 0, "tokens": [1], "segments": []}'], "exactly one of"),
        ([HEADER, '{"id": "a", "t": 0, "tokens": [1, -2]}'], "token ids >= 0"),
        ([HEADER, '{"id": "a", "t": 0, "tokens": [99999]}'], "vocab_size"),
        ([HEADER, '{"id": "a", "t": 0, "segments": [{"id": "x"}]}'], "a segment is"),
        ([HEADER, '{"id": "a", "t": 0, "tokens": [1]}', '{"id": "a", "t": 1, "tokens": [1]}'],
         "duplicate"),
        ([HEADER, '{"id": "a", "t": 2, "tokens": [1]}', '{"id": "b", "t": 1, "tokens": [1]}'],
         "backwards"),
    ],
)  # fmt: skip
def test_malformed_traces_say_where_and_why(tmp_path: Path, lines: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidValueError) as info:
        read_trace(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_missing_trace_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"requests": 0}, "requests must be >= 1"),
        ({"rate": 0}, "rate must be > 0"),
        ({"arrival": "bursty"}, "arrival must be"),
        ({"documents": 0}, "documents must be >= 1"),
        ({"zipf_s": -1}, "zipf_s must be >= 0"),
        ({"doc_tokens": 0, "suffix_tokens": 0}, "at least one token"),
    ],
)
def test_impossible_specs_are_rejected(change: dict, message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        generate_trace(TraceSpec(**change))
