"""A client's data connections to one member: the client side of the bulk data path.

:class:`BulkLink` keeps up to ``streams`` connections to the member's data port (opened on
first use, authenticated with the session's credential, see
:mod:`persisting.service.bulk.auth`) and runs each get or put on one of them, on its own
threads (blocking sockets with kernel timeouts; ``recv_into`` the destination itself).
A batch is spread over several connections at once by the reader and the writer.

What can go wrong, and what the caller makes of it:

* :class:`Unreachable` -- no connection could be made: the member is down.
* :class:`Refused` -- the server closed a new connection without answering: it does not
  know the session (it restarted, or the session expired). Say ``hello`` again.
* :class:`~persisting.service.bulk.stream.ConnectionLost` -- a connection ended, stalled
  past the timeout (``timed_out``) or carried garbage mid-request: what it was carrying
  is lost, never half-delivered: a value is returned only once all its bytes arrived and
  matched the checksum the server stored with it.
* a :class:`~persisting.errors.PersistingError` -- the server answered with an error.

A get or put cancelled by its caller shuts its connection down, so the thread stops
writing into the destination before the cancellation goes on (:meth:`BulkLink.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from persisting.errors import CapacityError, InvalidValueError, error_class_for
from persisting.kv import Layout
from persisting.service.bulk.auth import OK, PLAIN, SEALED, WELCOME, check_welcome, client_hello
from persisting.service.bulk.auth import stream_keys as derive_keys
from persisting.service.bulk.stream import (
    ConnectionLost,
    SealedStream,
    Stream,
    set_timeouts,
    tune,
)
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


class Call:
    """A blocking get or put in progress: the event loop can abort it."""

    def __init__(self) -> None:
        self.stream: Stream | None = None
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        if self.stream is not None:
            self.stream.shutdown()  # the thread using it fails fast and closes it


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

    def __init__(self, endpoint: Endpoint, *, streams: int, timeout_s: float):
        self.endpoint = endpoint
        self.streams = streams
        self.timeout_s = timeout_s
        self.executor = ThreadPoolExecutor(streams, thread_name_prefix="kv-client-bulk")
        self._idle: list[Stream] = []
        self._lock = threading.Lock()
        self._counter = itertools.count(1)
        self._closed = False
        #: Connections opened, and lost mid-request (read by the client's counters).
        self.opened = 0
        self.lost = 0

    # -- connections ----------------------------------------------------------------------

    def _connect(self) -> Stream:
        e = self.endpoint
        try:
            sock = socket.create_connection((e.host, e.port), timeout=self.timeout_s)
        except OSError as exc:
            raise Unreachable(f"{e.host}:{e.port}: {exc}") from exc
        try:
            tune(sock)
            set_timeouts(sock, self.timeout_s)
            with self._lock:
                counter = next(self._counter)
            hello = client_hello(e.key_id, e.secret, counter, SEALED if e.sealed else PLAIN)
            stream = Stream(sock)
            stream.send([hello])
            answer = bytearray(WELCOME.size)
            try:
                stream.recv_into(memoryview(answer))
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
            return SealedStream(sock, send_key=to_server, recv_key=to_client)
        return stream

    def _take(self, call: Call) -> Stream:
        with self._lock:
            stream = self._idle.pop() if self._idle else None
        if stream is None:
            stream = self._connect()
        call.stream = stream
        if call.aborted:
            stream.close()
            raise ConnectionLost("cancelled")
        return stream

    def _give_back(self, call: Call, stream: Stream) -> None:
        call.stream = None
        with self._lock:
            if not self._closed and not call.aborted:
                self._idle.append(stream)
                return
        stream.close()

    def _lose(self, call: Call, stream: Stream) -> None:
        """Drop a connection that failed mid-request, and the idle ones with it: whatever
        ended it (the session ended, the member restarted, the link went) most likely
        ended them too, and a fresh connection costs one round trip."""
        call.stream = None
        self.lost += 1
        stream.close()
        with self._lock:
            idle, self._idle = self._idle, []
        for other in idle:
            other.close()

    async def run(self, fn: Callable[[Call], T]) -> T:
        """``fn(call)`` on this link's threads; a cancelled caller aborts it and waits for
        its thread to stop touching the destination before the cancellation goes on."""
        call = Call()
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.executor, fn, call)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            call.abort()
            with contextlib.suppress(BaseException):
                await future
            raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for stream in idle:
            stream.close()
        self.executor.shutdown(wait=False)

    # -- operations (blocking: run them with :meth:`run`) ---------------------------------

    def get(
        self,
        call: Call,
        model: str,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: RecycledBuffers | None,
    ) -> list[BulkRead | None]:
        """Values of ``keys`` over one connection (None: a miss)."""
        stream = self._take(call)
        try:
            reads = self._get(stream, model, keys, expect, outs, results)
        except ConnectionLost:
            self._lose(call, stream)
            raise
        except BaseException:
            self._give_back(call, stream)  # a server's error leaves the stream in step
            raise
        self._give_back(call, stream)
        return reads

    @staticmethod
    def _get(
        stream: Stream,
        model: str,
        keys: list[str],
        expect: Layout | None,
        outs: list[memoryview] | None,
        results: RecycledBuffers | None,
    ) -> list[BulkRead | None]:
        request: dict[str, Any] = {"op": "get", "model": model, "keys": keys}
        if expect is not None:
            request["expect"] = expect.to_dict()
        stream.send_frame(request)
        reads: list[BulkRead | None] = []
        wrong_size: InvalidValueError | None = None
        start = time.perf_counter()
        for i in range(len(keys)):
            frame = stream.recv_frame()
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
                stream.discard(layout.nbytes, memoryview(bytearray(1 << 20)))
                reads.append(None)
                continue
            dest = Destination(results, layout.nbytes, out)
            whole = stream.recv_payload(dest.target) == expected
            now = time.perf_counter()
            if not whole:
                dest.discard()
            value = dest.value(layout) if whole else None
            reads.append(BulkRead(value, tier, layout.nbytes, now - start))
            start = now
        if wrong_size is not None:
            raise wrong_size
        return reads

    def put(self, call: Call, model: str, fmt: str, items: list[PutItem]) -> list[dict[str, Any]]:
        """Store ``items`` over one connection; the server's results."""
        stream = self._take(call)
        try:
            request = {
                "op": "put",
                "model": model,
                "fmt": fmt,
                "items": [
                    {"key": key, "layout": layout.to_dict(), "parent": parent}
                    for key, layout, _data, parent in items
                ],
            }
            stream.send_payloads(request, [data for _key, _layout, data, _parent in items])
            reply = stream.recv_frame()
        except ConnectionLost:
            self._lose(call, stream)
            raise
        self._give_back(call, stream)
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
    "Call",
    "ConnectionLost",
    "Endpoint",
    "PutItem",
    "Refused",
    "Unreachable",
    "spread",
]
