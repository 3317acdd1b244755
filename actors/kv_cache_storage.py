"""KVCacheStorageActor: a Pulsing actor serving the KV stores of the models it is set up for.

Start it with ``persisting serve`` (see :mod:`actors.launch`) or with Pulsing's
launcher::

    PERSISTING_STORAGE_PATH=./data PERSISTING_MODELS=meta-llama/Llama-3-8B \\
        pulsing actor actors.kv_cache_storage.KVCacheStorageActor - --name kvstore \\
        --addr 127.0.0.1:8610

Pulsing's launcher passes no constructor arguments (entry 1 of
:mod:`persisting.pulsing_compat`), so an actor built without any reads
:class:`~persisting.config.PersistingSettings` (``PERSISTING_*`` variables or the TOML
file named by ``PERSISTING_CONFIG``). Nothing is served without a passphrase: the actor
refuses a Pulsing system that :mod:`actors.system` did not start, and under the launcher
it makes the launcher's system start with the server's passphrase.

Control messages (sessions, lookups, pins, stats) come through Pulsing; the store calls
that may touch a file run on a thread pool. Values move on the data path
(:mod:`persisting.service.bulk`): a TCP port and a Unix socket this actor opens when it
starts. The protocol lives in :class:`persisting.service.handler.StorageHandler`; this
module only connects it to Pulsing and the data path and expires idle client sessions in
the background. With ``service.metrics_port`` set it also serves Prometheus metrics of its
stores (:mod:`persisting.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pulsing

from actors.logs import configure_logging, log_banner, log_bulk, log_stop, logger
from actors.ownership import ServiceClaims, claim_models
from actors.replicas import Replicator
from actors.system import (
    arm_launcher,
    is_authenticated,
    passphrase_source,
    require_authenticated,
)
from persisting.config import PersistingSettings
from persisting.errors import ConfigError
from persisting.kv import KVStore
from persisting.kv.namespace.identity import weights_namespace
from persisting.kv.options import validate_model
from persisting.lance_store import validate_name
from persisting.metrics import KVMetrics, MetricsServer
from persisting.service.bulk.server import BulkServer
from persisting.service.handler import StorageHandler
from persisting.service.handler.common import Opener

if TYPE_CHECKING:
    from actors.kv_events import EventConsumer

#: How often a server reads which members of its service are alive.
MEMBERS_EVERY_S = 2.0


def _model_names(models: Sequence[str]) -> list[str]:
    """The models to serve, checked: valid names, none twice (none at all: the server
    serves whatever namespace an authenticated client opens)."""
    names = list(models)
    for name in names:
        validate_name(name, "model")
    if len(set(names)) != len(names):
        raise ConfigError(f"models listed twice: {names}")
    return names


def _handler(
    settings: PersistingSettings, stores: dict[str, KVStore], opener: Opener | None
) -> StorageHandler:
    """The protocol handler over ``stores``, sized by the service settings."""
    service = settings.service
    return StorageHandler(
        stores,
        opener=opener,
        replicas=service.replicas,
        lease_ttl_s=service.lease_ttl_s,
        max_inflight=service.max_inflight,
        max_staged_bytes=service.staging_bytes,
        max_session_staged_bytes=service.session_staging_bytes,
        node={
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "storage_path": str(settings.storage_path),
        },
    )


class KVCacheStorageActor(pulsing.Actor):
    """Serves one or more models' KV stores under one storage root (see module docstring)."""

    def __init__(
        self,
        settings: PersistingSettings | None = None,
        models: Sequence[str] | None = None,
        claims: ServiceClaims | None = None,
    ):
        launched = settings is None  # by Pulsing's launcher: no arguments
        self.settings = settings if settings is not None else PersistingSettings.load()
        service = self.settings.service
        if pulsing.is_initialized():
            if not is_authenticated(pulsing.get_system()):
                raise ConfigError(
                    "refusing to serve in a Pulsing system started without Persisting's "
                    "passphrase: start it with actors.system.start_system"
                )
        else:  # Pulsing's launcher starts the system after building the actor
            arm_launcher(service)
        if launched:
            configure_logging(service.log_level, service.log_format)
        names = _model_names(models if models is not None else self.settings.models)
        #: One server per namespace: claimed before any store opens (the caller may have
        #: claimed them already, before it started Pulsing).
        self.claims = (
            claims
            if claims is not None
            else ServiceClaims(
                claim_models(self.settings, names, name=service.name, addr=service.addr)
            )
        )
        #: Whether clients open the namespaces (no models named at start-up).
        self.open_namespaces = not names
        stores: dict[str, KVStore] = {}
        try:
            for name in names:
                namespace, weights = weights_namespace(name, self.settings.kv.model_version)
                stores[name] = self._open_store(name, namespace, weights)
        except BaseException:
            for store in stores.values():
                with contextlib.suppress(Exception):
                    store.close()
            self.claims.release()
            raise
        opener = self._open_for_client if self.open_namespaces else None
        self.handler = _handler(self.settings, stores, opener)
        #: The served stores: the handler's own table, which an opener adds to.
        self.stores = self.handler.state.stores
        #: Sends the other copies of what this member holds (service.replicas).
        self.replicator = Replicator(self.settings, service.name, self.stores)
        self.handler.state.on_use = self.replicator.noted
        self.handler.extra_stats["copies"] = self.replicator.status
        self.metrics: KVMetrics | None = None
        #: The event consumer beside this actor (``start_service`` sets it), for readiness.
        self.consumer: EventConsumer | None = None
        self._addr: str | None = None
        #: Servers of this service seen alive in the cluster (None: not read yet).
        self._members: list[str] | None = None
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()
        self._closed = False
        self.metrics_server: MetricsServer | None = None
        if service.metrics_port is not None:
            self._serve_metrics(service.metrics_port)
        self._sweeper: asyncio.Task[None] | None = None
        #: The data path's server (started with the actor, or by its first message).
        self.data_path: BulkServer | None = None
        self._data_lock = threading.Lock()
        #: Why this server stopped serving on its own (an owner claim lost), else None; and
        #: what stops its process then (``serve`` sets it), else the actor just closes.
        self.claim_lost: str | None = None
        self.on_claim_lost: Callable[[], None] | None = None
        #: The name clients resolve (the launcher's ``--name`` is not passed to actors).
        self.name = service.name
        self._started_at = time.monotonic()

    def _open_store(self, name: str, namespace: str, describe: dict[str, str]) -> KVStore:
        service = self.settings.service
        store = KVStore.from_settings(
            self.settings,
            name,
            shared_memory=service.shared_memory_tier,
            # Received values land in the memory tier's page-aligned buffers, which keep
            # them: written with O_DIRECT, not copied into the page cache a second time,
            # and a put's fsync is left with only the file's metadata.
            direct_io=True,
            namespace=namespace,
            describe={"served by": "persisting serve", "model": name, **describe},
        )
        if service.prefault_memory:
            store.prefault_memory()
        return store

    def _open_for_client(self, name: str) -> KVStore:
        """Open the namespace ``name`` an authenticated client asked for: claimed first (one
        server per namespace on a root), then opened with this server's store settings --
        its own budget and identity checks, under the root's one budget. The client's
        namespace already names its weights and layout (the engines build it so)."""
        if self._closed:
            raise ConfigError("this server is stopping")
        validate_model(name)  # before anything is claimed or made on the root
        claim = self.claims.claim(self.settings, name, self.name, self._addr)
        try:
            store = self._open_store(name, name, {"opened by": "a client's hello"})
        except BaseException:
            self.claims.drop(name)
            raise
        if self.metrics is not None:
            self.metrics.attach(store)
        claim.watch(self._lost_claim)
        logger.info("persisting: opened namespace %r for a client", name)
        return store

    def _serve_metrics(self, port: int) -> None:
        """Prometheus figures of every served store, of the service itself and of the
        event consumer, with ``/healthz`` and ``/readyz`` beside ``/metrics``."""
        metrics = KVMetrics()
        for store in list(self.stores.values()):
            metrics.attach(store)
        metrics.track_queue_lag(self.settings.storage_path, [self.settings.service.event_topic])
        metrics.track_service(self.service_figures)
        host = self.settings.service.addr.rpartition(":")[0] or "127.0.0.1"
        self.metrics = metrics
        self.metrics_server = metrics.serve(port, host, ready=self.readiness)

    # -- health ---------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether this server serves: its stores are open, its event consumer (if it has
        one) runs, and it has joined the cluster (its actor is registered and seen alive)."""
        checks: dict[str, Any] = {}
        closed = [m for m, s in self.stores.items() if s.closed]
        checks["stores"] = True if not closed and not self._closed else f"closed: {closed}"
        consumer = self.consumer
        if consumer is None:
            checks["consumer"] = "none (events not consumed here)"
        else:
            checks["consumer"] = True if consumer.running else "not running"
        if self._addr is None:
            checks["cluster"] = "not started"
        elif self._members is None:
            checks["cluster"] = "membership not read yet"
        elif self._addr not in self._members:
            checks["cluster"] = f"{self._addr} not among the members seen alive"
        else:
            checks["cluster"] = True
        ready = all(v is True for k, v in checks.items() if k != "consumer" or consumer)
        return ready, checks

    def service_figures(self) -> dict[str, Any]:
        """What ``/metrics`` exports for the service: requests, errors, sessions, data
        connections, members up, readiness and the event consumer's position."""
        figures = self.handler.service_figures()
        figures["connections"] = self.data_path.stats()["connections"] if self.data_path else 0
        members = self._members or []
        figures["members_up"] = len(members)
        figures["ready"] = self.readiness()[0]
        figures["consumer"] = self.consumer.status() if self.consumer is not None else None
        figures["copies"] = self.replicator.status()
        return figures

    def _watch_members(self, system: Any) -> None:
        """Keep the members this server sees alive (for readiness, ``members_up`` and the
        clients' hello), logging one line when one comes up or goes. Runs on a thread of
        its own (Pulsing calls ``on_start`` outside any event loop), with a loop per read."""

        async def read() -> list[str]:
            found = await asyncio.wait_for(system.get_named_instances(self.name), 10.0)
            return sorted(
                str(i["addr"])
                for i in found
                if str(i.get("status", "Alive")) == "Alive" and i.get("addr")
            )

        while not self._stop_watching.is_set():
            try:
                alive = asyncio.run(read())
            except Exception as exc:  # the system is stopping, or a transient failure
                logger.debug("persisting: cannot read the cluster's members: %s", exc)
            else:
                if self._members is not None:
                    for addr in sorted(set(alive) - set(self._members)):
                        logger.info("persisting: member %s of %r is up", addr, self.name)
                    for addr in sorted(set(self._members) - set(alive)):
                        logger.warning("persisting: member %s of %r is gone", addr, self.name)
                self._members = alive
                self.handler.members = alive
                if self._addr is not None:
                    self.replicator.members(self._addr, alive)
            self._stop_watching.wait(MEMBERS_EVERY_S)

    # -- Pulsing lifecycle ---------------------------------------------------------------

    def on_start(self, actor_id: Any) -> None:
        require_authenticated()  # before the first message: refuse rather than serve
        system = pulsing.get_system()
        self._addr = str(system.addr)
        self.claims.bound(self.name, self._addr)
        self.claims.watch(self._lost_claim)
        self._watcher = threading.Thread(
            target=self._watch_members, args=(system,), name="persisting-members", daemon=True
        )
        self._watcher.start()
        self.replicator.name = self.name
        self.replicator.start()
        try:
            log_banner(
                name=self.name,
                addr=str(system.addr),
                storage_path=str(Path(self.settings.storage_path).absolute()),
                stores=self.stores,
                metrics_url=self.metrics_server.url if self.metrics_server is not None else None,
                passphrase_from=passphrase_source(system),
            )
        except Exception:  # a broken banner must not stop the service
            logger.exception("persisting: could not write the start-up banner")
        self._serve_data(str(system.addr))

    def _serve_data(self, addr: str) -> None:
        """Listen for data connections: on the host this actor's Pulsing system is bound
        to, at ``service.bulk_port`` (nowhere else), and on a private Unix socket. Runs
        once, from ``on_start`` or the first message, whichever comes first (a client's
        ``hello`` must name the data path)."""
        with self._data_lock:
            if self.data_path is None and not self._closed:
                self._listen(addr)

    def _listen(self, addr: str) -> None:
        service = self.settings.service
        host = addr.rpartition(":")[0].strip("[]") or "127.0.0.1"
        server = BulkServer(
            self.handler.state,
            host,
            service.bulk_port,
            encrypt=service.bulk_encryption,
            io_timeout_s=service.request_timeout_s,
            max_connections=service.bulk_connections,
        )
        try:
            self.handler.data = server.start()
        except OSError as exc:  # e.g. the port is taken: no value could move
            server.close()
            log_bulk(None, str(exc))
            raise ConfigError(f"cannot listen for data connections on {host}: {exc}") from exc
        self.data_path = server
        self.handler.extra_stats["data"] = server.stats
        log_bulk(self.handler.data)

    def _lost_claim(self, message: str) -> None:
        """Another process owns a namespace this server served (its owner lock was removed
        and claimed again): stop serving, loudly, rather than serve it twice."""
        if self.claim_lost is not None:
            return
        self.claim_lost = message
        logger.error("persisting: %s; this server stops", message)
        stop = self.on_claim_lost
        if stop is not None:
            stop()
        else:
            self.close()

    def on_stop(self) -> None:
        self.close()

    def metadata(self) -> dict[str, str]:
        return {"models": ",".join(sorted(self.stores)), "service": "persisting-kv"}

    async def receive(self, msg: Any) -> Any:
        if self._sweeper is None:  # the first message: the loop runs now
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
            self._serve_data(str(pulsing.get_system().addr))
        return await self.handler.handle(msg)

    async def _sweep(self) -> None:
        """Give back what crashed clients held, a few times per lease TTL."""
        period = max(0.05, self.handler.lease_ttl_s / 4.0)
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(period)
            with contextlib.suppress(Exception):
                await loop.run_in_executor(None, self.handler.expire_sessions)

    # -- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop answering, give back every session's holdings and close the stores."""
        if self._closed:
            return
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._stop_watching.set()
        self.replicator.stop()
        if self.data_path is not None:
            self.data_path.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.handler.close()
        self._close_stores()
        self.claims.release()
        log_stop(self.name, self._started_at, self.handler.counters)

    def _close_stores(self) -> None:
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()


__all__ = ["KVCacheStorageActor"]
