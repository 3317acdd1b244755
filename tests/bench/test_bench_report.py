"""Percentiles, hit rates over time and the PNG plot, checked against figures worked by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from persisting.bench.plot import write_plot
from persisting.bench.replay import ReplayOptions, ReplayResult, RequestRecord
from persisting.bench.report import hit_rate_over_time, op_stats, summarize


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
    assert image.shape[:2] == (420, 1100)  # figsize 11 x 4.2 in at 100 dpi
    # something was drawn: the image is far from a blank canvas
    assert float(np.std(image[..., :3])) > 0.05
