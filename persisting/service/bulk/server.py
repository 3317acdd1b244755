"""The server side of the bulk data path: a TCP listener for clients on other hosts.

It listens on the address the settings name (the service's host, ``service.bulk_port``)
and nowhere else. A connection is served in four steps:

1. **Admission.** At most :data:`MAX_PENDING` connections may be unauthenticated at once;
   one more is closed at once, unread.
2. **Handshake** (:mod:`.auth`): 80 bytes within ``HANDSHAKE_TIMEOUT_S``, a live session's
   key id, a valid MAC and a counter never seen before -- else the connection is closed
   without a byte sent. Then the caps on authenticated connections (per session and per
   server) apply; over them, the answer says the server is busy (the client raises a
   CapacityError) and the connection ends.
3. **Requests**, one at a time per connection, each renewing its session:
   ``get`` (keys, ``expect``) is answered key by key with a frame -- ``{"layout", "checksum",
   "tier"}`` and the payload, or ``{"miss": true}`` -- sent from the memory tier's own
   buffer, or from the payload file with ``sendfile`` (under a read lease while the file is
   opened: a file once open stays whole). ``put`` (items with key, layout and parent)
   is followed by each payload and its checksum; the payloads land in staging space (bounded
   per session and per server, as uploads are), are checked, and stored in one batch.
   An error ends the request with ``{"error": {"code", "message"}}``; a refused put's
   payloads are read and dropped first, so the connection stays in step.
4. **End.** A client that closes, a session that ends (its connections are shut down with
   it), bytes that make no sense, or a transfer stalled for ``io_timeout_s``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from persisting.errors import (
    CapacityError,
    CorruptValueError,
    PersistingError,
    ProtocolError,
)
from persisting.kv import KVStore, Layout
from persisting.service.bulk.auth import (
    BUSY,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    OK,
    SEALED,
    parse_hello,
    stream_keys,
    verify_hello,
    welcome,
)
from persisting.service.bulk.stream import (
    ConnectionLost,
    PollGate,
    SealedStream,
    Stream,
    set_timeouts,
    tune,
)
from persisting.service.handler.common import ServerState, layout_from, optional_layout
from persisting.service.protocol import MAX_KEYS_PER_REQUEST, error_reply
from persisting.service.sessions import Session, Staged

logger = logging.getLogger("persisting.service.bulk")

#: Connections that may be unauthenticated at once (the rest are closed unread).
MAX_PENDING = 64
#: Authenticated connections one session may hold (a client opens ``bulk_streams``).
MAX_PER_SESSION = 16
#: Items in one put request.
MAX_PUT_ITEMS = 1024
#: A connection's thread polls for the next request (``service.bulk_poll_us``) only after
#: a request that moved at least this much: bulk transfers come back to back, and a poll
#: after each small request would cost more CPU than it saves.
POLL_AFTER_BYTES = 1 << 20

#: Records where a put's values were placed (the placement feed of same-host readers).
RecordPlacements = Callable[[KVStore, str, list[Mapping[str, Any]], list[dict[str, Any]]], None]


class SessionStreams:
    """The data connections of one session: a session resource, so ending the session
    (bye, expiry, server close) shuts them down and wakes their threads."""

    def __init__(self) -> None:
        self.streams: set[Stream] = set()

    def close(self) -> None:
        for stream in list(self.streams):
            stream.shutdown()  # its thread wakes, ends and closes it
        self.streams.clear()


class BulkServer:
    """Serves gets and puts of the stores in ``state`` on data connections."""

    def __init__(
        self,
        state: ServerState,
        host: str,
        port: int,
        *,
        sealed: bool = False,
        io_timeout_s: float = 30.0,
        max_connections: int = 256,
        poll_s: float = 0.0,
        record_placements: RecordPlacements | None = None,
    ):
        self.state = state
        self.host = host
        self.port = port
        self.sealed = sealed
        self.io_timeout_s = io_timeout_s
        self.max_connections = max_connections
        self.poll_s = poll_s
        self._poll_gate = PollGate()
        self._record_placements = record_placements
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._active = 0
        self._closed = False
        #: Refused connections by reason, and other figures (read by ``stats``).
        self.figures: dict[str, int] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Listen; returns what ``hello`` tells clients (host, port, sealed)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        threading.Thread(target=self._accept, name="kv-bulk", daemon=True).start()
        return {"host": self.host, "port": self.port, "sealed": self.sealed}

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.figures[name] = self.figures.get(name, 0) + n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.figures, "connections": self._active, "pending": self._pending}

    # -- admission and handshake ----------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                conn, _peer = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                admitted = self._pending < MAX_PENDING and not self._closed
                if admitted:
                    self._pending += 1
            if not admitted:
                self._count("refused_pending")
                conn.close()
                continue
            threading.Thread(
                target=self._connection, args=(conn,), name="kv-bulk-conn", daemon=True
            ).start()

    def _connection(self, conn: socket.socket) -> None:
        stream: Stream | None = None
        session: Session | None = None
        try:
            authenticated = self._handshake(conn)
        finally:
            with self._lock:
                self._pending -= 1
        if authenticated is None:
            conn.close()
            return
        stream, session = authenticated
        try:
            self._serve(stream, session)
        except (ConnectionLost, OSError):
            pass  # the client went away, the session ended, or garbage arrived
        except Exception:  # a bug: log it, drop the connection, keep serving others
            logger.exception("bulk data connection failed")
        finally:
            self._count_waits(stream)
            self._unregister(stream, session)
            stream.close()

    def _handshake(self, conn: socket.socket) -> tuple[Stream, Session] | None:
        """The authenticated stream and its session, or None (closed without a byte)."""
        try:
            set_timeouts(conn, HANDSHAKE_TIMEOUT_S)
            data = bytearray(HELLO.size)
            Stream(conn).recv_into(memoryview(data))
            key_id, _counter, mode, _body, _mac = parse_hello(bytes(data))
        except (ConnectionLost, ProtocolError, OSError):
            self._count("refused_handshake")
            return None
        state = self.state
        with state.lock:
            session = state.sessions.by_key_id(key_id)
            proof = verify_hello(session.credential, bytes(data)) if session else None
        if session is None or proof is None or (self.sealed and mode != SEALED):
            self._count("refused_credential")
            return None
        stream: Stream = Stream(conn, self.poll_s, self._poll_gate)
        admitted = self._register(stream, session)
        answer, server_nonce = welcome(session.credential.secret, proof, OK if admitted else BUSY)
        if not admitted:
            self._count("refused_cap")
        try:
            conn.sendall(answer)
            if not admitted:  # told it is busy (nothing else is read or sent)
                return None
            tune(conn)
            set_timeouts(conn, self.io_timeout_s)
        except OSError:
            if admitted:
                self._unregister(stream, session)
            return None
        if proof.mode == SEALED:
            to_server, to_client = stream_keys(
                session.credential.secret, proof.client_mac, server_nonce
            )
            sealed = SealedStream(
                conn,
                send_key=to_client,
                recv_key=to_server,
                poll_s=self.poll_s,
                gate=self._poll_gate,
            )
            self._unregister(stream, session)
            if not self._register(sealed, session):
                return None
            stream = sealed
        self._count("connections_opened")
        return stream, session

    def _register(self, stream: Stream, session: Session) -> bool:
        """Count ``stream`` against its session's and the server's caps; False when over."""
        with self.state.lock:
            streams = next((r for r in session.resources if isinstance(r, SessionStreams)), None)
            if streams is None:
                streams = SessionStreams()
                session.resources.append(streams)
            if len(streams.streams) >= MAX_PER_SESSION:
                return False
            with self._lock:
                if self._active >= self.max_connections:
                    return False
                self._active += 1
            streams.streams.add(stream)
        return True

    def _unregister(self, stream: Stream, session: Session) -> None:
        with self.state.lock:
            for resource in session.resources:
                if isinstance(resource, SessionStreams):
                    resource.streams.discard(stream)
        with self._lock:
            self._active -= 1

    # -- requests -----------------------------------------------------------------------

    def _serve(self, stream: Stream, session: Session) -> None:
        scratch = memoryview(bytearray(1 << 20))
        moved = 0  # payload bytes of the last request
        while not self._closed:
            # idle between requests, until one comes or the end; polling first only after
            # a bulk transfer, where the next request most likely follows at once
            stream.wait_request(poll=moved >= POLL_AFTER_BYTES)
            moved = 0
            request = stream.recv_frame()
            self._count_waits(stream)  # those of the last request, and of the wait for this
            op = request.get("op")
            self._poll_gate.request(+1)
            try:
                with self.state.lock:
                    self.state.sessions.touch(session.sid)
                if op == "get":
                    moved = self._get(stream, session, request)
                elif op == "put":
                    moved = self._put(stream, session, request, scratch)
                else:
                    raise ProtocolError(f"unknown data-path operation {op!r}")
            except PersistingError as exc:
                self.state.counters["errors"] += 1
                stream.send_frame({"error": error_reply(exc)["error"]})
                if isinstance(exc, ProtocolError) and op not in ("get", "put"):
                    return
            finally:
                self._poll_gate.request(-1)

    def _count_waits(self, stream: Stream) -> None:
        """Add the connection's waits for bytes since the last call to the server's figures."""
        polled, slept, stream.polled, stream.slept = stream.polled, stream.slept, 0, 0
        self._count("waits_polled", polled)
        self._count("waits_slept", slept)

    def _get(self, stream: Stream, session: Session, request: dict[str, Any]) -> int:
        """Answer a get; the payload bytes sent."""
        store = self.state.store(request.get("model"))
        keys = request.get("keys")
        if not isinstance(keys, list) or not 0 < len(keys) <= MAX_KEYS_PER_REQUEST:
            raise ProtocolError(f"a get needs 1 to {MAX_KEYS_PER_REQUEST} keys")
        if not all(isinstance(k, str) for k in keys):
            raise ProtocolError("keys must be strings")
        expect = optional_layout(request.get("expect"))
        counters = self.state.counters
        total = 0
        for key in keys:
            sent = self._send_value(stream, session, store, str(request["model"]), key, expect)
            counters["get_hits" if sent else "get_misses"] += 1
            counters["get_bytes_bulk"] += sent
            total += sent
        return total

    def _send_value(
        self,
        stream: Stream,
        session: Session,
        store: KVStore,
        model: str,
        key: str,
        expect: Layout | None,
    ) -> int:
        """Send one value (from memory, else from its payload file) or a miss; its size."""
        held = store.memory_payload(key, expect=expect)
        if held is not None:
            header = {
                "layout": held.layout.to_dict(),
                "checksum": held.checksum,
                "tier": "memory",
            }
            stream.send_frame(header, held.buffer.data.cast("B"))
            return held.layout.nbytes
        fd, location = self._open_payload(session, store, model, key, expect)
        if fd is None or location is None:
            stream.send_frame({"miss": True})
            return 0
        try:
            header = {
                "layout": location.layout.to_dict(),
                "checksum": location.checksum,
                "tier": "disk",
            }
            stream.send_frame(header)
            stream.send_file(fd, location.offset, location.nbytes)
        finally:
            os.close(fd)
        return location.nbytes

    def _open_payload(
        self, session: Session, store: KVStore, model: str, key: str, expect: Layout | None
    ) -> tuple[int | None, Any]:
        """The open payload file of a value on disk (a file once open stays whole: eviction
        only unlinks it), taken under a read lease that is given back once it is open."""
        state = self.state
        location = store.lease(key, state.lease_ttl_s)
        if location is None:
            return None, None
        try:
            if expect is not None and not location.layout.matches(expect):
                state.counters["layout_misses"] += 1
                return None, None
            try:
                return os.open(location.path, os.O_RDONLY | os.O_CLOEXEC), location
            except OSError:
                return None, None
        finally:
            with contextlib.suppress(PersistingError):
                store.release(key, location.token)

    def _put(
        self, stream: Stream, session: Session, request: dict[str, Any], scratch: memoryview
    ) -> int:
        """Receive and store a put; the payload bytes received."""
        items = request.get("items")
        if not isinstance(items, list) or not 0 < len(items) <= MAX_PUT_ITEMS:
            raise ConnectionLost(f"a put needs 1 to {MAX_PUT_ITEMS} items")  # out of step
        try:
            layouts = [layout_from(item.get("layout")) for item in items]
        except (PersistingError, AttributeError) as exc:
            raise ConnectionLost(f"unreadable put items: {exc}") from exc
        total = sum(layout.nbytes for layout in layouts)
        try:
            store = self.state.store(request.get("model"))
            largest = max(layout.nbytes for layout in layouts)
            if largest > store.max_value_bytes:
                raise CapacityError(
                    f"a {largest}-byte value exceeds max_value_bytes {store.max_value_bytes}"
                )
            with self.state.lock:
                staged_id = self.state.sessions.stage(session, Staged(None, total))
        except PersistingError:
            for layout in layouts:  # stay in step: read what the client is sending anyway
                stream.discard(layout.nbytes + 8, scratch)
            raise
        try:
            self._receive_and_store(stream, store, str(request["model"]), request, layouts)
        finally:
            with self.state.lock:
                self.state.sessions.unstage(session, staged_id)
        return total

    def _receive_and_store(
        self,
        stream: Stream,
        store: KVStore,
        model: str,
        request: dict[str, Any],
        layouts: list[Layout],
    ) -> None:
        """Receive each payload straight into a buffer of the store's memory tier, hashing
        it as it lands; the store then keeps those buffers (no copy) once every checksum
        matched what the client sent after the payload."""
        items: list[Mapping[str, Any]] = request["items"]
        buffers: list[np.ndarray] = []
        checksums: list[int] = []
        damaged = 0
        for layout in layouts:
            buffer = store.allocate(layout.nbytes)
            digest = stream.recv_payload(buffer.data.cast("B"))
            if digest != stream.recv_checksum():
                damaged += 1
            buffers.append(buffer)
            checksums.append(digest)
        if damaged:
            self.state.counters["put_bulk_damaged"] += damaged
            raise CorruptValueError(f"{damaged} value(s) arrived damaged (checksum mismatch)")
        raw_keys = [item.get("key") for item in items]
        parents = [item.get("parent") for item in items]
        if not all(isinstance(k, str) for k in raw_keys) or not all(
            p is None or isinstance(p, str) for p in parents
        ):
            raise ProtocolError("put keys and parents must be strings")
        keys = [str(k) for k in raw_keys]
        results = store.batched_put_owned(keys, buffers, layouts, checksums, parents)
        replies = [
            {
                "key": str(r.key),
                "tier": str(r.tier),
                "durable": bool(r.durable),
                "stored": bool(r.stored),
            }
            for r in results
        ]
        if self._record_placements is not None:
            self._record_placements(store, model, items, replies)
        counters = self.state.counters
        counters["put_items"] += len(keys)
        counters["put_bytes_bulk"] += sum(layout.nbytes for layout in layouts)
        stream.send_frame({"results": replies})


__all__ = ["MAX_PENDING", "MAX_PER_SESSION", "BulkServer", "SessionStreams"]
