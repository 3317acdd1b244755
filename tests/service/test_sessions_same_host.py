"""Session bookkeeping (pins, leases, staged buffers, TTL) and the same-host building blocks."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persisting.errors import (
    CapacityError,
    CorruptValueError,
    ProtocolError,
    ServiceUnavailableError,
    SessionExpiredError,
)
from persisting.service.same_host import PAGE, ClientArena, ServerArenaMapping, read_file_into
from persisting.service.sessions import SessionTable, Staged


def test_sessions_expire_without_renewal_and_give_back_their_holdings() -> None:
    now = [0.0]
    table = SessionTable(ttl_s=10.0, clock=lambda: now[0])
    a, b = table.open({"pid": 1}), table.open({"pid": 2})
    table.add_pin(a, ("m", "k1"))
    table.add_pin(a, ("m", "k1"))
    table.add_lease(a, ("m", "k2"), 11)
    table.add_lease(b, ("m", "k2"), 12)
    assert table.pin_count == 2 and table.lease_count == 2
    assert table.drop_lease(a, ("m", "k2")) == 11  # a's own lease token, not b's
    assert table.drop_lease(a, ("m", "k2")) is None
    assert table.lease_count == 1  # b still leases k2
    now[0] = 8.0
    table.touch(b.sid)
    now[0] = 10.5
    gone = table.expire()
    assert [s.sid for s in gone] == [a.sid]
    assert gone[0].pins == {("m", "k1"): 2}
    with pytest.raises(SessionExpiredError):
        table.touch(a.sid)
    assert table.drop_lease(b, ("m", "k2")) == 12  # the last lease on k2
    assert table.lease_count == 0
    assert not table.drop_pin(b, ("m", "k1"))
    with pytest.raises(ProtocolError, match="needs a session"):
        table.touch(None)


def test_staged_buffers_are_bounded_and_freed_with_their_session() -> None:
    table = SessionTable(ttl_s=10.0, max_staged_bytes=100)
    session = table.open({})
    first = table.stage(session, Staged(np.zeros(60, np.uint8), 60))
    with pytest.raises(CapacityError):
        table.stage(session, Staged(np.zeros(60, np.uint8), 60))
    assert table.staged(session, first).nbytes == 60
    with pytest.raises(ProtocolError):
        table.staged(session, "nope")
    table.close(session.sid)
    assert table.staged_bytes == 0
    other = table.open({})
    table.stage(other, Staged(np.zeros(90, np.uint8), 90))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * PAGE)), max_size=60))
def test_arena_allocator_never_overlaps_and_coalesces(ops) -> None:
    arena = ClientArena(32 * PAGE)
    try:
        live = []
        for allocate, size in ops:
            if allocate or not live:
                region = arena.allocate(size)
                if region is not None:
                    assert region.offset % PAGE == 0 and region.offset >= PAGE
                    assert region.offset + region.capacity <= arena.size
                    for other in live:
                        assert (
                            region.offset + region.capacity <= other.offset
                            or other.offset + other.capacity <= region.offset
                        )
                    live.append(region)
            else:
                arena.free(live.pop(len(live) // 2))
        for region in live:
            arena.free(region)
        assert arena.free_bytes == arena.size - PAGE
        assert arena.allocate(arena.size - PAGE) is not None  # one range again
    finally:
        arena.close()


def test_server_maps_only_a_real_arena_with_the_clients_nonce(tmp_path: Path) -> None:
    arena = ClientArena(4 * PAGE)
    try:
        mapping = ServerArenaMapping(str(arena.path), arena.size, arena.nonce)
        region = arena.allocate(100)
        assert region is not None
        mapping.region(region.offset, 100)[:] = b"x" * 100
        assert bytes(arena.region_view(region)) == b"x" * 100
        with pytest.raises(ProtocolError, match="outside"):
            mapping.region(0, 10)  # the nonce page is not data
        with pytest.raises(ProtocolError, match="outside"):
            mapping.region(PAGE, arena.size)
        mapping.close()
        with pytest.raises(ProtocolError, match="nonce"):
            ServerArenaMapping(str(arena.path), arena.size, b"0" * 16)
        with pytest.raises(ProtocolError, match="bytes"):
            ServerArenaMapping(str(arena.path), arena.size * 2, arena.nonce)
        for other in (tmp_path / "secrets.txt", tmp_path / arena.path.name):
            other.write_bytes(arena.nonce + b"x" * (arena.size - len(arena.nonce)))
            with pytest.raises(ProtocolError, match="not a Persisting"):
                ServerArenaMapping(str(other), arena.size, arena.nonce)
        arena.unlink()
        with pytest.raises(ProtocolError, match="cannot open"):
            ServerArenaMapping(str(arena.path), arena.size, arena.nonce)
    finally:
        arena.close()


def test_read_file_into_reads_exactly_or_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "payload"
    path.write_bytes(b"h" * 16 + bytes(range(256)) * 4)
    out = bytearray(1024)
    read_file_into(str(path), 16, memoryview(out))
    assert bytes(out) == bytes(range(256)) * 4
    with pytest.raises(CorruptValueError):
        read_file_into(str(path), 32, memoryview(bytearray(1024)))
    os.unlink(path)
    with pytest.raises(FileNotFoundError):
        read_file_into(str(path), 0, memoryview(bytearray(1)))


def test_local_channel_needs_a_session_and_answers_concurrent_requests(tmp_path: Path) -> None:
    from persisting.kv import open_kv_store
    from persisting.service.handler import StorageHandler
    from persisting.service.local_channel import LocalChannel, LocalChannelServer
    from persisting.service.protocol import make_request, unwrap_reply

    async def scenario(handler: StorageHandler) -> None:
        server = LocalChannelServer(handler.answer, handler.is_light, handler.executor)
        path = server.start()
        assert os.stat(path).st_mode & 0o777 == 0o600
        channel = await LocalChannel.open(path)
        try:
            with pytest.raises(ProtocolError, match="through the actor"):
                unwrap_reply(await channel.ask(make_request("hello", model="m/a")))
            with pytest.raises(ProtocolError, match="need a session"):
                unwrap_reply(await channel.ask(make_request("stats", model="m/a")))
            sid = unwrap_reply(await handler.handle(make_request("hello", model="m/a")))["sid"]
            keys = [f"m/a@1@0@{i:x}@bfloat16" for i in range(40)]
            replies = await asyncio.gather(
                *(
                    channel.ask(make_request("contains", sid=sid, model="m/a", keys=[k]))
                    for k in keys
                )
            )
            assert [unwrap_reply(r) for r in replies] == [[False]] * 40
            with pytest.raises(SessionExpiredError):
                unwrap_reply(await channel.ask(make_request("stats", sid="0" * 32, model="m/a")))
        finally:
            server.close()
        assert not os.path.exists(path)
        with pytest.raises(ServiceUnavailableError):  # the server is gone
            await asyncio.wait_for(channel.ask(make_request("stats", sid="x", model="m/a")), 5)
        await channel.close()

    with open_kv_store(tmp_path / "root", "m/a", memory_bytes=1 << 20, disk_bytes=1 << 24) as st:
        handler = StorageHandler({"m/a": st})
        try:
            asyncio.run(scenario(handler))
        finally:
            handler.close()


def test_arenas_of_dead_clients_are_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    from persisting.service.same_host import remove_orphaned_arenas

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = tmp_path / f"persisting-arena-{int(dead.stdout)}-0123456789abcdef"
    mine = tmp_path / f"persisting-arena-{os.getpid()}-0123456789abcdef"
    other = tmp_path / "persisting-arena-notes.txt"
    for path in (orphan, mine, other):
        path.write_bytes(b"x")
    assert remove_orphaned_arenas(tmp_path) == 1
    assert not orphan.exists() and mine.exists() and other.exists()
    arena = ClientArena(4 * PAGE, directory=tmp_path)  # creating one sweeps as well
    arena.close()
    assert not arena.path.exists()


def test_socket_folders_of_killed_servers_are_removed(tmp_path: Path) -> None:
    from persisting.service.local_channel import remove_orphaned_channels

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"persisting-kv-{dead.pid}-abc"
    mine = tmp_path / f"persisting-kv-{os.getpid()}-def"
    other = tmp_path / "persisting-kv-notapid"
    for d in (orphan, mine, other):
        d.mkdir()
        (d / "service.sock").write_bytes(b"")
    assert remove_orphaned_channels(str(tmp_path)) == 1
    assert not orphan.exists() and mine.exists() and other.exists()
