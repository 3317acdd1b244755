"""The data path in one process: a real store, the control handler, the data path's server
(TCP on loopback and its Unix socket) and a client's links -- no Pulsing, so the loop runs
in seconds. Other hosts (TLS) are ``test_remote_hosts.py``; whole processes,
``test_data_path_processes.py``.

Failures are driven through a small TCP relay between the two (it cuts, stalls or
trickles a direction after a given number of bytes), or by speaking to the server
directly with blocking sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from persisting.errors import (
    AccessDeniedError,
    CapacityError,
    CorruptValueError,
    InvalidValueError,
    PersistingError,
)
from persisting.kv import KVStore, Layout, SharedLocation, open_kv_store
from persisting.kv.layout import encode_value
from persisting.service.bulk.frames import CHECKSUM, ConnectionLost, pack, raise_error, unpack
from persisting.service.bulk.server import BulkServer
from persisting.service.client.link import Closed, DataLink, Endpoint, PutItem, Read
from persisting.service.handler import StorageHandler
from persisting.service.protocol import make_request, unwrap_reply
from tests.service.service_helpers import MODEL, OTHER_MODEL, key
from tests.timing import HANG_S, wait_until, wait_until_async

pytestmark = pytest.mark.timeout(120)

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
    readers: ThreadPoolExecutor

    def session(self, client: dict[str, Any] | None = None) -> dict[str, Any]:
        """A fresh session's hello reply (as a client gets it over the control path)."""
        reply = self.handler.answer(make_request("hello", model=MODEL, client=client or {}))
        return dict(unwrap_reply(reply))

    def endpoint(self, port: int | None = None, info: dict[str, Any] | None = None) -> Endpoint:
        endpoint = Endpoint.from_hello((info or self.session())["data"], "127.0.0.1:1")
        assert endpoint is not None
        if port is not None:  # through the relay
            endpoint = Endpoint(endpoint.host, port, None, None, endpoint.key_id, endpoint.secret)
        return endpoint

    def link(self, unix: bool = False, port: int | None = None, timeout_s: float = 5.0) -> DataLink:
        return DataLink(
            self.endpoint(port), unix=unix, streams=2, timeout_s=timeout_s, readers=self.readers
        )

    def staged(self) -> int:
        return self.handler.sessions.staged_bytes


@contextlib.contextmanager
def serving(root: Path, memory_bytes: int, **options: Any) -> Iterator[Server]:
    store = open_kv_store(
        root, MODEL, memory_bytes=memory_bytes, disk_bytes=256 << 20, shared_memory=True
    )
    handler = StorageHandler({MODEL: store}, lease_ttl_s=30.0)
    options.setdefault("io_timeout_s", 5.0)
    bulk = BulkServer(handler.state, "127.0.0.1", 0, **options)
    handler.data = bulk.start()
    readers = ThreadPoolExecutor(2)
    try:
        yield Server(store, handler, bulk, readers)
    finally:
        bulk.close()
        handler.close()
        store.close()
        readers.shutdown()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    with serving(tmp_path / "mem", 64 << 20) as srv:
        yield srv


@pytest.fixture
def disk_server(tmp_path: Path) -> Iterator[Server]:
    with serving(tmp_path / "disk", 0) as srv:
        yield srv


def _get(link: DataLink, keys: list[str], **kw: Any) -> list[Any]:
    reply = asyncio.run(link.get(MODEL, keys, kw.get("expect"), kw.get("outs"), None))
    return [r.value if isinstance(r, Read) else r for r in reply.entries]


class Raw:
    """A data connection driven by hand with a blocking socket."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(30.0)
        self.sock = sock

    @classmethod
    def connect(
        cls,
        server: Server,
        info: dict[str, Any] | None = None,
        unix: bool = False,
        source: str | None = None,
    ) -> Raw:
        """Authenticated with ``info``'s credential (a fresh session's if None), over the
        Unix socket or TCP (from the loopback address ``source`` if given)."""
        endpoint = server.endpoint(info=info)
        if unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(endpoint.unix))
        else:
            bind = (source, 0) if source is not None else None
            sock = socket.create_connection(("127.0.0.1", server.bulk.port), source_address=bind)
        raw = cls(sock)
        raw.send(pack({"id": endpoint.key_id, "secret": endpoint.secret}))
        raise_error(raw.frame())
        return raw

    def send(self, *parts: bytes | memoryview) -> None:
        for part in parts:
            self.sock.sendall(part)

    def recv(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            got = self.sock.recv(n - len(data))
            if not got:
                raise ConnectionLost("closed")
            data += got
        return bytes(data)

    def frame(self) -> dict[str, Any]:
        (length,) = struct.unpack("<I", self.recv(4))
        return unpack(self.recv(length))

    def put(self, items: list[PutItem], checksums: list[int] | None = None) -> dict[str, Any]:
        request = {
            "op": "put",
            "model": MODEL,
            "fmt": "KV_2LTD",
            "items": [{"key": k, "layout": la.to_dict()} for k, la, _d, _p in items],
        }
        self.send(pack(request))
        for n, (_k, _la, data, _p) in enumerate(items):
            digest = xxhash.xxh3_64_intdigest(data) if checksums is None else checksums[n]
            self.send(data, CHECKSUM.pack(digest))
        return self.frame()

    def closed(self, timeout_s: float = 30.0) -> bool:
        """Whether the server closes the connection (reading whatever comes first)."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except OSError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


# -- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_values_round_trip_bit_exact_from_memory_and_disk(
    server: Server, disk_server: Server, unix: bool
) -> None:
    for srv, tier in ((server, "memory"), (disk_server, "disk")):
        link = srv.link(unix=unix)
        try:
            results = asyncio.run(link.put(MODEL, "KV_2LTD", [item(i) for i in range(3)]))
            assert [r["stored"] for r in results] == [True, True, True]
            reply = asyncio.run(link.get(MODEL, [str(key(i)) for i in range(4)], None, None, None))
            assert reply.entries[3] is None  # never stored: a miss
            for i in range(3):
                read = reply.entries[i]
                assert isinstance(read, Read) and read.tier == tier
                assert torch.equal(read.value, value(i))
            out = torch.empty(2, 4, 256, 512, dtype=torch.bfloat16)
            outs = [memoryview(out.view(-1).view(torch.uint8).numpy())]
            assert isinstance(_get(link, [str(key(1))], outs=outs)[0], Layout)
            assert torch.equal(out, value(1))
            other = Layout((2, 4, 256, 256), "bfloat16", "KV_2LTD", CHUNK // 2)
            assert _get(link, [str(key(1))], expect=other) == [None]  # layout mismatch
            assert srv.staged() == 0  # nothing left in flight
            assert link.opened == 1 and link.lost == 0
        finally:
            link.close()


def test_a_same_host_get_is_told_where_pooled_values_lie(server: Server) -> None:
    """Asked ``pool`` on the Unix socket, a get answers where each memory-tier value lies in
    the shared pool instead of sending it, and tells the placements other sessions' puts
    made; a put asked ``pool`` says where its values went."""
    writer, reader = server.link(unix=True), server.link(unix=True)
    try:
        results = asyncio.run(writer.put(MODEL, "KV_2LTD", [item(1), item(2)], pool=True))
        assert all(isinstance(r.get("pool"), list) for r in results)
        reply = asyncio.run(reader.get(MODEL, [str(key(1))], None, None, None, pool=True))
        (entry,) = reply.entries
        assert isinstance(entry, SharedLocation) and entry.layout.nbytes == CHUNK
        assert [k for k, _where in reply.told] == [str(key(2)), str(key(1))]  # newest first
        again = asyncio.run(reader.get(MODEL, [str(key(2))], None, None, None, pool=True))
        assert again.told == []  # each placement is told once
        tcp = server.link()  # not on the Unix socket: the bytes, whatever was asked
        try:
            reply = asyncio.run(tcp.get(MODEL, [str(key(1))], None, None, None, pool=True))
            assert isinstance(reply.entries[0], Read)
        finally:
            tcp.close()
    finally:
        writer.close()
        reader.close()


def test_refused_requests_keep_the_connection_usable(server: Server) -> None:
    link = server.link()
    try:
        with pytest.raises(AccessDeniedError):  # its payload is read and dropped
            asyncio.run(link.put(OTHER_MODEL, "KV_2LTD", [item(1)]))
        layout, data = encode_value(value(2).float(), "KV_2LTD")  # float32 under a bf16 key
        with pytest.raises(InvalidValueError, match="a float value under key"):
            asyncio.run(link.put(MODEL, "KV_2LTD", [(str(key(2)), layout, data, None)]))
        assert not server.store.contains(key(2))
        asyncio.run(link.put(MODEL, "KV_2LTD", [item(1)]))
        with pytest.raises(InvalidValueError):  # a destination of the wrong size
            asyncio.run(link.get(MODEL, [str(key(1))], None, [memoryview(bytearray(10))], None))
        assert torch.equal(_get(link, [str(key(1))])[0], value(1))
        assert link.opened == 1 and link.lost == 0  # all on one connection
    finally:
        link.close()


def test_a_damaged_put_is_refused_stores_nothing_and_keeps_the_stream_in_step(
    server: Server,
) -> None:
    raw = Raw.connect(server)
    with pytest.raises(CorruptValueError):
        raise_error(raw.put([item(20)], checksums=[12345]))
    assert not server.store.contains(key(20)) and server.staged() == 0
    # a batch with one damaged value in the middle stores none of it
    with pytest.raises(CorruptValueError):
        raise_error(
            raw.put([item(21), item(22)], checksums=[1, xxhash.xxh3_64_intdigest(item(22)[2])])
        )
    assert not server.store.contains(key(21)) and not server.store.contains(key(22))
    assert [r["stored"] for r in raw.put([item(22)])["results"]] == [True]  # in step
    raw.close()


def test_frames_too_large_or_cut_short_end_only_their_connection(server: Server) -> None:
    oversized = Raw.connect(server)
    oversized.send(struct.pack("<I", (64 << 20) + 1))
    assert oversized.closed()
    truncated = Raw.connect(server)
    truncated.send(pack({"op": "get", "model": MODEL, "keys": [str(key(0))]})[:-3])
    truncated.close()
    garbage = Raw.connect(server)
    garbage.send(struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1")  # not msgpack
    assert garbage.closed()
    unknown = Raw.connect(server)
    unknown.send(pack({"op": "drop-everything"}))
    assert unknown.frame()["error"]["code"] == "protocol" and unknown.closed()
    wait_until(lambda: server.bulk.stats()["connections"] == 0, "connections closed")
    link = server.link()  # the server serves on
    try:
        assert _get(link, [str(key(0))]) == [None]
    finally:
        link.close()


def test_ending_the_session_closes_its_data_connections(server: Server) -> None:
    info = server.session()
    link = DataLink(
        server.endpoint(info=info), unix=False, streams=1, timeout_s=5.0, readers=server.readers
    )
    try:
        assert _get(link, [str(key(1))]) == [None]
        server.handler.answer(make_request("bye", sid=str(info["sid"])))
        wait_until(lambda: server.bulk.stats()["connections"] == 0, "connections closed")
        with pytest.raises((ConnectionLost, Closed)):
            _get(link, [str(key(1))])
        with pytest.raises(Closed):  # the credential died with the session
            _get(link, [str(key(1))])
    finally:
        link.close()


# -- who may connect, and how many -------------------------------------------------------------


def _nothing_until_closed(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` without sending a byte (a reset counts: it closes
    with the client's bytes unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_an_unauthenticated_peer_gets_no_byte_and_holds_nothing_for_long(tmp_path: Path) -> None:
    with serving(tmp_path, 16 << 20, handshake_s=1.0) as srv:
        forged = pack({"id": b"\1" * 16, "secret": b"\2" * 32})
        real = srv.endpoint()
        stolen = pack({"id": real.key_id, "secret": b"\0" * 32})  # the id without the secret
        for first in (b"x" * 80, forged, stolen, b"GET / HTTP/1.0\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", srv.bulk.port), timeout=10) as sock:
                sock.sendall(first)
                assert _nothing_until_closed(sock)
        with socket.create_connection(("127.0.0.1", srv.bulk.port), timeout=30) as sock:
            assert _nothing_until_closed(sock)  # silence: closed at the deadline
        wait_until(lambda: srv.bulk.stats()["pending"] == 0, "0 pending")
        figures = srv.bulk.stats()
        assert figures["refused_handshake"] + figures["refused_credential"] == 5
        assert figures["connections"] == 0


def test_the_handshake_deadline_holds_however_slowly_bytes_come(tmp_path: Path) -> None:
    """A peer that sends one byte of its credential frame now and then (never pausing long)
    is cut at the deadline of the whole handshake, not kept for as long as it trickles."""
    with serving(tmp_path, 16 << 20, handshake_s=1.0) as srv:
        frame = pack({"id": srv.endpoint().key_id, "secret": b"\0" * 32})
        with socket.create_connection(("127.0.0.1", srv.bulk.port), timeout=30) as sock:
            cut = False
            for byte in frame:  # a byte every 0.2 s: ~12 s for the whole frame
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.2)  # real duration: the trickle is the case tested
                    ready, _, _ = select.select([sock], [], [], 0)
                    cut = bool(ready) and sock.recv(1) == b""
                except OSError:  # reset: closed with our bytes unread
                    cut = True
                if cut:
                    break
            assert cut, "a trickling handshake was never cut"
        assert srv.bulk.stats()["refused_handshake"] == 1


def _from(source: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def test_pending_connections_are_capped_per_source_and_in_all(tmp_path: Path) -> None:
    with serving(
        tmp_path, 16 << 20, handshake_s=30.0, max_pending=4, max_pending_per_source=2
    ) as srv:
        port = srv.bulk.port
        held = [_from("127.0.0.1", port) for _ in range(2)]
        wait_until(lambda: srv.bulk.stats()["pending"] == 2, "2 pending")
        with _from("127.0.0.1", port) as extra:  # a third from that address: closed unread
            extra.settimeout(10)
            assert extra.recv(10) == b""
        held += [_from("127.0.0.2", port) for _ in range(2)]  # another address still gets in
        wait_until(lambda: srv.bulk.stats()["pending"] == 4, "4 pending")
        with _from("127.0.0.3", port) as extra:  # over the cap of all
            extra.settimeout(10)
            assert extra.recv(10) == b""
        assert srv.bulk.stats()["refused_pending"] == 2
        for sock in held:
            sock.close()
        wait_until(lambda: srv.bulk.stats()["pending"] == 0, "0 pending")
        link = srv.link()
        try:
            assert _get(link, [str(key(0))]) == [None]
        finally:
            link.close()


def test_connections_are_capped_per_session_per_client_process_and_per_server(
    tmp_path: Path,
) -> None:
    """The caps count what the server verifies: the session's credential, the Unix peer's
    pid as the kernel reports it, the TCP peer's address. Sessions whose ``hello`` names
    other pids (what any client may write there) share their process's and their address's
    slots; another address still gets in."""
    options = {"max_per_session": 2, "max_per_client": 3, "max_per_address": 3}
    with serving(tmp_path, 16 << 20, max_connections=7, **options) as srv:
        a, b, c = (srv.session({"host": "h", "pid": pid}) for pid in (1, 2, 3))
        held = [Raw.connect(srv, a, unix=True), Raw.connect(srv, a, unix=True)]
        with pytest.raises(CapacityError, match="a session holds at most 2"):
            Raw.connect(srv, a, unix=True)
        held.append(Raw.connect(srv, b, unix=True))
        with pytest.raises(CapacityError, match="a client process holds at most 3"):
            Raw.connect(srv, c, unix=True)  # this process, whatever its hello said
        held.append(Raw.connect(srv, c))  # over TCP: counted by its address
        held += [Raw.connect(srv, srv.session({"pid": pid})) for pid in (4, 5)]
        with pytest.raises(CapacityError, match="an address holds at most 3"):
            Raw.connect(srv, srv.session({"pid": 6}))  # 127.0.0.1 again
        held.append(Raw.connect(srv, srv.session({"pid": 7}), source="127.0.0.2"))
        with pytest.raises(CapacityError, match="the server holds at most 7"):
            Raw.connect(srv, srv.session({"pid": 8}), source="127.0.0.3")
        assert srv.bulk.stats()["refused_cap"] == 4
        for raw in held:
            raw.close()
        wait_until(lambda: srv.bulk.stats()["connections"] == 0, "connections closed")
        Raw.connect(srv, srv.session({"pid": 9}), unix=True).close()


def test_sessions_naming_other_pids_cannot_fill_the_server(tmp_path: Path) -> None:
    """Issue 47, finding 10: one authenticated process opening sessions that each name
    another pid in ``hello`` held every slot, and a new client was refused. Now it holds
    at most its process's share on the Unix socket and its address's over TCP."""
    with serving(tmp_path, 16 << 20, max_connections=16, max_per_client=4) as srv:
        taken: list[Raw] = []
        for pid in range(100, 116):
            for unix in (True, False):
                with contextlib.suppress(CapacityError):
                    taken.append(Raw.connect(srv, srv.session({"pid": pid}), unix=unix))
        assert len(taken) == 4 + 8  # its process's slots and its address's (half)
        newcomer = Raw.connect(srv, srv.session({"pid": 999}), source="127.0.0.2")
        newcomer.close()
        for raw in taken:
            raw.close()


def test_a_client_of_a_busy_server_sees_its_connections_closed_not_its_credential_refused(
    tmp_path: Path,
) -> None:
    """A new connection closed before it is authenticated is :class:`Closed` (the caller
    then asks the control path whether the session lives), never taken for a refusal."""
    with serving(tmp_path, 16 << 20, handshake_s=30.0, max_pending_per_source=1) as srv:
        squatter = _from("127.0.0.1", srv.bulk.port)
        wait_until(lambda: srv.bulk.stats()["pending"] == 1, "1 pending")
        link = srv.link()
        try:
            with pytest.raises(Closed):
                _get(link, [str(key(0))])
            squatter.close()
            wait_until(lambda: srv.bulk.stats()["pending"] == 0, "0 pending")
            assert _get(link, [str(key(0))]) == [None]  # served once a slot is free
        finally:
            link.close()


# -- deadlines ----------------------------------------------------------------------------------


def test_a_reader_that_reads_slowly_or_not_at_all_is_dropped_by_the_deadline(
    tmp_path: Path,
) -> None:
    """Each value of a reply must be taken within ``io_timeout_s`` (2 s here) of its first
    byte: a reader that takes a little now and then does not restart the clock."""
    with serving(tmp_path, 64 << 20, io_timeout_s=2.0) as srv:
        setup = srv.link()
        asyncio.run(setup.put(MODEL, "KV_2LTD", [item(i) for i in range(8)]))
        setup.close()
        keys = [str(key(i)) for i in range(8)]
        silent = Raw.connect(srv)
        silent.send(pack({"op": "get", "model": MODEL, "keys": keys}))
        slow = Raw.connect(srv)
        slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        slow.send(pack({"op": "get", "model": MODEL, "keys": keys}))
        taken, ended = 0, False
        for _ in range(int(HANG_S / 0.2)):  # 64 KiB every 0.2 s: 320 KB/s
            try:
                got = slow.sock.recv(64 << 10)
            except OSError:
                got = b""
            if not got:
                ended = True
                break
            taken += len(got)
            time.sleep(0.2)  # real duration: a slow reader is the case tested
        assert ended and taken < 8 * CHUNK  # dropped mid-reply
        wait_until(lambda: srv.bulk.stats()["connections"] == 0, "connections closed")
        assert silent.closed(timeout_s=30)


def test_stalled_readers_on_the_unix_socket_do_not_stop_another_clients_puts(
    server: Server,
) -> None:
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(i) for i in range(8)]))
    setup.close()
    stalled = []
    for i in range(8):  # each asks for 2 MiB and reads nothing
        raw = Raw.connect(server, unix=True)
        raw.send(pack({"op": "get", "model": MODEL, "keys": [str(key(i))]}))
        stalled.append(raw)
    other = server.link(unix=True, timeout_s=30.0)
    try:
        for i in range(10, 14):
            results = asyncio.run(other.put(MODEL, "KV_2LTD", [item(i)]))
            assert results[0]["stored"]
        assert torch.equal(_get(other, [str(key(12))])[0], value(12))
    finally:
        other.close()
    # and each stalled one is closed by the deadline (5 s here), not waited for
    wait_until(lambda: server.bulk.stats()["connections"] == 0, "connections closed")
    for raw in stalled:
        assert raw.closed(timeout_s=30)


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
        #: Set once a stalling relay holds the rest back; ``closing``: once it is closed.
        self.stalled, self.closing = threading.Event(), threading.Event()
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
                            time.sleep(0.0002)  # real duration: a trickle, as tested
                    moved += len(data)
                    continue
                if name == self.direction and moved + len(data) > self.after:
                    dst.sendall(data[: max(0, self.after - moved)])
                    if self.action == "stall":
                        self.stalled.set()
                        self.closing.wait(HANG_S)  # holds the rest back until closed
                    break
                dst.sendall(data)
                moved += len(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closing.set()
        self.listener.close()
        for sock in self.sockets:  # shut down first: a pump blocked in recv on it wakes
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _auth_bytes(server: Server) -> int:
    endpoint = server.endpoint()
    return len(pack({"id": endpoint.key_id, "secret": endpoint.secret}))


def _put_request_bytes(items: list[PutItem]) -> int:
    """Bytes of the frame a link's put of ``items`` opens with (as ``DataLink.put`` sends it)."""
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


def test_a_connection_killed_mid_get_is_lost_never_a_partial_value(server: Server) -> None:
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(i) for i in range(2)]))
    setup.close()
    relay = Relay(server.bulk.port, "down", after=CHUNK + CHUNK // 2, action="cut")
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
    wait_until(lambda: server.bulk.stats()["connections"] == 0, "connections closed")
    assert server.staged() == 0


@pytest.mark.parametrize(
    "cut_at",
    [
        "in the first payload's tail",  # all but its last bytes landed
        "in the checksum after the first payload",
        "in the last checksum",  # every payload byte arrived, not the proof they are whole
    ],
)
def test_a_put_cut_anywhere_in_its_stream_stores_nothing_and_leaks_no_staging(
    server: Server, cut_at: str
) -> None:
    items = [item(12), item(13)]
    start = _auth_bytes(server) + _put_request_bytes(items)
    after = {
        "in the first payload's tail": start + CHUNK - 1000,
        "in the checksum after the first payload": start + CHUNK + 4,
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
    wait_until(lambda: server.bulk.stats()["connections"] == 0, "connections closed")
    assert server.staged() == 0
    assert not server.store.contains(key(12)) and not server.store.contains(key(13))
    link = server.link()  # the server serves on, and the same put then goes through
    try:
        assert [r["stored"] for r in asyncio.run(link.put(MODEL, "KV_2LTD", items))] == [True, True]
        got = _get(link, [str(key(12)), str(key(13))])
        assert torch.equal(got[0], value(12)) and torch.equal(got[1], value(13))
    finally:
        link.close()


def test_a_member_that_stalls_mid_transfer_times_out(server: Server) -> None:
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(0)]))
    setup.close()
    relay = Relay(server.bulk.port, "down", after=CHUNK // 2, action="stall")
    link = server.link(port=relay.port, timeout_s=0.5)
    try:
        with pytest.raises(ConnectionLost) as lost:
            asyncio.run(link.get(MODEL, [str(key(0))], None, None, None))
        assert lost.value.timed_out
    finally:
        link.close()
        relay.close()


def test_a_client_that_stalls_mid_put_is_dropped_by_the_server_and_holds_nothing(
    server: Server,
) -> None:
    items = [item(15)]
    after = _auth_bytes(server) + _put_request_bytes(items) + CHUNK // 2
    relay = Relay(server.bulk.port, "up", after=after, action="stall")
    link = server.link(port=relay.port, timeout_s=60.0)
    try:
        with pytest.raises(ConnectionLost):
            asyncio.run(link.put(MODEL, "KV_2LTD", items))  # the server's deadline: 5 s
    finally:
        link.close()
        relay.close()
    wait_until(lambda: server.bulk.stats()["connections"] == 0, "connections closed")
    assert server.staged() == 0 and not server.store.contains(key(15))


@pytest.mark.parametrize("direction", ["up", "down"])
def test_payloads_that_trickle_in_arrive_whole(server: Server, direction: str) -> None:
    """A receiver asks to be woken only once the rest of a piece is queued; it never asks
    for more than it still expects, so bytes that come a few at a time, with pauses, and
    the frames and checksums after them, all arrive."""
    items = [item(16), item(17)]
    relay = Relay(server.bulk.port, direction, after=_auth_bytes(server), action="trickle")
    link = server.link(port=relay.port)
    try:
        assert [r["stored"] for r in asyncio.run(link.put(MODEL, "KV_2LTD", items))] == [True, True]
        got = _get(link, [str(key(16)), str(key(17))])
        assert torch.equal(got[0], value(16)) and torch.equal(got[1], value(17))
    finally:
        link.close()
        relay.close()


def test_a_get_cancelled_mid_transfer_closes_its_connection_and_writes_no_more(
    server: Server,
) -> None:
    setup = server.link()
    asyncio.run(setup.put(MODEL, "KV_2LTD", [item(0)]))
    setup.close()
    relay = Relay(server.bulk.port, "down", after=CHUNK // 2, action="stall")
    link = server.link(port=relay.port, timeout_s=30.0)
    out = np.zeros(CHUNK, np.uint8)

    async def cancel_mid_transfer() -> None:
        task = asyncio.ensure_future(link.get(MODEL, [str(key(0))], None, [out.data], None))
        await asyncio.to_thread(relay.stalled.wait, HANG_S)  # it holds the rest back
        await wait_until_async(lambda: np.count_nonzero(out) > 0, "part of the value read")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(cancel_mid_transfer())
        written = out.copy()
        assert 0 < np.count_nonzero(written) < CHUNK  # it was mid-transfer
        assert link.lost == 0  # closed, and not counted as a failure
    finally:
        link.close()
        relay.close()
    time.sleep(0.3)  # real duration: a late write into the buffer would land within it
    assert np.array_equal(out, written)  # nothing wrote into the buffer after the cancel
    fresh = server.link()
    try:
        assert torch.equal(_get(fresh, [str(key(0))])[0], value(0))
    finally:
        fresh.close()


def test_a_session_cannot_take_the_servers_room_for_puts_in_flight(tmp_path: Path) -> None:
    store = open_kv_store(tmp_path, MODEL, memory_bytes=64 << 20, disk_bytes=256 << 20)
    handler = StorageHandler(
        {MODEL: store}, max_staged_bytes=3 * CHUNK, max_session_staged_bytes=2 * CHUNK
    )
    bulk = BulkServer(handler.state, "127.0.0.1", 0, io_timeout_s=5.0)
    handler.data = bulk.start()
    try:
        srv = Server(store, handler, bulk, ThreadPoolExecutor(1))
        raw = Raw.connect(srv)
        with pytest.raises(CapacityError, match="a session's bound"):
            raise_error(raw.put([item(i) for i in range(3)]))
        assert [r["stored"] for r in raw.put([item(0), item(1)])["results"]] == [True, True]
        assert srv.staged() == 0
        raw.close()
    finally:
        bulk.close()
        handler.close()
        store.close()


def test_a_server_that_never_answers_times_out_and_one_that_closes_is_closed() -> None:
    quiet = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = quiet.accept()
                accepted.append(conn)
                if len(accepted) > 1:
                    conn.recv(100)
                    conn.close()  # the second one: read and closed, as for a lost session

    threading.Thread(target=accept, daemon=True).start()
    endpoint = Endpoint("127.0.0.1", int(quiet.getsockname()[1]), None, None, b"k", b"s")
    link = DataLink(endpoint, unix=False, streams=1, timeout_s=0.5, readers=ThreadPoolExecutor(1))
    try:
        with pytest.raises(ConnectionLost) as lost:
            asyncio.run(link.get(MODEL, [str(key(0))], None, None, None))
        assert lost.value.timed_out
        with pytest.raises(Closed):
            asyncio.run(link.get(MODEL, [str(key(0))], None, None, None))
    finally:
        link.close()
        quiet.close()
        for conn in accepted:
            conn.close()


def test_errors_of_the_data_path_are_the_stores_own_types(server: Server) -> None:
    raw = Raw.connect(server)
    raw.send(pack({"op": "get", "model": "no/such-model", "keys": [str(key(0))]}))
    with pytest.raises(AccessDeniedError):
        raise_error(raw.frame())
    raw.send(pack({"op": "get", "model": MODEL, "keys": [1, 2]}))
    with pytest.raises(PersistingError):
        raise_error(raw.frame())
    raw.close()
