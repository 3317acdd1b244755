"""StorageHandler: one control request in, one reply out, over the KV stores of one server.

It checks a request (:func:`~persisting.service.protocol.parse_request`), finds its
session, applies the touches riding along (hits a same-host client served itself) and
hands it to the operation named in :data:`~persisting.service.protocol.OPS`: the session
operations here and the index operations (:mod:`.index_ops`). Every failure becomes a
structured error reply. Values never come this way: they move on data connections
(:mod:`persisting.service.bulk`), whose credentials ``hello`` hands out.

It knows nothing of Pulsing: the actor in :mod:`actors` only feeds it messages, so the
whole protocol is testable with plain function calls. Requests that may do file I/O run on
a thread pool, so a slow one never stalls lookups.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from persisting.errors import PersistingError, ProtocolError
from persisting.kv import KVStore
from persisting.service.handler.common import Opener, ServerState, plain_stats, quietly
from persisting.service.handler.index_ops import IndexOps
from persisting.service.protocol import (
    OPS,
    PROTOCOL_VERSION,
    Request,
    error_reply,
    is_light,
    ok_reply,
    parse_request,
)
from persisting.service.sessions import SESSION_STAGED_BYTES, Session, SessionTable

Operation = Callable[[Request, "Session | None"], Any]


class StorageHandler:
    """Answers protocol requests for the models of one server."""

    def __init__(
        self,
        stores: Mapping[str, KVStore],
        *,
        lease_ttl_s: float = 30.0,
        max_inflight: int = 16,
        max_staged_bytes: int = 1 << 30,
        max_session_staged_bytes: int = SESSION_STAGED_BYTES,
        threads: int = 4,
        node: Mapping[str, Any] | None = None,
        clock: Callable[[], float] | None = None,
        opener: Opener | None = None,
        replicas: int = 1,
    ):
        kwargs = {"clock": clock} if clock is not None else {}
        sessions = SessionTable(
            lease_ttl_s,
            max_staged_bytes=max_staged_bytes,
            max_session_staged_bytes=max_session_staged_bytes,
            **kwargs,
        )
        self.state = ServerState(stores, sessions, lease_ttl_s=lease_ttl_s, opener=opener)
        self.max_inflight = max_inflight
        #: How many members keep a copy of a key (clients read the next copy on a miss).
        self.replicas = replicas
        self.node = dict(node or {})
        self.node.setdefault("host", socket.gethostname())
        self.node.setdefault("pid", os.getpid())
        #: Where and how clients open data connections (``host``, ``port``, ``unix``,
        #: ``cert``; set by the actor once its data path listens).
        self.data: dict[str, Any] | None = None
        #: Servers of this service the actor sees alive (told to clients in ``hello``, so
        #: a new client waits for the members it has not found yet).
        self.members: list[str] | None = None
        #: Named callables whose plain-dict results join the ``stats`` reply (e.g. "events").
        self.extra_stats: dict[str, Callable[[], dict[str, Any]]] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-service")
        self.index = IndexOps(self.state, self._server_stats)
        self._ops: dict[str, Operation] = {}
        for name in OPS:
            own = getattr(self, f"op_{name}", None)
            self._ops[name] = own if callable(own) else getattr(self.index, name)

    @property
    def stores(self) -> dict[str, KVStore]:
        return self.state.stores

    @property
    def sessions(self) -> SessionTable:
        return self.state.sessions

    @property
    def counters(self) -> Any:
        return self.state.counters

    @property
    def lease_ttl_s(self) -> float:
        return self.state.lease_ttl_s

    # -- entry points -------------------------------------------------------------------

    async def handle(self, message: object) -> dict[str, Any]:
        """Answer one request; light ones on the event loop, the rest on the threads (a
        ``hello`` that opens its namespace among them)."""
        if is_light(message) and not self._opens(message):
            return self.answer(message)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.answer, message)

    def _opens(self, message: object) -> bool:
        """Whether ``message`` is a hello that would open a namespace (file I/O)."""
        if self.state.opener is None or not isinstance(message, Mapping):
            return False
        model = message.get("model")
        return message.get("op") == "hello" and model is not None and not self.state.serves(model)

    def answer(self, message: object) -> dict[str, Any]:
        """:meth:`handle` on the calling thread."""
        try:
            request = parse_request(message)
        except PersistingError as exc:
            return self._error(exc)
        self.counters[f"op_{request.op}"] += 1
        try:
            session = None
            if request.op not in ("hello", "stats") or request.sid is not None:
                with self.state.lock:  # an expired session is refused here; the sweeper frees it
                    session = self.sessions.touch(request.sid)
            if session is not None and request.args.get("touch"):
                # a hint riding along: a bad one must not fail the request it came with
                quietly(self.index.touch_keys, request.model, request.args["touch"])
            return ok_reply(self._ops[request.op](request, session))
        except Exception as exc:  # a refusal, a bug or an unexpected library error: a reply
            return self._error(exc)

    def _error(self, exc: BaseException) -> dict[str, Any]:
        """The error reply for ``exc``, counted in total and by its code."""
        reply = error_reply(exc)
        self.counters["errors"] += 1
        self.counters[f"error_{reply['error']['code']}"] += 1
        return reply

    def expire_sessions(self) -> int:
        """Give back what expired sessions held; returns how many expired."""
        with self.state.lock:
            gone = self.sessions.expire()
        for session in gone:
            self._give_back(session)
        self.counters["sessions_expired"] += len(gone)
        return len(gone)

    def close(self) -> None:
        with self.state.lock:
            ended = [self.sessions.close(s.sid) for s in self.sessions.sessions()]
        for session in ended:
            if session is not None:
                self._give_back(session)
        self._pool.shutdown(wait=True)

    # -- sessions -----------------------------------------------------------------------

    def _give_back(self, session: Session) -> None:
        """Undo a finished session's pins and end its data connections."""
        for (model, key), count in session.pins.items():
            store = self.stores.get(model)
            for _ in range(count):
                if store is not None:
                    quietly(store.unpin, key)
        session.pins.clear()
        with self.state.lock:
            connections = list(session.connections)
        for conn in connections:  # each one's thread wakes, ends it and unregisters it
            conn.shutdown()

    def op_hello(self, request: Request, _session: Session | None) -> dict[str, Any]:
        client = request.args.get("client") or {}
        if not isinstance(client, Mapping):
            raise ProtocolError("hello's client must be a dict")
        if request.model is not None and self.state.opener is not None:
            self.state.store(request.model)  # a server serving any namespace opens it now
        with self.state.lock:
            session = self.sessions.open(dict(client))
        self.counters["sessions_opened"] += 1
        data = None
        if self.data is not None:
            data = {**self.data, "id": session.key_id, "secret": session.secret}
        return {
            "sid": session.sid,
            "protocol": PROTOCOL_VERSION,
            "models": sorted(self.stores),
            # Token hashing must use the store's chunk size, or lookups quietly miss.
            "chunk_sizes": {m: getattr(s, "chunk_size", None) for m, s in self.stores.items()},
            "hash_schemes": {m: getattr(s, "hash_scheme", None) for m, s in self.stores.items()},
            "node": self.node,
            "members": list(self.members) if self.members is not None else None,
            "lease_ttl_s": self.lease_ttl_s,
            "max_inflight": self.max_inflight,
            "replicas": self.replicas,
            "pool": self._pool_of(request.model),
            "data": data,
        }

    def _pool_of(self, model: str | None) -> dict[str, Any] | None:
        """Where a same-host client maps ``model``'s memory tier (None: no shared pool)."""
        store = self.stores.get(model) if model is not None else None
        pool = store.shared_pool if store is not None else None
        return None if pool is None else {"path": str(pool.path), "size": pool.size}

    def op_bye(self, request: Request, _session: Session | None) -> bool:
        with self.state.lock:
            closed = self.sessions.close(request.sid)
        if closed is not None:
            self._give_back(closed)
        return closed is not None

    def op_renew(self, _request: Request, session: Session | None) -> dict[str, int]:
        assert session is not None
        return {"pins": sum(session.pins.values())}

    # -- figures --------------------------------------------------------------------------

    def service_figures(self) -> dict[str, Any]:
        """Requests by operation, errors by code, sessions and pins: what the metrics
        endpoint exports for the service itself."""
        with self.state.lock:
            counters = dict(self.counters)
            figures: dict[str, Any] = {
                "sessions": len(self.sessions),
                "pins": self.sessions.pin_count,
            }
        figures["requests"] = {k[3:]: n for k, n in counters.items() if k.startswith("op_")}
        figures["errors"] = {k[6:]: n for k, n in counters.items() if k.startswith("error_")}
        return figures

    def _server_stats(self) -> dict[str, Any]:
        """What ``stats`` adds to the stores' figures: this server and its sessions."""
        with self.state.lock:
            service = {
                "sessions": len(self.sessions),
                "pins": self.sessions.pin_count,
                "staged_bytes": self.sessions.staged_bytes,
                **dict(self.counters),
            }
        extra = {name: plain_stats(fn()) for name, fn in list(self.extra_stats.items())}
        return {"node": self.node, "service": service, **extra}


__all__ = ["StorageHandler"]
