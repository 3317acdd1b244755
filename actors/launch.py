"""Starting the KV-cache service: ``serve`` (blocking), ``start_service`` (async), the demo.

These are the plain functions behind ``persisting serve`` and ``persisting demo``:

* :func:`serve` joins (or starts) a Pulsing cluster, spawns a
  :class:`~actors.kv_cache_storage.KVCacheStorageActor` for the configured models, runs
  the prewarm/evict event consumer beside it, and blocks until SIGINT/SIGTERM.
* :func:`run_demo` runs a bounded end-to-end session against a served store on the
  embedded default storage root (store, read back, lookup, evict and prewarm through the
  event topic, stats) and returns what it saw.
* :func:`prewarm` (in :mod:`actors.kv_events`) feeds the event topic.

``python -m actors.launch`` runs :func:`serve` with settings from the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pulsing
import torch

from actors.kv_cache_storage import KVCacheStorageActor
from actors.kv_events import EventConsumer, publish_events
from actors.logs import configure_logging
from actors.ownership import claim_service
from actors.system import start_system
from persisting.config import PersistingSettings
from persisting.kv import TokenHasher
from persisting.pulsing_compat import exit_after_shutdown
from persisting.service import KVCacheClient
from persisting.service.events import evict_event, prewarm_event

#: The model the demo uses when the settings name none.
DEMO_MODEL = "demo/tiny-llama"


@dataclass
class RunningService:
    """A storage actor (and its event consumer) started in this process."""

    actor: KVCacheStorageActor
    name: str
    addr: str | None
    settings: PersistingSettings
    consumer: EventConsumer | None = None
    owns_system: bool = False

    async def stop(self) -> None:
        """Stop the consumer, the actor and (if this started it) the actor system."""
        if self.consumer is not None:
            await self.consumer.stop()
        system = pulsing.get_system() if pulsing.is_initialized() else None
        if system is not None:
            with contextlib.suppress(Exception):
                await system.stop(self.name)
        self.actor.close()
        if self.owns_system:
            with contextlib.suppress(Exception):
                await pulsing.shutdown()


async def start_service(
    settings: PersistingSettings | None = None,
    *,
    models: Sequence[str] | None = None,
    addr: str | None = None,
    seeds: Sequence[str] | None = None,
    passphrase: str | None = None,
    name: str | None = None,
    consume_events: bool = True,
) -> RunningService:
    """Spawn the storage actor (and the event consumer) in this process's Pulsing system.

    Arguments left out come from ``settings.service`` (addr, seeds, passphrase, name).
    Pulsing is started with the server's passphrase (:mod:`actors.system`):
    the configured one, or one generated for loopback use; a non-loopback address without
    a configured passphrase is a ConfigError.
    """
    settings = settings if settings is not None else PersistingSettings.load()
    if passphrase is not None:
        service = settings.service.model_copy(update={"passphrase": passphrase})
        settings = settings.model_copy(update={"service": service})
    service = settings.service
    models = list(models if models is not None else settings.models)  # none: any namespace
    name = name or service.name
    addr = addr if addr is not None else service.addr
    # One server per namespace, one consumer per topic: refused here, before Pulsing binds
    # a port or a store opens, naming the process that holds them.
    consume = consume_events and bool(service.event_topic)
    claims = claim_service(settings, models, name=name, addr=addr, consume_events=consume)
    owns = False
    actor: KVCacheStorageActor | None = None
    try:
        if not pulsing.is_initialized():
            await start_system(service, addr, list(seeds if seeds is not None else service.seeds))
            owns = True
        system = pulsing.get_system()
        actor = KVCacheStorageActor(settings, models, claims=claims)
        actor.name = name
        await system.spawn(actor, name=name, public=True)
    except BaseException:
        if actor is not None:
            actor.close()
        claims.release()
        if owns:
            await pulsing.shutdown()
        raise
    running = RunningService(actor, name, str(system.addr), settings, owns_system=owns)
    if consume:
        running.consumer = EventConsumer(
            settings, name=name, models=actor.stores, claim=claims.consumer
        )
        actor.handler.extra_stats["events"] = running.consumer.status
        actor.consumer = running.consumer
        await running.consumer.start()
    return running


def serve(
    settings: PersistingSettings | None = None,
    *,
    models: Sequence[str] | None = None,
    addr: str | None = None,
    seeds: Sequence[str] | None = None,
    passphrase: str | None = None,
    name: str | None = None,
    consume_events: bool = True,
    on_ready: Callable[[RunningService], None] | None = None,
    exit_process: bool = True,
) -> None:
    """Serve until SIGINT or SIGTERM (see :func:`start_service` for the arguments).

    With ``exit_process`` (the default) the process ends with ``os._exit(0)`` once the
    service has stopped: Pulsing may crash at interpreter exit after a shutdown
    (:func:`persisting.pulsing_compat.exit_after_shutdown`).
    The log (banner, stop line) follows ``settings.service.log_level``/``log_format``.
    """
    settings = settings if settings is not None else PersistingSettings.load()
    configure_logging(settings.service.log_level, settings.service.log_format)

    async def run() -> int:
        running = await start_service(
            settings,
            models=models,
            addr=addr,
            seeds=seeds,
            passphrase=passphrase,
            name=name,
            consume_events=consume_events,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)

        def stop_serving() -> None:  # called from the claim's watch thread
            loop.call_soon_threadsafe(stop.set)

        running.actor.on_claim_lost = stop_serving
        if on_ready is not None:
            on_ready(running)
        await stop.wait()
        await running.stop()
        return 1 if running.actor.claim_lost else 0

    status = asyncio.run(run())
    if exit_process:
        exit_after_shutdown(status)


# -- the demo -------------------------------------------------------------------------------


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_demo(settings: PersistingSettings | None = None, *, chunks: int = 4) -> dict[str, Any]:
    """A bounded end-to-end session against a store served in this process; returns a report.

    It serves the first configured model (or ``demo/tiny-llama``) on a free loopback port
    under ``settings.storage_path``, then through a :class:`KVCacheClient`: stores
    ``chunks`` chunks of a token sequence, reads them back bit-exact, looks the sequence
    up, evicts the last chunk and prewarms the rest through the event topic (applied by the
    consumer through the actor), and collects the stats.
    """
    settings = settings if settings is not None else PersistingSettings.load()
    return asyncio.run(asyncio.wait_for(_demo(settings, chunks), timeout=120))


async def _demo(settings: PersistingSettings, chunks: int) -> dict[str, Any]:
    started = time.perf_counter()
    model = settings.models[0] if settings.models else DEMO_MODEL
    settings = settings.model_copy(update={"models": [model]})
    addr = f"127.0.0.1:{free_loopback_port()}"
    running = await start_service(settings, models=[model], addr=addr, consume_events=True)
    report: dict[str, Any] = {
        "model": model,
        "addr": addr,
        "storage_path": str(Path(settings.storage_path).absolute()),
    }
    client = None
    try:
        client = await KVCacheClient.connect(name=running.name, model=model, settings=settings)
        hasher = TokenHasher(model=model, chunk_size=settings.kv.chunk_size)
        tokens = np.arange(chunks * hasher.chunk_size, dtype=np.int64) % 32000
        keys = [key for _s, _e, key in hasher.process_tokens(tokens)]
        generator = torch.Generator().manual_seed(0)
        values = [
            torch.randn(2, 4, hasher.chunk_size, 64, generator=generator).to(torch.bfloat16)
            for _ in keys
        ]
        puts = await client.batched_put(keys, values, fmt="KV_2LTD")
        report["stored"] = [p.tier for p in puts]
        got = await client.batched_get(keys)
        report["bit_exact"] = all(
            g is not None and torch.equal(g, v) for g, v in zip(got, values, strict=True)
        )
        report["same_host_path"] = client.same_host(client.members[0])
        report["lookup_tokens"] = await client.lookup_tokens(tokens)

        await publish_events(settings, [evict_event(model, [str(keys[-1])])])
        await _until(lambda: client.contains(keys[-1]), expect=False)
        report["lookup_tokens_after_evict"] = await client.lookup_tokens(tokens)

        before = await _prefetched(client)
        await publish_events(
            settings, [prewarm_event(model, tokens=tokens.tolist(), chunk_size=hasher.chunk_size)]
        )
        await _until(lambda: _prefetched(client), expect=lambda n: n > before)
        report["prewarmed_chunks"] = await _prefetched(client) - before
        stats = await client.stats()
        member = stats["members"][client.members[0]]
        store_stats = member["stores"][model]
        report["store"] = {
            k: store_stats.get(k) for k in ("memory_items", "disk_items", "prefetched")
        }
        report["service"] = {
            k: member["service"].get(k, 0)
            for k in (
                "sessions",
                "get_hits",
                "get_misses",
                "get_bytes_file",
                "put_bytes_arena",
                "put_bytes_message",
                "get_bytes_message",
            )
        }
        if running.consumer is not None:
            consumer = running.consumer

            async def applied() -> int:
                return consumer.applied

            # The consumer counts a batch after applying it: the effects seen above can come
            # a moment before the count of both events this session published.
            await _until(applied, expect=lambda n: n >= 2, timeout_s=10.0)
        report["events_applied"] = running.consumer.applied if running.consumer else 0
    finally:
        if client is not None:
            await client.close()
        await running.stop()
    report["elapsed_s"] = round(time.perf_counter() - started, 3)
    return report


async def _prefetched(client: KVCacheClient) -> int:
    stats = await client.stats()
    return sum(
        int(m["stores"][client.model].get("prefetched", 0)) for m in stats["members"].values()
    )


async def _until(probe: Callable[[], Any], expect: Any, timeout_s: float = 30.0) -> None:
    """Poll ``probe`` until it returns ``expect`` (or satisfies it, if callable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if expect(value) if callable(expect) else value == expect:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting: last value {value!r}")
        await asyncio.sleep(0.05)


def main() -> None:
    """``python -m actors.launch``: serve with settings from the environment / TOML."""
    serve(PersistingSettings.load())


if __name__ == "__main__":
    main()


__all__ = [
    "DEMO_MODEL",
    "RunningService",
    "free_loopback_port",
    "run_demo",
    "serve",
    "start_service",
]
