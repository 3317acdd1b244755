"""The connector's Prometheus metrics, on a registry and port of its own.

Served when ``kv_connector_extra_config`` has ``metrics_port``, from the engine process
that runs the connector (with one worker: the engine core, where both sides live). The
figures are read at scrape time from the open namespaces: the connector's counters and
the store's own usage, so they are the store's truth, not a second count (a cluster's
namespace: the counters only; its members report their stores). A port that
cannot be bound stops the engine at start (a scrape would otherwise read whoever holds
it, such as an orphaned engine of an earlier server); :func:`stop_metrics` closes them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from persisting.errors import ConfigError
from persisting.integrations.vllm.shared import open_counters, open_namespaces

log = logging.getLogger(__name__)

#: Counter -> help text; exported as ``persisting_vllm_<name>_total``.
COUNTERS = {
    "lookup_hits": "Blocks vLLM looked up that the store holds",
    "lookup_misses": "Blocks vLLM looked up that the store does not hold",
    "blocks_loaded": "Blocks loaded into vLLM's KV cache",
    "bytes_loaded": "Bytes loaded into vLLM's KV cache",
    "load_errors": "Blocks whose load failed (gone, damaged, another layout, I/O error); "
    "vLLM recomputes them",
    "blocks_stored": "Blocks written to the store",
    "bytes_stored": "Bytes of blocks written to the store",
    "store_errors": "Blocks whose store failed (a future miss)",
    "evictions": "Blocks the store evicted to stay within its disk budget",
    "events_applied": "Prewarm/evict events for the namespace applied from the event topic",
}
#: Store figure -> help text; exported as ``persisting_vllm_<name>``.
GAUGES = {
    "disk_items": "Blocks on disk",
    "disk_bytes": "Bytes the namespace directory holds (payload and metadata)",
    "disk_capacity": "The namespace's disk budget in bytes",
}


class ConnectorCollector(Collector):
    """Reads every open namespace's counters and store figures at scrape time."""

    def collect(self) -> Iterator[Metric]:
        namespaces = open_namespaces()
        counted = [(ns, counters.snapshot()) for ns, counters in open_counters()]
        for name, text in COUNTERS.items():
            family = CounterMetricFamily(f"persisting_vllm_{name}", text, labels=["namespace"])
            for ns, figures in counted:
                family.add_metric([ns], figures[name])
            yield family
        stats = [(ns.store.model, ns.store.stats()) for ns in namespaces if not ns.store.closed]
        for name, text in GAUGES.items():
            gauge = GaugeMetricFamily(f"persisting_vllm_{name}", text, labels=["namespace"])
            for model, figures in stats:
                gauge.add_metric([model], float(figures.get(name, 0)))
            yield gauge


_LOCK = threading.Lock()
_SERVED: dict[tuple[str, int], Any] = {}


def serve_metrics(addr: str, port: int) -> None:
    """Serve the connector's metrics on ``addr:port`` (once per process). A port that
    cannot be bound is a ConfigError: the engine does not start."""
    with _LOCK:
        if (addr, port) in _SERVED:
            return
        registry = CollectorRegistry()
        registry.register(ConnectorCollector())
        try:
            server, _thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise ConfigError(
                f"Persisting: cannot serve metrics on {addr}:{port} ({exc.strerror or exc});"
                " another process holds the port (an engine of an earlier server still"
                " running?): stop it, or set another metrics_port"
            ) from exc
        _SERVED[(addr, port)] = server
        log.info("Persisting: connector metrics on http://%s:%d/metrics", addr, port)


def stop_metrics() -> None:
    """Close every metrics port this process serves."""
    with _LOCK:
        servers = list(_SERVED.values())
        _SERVED.clear()
    for server in servers:
        server.shutdown()
        server.server_close()


__all__ = ["COUNTERS", "GAUGES", "ConnectorCollector", "serve_metrics", "stop_metrics"]
