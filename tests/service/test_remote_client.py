"""A client that is not on the server's host, against a server in this process (loopback,
the fast loop): its values move on data connections, its load-or-recompute plans price
hits at the bandwidth those achieved, a session the server lost is opened again under the
client's feet, and ``connect`` says what it cannot honour."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from actors.launch import free_loopback_port, start_service
from persisting.config import PersistingSettings
from persisting.kv import TokenHasher
from persisting.service import KVCacheClient
from tests.service.service_helpers import MODEL

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
            assert counters["put_bytes_bulk"] == counters["get_bytes_bulk"] - values[2].nbytes
            assert "get_bytes_message" not in counters and "put_bytes_message" not in counters
            measured = client._reader.bandwidth.bytes_per_s("bulk:memory")
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
            with handler.state.lock:
                for session in handler.sessions.sessions():
                    gone = handler.sessions.close(session.sid)
                    assert gone is not None
                    handler._give_back(gone)
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


def test_without_a_data_path_a_remote_client_moves_values_in_messages(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "root").model_copy(deep=True)
    settings.service.bulk = False
    settings.service.message_part_bytes = 1 << 20  # a 2 MiB value: uploaded and read in parts
    keys = [k for _s, _e, k in TokenHasher(MODEL, chunk_size=CHUNK).process_tokens(range(CHUNK))]
    values = _values(1)

    async def scenario() -> None:
        running = await start_service(
            settings, addr=f"127.0.0.1:{free_loopback_port()}", consume_events=False
        )
        client = await KVCacheClient.connect(
            name=running.name, model=MODEL, settings=settings, same_host=False
        )
        try:
            assert (await client.put(keys[0], values[0])).stored
            assert torch.equal(await client.get(keys[0]), values[0])
            counters = client.counters
            assert counters["put_bytes_message"] == counters["get_bytes_message"] > 0
            assert "get_bytes_bulk" not in counters
            service = (await client.stats())["members"][client.members[0]]["service"]
            assert service["staged_bytes"] == 0
        finally:
            await client.close()
            await running.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=100))
