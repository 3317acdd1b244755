"""The connector's Prometheus metrics, on a registry and port of its own.

Served when ``kv_connector_extra_config`` has ``metrics_port``, from the engine process
that runs the connector (with one worker: the engine core, where both sides live). The
figures are read at scrape time from the open namespaces: the connector's counters and
the store's own usage, so they are the store's truth, not a second count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from persisting.integrations.vllm.shared import open_namespaces

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
        for name, text in COUNTERS.items():
            family = CounterMetricFamily(f"persisting_vllm_{name}", text, labels=["namespace"])
            for ns in namespaces:
                family.add_metric([ns.store.model], ns.counters.snapshot()[name])
            yield family
        stats = [(ns.store.model, ns.store.stats()) for ns in namespaces if not ns.store.closed]
        for name, text in GAUGES.items():
            gauge = GaugeMetricFamily(f"persisting_vllm_{name}", text, labels=["namespace"])
            for model, figures in stats:
                gauge.add_metric([model], float(figures.get(name, 0)))
            yield gauge


_LOCK = threading.Lock()
_SERVED: dict[tuple[str, int], CollectorRegistry] = {}


def serve_metrics(addr: str, port: int) -> bool:
    """Serve the connector's metrics on ``addr:port`` (once per process); False, with a
    warning, if the port cannot be bound (the engine runs on without it)."""
    with _LOCK:
        if (addr, port) in _SERVED:
            return True
        registry = CollectorRegistry()
        registry.register(ConnectorCollector())
        try:
            start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            log.warning("Persisting: cannot serve metrics on %s:%d: %s", addr, port, exc)
            return False
        _SERVED[(addr, port)] = registry
        log.info("Persisting: connector metrics on http://%s:%d/metrics", addr, port)
        return True


__all__ = ["COUNTERS", "GAUGES", "ConnectorCollector", "serve_metrics"]
