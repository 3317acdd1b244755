"""KVMetrics on real KV stores and queue buckets, scraped over HTTP before and after traffic."""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import prometheus_client
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from persisting.errors import ConfigError
from persisting.kv import TokenHasher
from persisting.metrics import (
    LATENCY_BUCKETS,
    LATENCY_METRIC,
    QUEUE_LAG_METRIC,
    STORE_FIGURES,
    KVMetrics,
    figure_values,
    start_metrics_server,
)
from tests.cli.cli_ops_helpers import (
    MODEL,
    key,
    open_store,
    value,
    write_queue,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

#: 1 MiB values for the store whose disk evictions are counted: the disk budget covers the
#: store's metadata and directories too, which must be small beside one payload file.
BIG_BYTES = 2 * 8 * 256 * 128 * 2
BIG_FILE_BYTES = 4096 + BIG_BYTES
OVERHEAD_ROOM = 512 << 10


def big(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 8, 256, 128, generator=g).to(torch.bfloat16)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_counters_gauges_and_histograms_move_with_real_traffic(root: Path) -> None:
    metrics = KVMetrics()
    # Memory holds 2 values and disk 5 payload files: the 6th put evicts from disk.
    capacity = 5 * BIG_FILE_BYTES + OVERHEAD_ROOM
    store = open_store(root, memory_bytes=2 * BIG_BYTES, disk_bytes=capacity)
    other = open_store(root, "org/other-model")
    metrics.attach(store)
    metrics.attach(other)
    with metrics.serve() as server:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        before = scrape(server.url)
        for i in range(6):
            store.put(key(i), big(i))
        assert store.get(key(5)) is not None  # memory hit
        assert store.get(key(1)) is not None  # disk hit (memory holds 4 and 5)
        assert store.get(key(0)) is None  # evicted from disk
        assert store.get(key(99)) is None  # never stored
        stored = store.layout(key(5))
        assert stored is not None
        wrong = dataclasses.replace(stored, shape=(2, 8, 128, 256))
        assert store.get(key(5), expect=wrong) is None  # a layout mismatch is a miss
        where = store.lease(key(2), 30)
        assert where is not None
        with open(where.path, "r+b") as f:  # damage the payload on disk
            f.seek(where.offset + 100)
            f.write(b"\xff" * 16)
        store.release(key(2), where.token)
        assert store.get(key(2)) is None  # the checksum catches it
        hasher = TokenHasher("org/other-model", chunk_size=16)
        chunks = hasher.process_tokens(list(range(40)))
        other.batched_put([k for _s, _e, k in chunks], [value(7), value(8)], chain=True)
        assert other.lookup_tokens(list(range(40)), hasher) == 32
        store.flush()  # metadata committed and measured: the figures hold still
        other.flush()
        after = scrape(server.url)

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    m = {"model": MODEL}
    assert moved("persisting_kv_hits_total", **m, tier="memory") == 1
    assert moved("persisting_kv_hits_total", **m, tier="disk") == 1
    assert moved("persisting_kv_misses_total", **m) == 4  # absent, evicted, mismatch, damaged
    assert moved("persisting_kv_layout_mismatches_total", **m) == 1
    assert moved("persisting_kv_corruptions_total", **m) == 1
    assert moved("persisting_kv_evictions_total", **m, tier="memory") == 4
    assert moved("persisting_kv_evictions_total", **m, tier="disk") == 1
    assert moved("persisting_kv_written_bytes_total", **m, tier="disk") == 6 * BIG_BYTES
    assert moved("persisting_kv_read_bytes_total", **m, tier="memory") == BIG_BYTES
    assert moved("persisting_kv_read_bytes_total", **m, tier="disk") == BIG_BYTES
    assert moved("persisting_kv_put_requests_total", **m, tier="disk") == 6
    assert moved("persisting_kv_hit_tokens_total", model="org/other-model") == 32
    assert moved("persisting_kv_hit_tokens_total", **m) == 0
    # gauges: what is held now (6 stored, 1 evicted and 1 damaged dropped from disk)
    assert sample(after, "persisting_kv_items", **m, tier="memory") == 2
    assert sample(after, "persisting_kv_items", **m, tier="disk") == 4
    # disk bytes: 4 payload files plus the metadata and directories the budget also covers
    disk_bytes = sample(after, "persisting_kv_bytes", **m, tier="disk")
    assert 4 * BIG_FILE_BYTES < disk_bytes <= 4 * BIG_FILE_BYTES + OVERHEAD_ROOM
    assert sample(after, "persisting_kv_capacity_bytes", **m, tier="disk") == capacity
    # the latency histograms saw each timed operation once, in the tier it was served from
    count = f"{LATENCY_METRIC}_count"
    assert moved(count, **m, op="put", tier="disk", outcome="stored") == 6
    assert moved(count, **m, op="get", tier="memory", outcome="hit") == 1
    assert moved(count, **m, op="get", tier="disk", outcome="hit") == 1
    assert moved(count, **m, op="get", tier="disk", outcome="miss") == 1  # the damaged one
    put_labels = {**m, "op": "put", "tier": "disk", "outcome": "stored"}
    le = [f"{b:g}" if b < 1 else str(float(b)) for b in LATENCY_BUCKETS]
    cumulative = [sample(after, f"{LATENCY_METRIC}_bucket", **put_labels, le=x) for x in le]
    assert cumulative == sorted(cumulative) and cumulative[-1] <= 6
    assert sample(after, f"{LATENCY_METRIC}_bucket", **put_labels, le="+Inf") == 6
    assert sample(after, f"{LATENCY_METRIC}_sum", **put_labels) > 0
    # every exported counter and gauge is exactly the store's own figure
    for name, s in ((MODEL, store), ("org/other-model", other)):
        stats = s.stats()
        for figure in STORE_FIGURES:
            expected = figure_values(figure, stats)
            if isinstance(expected, dict):
                for tier, number in expected.items():
                    assert sample(after, figure.sample_name, model=name, tier=tier) == number
            else:
                assert sample(after, figure.sample_name, model=name) == expected, figure
    store.close()
    other.close()


def test_each_exporter_has_its_own_registry(root: Path) -> None:
    first, second = KVMetrics(), KVMetrics()
    assert first.registry is not second.registry
    assert first.registry is not prometheus_client.REGISTRY
    with open_store(root) as store:
        first.attach(store)
        store.put(key(1), value(1))
        assert f'persisting_kv_items{{model="{MODEL}",tier="disk"}} 1.0' in first.render()
        assert MODEL not in second.render()
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("persisting") for name in global_names)
    with pytest.raises(ConfigError):
        KVMetrics(first.registry)  # the same names twice in one registry
    with pytest.raises(ConfigError):
        start_metrics_server(0, "127.0.0.1", object())  # type: ignore[arg-type]


def test_detach_and_closed_stores(root: Path) -> None:
    metrics = KVMetrics()
    store = open_store(root)
    listeners = len(store.op_stats.listeners)
    metrics.attach(store)
    assert len(store.op_stats.listeners) == listeners + 1
    again = open_store(root, memory_bytes=0)  # a newer store of the same model replaces it
    metrics.attach(again)
    assert len(store.op_stats.listeners) == listeners
    assert metrics.detach(store) is False  # no longer the attached one
    again.put(key(3), value(3))
    items = f'persisting_kv_items{{model="{MODEL}",tier="disk"}} 1.0'
    timed = f'{LATENCY_METRIC}_count{{model="{MODEL}",op="put"'
    assert items in metrics.render() and timed in metrics.render()
    again.close()  # a store closed while attached is skipped, not an error
    assert items not in metrics.render() and timed in metrics.render()
    assert metrics.detach(again) is True  # its latency series go with it
    assert f'model="{MODEL}"' not in metrics.render()
    assert len(again.op_stats.listeners) == listeners
    store.close()


def test_queue_consumer_lag_is_set_or_read_from_committed_positions(root: Path) -> None:
    write_queue(root, "kv-events", 0, 10, consumers={"prewarm": 4})
    write_queue(root, "kv-events", 1, 3, consumers={"prewarm": 3, "audit": 0})
    write_queue(root, "other", 0, 5)  # no consumer: no lag series
    metrics = KVMetrics()
    metrics.track_queue_lag(root)
    with metrics.serve() as server:
        samples = scrape(server.url)
        lag = {
            tuple(sorted(labels)): v
            for (name, labels), v in samples.items()
            if name == QUEUE_LAG_METRIC
        }
        assert lag == {
            (("bucket", "0"), ("consumer", "prewarm"), ("topic", "kv-events")): 6,
            (("bucket", "1"), ("consumer", "audit"), ("topic", "kv-events")): 3,
            (("bucket", "1"), ("consumer", "prewarm"), ("topic", "kv-events")): 0,
        }
        write_queue(root, "kv-events", 0, 5)  # 5 more records: offsets 10..14
        assert (
            sample(
                scrape(server.url),
                QUEUE_LAG_METRIC,
                topic="kv-events",
                bucket="0",
                consumer="prewarm",
            )
            == 11
        )
        metrics.set_queue_lag("kv-events", 0, "prewarm", 2)  # a pushed value wins
        labels = {"topic": "kv-events", "bucket": "0", "consumer": "prewarm"}
        assert sample(scrape(server.url), QUEUE_LAG_METRIC, **labels) == 2
        metrics.clear_queue_lag("kv-events", 0, "prewarm")
        assert sample(scrape(server.url), QUEUE_LAG_METRIC, **labels) == 11


def test_a_busy_port_is_a_clear_error() -> None:
    metrics = KVMetrics()
    with metrics.serve() as server:
        with pytest.raises(ConfigError, match=f"127.0.0.1:{server.port}"):
            start_metrics_server(server.port, "127.0.0.1", KVMetrics().registry)
        with urllib.request.urlopen(server.url, timeout=10) as response:  # still answers
            assert b"# TYPE persisting_kv_hits_total counter" in response.read()


def _get(url: str) -> tuple[int, str, str]:
    import urllib.error

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_healthz_readyz_and_404_beside_metrics(root: Path) -> None:
    import json

    state = {"ready": False}

    def probe() -> tuple[bool, dict[str, object]]:
        return state["ready"], {"stores": True, "cluster": True if state["ready"] else "not yet"}

    metrics = KVMetrics()
    with metrics.serve(ready=probe) as server:
        base = server.url.removesuffix("/metrics")
        assert _get(f"{base}/healthz")[::2] == (200, "ok\n")
        status, kind, body = _get(f"{base}/readyz")
        assert (status, kind) == (503, "application/json")
        assert json.loads(body) == {
            "ready": False,
            "checks": {"stores": True, "cluster": "not yet"},
        }
        state["ready"] = True
        assert _get(f"{base}/readyz")[0] == 200
        for path in ("/", "/ready", "/healthz/x", "/metricsx"):
            status, _kind, body = _get(base + path)
            assert status == 404 and "/metrics, /healthz, /readyz" in body, path
        status, kind, body = _get(server.url)
        assert status == 200 and kind.startswith("text/plain") and "persisting_kv_hits" in body


def test_a_failing_probe_reads_not_ready() -> None:
    def probe() -> tuple[bool, dict[str, object]]:
        raise RuntimeError("boom")

    with KVMetrics().serve(ready=probe) as server:
        status, _kind, body = _get(server.url.replace("/metrics", "/readyz"))
    assert status == 503 and "boom" in body


def test_hits_read_without_a_duration_are_counted_not_timed(root: Path) -> None:
    metrics = KVMetrics()
    store = open_store(root)
    metrics.attach(store)
    try:
        store.put(key(1), value(1))
        assert store.get(key(1)) is not None  # timed
        assert store.touch([key(1), key(1)]) == 2  # a same-host reader's hits: no duration
        samples = {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.render())
            for s in family.samples
        }
        labels = frozenset(
            {("model", MODEL), ("op", "get"), ("tier", "memory"), ("outcome", "hit")}
        )
        assert samples[(f"{LATENCY_METRIC}_count", labels)] == 1
        assert samples[(f"{LATENCY_METRIC}_sum", labels)] > 0  # so the mean is never 0
        hits = frozenset({("model", MODEL), ("tier", "memory")})
        assert samples[("persisting_kv_hits_total", hits)] == 3
    finally:
        metrics.detach(store)
        store.close()


def test_service_figures_are_exported_from_the_snapshot() -> None:
    metrics = KVMetrics()
    metrics.track_service(
        lambda: {
            "requests": {"put": 3, "get": 5},
            "errors": {"invalid_value": 2},
            "sessions": 1,
            "pins": 0,
            "connections": 4,
            "members_up": 2,
            "ready": True,
            "consumer": {
                "topic": "kv-events",
                "consumer": "kv-service/kvstore",
                "position": {"0": 17},
                "applied": 9,
            },
        }
    )
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render())
        for s in family.samples
    }
    assert samples[("persisting_service_requests_total", frozenset({("op", "get")}))] == 5
    assert samples[("persisting_service_errors_total", frozenset({("code", "invalid_value")}))] == 2
    assert samples[("persisting_service_members_up", frozenset())] == 2
    assert samples[("persisting_service_ready", frozenset())] == 1
    assert samples[("persisting_service_connections", frozenset())] == 4
    position = frozenset(
        {("topic", "kv-events"), ("bucket", "0"), ("consumer", "kv-service/kvstore")}
    )
    assert samples[("persisting_events_consumer_position", position)] == 17
    applied = frozenset(
        {("topic", "kv-events"), ("consumer", "kv-service/kvstore"), ("outcome", "applied")}
    )
    assert samples[("persisting_events_total", applied)] == 9
