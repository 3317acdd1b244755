"""The local channel's connections are capped, in all and per session, and a connection
over a cap is refused cleanly (issue 25, item 4): nothing sent on it is carried out, the
client is told so, and its requests go through Pulsing instead."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pulsing
import pytest

from actors.kv_cache_storage import _Lane
from persisting.config import PersistingSettings
from persisting.errors import ServiceUnavailableError
from persisting.kv import KVStore, open_kv_store
from persisting.kv.layout import checksum, encode_value
from persisting.service.client.cluster import Cluster
from persisting.service.client.member import Member
from persisting.service.handler import StorageHandler
from persisting.service.local_channel import ChannelRefused, LocalChannel, LocalChannelServer
from persisting.service.protocol import make_request, unwrap_reply
from persisting.service.same_host import ClientArena
from tests.service.service_helpers import MODEL, key, tensor


@pytest.fixture
def store(tmp_path: Path) -> Iterator[KVStore]:
    with open_kv_store(tmp_path / "root", MODEL, memory_bytes=0, disk_bytes=64 << 20) as s:
        yield s


@pytest.fixture
def handler(store: KVStore) -> Iterator[StorageHandler]:
    h = StorageHandler({MODEL: store})
    yield h
    h.close()


def serve(handler: StorageHandler, **caps: int) -> LocalChannelServer:
    server = LocalChannelServer(handler.answer, handler.is_light, handler.executor, **caps)
    server.start()
    return server


def put_args(i: int) -> dict[str, Any]:
    layout, view = encode_value(tensor(i), "KV_2LTD")
    item = {
        "key": str(key(i)),
        "layout": layout.to_dict(),
        "checksum": checksum(view),
        "source": {"inline": bytes(view)},
    }
    return {"items": [item], "fmt": "KV_2LTD"}


def connection_threads() -> int:
    return sum(t.name == "kv-channel-conn" for t in threading.enumerate())


def eventually(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return bool(predicate())


def test_a_session_over_its_share_is_refused_before_sending_anything(
    store: KVStore, handler: StorageHandler
) -> None:
    server = serve(handler, max_connections=16, max_per_session=2)

    async def scenario() -> None:
        assert server.path is not None
        sid = unwrap_reply(await handler.handle(make_request("hello", model=MODEL)))["sid"]
        attached = [await LocalChannel.open(server.path, sid) for _ in range(2)]
        with pytest.raises(ChannelRefused, match="session holds 2"):
            await LocalChannel.open(server.path, sid)
        # A client that skips attaching is refused at its first request, not carrying it out.
        unattached = await LocalChannel.open(server.path)
        with pytest.raises(ChannelRefused, match="session holds 2"):
            await unattached.ask(make_request("put", sid=sid, model=MODEL, **put_args(1)))
        assert unattached.refused
        assert not store.contains(key(1))
        # Another session has its own share.
        other = unwrap_reply(await handler.handle(make_request("hello", model=MODEL)))["sid"]
        fresh = await LocalChannel.open(server.path, other)
        unwrap_reply(await fresh.ask(make_request("put", sid=other, model=MODEL, **put_args(2))))
        assert store.contains(key(2))
        # A connection that goes gives its slot back.
        await attached[0].close()
        assert await asyncio.to_thread(eventually, lambda: server._per_session[sid] == 1)
        again = await LocalChannel.open(server.path, sid)
        unwrap_reply(await again.ask(make_request("put", sid=sid, model=MODEL, **put_args(3))))
        assert store.contains(key(3))
        for ch in [attached[1], unattached, fresh, again]:
            await ch.close()

    try:
        asyncio.run(scenario())
        assert server.refused_over_cap == 2
    finally:
        server.close()


def test_connections_over_the_servers_cap_get_no_thread_and_are_refused(
    handler: StorageHandler,
) -> None:
    before = connection_threads()
    server = serve(handler, max_connections=3)

    async def scenario() -> None:
        assert server.path is not None
        sid = unwrap_reply(await handler.handle(make_request("hello", model=MODEL)))["sid"]
        held = [await LocalChannel.open(server.path) for _ in range(3)]
        for _ in range(5):  # refused, or broken by the refusal's close: no channel either way
            with pytest.raises(ServiceUnavailableError):
                await LocalChannel.open(server.path, sid)
        assert connection_threads() - before <= 3
        for ch in held:
            await ch.close()

    try:
        asyncio.run(scenario())
        assert server.refused_over_cap == 5
    finally:
        server.close()


def test_a_client_whose_channel_is_refused_stays_on_pulsing(
    store: KVStore, handler: StorageHandler
) -> None:
    """A real client (its cluster's hello and restore) against a server whose channel is
    full: it gets no channel, and its requests go through Pulsing."""
    server = serve(handler, max_connections=1)
    handler.local_channel = server.path
    counters: Counter[str] = Counter()
    arena = ClientArena(8 << 20)

    async def scenario() -> None:
        assert server.path is not None
        system = await pulsing.actor_system()  # in-process: no address, nothing listens
        try:
            ref = await system.spawn(_Lane(handler), name="persisting_lane_caps", public=True)
            cluster = Cluster(
                system, "kvstore", MODEL, PersistingSettings().service, counters, arena
            )
            member = Member(addr="local", node_id=1, refs=[ref], semaphore=asyncio.Semaphore(16))
            hog = await LocalChannel.open(server.path)  # takes the server's one connection
            assert await asyncio.to_thread(eventually, lambda: len(server._connections) == 1)
            await cluster.hello(member)
            assert member.same_host and member.channel is None  # refused: Pulsing carries on
            await cluster.call(member, "put", **put_args(5))
            assert await cluster.call(member, "contains", keys=[str(key(5))]) == [True]
            await hog.close()
        finally:
            await system.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        arena.close()
    assert server.refused_over_cap == 1
    assert store.contains(key(5))


def test_a_client_with_room_attaches_its_session_and_uses_the_channel(
    store: KVStore, handler: StorageHandler
) -> None:
    server = serve(handler)
    handler.local_channel = server.path
    arena = ClientArena(8 << 20)

    async def scenario() -> None:
        system = await pulsing.actor_system()
        try:
            ref = await system.spawn(_Lane(handler), name="persisting_lane_room", public=True)
            cluster = Cluster(
                system, "kvstore", MODEL, PersistingSettings().service, Counter(), arena
            )
            member = Member(addr="local", node_id=1, refs=[ref], semaphore=asyncio.Semaphore(16))
            await cluster.hello(member)
            assert member.channel is not None and not member.channel.broken
            assert member.sid is not None and server._per_session[member.sid] == 1
            await cluster.call(member, "put", **put_args(6))
            await member.channel.close()
        finally:
            await system.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
        arena.close()
    assert store.contains(key(6)) and server.refused_over_cap == 0
