"""The data path's one codec (:mod:`persisting.service.bulk.frames`) and the socket steps
both sides drive it with (:mod:`persisting.service.bulk.stream`): the same bytes decoded
the same way by the server's blocking connection and the client's event-loop one."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import msgpack
import pytest
import xxhash

from persisting.errors import CapacityError, ProtocolError
from persisting.service.bulk.conn import Conn
from persisting.service.bulk.frames import (
    CHECKSUM,
    MAX_FRAME_BYTES,
    WIRE_PIECE,
    ConnectionLost,
    Reader,
    error_frame,
    pack,
    raise_error,
    read_checksum,
    read_frame,
    read_payload,
    skip,
    write_put,
)
from persisting.service.client.link import LoopConn

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")


def feed(reader: Reader[T], data: bytes) -> tuple[T, int]:
    """Drive ``reader`` from ``data`` with no socket: what it decoded, bytes it took."""
    taken = 0
    while True:
        try:
            view = next(reader)
        except StopIteration as done:
            return done.value, taken
        if taken + len(view) > len(data):
            raise EOFError
        view[:] = data[taken : taken + len(view)]
        taken += len(view)


def written(message: dict[str, Any], payloads: list[memoryview]) -> bytes:
    return b"".join(bytes(part) for parts in write_put(message, payloads) for part in parts)


def test_a_put_stream_round_trips_through_the_readers_bit_exact() -> None:
    message = {"op": "put", "model": "m", "items": [{"key": "k", "parent": None}]}
    payloads = [memoryview(bytes(range(256)) * (WIRE_PIECE // 128 + 3)), memoryview(b"x")]
    stream = written(message, payloads)
    frame, at = feed(read_frame(), stream)
    assert frame == message
    for payload in payloads:
        out = bytearray(len(payload))
        digest, n = feed(read_payload(memoryview(out)), stream[at:])
        claimed, m = feed(read_checksum(), stream[at + n :])
        at += n + m
        assert out == payload and digest == claimed == xxhash.xxh3_64_intdigest(payload)
    assert at == len(stream)
    scratch = memoryview(bytearray(7))
    assert feed(skip(len(stream), scratch), stream) == (None, len(stream))


def test_the_wire_format_is_a_u32_length_and_a_msgpack_map() -> None:
    message = {"id": b"\1" * 16, "secret": b"\2" * 32}
    body = msgpack.packb(message, use_bin_type=True)
    assert pack(message) == struct.pack("<I", len(body)) + body
    assert written({"op": "put"}, [memoryview(b"ab")]) == (
        pack({"op": "put"}) + b"ab" + CHECKSUM.pack(xxhash.xxh3_64_intdigest(b"ab"))
    )


def test_a_truncated_frame_is_not_decoded() -> None:
    with pytest.raises(EOFError):
        feed(read_frame(), pack({"op": "get", "keys": ["k"]})[:-3])


def framed(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    "raw",
    [
        struct.pack("<I", MAX_FRAME_BYTES + 1),  # oversized length: refused before its body
        framed(b"\xc1\xc1\xc1\xc1\xc1"),  # not msgpack
        framed(msgpack.packb([1, 2])),  # a list, not a map
        framed(msgpack.packb({"a": msgpack.ExtType(1, b"x")})),  # not a plain value
        framed(msgpack.packb({1: "a"})),  # a key that is not a string
    ],
)
def test_bad_frames_are_connection_lost(raw: bytes) -> None:
    with pytest.raises(ConnectionLost):
        feed(read_frame(), raw)


def test_an_oversized_frame_is_refused_to_its_sender_and_errors_keep_their_type() -> None:
    with pytest.raises(ProtocolError):
        pack({"keys": ["k" * 1024] * (MAX_FRAME_BYTES // 1024)})
    frame, _ = feed(read_frame(), pack(error_frame(CapacityError("full"))))
    with pytest.raises(CapacityError, match="full"):
        raise_error(frame)
    raise_error({"ok": True})


@pytest.fixture(params=["unix", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    if request.param == "unix":
        a, b = socket.socketpair()
    else:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            a = socket.create_connection(listener.getsockname())
            b, _ = listener.accept()
    with a, b:
        yield a, b


def test_server_and_client_connections_decode_the_same_stream(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The client sends a put's stream and reads a frame; the server reads the put and
    answers, each driving the same codec with its own waits."""
    client_sock, server_sock = pair
    kind = "unix" if client_sock.family == socket.AF_UNIX else "tcp"
    payload = memoryview(bytes(range(256)) * (3 * WIRE_PIECE // 256 + 1))
    server = Conn(server_sock, kind)

    async def client() -> dict[str, Any]:
        conn = LoopConn(client_sock, kind, timeout_s=10)
        await conn.send_put({"op": "put"}, [payload])
        return await conn.recv_frame()

    async def both() -> dict[str, Any]:
        task = asyncio.create_task(client())

        def serve() -> None:
            deadline = time.monotonic() + 10
            frame = server.recv_frame(deadline)
            out = bytearray(len(payload))
            digest = server.recv_payload(memoryview(out), deadline)
            checksum = server.recv_checksum(deadline)
            assert frame == {"op": "put"}
            assert digest == checksum and out == payload
            server.send_frame({"results": [digest]}, deadline)

        await asyncio.to_thread(serve)
        return await task

    reply = asyncio.run(both())
    assert reply == {"results": [xxhash.xxh3_64_intdigest(payload)]}


def test_a_frame_cut_short_by_the_peer_is_connection_lost_on_both_sides(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    kind = "unix" if a.family == socket.AF_UNIX else "tcp"
    a.sendall(pack({"op": "get"})[:-2])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionLost, match="closed"):
        Conn(b, kind).recv_frame(time.monotonic() + 10)
    b.sendall(pack({"ok": True})[:3])
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionLost, match="closed"):
        asyncio.run(LoopConn(a, kind, timeout_s=10).recv_frame())


def test_a_silent_peer_times_out_on_both_sides(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    kind = "unix" if a.family == socket.AF_UNIX else "tcp"
    a.sendall(pack({"op": "get"})[:2])
    with pytest.raises(ConnectionLost) as server_side:
        Conn(b, kind).recv_frame(time.monotonic())
    assert server_side.value.timed_out
    with pytest.raises(ConnectionLost) as client_side:
        asyncio.run(LoopConn(a, kind, timeout_s=0.01).recv_frame())
    assert client_side.value.timed_out
