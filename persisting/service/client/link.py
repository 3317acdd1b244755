"""A client's data connections to one member, and its gets and puts over them.

:class:`DataLink` keeps up to ``streams`` connections to the member's data path (the Unix
socket on the member's host, else TCP, with TLS when the member sent a certificate and
the address is not loopback), opened on first use and authenticated with the session's
credential; each request runs on one of them, on the caller's event loop, in the frames
of :mod:`persisting.service.bulk.frames`. A value's bytes are received straight into its
destination and hashed as they land; a value is returned only once all its bytes arrived
and matched the checksum the server stored with it (else it is a miss).

Why the event loop and not a blocking socket on a helper thread: a request would then
cross two threads, each hand-off a wake-up, and on a machine with few cores the scheduler
can wake the helper on the core where the peer is busy sending.

What can go wrong, and what the caller makes of it:

* :class:`Unreachable` -- no connection could be made: the member is down;
* :class:`Closed` -- the server closed a new connection before authenticating it: it is
  busy (its pending slots are full) or no longer knows the session;
* :class:`~persisting.errors.CapacityError` -- the server holds all the connections this
  session, this process or the server may;
* :class:`~persisting.service.bulk.frames.ConnectionLost` -- a connection ended, stalled
  past the timeout (``timed_out``) or carried garbage mid-request: what it was carrying
  is lost, never half-delivered;
* another :class:`~persisting.errors.PersistingError` -- the server answered with it.

A request cancelled by its caller stops writing into the destination at once; its
connection, out of step, is closed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import xxhash

from persisting.errors import InvalidValueError, PersistingError
from persisting.kv import Layout, SharedLocation
from persisting.kv.disk.range_reads import READ_PIECE
from persisting.service.bulk.frames import (
    ConnectionLost,
    Reader,
    pack,
    placements,
    pool_location,
    raise_error,
    read_frame,
    read_payload,
    skip,
    value_header,
    write_put,
)
from persisting.service.bulk.server import is_loopback
from persisting.service.bulk.stream import READ, Stream, outgoing
from persisting.service.bulk.tls import check_pinned, client_context
from persisting.service.client.destination import Destination
from persisting.shm import RecycledBuffers

T = TypeVar("T")


class Unreachable(Exception):
    """No data connection to the member could be made."""


class Closed(Exception):
    """The member closed a new data connection before authenticating it."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how to open data connections to a member (from its ``hello``)."""

    host: str
    port: int
    unix: str | None
    cert: str | None
    key_id: bytes
    secret: bytes

    @classmethod
    def from_hello(cls, info: Any, member_addr: str) -> Endpoint | None:
        """The endpoint a ``hello`` reply names (None when it names none). A server bound
        to every address is reached at the address its member is known by."""
        if not isinstance(info, dict):
            return None
        try:
            host = str(info["host"])
            if host in ("0.0.0.0", "::", ""):
                host = member_addr.rpartition(":")[0].strip("[]")
            cert = info.get("cert")
            unix = info.get("unix")
            return cls(
                host,
                int(info["port"]),
                str(unix) if unix else None,
                str(cert) if cert else None,
                bytes(info["id"]),
                bytes(info["secret"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Read:
    """One value a get read: the value (the layout for ``get_into``; None when its bytes
    failed their checksum), the tier it came from, its size, and the seconds it took."""

    value: Any
    tier: str
    nbytes: int
    seconds: float


@dataclass
class GetReply:
    """Per key a :class:`Read`, where it lies in the member's shared pool (a
    :class:`~persisting.kv.SharedLocation` to copy it from), or None (a miss); and the
    placements told with it (key, location)."""

    entries: list[Read | SharedLocation | None]
    told: list[tuple[str, SharedLocation]] = field(default_factory=list)


#: One put item: key, layout, payload bytes, parent key.
PutItem = tuple[str, Layout, memoryview, "str | None"]


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class LoopConn(Stream):
    """One data connection on the client's event loop: a non-blocking socket (plain TCP,
    TLS or Unix), every wait for it bounded by ``timeout_s``."""

    def __init__(self, sock: socket.socket, kind: str, timeout_s: float):
        super().__init__(sock, kind)
        self.timeout_s = timeout_s
        #: Files passed along with frames (Unix socket), oldest first.
        self.files: list[int] = []

    async def wait(self, reading: bool) -> None:
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        future: asyncio.Future[None] = loop.create_future()
        (loop.add_reader if reading else loop.add_writer)(fd, _wake, future)
        try:
            async with asyncio.timeout(self.timeout_s):
                await future
        except TimeoutError as exc:
            what = "receive" if reading else "send"
            raise ConnectionLost(f"no {what} progress for {self.timeout_s} s", True) from exc
        finally:
            (loop.remove_reader if reading else loop.remove_writer)(fd)

    async def handshake(self, cert: str) -> None:
        """Wrap the socket in TLS 1.3 trusting ``cert`` only, and complete the handshake."""
        self.sock = client_context(cert).wrap_socket(self.sock, do_handshake_on_connect=False)
        self.kind = "tls"
        while want := self.handshake_some():
            await self.wait(want == READ)
        check_pinned(self.sock, cert)

    # -- receiving ----------------------------------------------------------------------

    async def recv_into(self, view: memoryview, files: list[int] | None = None) -> None:
        """Fill ``view`` (all of it, or ConnectionLost); with ``files``, keep any file
        passed along with these bytes there."""
        got, size = 0, len(view)
        while got < size:
            n = self.recv_some(view[got:], files)
            if n > 0:
                got += n
            else:
                await self.wait(n == READ)

    async def decode(self, reader: Reader[T], files: list[int] | None = None) -> T:
        """Fill each view a reader of :mod:`~persisting.service.bulk.frames` asks for;
        what it decoded."""
        while True:
            try:
                view = next(reader)
            except StopIteration as done:
                return done.value
            await self.recv_into(view, files)

    async def recv_frame(self) -> dict[str, Any]:
        """The next frame, keeping any file passed along with it."""
        return await self.decode(read_frame(), self.files)

    async def recv_payload(self, view: memoryview) -> int:
        """Receive a payload into ``view`` (its destination), hashing each piece as it
        lands; returns the checksum of the whole."""
        return await self.decode(read_payload(view))

    async def discard(self, nbytes: int) -> None:
        """Read and drop ``nbytes`` (a payload the caller cannot take)."""
        await self.decode(skip(nbytes, memoryview(bytearray(min(nbytes, 1 << 20)))))

    def take_file(self) -> int:
        if not self.files:
            raise ConnectionLost("a file was announced but not passed")
        return self.files.pop(0)

    # -- sending ------------------------------------------------------------------------

    async def send(self, parts: Sequence[bytes | memoryview]) -> None:
        views = outgoing(parts)
        while views:
            n = self.send_some(views)
            if n < 0:
                await self.wait(n == READ)

    async def send_frame(self, message: dict[str, Any]) -> None:
        await self.send([pack(message)])

    async def send_put(self, message: dict[str, Any], payloads: Sequence[memoryview]) -> None:
        """A put's frame and payloads, each followed by its checksum (:func:`write_put`)."""
        for parts in write_put(message, payloads):
            await self.send(parts)

    def close(self) -> None:
        for fd in self.files:
            os.close(fd)
        self.files.clear()
        super().close()


class DataLink:
    """Data connections of one client to one member (see the module docstring)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        unix: bool,
        streams: int,
        timeout_s: float,
        readers: Executor,
    ):
        self.endpoint = endpoint
        #: Over the member's Unix socket (same host), else TCP.
        self.unix = unix
        self.streams = streams
        self.timeout_s = timeout_s
        self._readers = readers
        self._slots = asyncio.Semaphore(streams)
        self._idle: list[LoopConn] = []
        self._closed = False
        #: Connections opened, and lost mid-request (read by the client's counters).
        self.opened = 0
        self.lost = 0

    @property
    def path(self) -> str:
        """The bandwidth name of this link's reads ("local" or "remote")."""
        return "local" if self.unix else "remote"

    # -- connections --------------------------------------------------------------------

    async def _connect(self) -> LoopConn:
        e = self.endpoint
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.unix:
                    assert e.unix is not None
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    address: Any = e.unix
                else:
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
            raise Unreachable(f"{e.unix if self.unix else f'{e.host}:{e.port}'}: {exc}") from exc
        conn = LoopConn(sock, "unix" if self.unix else "tcp", self.timeout_s)
        try:
            if not self.unix:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if e.cert is not None and not is_loopback(e.host):
                    await conn.handshake(e.cert)
            await conn.send_frame({"id": e.key_id, "secret": e.secret})
            answer = await conn.recv_frame()
        except ConnectionLost as exc:
            conn.close()
            if exc.timed_out:  # no answer at all: a member that hangs
                raise
            raise Closed(str(exc)) from exc
        except BaseException:
            conn.close()
            raise
        try:
            raise_error(answer)
        except PersistingError:
            conn.close()
            raise
        self.opened += 1
        return conn

    async def _request(self, work: Callable[[LoopConn], Awaitable[T]]) -> T:
        """Run ``work(conn)`` on one connection: given back when the request ended in
        step (a value, or an error the server answered), else closed."""
        async with self._slots:
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                result = await work(conn)
            except ConnectionLost:
                self._lose(conn, counted=True)
                raise
            except PersistingError:
                self._give_back(conn)  # the server's answer: the connection is in step
                raise
            except BaseException:  # cancelled, or a bug: the connection is out of step
                self._lose(conn, counted=False)
                raise
            self._give_back(conn)
            return result

    def _give_back(self, conn: LoopConn) -> None:
        if self._closed:
            conn.close()
        else:
            self._idle.append(conn)

    def _lose(self, conn: LoopConn, counted: bool) -> None:
        """Close a connection that stopped mid-request; after a failure (``counted``) the
        idle ones too: whatever ended it most likely ended them."""
        conn.close()
        if not counted:
            return
        self.lost += 1
        idle, self._idle = self._idle, []
        for other in idle:
            other.close()

    def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- operations ---------------------------------------------------------------------

    async def get(
        self,
        model: str,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: RecycledBuffers | None,
        *,
        pool: bool = False,
    ) -> GetReply:
        """The values of ``keys`` over one connection; with ``pool``, where the ones in the
        member's shared pool lie instead, and the placements the member tells."""
        request: dict[str, Any] = {"op": "get", "model": model, "keys": keys}
        if expect is not None:
            request["expect"] = expect.to_dict()
        if pool:
            request["pool"] = request["learn"] = True

        async def work(conn: LoopConn) -> GetReply:
            await conn.send_frame(request)
            reply = GetReply([])
            wrong_size: InvalidValueError | None = None
            start = time.perf_counter()
            for i in range(len(keys)):
                frame = await conn.recv_frame()
                raise_error(frame)
                if frame.get("miss"):
                    reply.entries.append(None)
                    continue
                if "pool" in frame:
                    reply.entries.append(pool_location(frame))
                    continue
                layout, expected, tier = value_header(frame)
                out = outs[i] if outs else None
                if out is not None and len(out) != layout.nbytes:
                    wrong_size = InvalidValueError(
                        f"get_into needs a buffer of {layout.nbytes} bytes, got {len(out)}"
                    )
                    await self._skip(conn, frame, layout)
                    reply.entries.append(None)
                    continue
                dest = Destination(results, layout.nbytes, out)
                if "file" in frame:
                    whole = await self._read_file(conn, frame, dest.target, expected, len(keys))
                else:
                    whole = await conn.recv_payload(dest.target) == expected
                if not whole:
                    dest.discard()
                now = time.perf_counter()
                value = dest.value(layout) if whole else None
                reply.entries.append(Read(value, tier, layout.nbytes, now - start))
                start = now
            if pool:
                reply.told = placements(await conn.recv_frame())
            if wrong_size is not None:
                raise wrong_size
            return reply

        return await self._request(work)

    async def _read_file(
        self, conn: LoopConn, frame: dict[str, Any], target: memoryview, digest: int, batch: int
    ) -> bool:
        """Read a value from the payload file passed along with ``frame`` (the Unix socket)
        into ``target``: whether it matched its checksum. In a batch, on a reader thread
        (several files then read at once); a lone read is faster without the hop."""
        fd = conn.take_file()
        try:
            offset, _nbytes = (int(x) for x in frame["file"])
            if batch > 1:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(
                    self._readers, _read_fd, fd, offset, target, digest
                )
            return _read_fd(fd, offset, target, digest)
        except (TypeError, ValueError, OSError, PersistingError):
            return False
        finally:
            os.close(fd)

    @staticmethod
    async def _skip(conn: LoopConn, frame: dict[str, Any], layout: Layout) -> None:
        if "file" in frame:
            os.close(conn.take_file())
        else:
            await conn.discard(layout.nbytes)

    async def put(
        self,
        model: str,
        fmt: str,
        items: list[PutItem],
        *,
        pool: bool = False,
        checked: bool = True,
    ) -> list[dict[str, Any]]:
        """Store ``items`` over one connection; the server's results (with ``pool``, each
        stored value's place in the member's shared pool; ``checked=False``: the keys'
        dtypes are not checked against the layouts, which the caller owns)."""
        request: dict[str, Any] = {
            "op": "put",
            "model": model,
            "fmt": fmt,
            "items": [
                {"key": key, "layout": layout.to_dict(), "parent": parent}
                for key, layout, _data, parent in items
            ],
        }
        if pool:
            request["pool"] = True
        if not checked:
            request["check_shape"] = False

        async def work(conn: LoopConn) -> dict[str, Any]:
            await conn.send_put(request, [data for _key, _layout, data, _parent in items])
            return await conn.recv_frame()

        reply = await self._request(work)
        raise_error(reply)
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != len(items):
            raise ConnectionLost("a put reply without one result per item")
        return results


def _read_fd(fd: int, offset: int, target: memoryview, digest: int) -> bool:
    """Read ``target`` from the file ``fd`` at ``offset``, hashing each piece as it lands;
    whether the whole matched ``digest`` (a file shorter than that does not)."""
    hasher = xxhash.xxh3_64()
    done = 0
    while done < len(target):
        piece = target[done : done + READ_PIECE]
        n = os.preadv(fd, [piece], offset + done)
        if n == 0:
            return False
        hasher.update(piece[:n])
        done += n
    return hasher.intdigest() == digest


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
    "Closed",
    "ConnectionLost",
    "DataLink",
    "Endpoint",
    "GetReply",
    "PutItem",
    "Read",
    "Unreachable",
    "spread",
]
