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

from persisting.actors.kv_cache_storage import _Lane
from persisting.kv import KVStore, open_kv_store
from persisting.kv.layout import checksum, encode_value
from persisting.service.client.member import Member
from persisting.service.client.transport import Transport
from persisting.service.handler import StorageHandler
from persisting.service.local_channel import ChannelRefused, LocalChannel, LocalChannelServer
from persisting.service.protocol import make_request, unwrap_reply
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


def test_a_session_over_its_share_is_refused_and_its_request_not_run(
    store: KVStore, handler: StorageHandler
) -> None:
    server = serve(handler, max_connections=16, max_per_session=2)

    async def scenario() -> None:
        assert server.path is not None
        sid = unwrap_reply(await handler.handle(make_request("hello", model=MODEL)))["sid"]
        channels = [await LocalChannel.open(server.path) for _ in range(3)]
        for ch in channels[:2]:
            ask = make_request("contains", sid=sid, model=MODEL, keys=[str(key(0))])
            assert unwrap_reply(await ch.ask(ask)) == [False]
        with pytest.raises(ChannelRefused, match="session holds 2"):
            await channels[2].ask(make_request("put", sid=sid, model=MODEL, **put_args(1)))
        assert channels[2].refused
        assert not store.contains(key(1))  # refused unread: the put was never carried out
        # Another session has its own share.
        other = unwrap_reply(await handler.handle(make_request("hello", model=MODEL)))["sid"]
        fresh = await LocalChannel.open(server.path)
        unwrap_reply(await fresh.ask(make_request("put", sid=other, model=MODEL, **put_args(2))))
        assert store.contains(key(2))
        # A connection that goes gives its slot back.
        await channels[0].close()
        assert await asyncio.to_thread(eventually, lambda: server._per_session[sid] == 1)
        again = await LocalChannel.open(server.path)
        unwrap_reply(await again.ask(make_request("put", sid=sid, model=MODEL, **put_args(3))))
        assert store.contains(key(3))
        for ch in [*channels[1:], fresh, again]:
            await ch.close()

    try:
        asyncio.run(scenario())
        assert server.refused_over_cap == 1
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
        extra = [await LocalChannel.open(server.path) for _ in range(5)]
        for ch in extra:
            with pytest.raises(ChannelRefused, match="3 channel connections"):
                await ch.ask(make_request("contains", sid=sid, model=MODEL, keys=["x"]))
        assert connection_threads() - before <= 3
        for ch in held + extra:
            await ch.close()

    try:
        asyncio.run(scenario())
        assert server.refused_over_cap == 5
    finally:
        server.close()


def test_a_client_whose_channel_is_refused_goes_on_through_pulsing(
    store: KVStore, handler: StorageHandler
) -> None:
    server = serve(handler, max_connections=1)
    counters: Counter[str] = Counter()

    async def never(_member: Member) -> None:
        raise AssertionError("the session was not lost")

    async def scenario() -> None:
        assert server.path is not None
        system = await pulsing.actor_system()  # in-process: no address, nothing listens
        try:
            ref = await system.spawn(_Lane(handler), name="persisting_lane_caps", public=True)
            info = unwrap_reply(await handler.handle(make_request("hello", model=MODEL)))
            member = Member(
                addr="local",
                node_id=1,
                refs=[ref],
                semaphore=asyncio.Semaphore(16),
                sid=info["sid"],
                info=info,
                same_host=True,
            )
            transport = Transport(
                MODEL, 10.0, counters, rehello=never, answered=lambda _m: None, restore=never
            )
            hog = await LocalChannel.open(server.path)  # takes the server's one connection
            assert await asyncio.to_thread(eventually, lambda: len(server._connections) == 1)
            member.channel = await LocalChannel.open(server.path)
            await transport.call(member, "put", **put_args(5))
            assert member.channel is None  # Pulsing carries its requests now
            assert await transport.call(member, "contains", keys=[str(key(5))]) == [True]
            await hog.close()
        finally:
            await system.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
    assert counters["channel_refused"] == 1
    assert store.contains(key(5))
