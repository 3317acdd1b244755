"""Percentiles, hit rates over time and the PNG plot, checked against figures worked by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from persisting.bench.plot import values_caption, write_plot
from persisting.bench.replay import ReplayOptions, ReplayResult, RequestRecord
from persisting.bench.report import hit_rate_over_time, hit_rates_over_time, op_stats, summarize


def record(arrival_s: float, tokens: int, hit_tokens: int, **kw: object) -> RequestRecord:
    return RequestRecord(
        id=f"r{arrival_s}",
        arrival_s=arrival_s,
        start_s=arrival_s,
        tokens=tokens,
        chunks=tokens // 4,
        hit_chunks=hit_tokens // 4,
        hit_tokens=hit_tokens,
        **kw,  # type: ignore[arg-type]
    )


def test_percentiles_interpolate_between_order_statistics() -> None:
    # 1, 2, ..., 100 ms: the p-th percentile sits at rank 1 + 99 p / 100
    stats = op_stats([i / 1000 for i in range(1, 101)])
    assert stats.count == 100
    assert stats.p50_ms == pytest.approx(50.5)
    assert stats.p95_ms == pytest.approx(95.05)
    assert stats.p99_ms == pytest.approx(99.01)
    assert stats.mean_ms == pytest.approx(50.5)
    assert stats.max_ms == pytest.approx(100.0)


def test_percentiles_of_a_skewed_sample() -> None:
    # nine fast ops at 1 ms and one slow op at 100 ms
    stats = op_stats([0.001] * 9 + [0.1])
    assert stats.p50_ms == pytest.approx(1.0)
    assert stats.p95_ms == pytest.approx(1 + 0.55 * 99)  # rank 9.55: 55% of the way to 100
    assert stats.p99_ms == pytest.approx(1 + 0.91 * 99)
    assert stats.mean_ms == pytest.approx(10.9)


def test_an_op_that_never_ran_has_no_percentiles() -> None:
    stats = op_stats([])
    assert stats.count == 0
    assert stats.p50_ms is stats.p99_ms is stats.mean_ms is None
    report = summarize(ReplayResult(model="m", target="t", options=ReplayOptions()))
    assert report.requests == report.tokens == 0
    assert report.token_hit_rate == report.get_bytes_per_s == report.requests_per_s == 0.0


def test_summary_adds_up_records() -> None:
    result = ReplayResult(model="m", target="t", options=ReplayOptions())
    result.records = [
        record(0.0, 100, 0, bytes_written=1000),
        record(1.0, 100, 80, bytes_read=800, bytes_written=200),
        record(2.0, 200, 200, bytes_read=2000),
    ]
    result.latencies_s = {"lookup": [0.001, 0.002, 0.003], "get": [0.01, 0.02], "put": [0.1]}
    result.wall_s = 2.0
    report = summarize(result)
    assert report.requests == 3
    assert report.tokens == 400 and report.hit_tokens == 280
    assert report.token_hit_rate == pytest.approx(0.7)
    assert report.chunks == 100 and report.hit_chunks == 70
    assert report.requests_with_hits == 2
    assert report.bytes_read == 2800 and report.bytes_written == 1200
    assert report.requests_per_s == pytest.approx(1.5)
    assert report.get_bytes_per_s == pytest.approx(2800 / 0.03)
    assert report.put_bytes_per_s == pytest.approx(1200 / 0.1)
    assert report.ops["lookup"].p50_ms == pytest.approx(2.0)
    assert report.ops["put"].count == 1
    assert report.to_dict()["ops"]["get"]["p50_ms"] == pytest.approx(15.0)


def test_hit_rate_over_time_per_bin_and_cumulative() -> None:
    # four bins over 0..3.5 s: [0, 0.875), [0.875, 1.75), [1.75, 2.625), [2.625, 3.5]
    records = [
        record(0.0, 100, 0),
        record(0.5, 100, 50),  # first bin: 50 of 200 tokens hit
        record(1.5, 100, 100),  # second bin: 100 of 100
        record(3.5, 200, 100),  # last bin: 100 of 200; the third bin is empty
    ]
    ends, windowed, cumulative = hit_rate_over_time(records, bins=4)
    assert ends.tolist() == pytest.approx([0.875, 1.75, 2.625, 3.5])
    # the empty bin repeats its predecessor's rate
    assert windowed.tolist() == pytest.approx([0.25, 1.0, 1.0, 0.5])
    assert cumulative.tolist() == pytest.approx([0.25, 0.5, 0.5, 250 / 500])


def test_hit_rate_over_time_of_simultaneous_and_no_requests() -> None:
    ends, windowed, cumulative = hit_rate_over_time([record(0.0, 10, 5), record(0.0, 10, 10)])
    assert ends.tolist() == [0.0]
    assert windowed.tolist() == cumulative.tolist() == [0.75]
    assert all(a.size == 0 for a in hit_rate_over_time([]))


def test_plot_is_a_png_with_both_panels(tmp_path: Path) -> None:
    from matplotlib.image import imread

    rng = np.random.default_rng(0)
    result = ReplayResult(model="m", target="local store", options=ReplayOptions())
    result.records = [record(i * 0.1, 400, min(400, i * 8)) for i in range(60)]
    result.latencies_s = {
        "lookup": list(rng.lognormal(-9, 0.3, 60)),
        "get": list(rng.lognormal(-7, 0.5, 50)),
        "put": [],
    }
    path = write_plot(result, tmp_path / "replay.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[:2] == (460, 1200)  # figsize 12 x 4.6 in at 100 dpi
    # something was drawn: the image is far from a blank canvas
    assert float(np.std(image[..., :3])) > 0.05


def test_hits_split_by_tier_and_the_best_achievable_rate() -> None:
    result = ReplayResult(
        model="m", target="t", options=ReplayOptions.for_model("llama-3.1-8b", chunk_size=4)
    )
    result.records = [
        # 400 tokens each; hits split 3:1 (memory:disk) in the first, all disk in the second
        record(0.0, 400, 0, memory_hit_chunks=0, disk_hit_chunks=0, best_hit_tokens=0),
        record(1.0, 400, 200, memory_hit_chunks=30, disk_hit_chunks=10, best_hit_tokens=300),
        record(2.0, 400, 100, memory_hit_chunks=0, disk_hit_chunks=25, best_hit_tokens=400),
    ]
    report = summarize(result)
    assert (report.memory_hit_chunks, report.disk_hit_chunks) == (30, 35)
    assert report.best_hit_tokens == 700
    assert report.best_token_hit_rate == pytest.approx(700 / 1200)
    assert report.kv_model == "llama-3.1-8b" and report.bytes_per_token == 128 << 10
    assert report.chunk_bytes == 4 * (128 << 10)
    rates = hit_rates_over_time(result.records, bins=2)
    # bins [0, 1) (the request at 0) and [1, 2] (the requests at 1 and 2)
    assert list(rates.ends) == [1.0, 2.0]
    assert rates.split
    assert rates.memory == pytest.approx([0.0, 150 / 800])
    assert rates.disk == pytest.approx([0.0, (50 + 100) / 800])
    assert rates.cumulative == pytest.approx([0.0, 300 / 1200])
    assert rates.best_cumulative == pytest.approx([0.0, 700 / 1200])
    assert values_caption(result) == "llama-3.1-8b KV: 128 KiB/token, 512 KiB chunks of 4 tokens"


def test_without_a_tier_split_every_hit_counts_once() -> None:
    result = ReplayResult(model="m", target="t", options=ReplayOptions())
    result.records = [record(0.0, 100, 50), record(1.0, 100, 100)]
    report = summarize(result)
    assert report.memory_hit_chunks is None and report.disk_hit_chunks is None
    rates = hit_rates_over_time(result.records, bins=1)
    assert not rates.split
    assert rates.memory == pytest.approx([0.75]) and rates.disk == pytest.approx([0.0])
