"""`persisting stats` from a storage root and from a running server's metrics endpoint (a
separate process with a real store, traffic and a KVMetrics exporter)."""

from __future__ import annotations

import functools
import http.server
import json
import math
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner, Result

from persisting.admin import figures_from_stats, histogram_quantile
from persisting.cli import app, to_jsonable
from persisting.metrics import LATENCY_BUCKETS, start_metrics_server
from tests import child_env
from tests.cli.cli_ops_helpers import FILE_BYTES, MODEL, fill, write_queue

runner = CliRunner()
OTHER = "org/small-model"

SERVER = r"""
import json, sys
from tests.cli.cli_ops_helpers import MODEL, VALUE_BYTES, key, open_store, value
from persisting.metrics import KVMetrics

root = sys.argv[1]
metrics = KVMetrics()
store = open_store(root, memory_bytes=3 * VALUE_BYTES)
metrics.attach(store)
metrics.track_queue_lag(root)
for i in range(8):
    store.put(key(i), value(i))
for i in range(12):
    store.get(key(i))
store.flush()  # settles the measured metadata overhead that disk bytes include
server = metrics.serve()
print(json.dumps({"url": server.url, "stats": store.stats()}), flush=True)
sys.stdin.read()  # serve until the test closes our stdin
server.close()
metrics.detach(store)
store.close()
"""


def invoke(*args: object, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "160", **(env or {})})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stats_of_a_running_server_match_its_store(root: Path) -> None:
    write_queue(root, "kv-events", 0, 10, consumers={"prewarm": 4})
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(root)],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        hello = json.loads(server.stdout.readline())
        result = invoke("stats", "--metrics-url", hello["url"], "--json")
        assert result.exit_code == 0, result.output
        table = invoke("stats", "--metrics-url", hello["url"])
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=60)
    assert server.returncode == 0
    stats = hello["stats"]
    data = json.loads(result.stdout)
    assert (data["source"], data["kind"]) == (hello["url"], "metrics_url")
    figures = data["models"][MODEL]
    expected = figures_from_stats(MODEL, stats).figures
    assert {k: v for k, v in figures.items() if k not in ("model", "latency")} == expected
    assert figures["hits"] == {"memory": 3, "disk": 5} and figures["misses"] == 4
    latency = {(x["op"], x["tier"], x["outcome"]): x for x in figures["latency"]}
    assert {k: x["count"] for k, x in latency.items()} == {
        ("put", "disk", "stored"): 8,
        ("get", "memory", "hit"): stats["get_hit_memory"],
        ("get", "disk", "hit"): stats["get_hit_disk"],
    }
    for x in latency.values():
        assert 0 < x["p50_ms"] <= x["p95_ms"] <= x["p99_ms"] <= LATENCY_BUCKETS[-1] * 1000
        assert x["mean_ms"] > 0
    assert data["queue_lag"] == [
        {
            "topic": "kv-events",
            "bucket": 0,
            "consumer": "prewarm",
            "position": None,
            "end_offset": None,
            "lag": 6,
        }
    ]
    assert table.exit_code == 0, table.output
    for text in (f"Model {MODEL}", "read_bytes", "Latency of", "p99", "prewarm"):
        assert text in table.stdout


def test_stats_of_a_storage_root_show_what_is_stored(root: Path) -> None:
    fill(root, MODEL, 4)
    fill(root, OTHER, 2)
    write_queue(root, "kv-events", 1, 5, consumers={"prewarm": 5, "audit": 1})
    files = sorted(p for p in (root / "kv").rglob("*") if p.is_file())
    # A budget in this process's settings far under what is stored: a report never
    # applies it (a store opened with it would evict all but a few chunks).
    env = {"PERSISTING_KV__DISK_BYTES": "8KiB"}
    result = invoke("stats", "--storage-path", root, "--json", env=env)
    assert result.exit_code == 0, result.output
    assert sorted(p for p in (root / "kv").rglob("*") if p.is_file()) == files
    data = json.loads(result.stdout)
    assert (data["source"], data["kind"]) == (str(root), "storage_root")
    big = data["models"][MODEL]
    assert big["items"] == {"disk": 4}
    # disk: 4 files plus the metadata and directories
    assert 4 * FILE_BYTES < big["bytes"]["disk"] <= 4 * FILE_BYTES + (512 << 10)
    assert big["capacity"] == {"disk": 1 << 24}  # as its writer (fill) configured it
    assert big["latency"] == []
    assert data["models"][OTHER]["items"]["disk"] == 2
    lags = {(x["consumer"], x["position"], x["end_offset"], x["lag"]) for x in data["queue_lag"]}
    assert lags == {("audit", 1, 5, 4), ("prewarm", 5, 5, 0)}
    table = invoke("stats", "--json", env={"PERSISTING_STORAGE_PATH": str(root), **env})
    assert json.loads(table.stdout)["models"] == data["models"]
    text = invoke("stats", "--storage-path", root).stdout
    assert "processes serving it" in text and f"Model {OTHER}" in text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_stats_errors_are_one_clear_line(root: Path, tmp_path: Path) -> None:
    root.mkdir()
    both = invoke("stats", "--storage-path", root, "--metrics-url", "http://127.0.0.1:1/")
    assert both.exit_code == 2 and "not both" in both.stderr
    bad = invoke("stats", "--metrics-url", "ftp://example/metrics")
    assert bad.exit_code == 2 and "http://" in bad.stderr
    down = invoke("stats", "--metrics-url", f"http://127.0.0.1:{free_port()}/metrics")
    assert down.exit_code == 1 and "cannot scrape" in down.stderr
    with start_metrics_server(0, "127.0.0.1", CollectorRegistry()) as empty:
        foreign = invoke("stats", "--metrics-url", empty.url)
    assert foreign.exit_code == 1 and "no Persisting metrics" in foreign.stderr
    (tmp_path / "index.html").write_text("<html><body>not metrics</body></html>\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as web:
        thread = threading.Thread(target=web.serve_forever, daemon=True)
        thread.start()
        page = invoke("stats", "--metrics-url", f"http://127.0.0.1:{web.server_port}/")
        web.shutdown()
    assert page.exit_code == 1 and "did not return Prometheus text" in page.stderr
    for result in (both, bad, down, foreign, page):
        assert "Traceback" not in result.output


def test_histogram_quantile_interpolates_like_promql() -> None:
    buckets = [(0.1, 2.0), (0.2, 6.0), (0.4, 6.0), (math.inf, 8.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 2: top of bucket 1
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 4: half of (0.1, 0.2]
    assert histogram_quantile(0.125, buckets) == pytest.approx(0.05)  # rank 1, from 0
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.4)  # +Inf: highest bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, []) is None


def test_json_of_dataclasses_is_plain() -> None:
    figures = figures_from_stats("m", {"get_hit_memory": 3, "disk_items": 2, "memory_items": 1})
    data = to_jsonable(figures.to_dict())
    assert data["hits"] == {"memory": 3, "disk": 0} and data["items"] == {"memory": 1, "disk": 2}
    assert "capacity" not in data  # a gauge the stats do not have is left out
    assert json.loads(json.dumps(data)) == data


def test_sub_microsecond_latency_reads_the_same_in_mean_and_percentiles() -> None:
    """Regression: memory hits of ~0.3 us showed as mean 0.000 ms and p50 0.005 ms (three
    fixed decimals; a first bucket of 10 us, interpolated from 0)."""
    from io import StringIO

    from rich.console import Console

    from persisting.admin import figures_from_scrape
    from persisting.cli.output import human_ms
    from persisting.cli.storage import render_stats
    from persisting.metrics import KVMetrics

    metrics = KVMetrics()
    fast = metrics.latency.labels(MODEL, "get", "memory", "hit")
    for _ in range(10):
        fast.observe(3e-7)
    report = figures_from_scrape(metrics.render(), "test")
    (latency,) = report.models[0].latency
    assert latency.mean_ms == pytest.approx(0.0003)
    assert latency.p50_ms is not None and latency.p99_ms is not None
    assert latency.p50_ms <= LATENCY_BUCKETS[0] * 1000  # within the first bucket: 1 us
    assert latency.p50_ms == pytest.approx(0.0005)
    out = StringIO()
    render_stats(Console(file=out, width=160), report)
    row = next(line for line in out.getvalue().splitlines() if "memory" in line and "hit" in line)
    assert "0.000300" in row and "0.000500" in row
    assert " 0.000 " not in row and "0.005" not in row
    assert human_ms(0.0003) == "0.000300" and human_ms(40.777) == "40.8"
