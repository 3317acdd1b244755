"""Clients against a server in this process (loopback, the fast loop): one as from
another host (TCP) and one on the server's host (its Unix socket and pool). Values move on
data connections, load-or-recompute plans price hits at the bandwidth those achieved, a
session the server lost is opened again under the client's feet, a busy server is waited
for and said to be busy, and ``connect`` says what it cannot honour."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
import torch

from actors.launch import free_loopback_port, start_service
from persisting.config import PersistingSettings
from persisting.errors import ServiceUnavailableError
from persisting.kv import TokenHasher
from persisting.service import KVCacheClient
from persisting.service.protocol import make_request
from tests.service.service_helpers import MODEL
from tests.timing import wait_until_async

pytestmark = pytest.mark.timeout(120)

CHUNK = 64


def _settings(root: Path) -> PersistingSettings:
    return PersistingSettings(
        storage_path=root,
        models=[MODEL],
        kv={"memory_bytes": 64 << 20, "chunk_size": CHUNK},
        service={"discovery_timeout_s": 15.0},
    )


def _values(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 8, CHUNK, 1024, generator=g).to(torch.bfloat16) for _ in range(n)]


def test_a_remote_client_moves_values_on_data_connections_and_plans_with_them(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path / "root")
    tokens = list(range(4 * CHUNK))
    keys = [k for _s, _e, k in TokenHasher(MODEL, chunk_size=CHUNK).process_tokens(tokens)]
    values = _values(len(keys))

    async def scenario() -> None:
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        client = await KVCacheClient.connect(
            name=running.name, model=MODEL, settings=settings, same_host=False
        )
        try:
            assert not client.same_host(client.members[0])
            assert all(r.stored for r in await client.batched_put(keys, values))
            got = await client.batched_get(keys)
            assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
            out = torch.empty_like(values[2])
            assert await client.get_into(keys[2], out) is not None and torch.equal(out, values[2])
            counters = client.counters
            assert counters["put_bytes"] == counters["get_bytes_remote"] - values[2].nbytes
            assert "get_bytes_pool" not in counters and "get_bytes_local" not in counters
            measured = client._reader.bandwidth.bytes_per_s("remote:memory")
            assert measured is not None and measured > 0
            # A prefill faster than the network: not worth loading; a slow one: load it all.
            fast = await client.plan_tokens(tokens, recompute_tokens_per_s=1e15)
            assert (fast.hit_tokens, fast.load_tokens) == (4 * CHUNK, 0)
            slow = await client.plan_tokens(tokens, recompute_tokens_per_s=1.0)
            assert slow.load_tokens == 4 * CHUNK and slow.load_chunks == 4
            partial = await client.plan_tokens(
                tokens[: 2 * CHUNK] + [7] * CHUNK, recompute_tokens_per_s=1.0
            )
            assert partial.hit_tokens == 2 * CHUNK  # the prefix ends at the first miss
            # The server loses the session (expiry, restart): the data path opens it again.
            handler = running.actor.handler
            for session in handler.sessions.sessions():  # as at expiry or a restart
                assert handler.answer(make_request("bye", sid=session.sid))["result"] is True
            assert torch.equal(await client.get(keys[1]), values[1])
            # Pulsing already runs in this process: seeds and a passphrase cannot be applied.
            with pytest.warns(RuntimeWarning, match="seeds and passphrase"):
                other = await KVCacheClient.connect(
                    seeds=["127.0.0.1:1"],
                    passphrase="ignored",
                    name=running.name,
                    model=MODEL,
                    settings=settings,
                    same_host=False,
                )
            await other.close()
        finally:
            await client.close()
            await running.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=100))


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_same_host_client_reads_the_pool_and_passed_files_and_writes_on_the_socket(
    tmp_path: Path, tier: str
) -> None:
    settings = _settings(tmp_path / "root").model_copy(deep=True)
    if tier == "disk":
        settings.kv.memory_bytes = 0
    keys = [
        k for _s, _e, k in TokenHasher(MODEL, chunk_size=CHUNK).process_tokens(range(4 * CHUNK))
    ]
    values = _values(len(keys))

    async def scenario() -> None:
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        writer = await KVCacheClient.connect(name=running.name, model=MODEL, settings=settings)
        reader = await KVCacheClient.connect(name=running.name, model=MODEL, settings=settings)
        try:
            assert writer.same_host(writer.members[0])
            assert all(r.stored for r in await writer.batched_put(keys, values))
            got = await reader.batched_get(keys)
            assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
            single = [await reader.get(k) for k in keys]
            assert all(torch.equal(g, v) for g, v in zip(single, values, strict=True))
            nbytes = sum(v.nbytes for v in values)
            counters = reader.counters
            if tier == "memory":  # copied out of the pool: asked once, then remembered
                assert counters["get_bytes_pool"] == 2 * nbytes
                assert counters["get_hits_remembered"] == len(keys)
            else:  # each payload file passed along on the socket and read here
                assert counters["get_bytes_local"] == 2 * nbytes
                assert "get_bytes_pool" not in counters
        finally:
            await reader.close()
            await writer.close()
            await running.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=100))


def test_a_busy_data_path_is_waited_for_then_reported_busy_never_a_dead_member(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path / "root").model_copy(deep=True)
    settings.service.request_timeout_s = 3.0
    keys = [k for _s, _e, k in TokenHasher(MODEL, chunk_size=CHUNK).process_tokens(range(CHUNK))]
    values = _values(1)

    async def scenario() -> None:
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        client = await KVCacheClient.connect(
            name=running.name, model=MODEL, settings=settings, same_host=False
        )
        bulk = running.actor.data_path
        assert bulk is not None
        bulk.max_pending_per_source = 1  # one silent peer from here fills this address
        squatter = socket.create_connection(("127.0.0.1", bulk.port))
        try:
            await wait_until_async(lambda: bulk.stats()["pending"] >= 1, "the squatter pending")
            refused = squatter

            async def free_a_slot_once_refused() -> None:  # a slot frees while the client waits
                await wait_until_async(
                    lambda: client.counters["data_connections_closed"] >= 1, "a refusal"
                )
                refused.close()

            freeing = asyncio.create_task(free_a_slot_once_refused())
            assert (await client.put(keys[0], values[0])).stored
            await freeing
            assert client.counters["data_connections_closed"] >= 1
            client.cluster.drop_data_path(client.cluster.members[client.members[0]])
            await client.cluster.hello(client.cluster.members[client.members[0]])
            squatter = socket.create_connection(("127.0.0.1", bulk.port))
            await wait_until_async(lambda: bulk.stats()["pending"] >= 1, "the squatter pending")
            with pytest.raises(ServiceUnavailableError, match="busy"):  # still busy at the end
                await client.get(keys[0])
            assert client.members  # and the member is still in use
            squatter.close()
            assert torch.equal(await client.get(keys[0]), values[0])
        finally:
            squatter.close()
            await client.close()
            await running.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=100))
