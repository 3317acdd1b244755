"""A client's data connections to one member: the client side of the bulk data path.

:class:`BulkLink` keeps up to ``streams`` connections to the member's data port (opened on
first use, authenticated with the session's credential, see
:mod:`persisting.service.bulk.auth`) and runs each get or put on one of them, on the
caller's event loop (:mod:`persisting.service.bulk.loop_stream`: non-blocking sockets,
received straight into the destination). A batch is spread over several connections at
once by the reader and the writer.

What can go wrong, and what the caller makes of it:

* :class:`Unreachable` -- no connection could be made: the member is down.
* :class:`Refused` -- the server closed a new connection without answering: it does not
  know the session (it restarted, or the session expired). Say ``hello`` again.
* :class:`~persisting.service.bulk.stream.ConnectionLost` -- a connection ended, stalled
  past the timeout (``timed_out``) or carried garbage mid-request: what it was carrying
  is lost, never half-delivered: a value is returned only once all its bytes arrived and
  matched the checksum the server stored with it.
* a :class:`~persisting.errors.PersistingError` -- the server answered with an error.

A get or put cancelled by its caller stops writing into the destination at once; its
connection, out of step, is closed.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from persisting.errors import (
    CapacityError,
    InvalidValueError,
    PersistingError,
    error_class_for,
)
from persisting.kv import Layout
from persisting.service.bulk.auth import OK, PLAIN, SEALED, WELCOME, check_welcome, client_hello
from persisting.service.bulk.auth import stream_keys as derive_keys
from persisting.service.bulk.loop_stream import LoopSealedStream, LoopStream
from persisting.service.bulk.stream import ConnectionLost, tune
from persisting.service.client.destination import Destination
from persisting.shm import RecycledBuffers

T = TypeVar("T")


class Unreachable(Exception):
    """No data connection to the member could be made."""


class Refused(Exception):
    """The member closed a new data connection unanswered (it does not know the session)."""


@dataclass(frozen=True, slots=True)
class BulkRead:
    """One value a get read: the value (the layout for ``get_into``; None when its bytes
    failed their checksum), the tier it came from, its size, and the seconds it took."""

    value: Any
    tier: str
    nbytes: int
    seconds: float


#: One put item: key, layout, payload bytes, parent key.
PutItem = tuple[str, Layout, memoryview, "str | None"]


@dataclass(frozen=True)
class Endpoint:
    """Where and how to open data connections to a member (from its ``hello``)."""

    host: str
    port: int
    key_id: bytes
    secret: bytes
    sealed: bool

    @classmethod
    def from_hello(cls, info: Any, member_addr: str, want_sealed: bool) -> Endpoint | None:
        """The endpoint a ``hello`` reply names (None when it names none). A server bound
        to every address is reached at the address its member is known by."""
        if not isinstance(info, dict):
            return None
        try:
            host = str(info["host"])
            if host in ("0.0.0.0", "::", ""):
                host = member_addr.rpartition(":")[0].strip("[]")
            return cls(
                host,
                int(info["port"]),
                bytes(info["id"]),
                bytes(info["secret"]),
                bool(info.get("sealed")) or want_sealed,
            )
        except (KeyError, TypeError, ValueError):
            return None


class BulkLink:
    """Data connections of one client to one member (see the module docstring)."""

    def __init__(self, endpoint: Endpoint, *, streams: int, timeout_s: float, poll_s: float = 0.0):
        self.endpoint = endpoint
        self.streams = streams
        self.timeout_s = timeout_s
        #: How long a connection polls for bytes before it waits on the loop (see LoopStream).
        self.poll_s = poll_s
        self._idle: list[LoopStream] = []
        self._counter = itertools.count(1)
        self._closed = False
        #: Connections opened, and lost mid-request (read by the client's counters).
        self.opened = 0
        self.lost = 0

    # -- connections ----------------------------------------------------------------------

    async def _connect(self) -> LoopStream:
        e = self.endpoint
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                infos = await loop.getaddrinfo(e.host, e.port, type=socket.SOCK_STREAM)
                family, kind, proto, _name, address = infos[0]
                sock = socket.socket(family, kind, proto)
                try:
                    sock.setblocking(False)
                    await loop.sock_connect(sock, address)
                except BaseException:
                    sock.close()
                    raise
        except (OSError, TimeoutError) as exc:
            raise Unreachable(f"{e.host}:{e.port}: {exc}") from exc
        try:
            tune(sock)
            hello = client_hello(
                e.key_id, e.secret, next(self._counter), SEALED if e.sealed else PLAIN
            )
            stream = LoopStream(sock, self.timeout_s, self.poll_s)
            await stream.send([hello])
            answer = bytearray(WELCOME.size)
            try:
                await stream.recv_into(memoryview(answer))
            except ConnectionLost as exc:
                if exc.timed_out:  # no answer at all: a member that hangs
                    raise
                raise Refused(f"{e.host}:{e.port} refused the session's credential") from exc
            mode, status, server_nonce = check_welcome(e.secret, hello, bytes(answer))
            if status != OK:
                raise CapacityError(f"{e.host}:{e.port} holds all the data connections it may")
        except BaseException:
            sock.close()
            raise
        self.opened += 1
        if mode == SEALED:
            to_server, to_client = derive_keys(e.secret, hello[-32:], server_nonce)
            return LoopSealedStream(
                sock, self.timeout_s, send_key=to_server, recv_key=to_client, poll_s=self.poll_s
            )
        return stream

    async def _take(self) -> LoopStream:
        if self._idle:
            return self._idle.pop()
        return await self._connect()

    def _give_back(self, stream: LoopStream) -> None:
        if self._closed:
            stream.close()
        else:
            self._idle.append(stream)

    def _lose(self, stream: LoopStream, counted: bool) -> None:
        """Close a connection that stopped mid-request; after a failure (``counted``) the
        idle ones too: whatever ended it (the session ended, the member restarted, the
        link went) most likely ended them, and a fresh connection costs one round trip."""
        stream.close()
        if not counted:
            return  # cancelled by the caller: the others are fine
        self.lost += 1
        idle, self._idle = self._idle, []
        for other in idle:
            other.close()

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for stream in idle:
            stream.close()

    async def _request(self, work: Callable[[LoopStream], Awaitable[T]]) -> T:
        """Run ``work(stream)`` on one connection: given back when the request ended in
        step (a value, or an error the server answered), else closed."""
        stream = await self._take()
        try:
            result = await work(stream)
        except ConnectionLost:
            self._lose(stream, counted=True)
            raise
        except PersistingError:
            self._give_back(stream)  # the server's answer: the stream is in step
            raise
        except BaseException:  # cancelled, or a bug: the stream is out of step
            self._lose(stream, counted=False)
            raise
        self._give_back(stream)
        return result

    # -- operations -----------------------------------------------------------------------

    async def get(
        self,
        model: str,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: RecycledBuffers | None,
    ) -> list[BulkRead | None]:
        """Values of ``keys`` over one connection (None: a miss)."""

        async def work(stream: LoopStream) -> list[BulkRead | None]:
            return await self._get(stream, model, keys, expect, outs, results)

        return await self._request(work)

    @staticmethod
    async def _get(
        stream: LoopStream,
        model: str,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: RecycledBuffers | None,
    ) -> list[BulkRead | None]:
        request: dict[str, Any] = {"op": "get", "model": model, "keys": keys}
        if expect is not None:
            request["expect"] = expect.to_dict()
        await stream.send_frame(request)
        reads: list[BulkRead | None] = []
        wrong_size: InvalidValueError | None = None
        start = time.perf_counter()
        for i in range(len(keys)):
            frame = await stream.recv_frame()
            raise_error(frame)
            if frame.get("miss"):
                reads.append(None)
                continue
            try:
                layout = Layout.from_dict(frame["layout"])
                expected = int(frame["checksum"])
                tier = str(frame.get("tier", ""))
            except (KeyError, TypeError, ValueError) as exc:
                raise ConnectionLost(f"unreadable value header: {exc}") from exc
            out = outs[i] if outs else None
            if out is not None and len(out) != layout.nbytes:
                wrong_size = InvalidValueError(
                    f"get_into needs a buffer of {layout.nbytes} bytes, got {len(out)}"
                )
                await stream.discard(layout.nbytes)
                reads.append(None)
                continue
            dest = Destination(results, layout.nbytes, out)
            whole = await stream.recv_payload(dest.target) == expected
            now = time.perf_counter()
            if not whole:
                dest.discard()
            value = dest.value(layout) if whole else None
            reads.append(BulkRead(value, tier, layout.nbytes, now - start))
            start = now
        if wrong_size is not None:
            raise wrong_size
        return reads

    async def put(self, model: str, fmt: str, items: list[PutItem]) -> list[dict[str, Any]]:
        """Store ``items`` over one connection; the server's results."""
        request = {
            "op": "put",
            "model": model,
            "fmt": fmt,
            "items": [
                {"key": key, "layout": layout.to_dict(), "parent": parent}
                for key, layout, _data, parent in items
            ],
        }

        async def work(stream: LoopStream) -> dict[str, Any]:
            await stream.send_payloads(request, [data for _key, _layout, data, _parent in items])
            return await stream.recv_frame()

        reply = await self._request(work)
        raise_error(reply)
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != len(items):
            raise ConnectionLost("a put reply without one result per item")
        return results


def raise_error(frame: dict[str, Any]) -> None:
    """Raise the error a frame carries, as its persisting.errors type."""
    error = frame.get("error")
    if error is None:
        return
    if not isinstance(error, dict):
        raise ConnectionLost("a malformed error frame")
    cls = error_class_for(str(error.get("code", "")))
    raise cls(str(error.get("message", "")))


def spread(count: int, ways: int) -> list[range]:
    """``range(count)`` cut into at most ``ways`` runs of near-equal length."""
    ways = max(1, min(ways, count))
    size, extra = divmod(count, ways)
    runs, start = [], 0
    for w in range(ways):
        end = start + size + (1 if w < extra else 0)
        runs.append(range(start, end))
        start = end
    return runs


__all__ = [
    "BulkLink",
    "BulkRead",
    "ConnectionLost",
    "Endpoint",
    "PutItem",
    "Refused",
    "Unreachable",
    "spread",
]
