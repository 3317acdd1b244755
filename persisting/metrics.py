"""Prometheus metrics of KV stores and queue consumers, on a registry of their own.

:class:`KVMetrics` watches any number of :class:`~persisting.kv.KVStore` s (one per model)
without ``persisting.kv`` knowing about Prometheus, in two ways:

* a listener on ``store.op_stats.listeners`` feeds the latency histograms as operations
  happen (only a listener sees each operation's duration);
* a collector reads ``store.stats()`` at scrape time for every counter and gauge, so the
  exported figures are exactly the store's own (no second count that could drift).

Queue consumer lag (records put but not yet committed by a consumer) is either set by the
caller (:meth:`KVMetrics.set_queue_lag`) or worked out at scrape time from the committed
positions under a storage root (:meth:`KVMetrics.track_queue_lag`).

A server also exports its service-level figures (:meth:`KVMetrics.track_service`):
requests by operation, errors by code, sessions, the cluster members it sees up, and its
event consumer's position. The endpoint (:func:`start_metrics_server`) answers
``/metrics``, ``/healthz`` (the process answers) and ``/readyz`` (a readiness probe the
caller supplies: 200 when ready, else 503, with the checks as JSON), and 404 for anything
else.

Nothing here touches prometheus_client's global default registry: a server process makes
one ``KVMetrics`` (with its own ``CollectorRegistry``) and serves it with
:func:`start_metrics_server`. The names of the figures and metrics, and the consumer lag,
live in :mod:`persisting.figures` (re-exported here), which does not import Prometheus.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.registry import Collector

from persisting.errors import ConfigError, PersistingError
from persisting.figures import (
    LATENCY_METRIC,
    QUEUE_LAG_METRIC,
    STORE_FIGURES,
    TIERS,
    ConsumerLag,
    StoreFigure,
    consumer_lags,
    figure_values,
)

if TYPE_CHECKING:
    from persisting.kv import KVStore

log = logging.getLogger(__name__)

#: Histogram buckets (seconds): 1 us to 10 s, about three per decade. Memory-tier hits
#: in-process take a few microseconds: a coarser first bucket would put every one of them
#: in it, and an estimated percentile would say only "half of 10 us".
LATENCY_BUCKETS = (
    0.000001,
    0.0000025,
    0.000005,
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# ---------------------------------------------------------------------------------------
# The exporter
# ---------------------------------------------------------------------------------------

Listener = Callable[[str, str, float, int, str], None]


@dataclass
class _Attached:
    store: KVStore
    listener: Listener


class KVMetrics:
    """Prometheus metrics of KV stores (one per model) and queue consumers.

    ::

        metrics = KVMetrics()                 # its own CollectorRegistry
        metrics.attach(store)                 # once per KVStore (per model)
        metrics.track_queue_lag(storage_root) # optional: lag of committed consumers
        server = metrics.serve(port=9464)     # or start_metrics_server(port, addr, registry)
        ...
        server.close(); metrics.detach(store)
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._stores: dict[str, _Attached] = {}
        self._series: dict[str, set[tuple[str, str, str]]] = {}
        self._lags: dict[tuple[str, int, str], int] = {}
        self._tracked: list[tuple[Path, tuple[str, ...] | None]] = []
        self._service: Callable[[], Mapping[str, Any]] | None = None
        try:
            self.latency = Histogram(
                LATENCY_METRIC,
                "Duration of KV store operations, by operation, tier and outcome.",
                labelnames=("model", "op", "tier", "outcome"),
                buckets=LATENCY_BUCKETS,
                registry=self.registry,
            )
            self.registry.register(_Collector(self))
            self.registry.register(_ServiceCollector(self))
        except ValueError as exc:  # the registry already holds Persisting's metrics
            raise ConfigError(f"this registry already exports Persisting metrics: {exc}") from exc

    # -- stores ---------------------------------------------------------------------------

    def attach(self, store: KVStore) -> None:
        """Export ``store``'s figures (labelled with its model); replaces an earlier store
        of the same model."""
        with self._lock:
            previous = self._stores.pop(store.model, None)
            if previous is not None:
                _remove_listener(previous)
            listener = self._listener(store.model)
            store.op_stats.listeners.append(listener)
            self._stores[store.model] = _Attached(store, listener)

    def detach(self, store: KVStore) -> bool:
        """Stop exporting ``store`` (its latency series go too); False if not attached.

        Detach a store before closing it; a closed store still attached is skipped.
        """
        with self._lock:
            attached = self._stores.get(store.model)
            if attached is None or attached.store is not store:
                return False
            del self._stores[store.model]
            series = self._series.pop(store.model, set())
        _remove_listener(attached)
        for labels in series:
            with contextlib.suppress(KeyError):
                self.latency.remove(store.model, *labels)
        return True

    def _listener(self, model: str) -> Listener:
        histogram = self.latency
        children: dict[tuple[str, str, str], Any] = {}
        series = self._series.setdefault(model, set())

        def observe(op: str, tier: str, seconds: float, _nbytes: int, outcome: str) -> None:
            # Index-only misses carry no tier and no timing, and hits a same-host client
            # copied out of the shared pool itself are reported without a duration: they
            # are counted (the store's counters), not timed -- a 0 here would drag the
            # mean to 0 beside percentiles interpolated inside the first bucket.
            if not tier or seconds <= 0.0:
                return
            labels = (op, tier, outcome)
            child = children.get(labels)
            if child is None:
                child = children[labels] = histogram.labels(model, *labels)
                series.add(labels)
            child.observe(seconds)

        return observe

    # -- queue consumer lag -----------------------------------------------------------------

    def set_queue_lag(self, topic: str, bucket: int, consumer: str, lag: int) -> None:
        """Report that ``consumer`` of ``topic``'s ``bucket`` is ``lag`` records behind."""
        with self._lock:
            self._lags[(topic, int(bucket), consumer)] = max(0, int(lag))

    def clear_queue_lag(self, topic: str, bucket: int, consumer: str) -> None:
        with self._lock:
            self._lags.pop((topic, int(bucket), consumer), None)

    def track_queue_lag(
        self, storage_root: str | os.PathLike[str], topics: Iterable[str] | None = None
    ) -> None:
        """At every scrape, export the lag of each committed consumer under ``storage_root``
        (of ``topics``, or of every topic); values set with :meth:`set_queue_lag` win."""
        with self._lock:
            self._tracked.append(
                (Path(storage_root), tuple(topics) if topics is not None else None)
            )

    # -- the service ---------------------------------------------------------------------

    def track_service(self, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        """At every scrape, export a server's figures from ``snapshot()``: a mapping with
        ``requests`` ({op: n}), ``errors`` ({code: n}), ``sessions``, ``pins``, ``connections``,
        ``members_up``, ``members_known``, ``ready`` (bool), ``consumer`` (its
        :meth:`~actors.kv_events.EventConsumer.status`, or None) and ``copies`` (the
        replicator's status, or None)."""
        with self._lock:
            self._service = snapshot

    def _service_snapshot(self) -> Mapping[str, Any] | None:
        with self._lock:
            snapshot = self._service
        if snapshot is None:
            return None
        try:
            return snapshot()
        except Exception as exc:  # a scrape must not fail over one figure
            log.warning("cannot read the service figures: %s", exc)
            return None

    # -- output ---------------------------------------------------------------------------

    def serve(
        self, port: int = 0, addr: str = "127.0.0.1", ready: ReadyProbe | None = None
    ) -> MetricsServer:
        """Serve this registry on ``http://addr:port/metrics`` (port 0: any free port),
        with ``/healthz`` and ``/readyz`` (``ready``: the readiness probe)."""
        return start_metrics_server(port, addr, self.registry, ready=ready)

    def render(self) -> str:
        """The text a scrape would return now."""
        return generate_latest(self.registry).decode("utf-8")

    # -- what the collector reads -----------------------------------------------------------

    def _store_stats(self) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            attached = list(self._stores.values())
        out = []
        for item in attached:
            if item.store.closed:
                continue
            try:
                out.append((item.store.model, item.store.stats()))
            except (PersistingError, OSError) as exc:  # closed while we read
                log.debug("skipping stats of %r: %s", item.store.model, exc)
        return out

    def _queue_lags(self) -> dict[tuple[str, int, str], int]:
        with self._lock:
            tracked = list(self._tracked)
            lags: dict[tuple[str, int, str], int] = {}
        for root, topics in tracked:
            try:
                for item in consumer_lags(root, topics):
                    lags[(item.topic, item.bucket, item.consumer)] = item.lag
            except (PersistingError, OSError) as exc:
                log.warning("cannot read queue consumer positions under %s: %s", root, exc)
        with self._lock:
            lags.update(self._lags)
        return lags


def _remove_listener(attached: _Attached) -> None:
    with contextlib.suppress(ValueError):  # already removed
        attached.store.op_stats.listeners.remove(attached.listener)


class _Collector(Collector):
    """Counters and gauges read from each attached store's ``stats()`` at scrape time."""

    def __init__(self, metrics: KVMetrics):
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        yield from self._families([], {})

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.metrics._store_stats(), self.metrics._queue_lags())

    @staticmethod
    def _families(
        stores: list[tuple[str, dict[str, Any]]], lags: dict[tuple[str, int, str], int]
    ) -> Iterator[Metric]:
        for figure in STORE_FIGURES:
            labels = ["model", "tier"] if figure.per_tier else ["model"]
            family_type = CounterMetricFamily if figure.kind == "counter" else GaugeMetricFamily
            family = family_type(figure.metric, figure.help, labels=labels)
            for model, stats in stores:
                value = figure_values(figure, stats)
                if isinstance(value, dict):
                    for tier, number in value.items():
                        family.add_metric([model, tier], number)
                elif value is not None:
                    family.add_metric([model], value)
            yield family
        lag = GaugeMetricFamily(
            QUEUE_LAG_METRIC,
            "Records of a queue bucket its committed consumer has not yet committed past.",
            labels=["topic", "bucket", "consumer"],
        )
        for (topic, bucket, consumer), value in sorted(lags.items()):
            lag.add_metric([topic, str(bucket), consumer], value)
        yield lag


def _service_families(figures: Mapping[str, Any] | None) -> Iterator[Metric]:
    """A server's request, error, session, member and consumer figures."""
    requests = CounterMetricFamily(
        SERVICE_REQUESTS_METRIC, "Requests a server answered, by operation.", labels=["op"]
    )
    errors = CounterMetricFamily(
        SERVICE_ERRORS_METRIC,
        "Requests a server answered with an error, by error code.",
        labels=["code"],
    )
    gauges = {
        "sessions": GaugeMetricFamily(
            "persisting_service_sessions", "Client sessions open on this server."
        ),
        "pins": GaugeMetricFamily("persisting_service_pins", "Pins held by client sessions."),
        "connections": GaugeMetricFamily(
            "persisting_service_connections", "Data connections open on this server."
        ),
        "members_up": GaugeMetricFamily(
            SERVICE_MEMBERS_METRIC,
            "Storage servers of this service this server sees up in the cluster.",
        ),
        "ready": GaugeMetricFamily(
            "persisting_service_ready",
            "1 when this server is ready (stores open, consumer running, cluster joined).",
        ),
    }
    position = GaugeMetricFamily(
        CONSUMER_POSITION_METRIC,
        "The offset the server's event consumer reads next, per bucket.",
        labels=["topic", "bucket", "consumer"],
    )
    copies = CounterMetricFamily(
        COPIES_METRIC,
        "Keys this member checked on the members that should hold their copies, by outcome "
        "(sent, present: the target had it, gone: evicted here first, failed).",
        labels=["outcome"],
    )
    copy_bytes = CounterMetricFamily(COPY_BYTES_METRIC, "Bytes of copies this member sent.")
    copies_due = GaugeMetricFamily(
        COPIES_DUE_METRIC, "Keys whose copies this member has still to check (0 when healed)."
    )
    applied = CounterMetricFamily(
        "persisting_events",
        "Events the server's event consumer handled, by outcome (applied, failed, "
        "invalid, foreign_model).",
        labels=["topic", "consumer", "outcome"],
    )
    if figures is not None:
        for op, n in sorted((figures.get("requests") or {}).items()):
            requests.add_metric([op], n)
        for code, n in sorted((figures.get("errors") or {}).items()):
            errors.add_metric([code], n)
        for name, family in gauges.items():
            value = figures.get(name)
            if value is not None:
                family.add_metric([], float(value))
        consumer = figures.get("consumer")
        if consumer:
            topic, name = str(consumer.get("topic", "")), str(consumer.get("consumer", ""))
            for bucket, offset in sorted((consumer.get("position") or {}).items()):
                position.add_metric([topic, str(bucket), name], offset)
            for outcome in ("applied", "failed", "invalid", "foreign_model"):
                applied.add_metric([topic, name, outcome], int(consumer.get(outcome, 0)))
        status = figures.get("copies")
        if status:
            for outcome, key in _COPY_OUTCOMES.items():
                copies.add_metric([outcome], int(status.get(key, 0)))
            copy_bytes.add_metric([], int(status.get("copy_bytes", 0)))
            copies_due.add_metric([], int(status.get("due", 0)))
    yield requests
    yield errors
    yield from gauges.values()
    yield position
    yield applied
    yield copies
    yield copy_bytes
    yield copies_due


#: Outcomes of a copy check, and the replicator's counter of each.
_COPY_OUTCOMES = {
    "sent": "copies_sent",
    "present": "copies_present",
    "gone": "copies_gone",
    "failed": "copy_failures",
}


class _ServiceCollector(Collector):
    """A server's own figures, read from its snapshot at scrape time."""

    def __init__(self, metrics: KVMetrics):
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        yield from _service_families(None)

    def collect(self) -> Iterator[Metric]:
        yield from _service_families(self.metrics._service_snapshot())


SERVICE_REQUESTS_METRIC = "persisting_service_requests"
SERVICE_ERRORS_METRIC = "persisting_service_errors"
SERVICE_MEMBERS_METRIC = "persisting_service_members_up"
CONSUMER_POSITION_METRIC = "persisting_events_consumer_position"
COPIES_METRIC = "persisting_service_copies"
COPY_BYTES_METRIC = "persisting_service_copy_bytes"
COPIES_DUE_METRIC = "persisting_service_copies_due"
#: The sample names a server exports about itself (beside its stores' figures).
SERVICE_METRICS = (
    f"{SERVICE_REQUESTS_METRIC}_total",
    f"{SERVICE_ERRORS_METRIC}_total",
    "persisting_service_sessions",
    "persisting_service_pins",
    "persisting_service_connections",
    SERVICE_MEMBERS_METRIC,
    "persisting_service_ready",
    CONSUMER_POSITION_METRIC,
    "persisting_events_total",
    f"{COPIES_METRIC}_total",
    f"{COPY_BYTES_METRIC}_total",
    COPIES_DUE_METRIC,
)


# ---------------------------------------------------------------------------------------
# The HTTP endpoint
# ---------------------------------------------------------------------------------------

#: A readiness probe: (ready, checks), each check a short state (True, or why not).
ReadyProbe = Callable[[], tuple[bool, Mapping[str, Any]]]
#: The paths the endpoint answers; anything else is a 404.
ENDPOINTS = ("/metrics", "/healthz", "/readyz")


class _Endpoint(BaseHTTPRequestHandler):
    """``/metrics``, ``/healthz``, ``/readyz``; 404 for every other path."""

    registry: CollectorRegistry
    ready: ReadyProbe | None

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/") or "/"
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._reply(200, encoder(self.registry), content_type)
        elif path == "/healthz":
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/readyz":
            ready, checks = self._probe()
            body = json.dumps({"ready": ready, "checks": dict(checks)}, default=str)
            self._reply(200 if ready else 503, body.encode() + b"\n", "application/json")
        else:
            text = f"not found: {path} (this endpoint serves {', '.join(ENDPOINTS)})\n"
            self._reply(404, text.encode(), "text/plain; charset=utf-8")

    def _probe(self) -> tuple[bool, Mapping[str, Any]]:
        probe = type(self).ready
        if probe is None:
            return True, {}
        try:
            return probe()
        except Exception as exc:  # a probe that fails says not ready, with why
            return False, {"probe": f"failed: {exc}"}

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes are not logged (one every few seconds, forever)."""


class MetricsServer:
    """A running ``/metrics`` endpoint on a daemon thread; :meth:`close` stops it."""

    def __init__(self, server: Any, thread: threading.Thread):
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.host: str = host
        self.port: int = port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    port: int, addr: str, registry: CollectorRegistry, ready: ReadyProbe | None = None
) -> MetricsServer:
    """Serve ``registry`` (never the global default) at ``http://addr:port/metrics``, with
    ``/healthz`` (200 while the process answers) and ``/readyz`` (``ready()``'s verdict:
    200 or 503, the checks as JSON; always ready without a probe). Other paths are 404.

    ``port=0`` picks a free port (see :attr:`MetricsServer.port`).
    """
    if not isinstance(registry, CollectorRegistry):
        raise ConfigError(f"registry must be a CollectorRegistry, got {type(registry).__name__}")
    handler = type("MetricsEndpoint", (_Endpoint,), {"registry": registry, "ready": ready})
    server_class = type(
        "MetricsHTTPServer",
        (ThreadingHTTPServer,),
        {"daemon_threads": True, "address_family": _family(addr)},
    )
    try:
        server = server_class((addr, port), handler)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from exc
    thread = threading.Thread(target=server.serve_forever, name="persisting-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


def _family(addr: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in addr else socket.AF_INET


__all__ = [
    "CONSUMER_POSITION_METRIC",
    "ENDPOINTS",
    "LATENCY_BUCKETS",
    "LATENCY_METRIC",
    "QUEUE_LAG_METRIC",
    "SERVICE_ERRORS_METRIC",
    "SERVICE_MEMBERS_METRIC",
    "SERVICE_METRICS",
    "SERVICE_REQUESTS_METRIC",
    "STORE_FIGURES",
    "TIERS",
    "ConsumerLag",
    "KVMetrics",
    "MetricsServer",
    "ReadyProbe",
    "StoreFigure",
    "consumer_lags",
    "figure_values",
    "start_metrics_server",
]
