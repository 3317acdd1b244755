"""KVCacheStorageActor: a Pulsing actor serving the KV stores of the models it is set up for.

Start it with ``persisting serve`` (see :mod:`persisting.actors.launch`) or with Pulsing's
launcher::

    PERSISTING_STORAGE_PATH=./data PERSISTING_MODELS=meta-llama/Llama-3-8B \\
        pulsing actor persisting.actors.kv_cache_storage.KVCacheStorageActor - --name kvstore \\
        --addr 127.0.0.1:8610

Pulsing 0.1.2's launcher passes no constructor arguments, so an actor built without any
reads :class:`~persisting.config.PersistingSettings` (``PERSISTING_*`` variables or the TOML
file named by ``PERSISTING_CONFIG``). Nothing is served without a passphrase: the actor
refuses a Pulsing system that :mod:`persisting.actors.system` did not start, and under the
launcher it makes the launcher's system start with the server's passphrase.

Pulsing hands one actor one message at a time, so the actor also spawns ``lanes - 1``
helper actors over the same stores; a client spreads its requests over all of them, and
the store calls themselves run on a thread pool. Clients on the same host send their
requests over a Unix socket instead (:mod:`persisting.service.local_channel`), once their
session is open. The protocol lives in
:class:`persisting.service.handler.StorageHandler`; this module only connects it to Pulsing
and expires idle client sessions in the background. With ``service.metrics_port`` set it
also serves Prometheus metrics of its stores (:mod:`persisting.metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pulsing

from persisting.actors.logs import configure_logging, log_banner, log_bulk, log_stop, logger
from persisting.actors.system import (
    arm_launcher,
    is_authenticated,
    passphrase_source,
    require_authenticated,
)
from persisting.config import PersistingSettings
from persisting.errors import ConfigError
from persisting.kv import KVStore
from persisting.lance_store import validate_name
from persisting.metrics import KVMetrics, MetricsServer
from persisting.service.bulk.server import BulkServer
from persisting.service.handler import StorageHandler
from persisting.service.local_channel import LocalChannelServer


class _Lane(pulsing.Actor):
    """A helper actor answering requests with its parent's handler (another mailbox)."""

    def __init__(self, handler: StorageHandler):
        self._handler = handler

    async def receive(self, msg: Any) -> Any:
        return await self._handler.handle(msg)


class KVCacheStorageActor(pulsing.Actor):
    """Serves one or more models' KV stores under one storage root (see module docstring)."""

    def __init__(
        self,
        settings: PersistingSettings | None = None,
        models: Sequence[str] | None = None,
    ):
        launched = settings is None  # by Pulsing's launcher: no arguments
        self.settings = settings if settings is not None else PersistingSettings.load()
        service = self.settings.service
        if pulsing.is_initialized():
            if not is_authenticated(pulsing.get_system()):
                raise ConfigError(
                    "refusing to serve in a Pulsing system started without Persisting's "
                    "passphrase: start it with persisting.actors.system.start_system"
                )
        else:  # Pulsing's launcher starts the system after building the actor
            arm_launcher(service)
        if launched:
            configure_logging(service.log_level, service.log_format)
        names = list(models if models is not None else self.settings.models)
        if not names:
            raise ConfigError(
                "no models to serve: set PERSISTING_MODELS (comma-separated) or settings.models"
            )
        for name in names:
            validate_name(name, "model")
        if len(set(names)) != len(names):
            raise ConfigError(f"models listed twice: {names}")
        self.stores: dict[str, KVStore] = {}
        try:
            for name in names:
                self.stores[name] = KVStore.from_settings(
                    self.settings, name, shared_memory=service.shared_memory_tier
                )
        except BaseException:
            self._close_stores()
            raise
        self.handler = StorageHandler(
            self.stores,
            lease_ttl_s=service.lease_ttl_s,
            message_part_bytes=service.message_part_bytes,
            max_inflight=service.max_inflight,
            max_staged_bytes=service.staging_bytes,
            max_session_staged_bytes=service.session_staging_bytes,
            staged_ttl_s=service.staging_ttl_s,
            threads=max(2, service.lanes),
            node={
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "storage_path": str(self.settings.storage_path),
            },
        )
        self.metrics_server: MetricsServer | None = None
        if service.metrics_port is not None:
            self._serve_metrics(service.metrics_port)
        self._actor_id = f"{os.getpid()}"
        self._started = False
        self._start_lock: asyncio.Lock | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._channel: LocalChannelServer | None = None
        self._bulk: BulkServer | None = None
        self._closed = False
        #: The name clients resolve (the launcher's ``--name`` is not passed to actors).
        self.name = service.name
        self._started_at = time.monotonic()

    def _serve_metrics(self, port: int) -> None:
        """Prometheus figures of every served store and the event consumer's lag."""
        metrics = KVMetrics()
        for store in self.stores.values():
            metrics.attach(store)
        metrics.track_queue_lag(self.settings.storage_path, [self.settings.service.event_topic])
        host = self.settings.service.addr.rpartition(":")[0] or "127.0.0.1"
        self.metrics = metrics
        self.metrics_server = metrics.serve(port, host)

    # -- Pulsing lifecycle ---------------------------------------------------------------

    def on_start(self, actor_id: Any) -> None:
        require_authenticated()  # before the first message: refuse rather than serve
        self._actor_id = str(actor_id)
        system = pulsing.get_system()
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
        self._serve_bulk(str(system.addr))

    def _serve_bulk(self, addr: str) -> None:
        """Listen for data connections of clients on other hosts: on the host this actor's
        Pulsing system is bound to, at ``service.bulk_port`` (nowhere else)."""
        service = self.settings.service
        if not service.bulk or self._bulk is not None:
            log_bulk(None)
            return
        host = addr.rpartition(":")[0].strip("[]") or "127.0.0.1"
        if service.bulk_sealed:
            try:
                import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401
            except ImportError as exc:
                raise ConfigError(
                    "service.bulk_sealed needs the cryptography package (pip install cryptography)"
                ) from exc
        handler = self.handler
        server = BulkServer(
            handler.state,
            host,
            service.bulk_port,
            sealed=service.bulk_sealed,
            io_timeout_s=service.request_timeout_s,
            max_connections=service.bulk_connections,
            record_placements=lambda store, model, items, replies: handler.puts.record_placements(
                store, model, items, replies, False
            ),
        )
        try:
            handler.bulk = server.start()
        except OSError as exc:  # e.g. the port is taken: say so, serve without it
            logger.error("persisting: cannot listen for data connections: %s", exc)
            log_bulk(None, str(exc))
            return
        self._bulk = server
        handler.extra_stats["bulk"] = server.stats
        log_bulk(handler.bulk)

    def on_stop(self) -> None:
        self.close()

    def metadata(self) -> dict[str, str]:
        return {"models": ",".join(sorted(self.stores)), "service": "persisting-kv"}

    async def receive(self, msg: Any) -> Any:
        if not self._started:
            await self._start()
        return await self.handler.handle(msg)

    async def _start(self) -> None:
        """Spawn the helper lanes and the session sweeper (needs the running system)."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            system = pulsing.get_system()
            lanes = []
            for i in range(1, self.settings.service.lanes):
                name = f"persisting_lane_{self._actor_id}_{i}"
                await system.spawn(_Lane(self.handler), name=name, public=True)
                lanes.append(name)
            self.handler.lanes = lanes
            try:  # same-host clients send requests here instead of through Pulsing
                self._channel = LocalChannelServer(
                    self.handler.answer, self.handler.is_light, self.handler.executor
                )
                self.handler.local_channel = self._channel.start()
            except OSError:
                self._channel = None
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
            self._started = True

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
        if self._channel is not None:
            self._channel.close()
        if self._bulk is not None:
            self._bulk.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.handler.close()
        self._close_stores()
        log_stop(self.name, self._started_at, self.handler.counters)

    def _close_stores(self) -> None:
        for store in self.stores.values():
            with contextlib.suppress(Exception):
                store.close()


__all__ = ["KVCacheStorageActor"]
