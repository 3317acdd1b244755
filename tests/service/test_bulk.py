"""The bulk data path on loopback, in one process: a real store, the protocol handler, the
data-connection server, and a client's connections -- no Pulsing, so the fast loop runs in
seconds. What other hosts see is tested in ``test_remote_hosts.py``.

Failures are driven through a small TCP relay between the two (it cuts or stalls a
connection after a given number of bytes), or by speaking to the server directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from persisting.errors import AccessDeniedError, CapacityError, CorruptValueError, InvalidValueError
from persisting.kv import KVStore, Layout, open_kv_store
from persisting.kv.layout import encode_value
from persisting.service.bulk import server as bulk_server
from persisting.service.bulk.auth import HELLO, PLAIN, WELCOME, client_hello
from persisting.service.bulk.server import BulkServer
from persisting.service.bulk.stream import ConnectionLost, PollGate, Stream, pack, set_timeouts
from persisting.service.client.bulk import BulkLink, Endpoint, PutItem, Refused
from persisting.service.handler import StorageHandler
from persisting.service.protocol import make_request, unwrap_reply
from tests.service.service_helpers import MODEL, OTHER_MODEL, key

pytestmark = pytest.mark.timeout(60)

CHUNK = 2 * 4 * 256 * 512 * 2  # bytes of one [2, 4, 256, 512] bf16 value (2 MiB)


def value(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 4, 256, 512, generator=g).to(torch.bfloat16)


def item(i: int) -> PutItem:
    layout, data = encode_value(value(i), "KV_2LTD")
    return (str(key(i)), layout, data, None)


@dataclass
class Server:
    store: KVStore
    handler: StorageHandler
    bulk: BulkServer
    #: How long the links it makes poll for bytes (a polling server's clients poll too).
    poll_s: float = 0.0

    def session(self) -> dict[str, object]:
        """A fresh session's hello reply (as a client gets it over the control path)."""
        reply = self.handler.answer(make_request("hello", model=MODEL, client={}))
        return dict(unwrap_reply(reply))

    def endpoint(self, sealed: bool = False, port: int | None = None) -> Endpoint:
        info = self.session()["bulk"]
        assert isinstance(info, dict)
        endpoint = Endpoint.from_hello(info, "127.0.0.1:1", sealed)
        assert endpoint is not None
        if port is not None:  # through the relay
            endpoint = Endpoint(endpoint.host, port, endpoint.key_id, endpoint.secret, sealed)
        return endpoint

    def link(
        self, sealed: bool = False, port: int | None = None, timeout_s: float = 5.0
    ) -> BulkLink:
        return BulkLink(
            self.endpoint(sealed, port), streams=2, timeout_s=timeout_s, poll_s=self.poll_s
        )

    def held(self) -> tuple[int, int]:
        """Leases and staged bytes the server holds for its sessions."""
        sessions = self.handler.sessions
        return sessions.lease_count, sessions.staged_bytes


def _server(
    root: Path, memory_bytes: int, sealed: bool = False, poll_s: float = 0.0
) -> Iterator[Server]:
    store = open_kv_store(root, MODEL, memory_bytes=memory_bytes, disk_bytes=256 << 20)
    handler = StorageHandler({MODEL: store}, lease_ttl_s=5.0)
    bulk = BulkServer(handler.state, "127.0.0.1", 0, sealed=sealed, io_timeout_s=5.0, poll_s=poll_s)
    handler.bulk = bulk.start()
    try:
        yield Server(store, handler, bulk, poll_s)
    finally:
        bulk.close()
        handler.close()
        store.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from _server(tmp_path / "mem", 64 << 20)


@pytest.fixture
def disk_server(tmp_path: Path) -> Iterator[Server]:
    yield from _server(tmp_path / "disk", 0)


@pytest.fixture
def polling_server(tmp_path: Path) -> Iterator[Server]:
    """A server (and links) that poll for bytes for up to 50 ms before sleeping."""
    yield from _server(tmp_path / "poll", 64 << 20, poll_s=0.05)


@pytest.fixture(params=[0.0, 0.05], ids=["sleeping", "polling"])
def either_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Server]:
    """A server whose connection threads sleep at once, and one that polls first."""
    yield from _server(tmp_path / "mem", 64 << 20, poll_s=request.param)


def _get(link: BulkLink, keys: list[str], **kw: object) -> list[object]:
    reads = asyncio.run(link.get(MODEL, keys, kw.get("expect"), kw.get("outs"), None))  # type: ignore[arg-type]
    return [None if r is None else r.value for r in reads]


@pytest.mark.parametrize("sealed", [False, True])
def test_values_round_trip_bit_exact_from_memory_and_disk(
    server: Server, disk_server: Server, sealed: bool
) -> None:
    for srv, tier in ((server, "memory"), (disk_server, "disk")):
        link = srv.link(sealed=sealed)
        try:
            results = asyncio.run(link.put(MODEL, "KV_2LTD", [item(i) for i in range(3)]))
            assert [r["stored"] for r in results] == [True, True, True]
            reads = asyncio.run(link.get(MODEL, [str(key(i)) for i in range(4)], None, None, None))
            assert reads[3] is None  # never stored: a miss
            for i in range(3):
                read = reads[i]
                assert read is not None and read.tier == tier
                assert torch.equal(read.value, value(i))
            out = torch.empty(2, 4, 256, 512, dtype=torch.bfloat16)
            outs = [memoryview(out.view(-1).view(torch.uint8).numpy())]
            got = asyncio.run(link.get(MODEL, [str(key(1))], None, outs, None))
            assert got[0] is not None and isinstance(got[0].value, Layout)
            assert torch.equal(out, value(1))
            other = Layout((2, 4, 256, 256), "bfloat16", "KV_2LTD", CHUNK // 2)
            assert _get(link, [str(key(1))], expect=other) == [None]  # layout mismatch: miss
            assert srv.held() == (0, 0)  # no lease, no staging left behind
        finally:
            link.close()


def test_an_unauthenticated_peer_gets_no_byte_and_holds_nothing_for_long(server: Server) -> None:
    port = server.bulk.port
    # garbage of the hello's size, a well-formed hello for a key id nobody holds, silence
    forged = client_hello(b"\1" * 16, b"\2" * 32, 1, PLAIN)
    for first in (b"x" * HELLO.size, forged, b"GET / HTTP/1.0\r\n\r\n" + b" " * 62):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(first)
            assert sock.recv(100) == b""  # closed without a byte
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        assert sock.recv(100) == b""
    assert time.monotonic() - start < bulk_server.HANDSHAKE_TIMEOUT_S + 2
    figures = server.bulk.stats()
    assert figures["refused_handshake"] + figures["refused_credential"] == 4
    assert figures["pending"] == 0 and figures["connections"] == 0


def test_a_sniffed_hello_cannot_be_replayed_nor_used_for_another_session(server: Server) -> None:
    mine, other = server.endpoint(), server.endpoint()
    hello = client_hello(mine.key_id, mine.secret, 7, PLAIN)
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=10) as sock:
        sock.sendall(hello)
        assert len(sock.recv(WELCOME.size, socket.MSG_WAITALL)) == WELCOME.size  # accepted
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=10) as sock:
        sock.sendall(hello)  # the same bytes again: refused
        assert sock.recv(100) == b""
    body = bytearray(hello)
    body[8:24] = other.key_id  # another session's key id with this session's MAC
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=10) as sock:
        sock.sendall(bytes(body))
        assert sock.recv(100) == b""


def test_handshakes_and_connections_are_capped(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk_server, "MAX_PENDING", 3)
    silent = [socket.create_connection(("127.0.0.1", server.bulk.port)) for _ in range(3)]
    time.sleep(0.3)
    try:
        with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=10) as extra:
            assert extra.recv(10) == b""  # closed at once, unread
        assert server.bulk.stats()["refused_pending"] >= 1
    finally:
        for sock in silent:
            sock.close()
    _wait_until(lambda: server.bulk.stats()["pending"] == 0)
    monkeypatch.setattr(bulk_server, "MAX_PER_SESSION", 2)
    link = BulkLink(server.endpoint(), streams=3, timeout_s=5.0)
    try:
        streams = [asyncio.run(link._take()) for _ in range(2)]  # two connections at once
        for stream in streams:
            asyncio.run(stream.send_frame({"op": "get", "model": MODEL, "keys": [str(key(1))]}))
            assert asyncio.run(stream.recv_frame()) == {"miss": True}
        with pytest.raises(CapacityError):  # a third: the server says it is busy
            asyncio.run(link._take())
        assert server.bulk.stats()["refused_cap"] == 1
    finally:
        link.close()


def _raise(frame: dict[str, object]) -> None:
    from persisting.service.client.bulk import raise_error

    raise_error(frame)


class Relay:
    """A TCP relay to ``port``: ``cut`` or ``stall`` a direction after ``after`` bytes, or
    ``trickle`` it from there on (small pieces, a pause between them)."""

    def __init__(self, port: int, direction: str, after: int, action: str):
        self.target = port
        self.direction = direction  # "down" (server to client) or "up"
        self.after = after
        self.action = action
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.sockets: list[socket.socket] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
                self.sockets += [client, upstream]
                for src, dst, name in ((client, upstream, "up"), (upstream, client, "down")):
                    threading.Thread(target=self._pump, args=(src, dst, name), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
        moved = 0
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if name == self.direction and self.action == "trickle":
                    for start in range(0, len(data), 3000):
                        dst.sendall(data[start : start + 3000])
                        if moved + start >= self.after:
                            time.sleep(0.0002)
                    moved += len(data)
                    continue
                if name == self.direction and moved + len(data) > self.after:
                    dst.sendall(data[: max(0, self.after - moved)])
                    self.done.set()
                    if self.action == "stall":
                        time.sleep(30)
                    break
                dst.sendall(data)
                moved += len(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:  # shut down first: a pump blocked in recv on it wakes
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _wait_until(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_connection_killed_mid_get_is_lost_never_a_partial_value(server: Server) -> None:
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(i) for i in range(2)]))
    setup.close()
    relay = Relay(server.bulk.port, "down", after=WELCOME.size + CHUNK + CHUNK // 2, action="cut")
    link = server.link(port=relay.port)
    out = np.zeros(CHUNK, np.uint8)
    try:
        with pytest.raises(ConnectionLost) as lost:
            asyncio.run(
                link.get(
                    MODEL,
                    [str(key(0)), str(key(1))],
                    None,
                    [memoryview(bytearray(CHUNK)), out.data],
                    None,
                )
            )
        assert not lost.value.timed_out
        assert link.lost == 1  # the connection is dropped, never reused
    finally:
        link.close()
        relay.close()
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    assert server.held() == (0, 0)


def test_a_connection_killed_mid_put_stores_nothing_and_leaks_no_staging(server: Server) -> None:
    relay = Relay(server.bulk.port, "up", after=HELLO.size + CHUNK + CHUNK // 2, action="cut")
    link = server.link(port=relay.port)
    try:
        with pytest.raises(ConnectionLost):
            asyncio.run(link.put(MODEL, "KV_2LTD", [item(10), item(11)]))
    finally:
        link.close()
        relay.close()
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    assert server.held() == (0, 0)
    assert not server.store.contains(key(10)) and not server.store.contains(key(11))


def _put_request_bytes(items: list[PutItem]) -> int:
    """Bytes of the frame a link's put of ``items`` opens with (as ``BulkLink.put`` sends it)."""
    request = {
        "op": "put",
        "model": MODEL,
        "fmt": "KV_2LTD",
        "items": [
            {"key": k, "layout": layout.to_dict(), "parent": parent}
            for k, layout, _data, parent in items
        ],
    }
    return len(pack(request))


@pytest.mark.parametrize(
    "cut_at",
    [
        "in the first payload's tail",  # all but its last bytes landed
        "in the checksum riding before the second payload",
        "in the last checksum",  # every payload byte arrived, not the proof they are whole
    ],
)
def test_a_put_cut_anywhere_in_its_stream_stores_nothing_and_leaks_no_staging(
    server: Server, cut_at: str
) -> None:
    items = [item(12), item(13)]
    start = HELLO.size + _put_request_bytes(items)
    after = {
        "in the first payload's tail": start + CHUNK - 1000,
        "in the checksum riding before the second payload": start + CHUNK + 4,
        "in the last checksum": start + 2 * CHUNK + 8 + 5,
    }[cut_at]
    relay = Relay(server.bulk.port, "up", after=after, action="cut")
    link = server.link(port=relay.port)
    try:
        with pytest.raises(ConnectionLost):
            asyncio.run(link.put(MODEL, "KV_2LTD", items))
    finally:
        link.close()
        relay.close()
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    assert server.held() == (0, 0)
    assert not server.store.contains(key(12)) and not server.store.contains(key(13))
    link = server.link()  # the server serves on, and the same put then goes through
    try:
        assert [r["stored"] for r in asyncio.run(link.put(MODEL, "KV_2LTD", items))] == [True, True]
        got = _get(link, [str(key(12)), str(key(13))])
        assert torch.equal(got[0], value(12)) and torch.equal(got[1], value(13))  # type: ignore[arg-type]
    finally:
        link.close()


def test_a_get_cut_in_a_payloads_tail_is_lost_never_a_partial_value(server: Server) -> None:
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(14)]))
    setup.close()
    # all but the value's last bytes have landed when the connection goes
    relay = Relay(server.bulk.port, "down", after=WELCOME.size + CHUNK - 1000, action="cut")
    link = server.link(port=relay.port)
    out = np.zeros(CHUNK, np.uint8)
    try:
        with pytest.raises(ConnectionLost):
            asyncio.run(link.get(MODEL, [str(key(14))], None, [out.data], None))
    finally:
        link.close()
        relay.close()
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    assert server.held() == (0, 0)


def test_a_member_that_stalls_mid_transfer_times_out(either_server: Server) -> None:
    """A client polls for a while, then waits with its timeout: a stall still ends there."""
    server = either_server
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(0)]))
    setup.close()
    relay = Relay(server.bulk.port, "down", after=WELCOME.size + CHUNK // 2, action="stall")
    link = server.link(port=relay.port, timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionLost) as lost:
            asyncio.run(link.get(MODEL, [str(key(0))], None, None, None))
        assert lost.value.timed_out and time.monotonic() - start < 5
    finally:
        link.close()
        relay.close()


def test_a_client_that_stalls_mid_put_is_timed_out_by_the_server_and_holds_nothing(
    either_server: Server,
) -> None:
    """The server waits for a payload's bytes by polling with its receive timeout (it
    sleeps until a whole piece is queued; a polling server polls for a while first): a
    client that stops sending still ends there."""
    server = either_server
    items = [item(15)]
    after = HELLO.size + _put_request_bytes(items) + CHUNK // 2
    relay = Relay(server.bulk.port, "up", after=after, action="stall")
    link = server.link(port=relay.port, timeout_s=60.0)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectionLost):
            asyncio.run(link.put(MODEL, "KV_2LTD", items))
        assert 4.0 < time.monotonic() - start < 30  # the server's io_timeout_s is 5 s
    finally:
        link.close()
        relay.close()
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    assert server.held() == (0, 0)
    assert not server.store.contains(key(15))


@pytest.mark.parametrize("direction", ["up", "down"])
def test_payloads_that_trickle_in_arrive_whole(either_server: Server, direction: str) -> None:
    """A receiver asks to be woken only once the rest of a piece is queued; it never asks
    for more than it still expects, so bytes that come a few at a time, with pauses, and
    the frames and checksums after them, all arrive (a polling server's polls end before
    the pauses do, and it sleeps for the rest)."""
    server = either_server
    items = [item(16), item(17)]
    relay = Relay(server.bulk.port, direction, after=HELLO.size, action="trickle")
    link = server.link(port=relay.port)
    try:
        assert [r["stored"] for r in asyncio.run(link.put(MODEL, "KV_2LTD", items))] == [True, True]
        got = _get(link, [str(key(16)), str(key(17))])
        assert torch.equal(got[0], value(16)) and torch.equal(got[1], value(17))  # type: ignore[arg-type]
    finally:
        link.close()
        relay.close()


def test_a_polling_server_takes_back_to_back_transfers_without_sleeping(
    polling_server: Server,
) -> None:
    """With ``poll_s``, a connection's thread polls for a payload's pieces and, after a bulk
    transfer, for the next request, before it sleeps: values stay bit-exact, and the
    server counts which waits polling ended. After small requests it sleeps at once."""
    srv = polling_server
    link = srv.link()
    try:
        for i in range(40, 44):  # puts one after another, as an engine stores a prefix
            asyncio.run(link.put(MODEL, "KV_2LTD", [item(i)]))
        got = _get(link, [str(key(i)) for i in range(40, 44)])
        assert all(torch.equal(g, value(i)) for g, i in zip(got, range(40, 44), strict=True))  # type: ignore[arg-type]
        # (a request's waits are counted when the next request comes)
        figures = srv.bulk.stats()
        # the 512 KiB pieces of 4 values of 2 MiB came while the thread polled for them
        # (a wait that outlasts the poll, as the client's asyncio.run between requests
        # may, is counted as slept)
        assert figures["waits_polled"] >= 4 * CHUNK // (512 << 10)
        before = figures["waits_polled"] + figures["waits_slept"]
        for _ in range(3):  # misses move no payload: no poll after them
            assert _get(link, [str(key(99))]) == [None]
        after = srv.bulk.stats()
        # one more: the wait after the bulk get; none after the misses
        assert after["waits_polled"] + after["waits_slept"] == before + 1
    finally:
        link.close()


def test_a_server_polls_only_while_its_connection_is_the_only_one_busy() -> None:
    """Several transfers at once keep the cores busy: a thread polls only when its own
    request is the only one in flight (or, between requests, when none is), and one at a
    time."""
    gate = PollGate()
    assert gate.enter(in_request=False)  # idle server: the first may poll...
    assert not gate.enter(in_request=False)  # ...and nobody else meanwhile
    gate.leave()
    gate.request(+1)
    assert not gate.enter(in_request=False)  # another connection's request is in flight
    assert gate.enter(in_request=True)  # the one in flight is the caller's own
    gate.leave()
    gate.request(+1)
    assert not gate.enter(in_request=True)  # two transfers at once: nobody polls
    gate.request(-1)
    gate.request(-1)
    assert gate.enter(in_request=False)
    gate.leave()


def test_a_client_that_polls_lets_its_other_requests_go_on(polling_server: Server) -> None:
    """A client polls for bytes on its event loop, yielding between tries: while one get
    polls a member that stalls mid-value, a get on another connection completes, and the
    stalled one still ends with its timeout."""
    srv = polling_server
    setup = srv.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(0)]))
    relay = Relay(srv.bulk.port, "down", after=WELCOME.size + CHUNK // 2, action="stall")
    stalled = BulkLink(srv.endpoint(port=relay.port), streams=1, timeout_s=1.0, poll_s=2.0)
    direct = BulkLink(srv.endpoint(), streams=1, timeout_s=5.0, poll_s=2.0)
    ended: dict[str, float] = {}

    async def timed(name: str, link: BulkLink) -> None:
        try:
            reads = await link.get(MODEL, [str(key(0))], None, None, None)
            assert reads[0] is not None and torch.equal(reads[0].value, value(0))
        finally:
            ended[name] = time.monotonic()

    async def both() -> None:
        start = time.monotonic()
        results = await asyncio.gather(
            timed("stalled", stalled), timed("direct", direct), return_exceptions=True
        )
        assert isinstance(results[0], ConnectionLost) and results[0].timed_out
        assert results[1] is None
        assert ended["direct"] - start < 1.0  # not held up by the other's polling
        assert ended["stalled"] - start >= 2.0  # polled 2 s, then waited out 1 s

    try:
        asyncio.run(both())
    finally:
        for link in (setup, stalled, direct):
            link.close()
        relay.close()


def test_a_get_cancelled_mid_transfer_closes_its_connection_and_writes_no_more(
    either_server: Server,
) -> None:
    """The client reads on its event loop (polling on it first, for a polling server's
    links): a cancelled get stops writing into the caller's buffer at once, and its
    connection (out of step) is closed, not reused."""
    server = either_server
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(0)]))
    setup.close()
    relay = Relay(server.bulk.port, "down", after=WELCOME.size + CHUNK // 2, action="stall")
    link = server.link(port=relay.port, timeout_s=30.0)
    out = np.zeros(CHUNK, np.uint8)

    async def cancel_mid_transfer() -> None:
        task = asyncio.ensure_future(link.get(MODEL, [str(key(0))], None, [out.data], None))
        await asyncio.sleep(0.5)  # the relay holds the rest of the payload back
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(cancel_mid_transfer())
        written = out.copy()
        assert 0 < np.count_nonzero(written) < CHUNK  # it was mid-transfer
        assert link._idle == [] and link.lost == 0  # closed, and not counted as a failure
    finally:
        link.close()
        relay.close()
    time.sleep(0.3)
    assert np.array_equal(out, written)  # nothing wrote into the buffer after the cancel
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    fresh = server.link()
    try:
        assert torch.equal(_get(fresh, [str(key(0))])[0], value(0))  # type: ignore[arg-type]
    finally:
        fresh.close()
    assert server.held() == (0, 0)


def test_a_server_that_never_answers_the_hello_times_out_and_one_that_closes_refuses() -> None:
    quiet = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = quiet.accept()
                accepted.append(conn)
                if len(accepted) > 1:
                    conn.recv(HELLO.size)
                    conn.close()  # the second one: read and closed, as for a lost session

    threading.Thread(target=accept, daemon=True).start()
    endpoint = Endpoint("127.0.0.1", int(quiet.getsockname()[1]), b"k" * 16, b"s" * 32, False)
    link = BulkLink(endpoint, streams=1, timeout_s=0.5)
    try:
        with pytest.raises(ConnectionLost) as lost:
            asyncio.run(link.get(MODEL, [str(key(0))], None, None, None))
        assert lost.value.timed_out
        with pytest.raises(Refused):
            asyncio.run(link.get(MODEL, [str(key(0))], None, None, None))
    finally:
        link.close()
        quiet.close()
        for conn in accepted:
            conn.close()


def _authenticated(server: Server) -> Stream:
    """An authenticated data connection, driven by hand with blocking calls."""
    taken = asyncio.run(server.link()._take())
    taken.sock.setblocking(True)
    set_timeouts(taken.sock, 10.0)
    return Stream(taken.sock)


def test_frames_too_large_or_cut_short_end_only_their_connection(server: Server) -> None:
    oversized = _authenticated(server)
    oversized.send([struct.pack("<I", (64 << 20) + 1)])
    with pytest.raises(ConnectionLost):
        oversized.recv_frame()
    truncated = _authenticated(server)
    truncated.send([pack({"op": "get", "model": MODEL, "keys": [str(key(0))]})[:-3]])
    truncated.close()
    garbage = _authenticated(server)
    garbage.send([struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1"])  # not msgpack
    with pytest.raises(ConnectionLost):
        garbage.recv_frame()
    _wait_until(lambda: server.bulk.stats()["connections"] == 0)
    link = server.link()  # the server serves on
    try:
        assert _get(link, [str(key(0))]) == [None]
    finally:
        link.close()


def test_a_damaged_put_is_refused_stores_nothing_and_keeps_the_stream_in_step(
    server: Server,
) -> None:
    stream = _authenticated(server)
    k, layout, data, _parent = item(20)
    stream.send_frame(
        {"op": "put", "model": MODEL, "items": [{"key": k, "layout": layout.to_dict()}]}
    )
    stream.send_payload(data)
    stream.send_checksum(12345)  # not the checksum of those bytes
    with pytest.raises(CorruptValueError):
        _raise(stream.recv_frame())
    assert not server.store.contains(k) and server.held() == (0, 0)
    stream.send_frame({"op": "get", "model": MODEL, "keys": [k]})
    assert stream.recv_frame() == {"miss": True}


def test_a_batch_with_one_damaged_value_stores_none_of_it(server: Server) -> None:
    """The checksum of each payload rides in front of the next one: a wrong one in the
    middle of a batch fails the whole batch, and the stream stays in step."""
    stream = _authenticated(server)
    (k0, layout0, data0, _), (k1, layout1, data1, _) = item(21), item(22)
    stream.send_frame(
        {
            "op": "put",
            "model": MODEL,
            "items": [
                {"key": k0, "layout": layout0.to_dict()},
                {"key": k1, "layout": layout1.to_dict()},
            ],
        }
    )
    stream.send([data0])
    stream.send_checksum(12345)  # not the checksum of the first value's bytes
    stream.send_checksum(stream.send_payload(data1))
    with pytest.raises(CorruptValueError):
        _raise(stream.recv_frame())
    assert not server.store.contains(k0) and not server.store.contains(k1)
    assert server.held() == (0, 0)
    stream.send_payloads(
        {"op": "put", "model": MODEL, "items": [{"key": k1, "layout": layout1.to_dict()}]},
        [data1],
    )
    assert [r["stored"] for r in stream.recv_frame()["results"]] == [True]


def test_refused_requests_keep_the_connection_usable(server: Server) -> None:
    link = server.link()
    try:
        with pytest.raises(AccessDeniedError):  # its payload is read and dropped
            asyncio.run(link.put(OTHER_MODEL, "KV_2LTD", [item(1)]))
        asyncio.run(link.put(MODEL, "KV_2LTD", [item(1)]))
        with pytest.raises(InvalidValueError):  # a destination of the wrong size
            asyncio.run(link.get(MODEL, [str(key(1))], None, [memoryview(bytearray(10))], None))
        assert torch.equal(_get(link, [str(key(1))])[0], value(1))  # type: ignore[arg-type]
        assert link.opened == 1 and link.lost == 0  # all on one connection
    finally:
        link.close()


def test_ending_the_session_closes_its_data_connections(server: Server) -> None:
    info = server.session()
    endpoint = Endpoint.from_hello(info["bulk"], "127.0.0.1:1", False)
    assert endpoint is not None
    link = BulkLink(endpoint, streams=1, timeout_s=5.0)
    try:
        assert _get(link, [str(key(1))]) == [None]
        server.handler.answer(make_request("bye", sid=str(info["sid"])))
        _wait_until(lambda: server.bulk.stats()["connections"] == 0)
        with pytest.raises((ConnectionLost, Refused)):
            _get(link, [str(key(1))])
        with pytest.raises(Refused):  # the credential died with the session
            _get(link, [str(key(1))])
    finally:
        link.close()


def test_a_sealed_server_refuses_plain_connections(tmp_path: Path) -> None:
    for srv in _server(tmp_path / "sealed", 16 << 20, sealed=True):
        told = srv.endpoint()
        assert told.sealed  # a client follows the server's mode; one that does not:
        plain = BulkLink(
            Endpoint(told.host, told.port, told.key_id, told.secret, False), streams=1, timeout_s=5
        )
        try:
            with pytest.raises(Refused):
                _get(plain, [str(key(1))])
        finally:
            plain.close()
        info = srv.session()["bulk"]
        assert isinstance(info, dict) and info["sealed"] is True
        sealed = BulkLink(Endpoint.from_hello(info, "127.0.0.1:1", False), streams=1, timeout_s=5)  # type: ignore[arg-type]
        try:
            assert _get(sealed, [str(key(1))]) == [None]
        finally:
            sealed.close()
