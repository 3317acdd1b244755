"""A server started without models (a fleet's member): it serves whatever namespace an
authenticated client opens -- each with its own store, claimed on the root, kept across a
restart -- while a server started with models still serves only those."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.launch import free_loopback_port, start_service
from persisting.config import PersistingSettings
from persisting.errors import AccessDeniedError, PersistingError
from persisting.kv import KVStore
from persisting.service import KVCacheClient
from tests.service.service_helpers import key

pytestmark = pytest.mark.timeout(120)

NAMESPACES = ["org/model-a#0123456789ab", "org/model-b:tp2"]


def _settings(root: Path, models: list[str]) -> PersistingSettings:
    return PersistingSettings(
        storage_path=root,
        models=models,
        kv={"memory_bytes": 8 << 20, "disk_bytes": 64 << 20, "durability": "sync"},
        service={"discovery_timeout_s": 10.0},
    )


async def _client(settings: PersistingSettings, name: str, model: str) -> KVCacheClient:
    return await KVCacheClient.connect(name=name, model=model, settings=settings, same_host=False)


def test_a_server_without_models_opens_each_namespace_a_client_names(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "root", [])
    values = {ns: [bytes([i]) * 4096 for i in range(1, 6)] for ns in NAMESPACES}

    async def serve_and_store() -> None:
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        try:
            assert running.actor.stores == {}  # nothing opened before a client asks
            for ns in NAMESPACES:
                client = await _client(settings, running.name, ns)
                try:
                    keys = [key(i, ns) for i in range(5)]
                    results = await client.batched_put(keys, values[ns], fmt="binary")
                    assert all(r.stored for r in results)
                    got = await client.batched_get(keys)
                    assert [bytes(g) for g in got] == values[ns]
                finally:
                    await client.close()
            assert sorted(running.actor.stores) == sorted(NAMESPACES)
            # each namespace is its own store on the root, claimed by this server
            assert all(isinstance(s, KVStore) for s in running.actor.stores.values())
            assert sorted(running.actor.claims.models) == sorted(NAMESPACES)
            with pytest.raises(PersistingError, match="must not contain '@'"):
                await _client(settings, running.name, "org/bad@name")
            assert "org/bad@name" not in running.actor.stores
        finally:
            await running.stop()

    async def serve_and_read() -> None:  # a restart: what clients stored is still there
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        try:
            for ns in reversed(NAMESPACES):
                client = await _client(settings, running.name, ns)
                try:
                    got = await client.batched_get([key(i, ns) for i in range(5)])
                    assert [bytes(g) for g in got] == values[ns]
                finally:
                    await client.close()
        finally:
            await running.stop()

    asyncio.run(serve_and_store())
    asyncio.run(serve_and_read())


def test_a_server_started_with_models_serves_only_those(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "root", [NAMESPACES[0]])

    async def scenario() -> None:
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        try:
            with pytest.raises(AccessDeniedError, match="serves"):
                await _client(settings, running.name, NAMESPACES[1])
            assert sorted(running.actor.stores) == [NAMESPACES[0]]
        finally:
            await running.stop()

    asyncio.run(scenario())
