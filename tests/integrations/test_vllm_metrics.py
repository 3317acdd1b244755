"""The connector's metrics port: read by ``persisting stats --metrics-url``, and a port that
cannot be bound stops the engine at start (a scrape would read whoever holds it)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from persisting.errors import ConfigError
from persisting.integrations.vllm.metrics import serve_metrics, stop_metrics
from persisting.integrations.vllm.settings import connector_settings
from persisting.integrations.vllm.shared import Namespace, acquire, release

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "vllm.test.fedcba9876543210"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def namespace(tmp_path: Path) -> Iterator[Namespace]:
    state = acquire(connector_settings({"storage_path": str(tmp_path)}), NAMESPACE)
    try:
        yield state
    finally:
        stop_metrics()
        release(state)


def test_stats_reads_an_engines_connector_metrics(namespace: Namespace) -> None:
    namespace.counters.add(lookup_hits=7, blocks_loaded=5, bytes_loaded=5 << 20, load_errors=1)
    port = free_port()
    serve_metrics("127.0.0.1", port)
    out = subprocess.run(
        [
            sys.executable, "-m", "persisting.cli", "stats",
            "--metrics-url", f"http://127.0.0.1:{port}/metrics", "--json",
        ],
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    figures = json.loads(out)["models"][NAMESPACE]
    assert figures["lookup_hits"] == 7 and figures["blocks_loaded"] == 5
    assert figures["bytes_loaded"] == 5 << 20 and figures["load_errors"] == 1
    assert figures["disk_capacity"] == 64 << 30


def test_a_metrics_port_that_cannot_be_bound_is_an_error(namespace: Namespace) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve_metrics("127.0.0.1", port)
