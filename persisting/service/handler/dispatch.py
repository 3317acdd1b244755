"""StorageHandler: one request in, one reply out, over the KV stores of one server.

It checks a request (:func:`~persisting.service.protocol.parse_request`), finds its
session, applies what rides along (read leases given back, hits the client served itself)
and hands it to the operation named in :data:`~persisting.service.protocol.OPS`: the
session operations here, the put paths (:mod:`.puts`), the get paths (:mod:`.gets`) and
the index operations (:mod:`.index_ops`). Every failure becomes a structured error reply.

It knows nothing of Pulsing: the actor in :mod:`actors` only feeds it
messages, so the whole protocol is testable with plain function calls. Requests that may
do file I/O run on a thread pool, so a slow put (fsync) never stalls lookups.
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
from persisting.service.handler.common import (
    DEFAULT_MESSAGE_PART_BYTES,
    ServerState,
    plain_stats,
    quietly,
)
from persisting.service.handler.gets import GetPaths
from persisting.service.handler.index_ops import IndexOps
from persisting.service.handler.puts import PutPaths
from persisting.service.protocol import (
    OPS,
    PROTOCOL_VERSION,
    Request,
    error_reply,
    is_light,
    ok_reply,
    parse_request,
)
from persisting.service.same_host import ServerArenaMapping
from persisting.service.sessions import (
    SESSION_STAGED_BYTES,
    STAGED_TTL_S,
    Session,
    SessionTable,
)

Operation = Callable[[Request, "Session | None"], Any]


class StorageHandler:
    """Answers protocol requests for the models of one server."""

    def __init__(
        self,
        stores: Mapping[str, KVStore],
        *,
        lease_ttl_s: float = 30.0,
        message_part_bytes: int = DEFAULT_MESSAGE_PART_BYTES,
        max_inflight: int = 16,
        max_staged_bytes: int = 1 << 30,
        max_session_staged_bytes: int = SESSION_STAGED_BYTES,
        staged_ttl_s: float = STAGED_TTL_S,
        threads: int = 4,
        node: Mapping[str, Any] | None = None,
        clock: Callable[[], float] | None = None,
    ):
        kwargs = {"clock": clock} if clock is not None else {}
        sessions = SessionTable(
            lease_ttl_s,
            max_staged_bytes=max_staged_bytes,
            max_session_staged_bytes=max_session_staged_bytes,
            staged_ttl_s=staged_ttl_s,
            **kwargs,
        )
        self.state = ServerState(
            stores, sessions, lease_ttl_s=lease_ttl_s, message_part_bytes=message_part_bytes
        )
        self.max_inflight = max_inflight
        self.node = dict(node or {})
        self.node.setdefault("host", socket.gethostname())
        self.node.setdefault("pid", os.getpid())
        self.lanes: list[str] = []
        #: Path of the Unix socket same-host clients may send requests to (set by the actor).
        self.local_channel: str | None = None
        #: Where clients on other hosts open data connections (``host``, ``port``,
        #: ``sealed``; set by the actor when it serves the bulk data path).
        self.bulk: dict[str, Any] | None = None
        #: Servers of this service the actor sees alive (told to clients in ``hello``, so
        #: a new client waits for the members it has not found yet).
        self.members: list[str] | None = None
        #: Named callables whose plain-dict results join the ``stats`` reply (e.g. "events").
        self.extra_stats: dict[str, Callable[[], dict[str, Any]]] = {}
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-service")
        self.puts = PutPaths(self.state)
        self.gets = GetPaths(self.state)
        self.index = IndexOps(self.state, self._server_stats)
        self._ops = self._bind(OPS)

    def _bind(self, names: Mapping[str, Any]) -> dict[str, Operation]:
        """Each operation of the protocol table, bound to the object implementing it."""
        ops: dict[str, Operation] = {}
        for name in names:
            for owner in (self, self.puts, self.gets, self.index):
                fn = getattr(owner, f"op_{name}" if owner is self else name, None)
                if callable(fn):
                    ops[name] = fn
                    break
            else:  # pragma: no cover - a table entry without an implementation
                raise TypeError(f"no implementation of protocol operation {name!r}")
        return ops

    # -- what other layers read -----------------------------------------------------------

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

    @property
    def message_part_bytes(self) -> int:
        return self.state.message_part_bytes

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The threads that run requests doing file I/O."""
        return self._pool

    # -- entry points -------------------------------------------------------------------

    is_light = staticmethod(is_light)

    async def handle(self, message: object) -> dict[str, Any]:
        """Answer one request; light ones on the event loop, the rest on the threads."""
        if is_light(message):
            return self.answer(message)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.answer, message)

    def answer(self, message: object) -> dict[str, Any]:
        """:meth:`handle` on the calling thread (the local channel's threads use this)."""
        try:
            request = parse_request(message)
        except PersistingError as exc:
            return self._error(exc)
        return self.handle_sync(request)

    def _error(self, exc: BaseException) -> dict[str, Any]:
        """The error reply for ``exc``, counted in total and by its code."""
        reply = error_reply(exc)
        self.counters["errors"] += 1
        self.counters[f"error_{reply['error']['code']}"] += 1
        return reply

    def handle_sync(self, request: Request) -> dict[str, Any]:
        self.counters[f"op_{request.op}"] += 1
        state = self.state
        try:
            session = None
            if request.op not in ("hello", "stats") or request.sid is not None:
                with state.lock:  # an expired session is refused here; the sweeper frees it
                    session = state.sessions.touch(request.sid)
            if session is not None and request.args.get("release"):
                self.gets.release_keys(session, request.model, request.args["release"])
            if session is not None and request.args.get("touch"):
                # a hint riding along: a bad one must not fail the request it came with
                quietly(self.gets.touch_keys, request.model, request.args["touch"])
            return ok_reply(self._ops[request.op](request, session))
        except Exception as exc:  # a refusal, a bug or an unexpected library error: a reply
            return self._error(exc)

    def expire_sessions(self) -> int:
        """Give back what expired sessions held; returns how many expired."""
        with self.state.lock:
            gone = self.sessions.expire()
            for session in gone:
                self._give_back(session)
            self.counters["sessions_expired"] += len(gone)
            self.counters["staged_expired"] += self.sessions.expire_staged()
            return len(gone)

    def close(self) -> None:
        with self.state.lock:
            for session in self.sessions.sessions():
                self.sessions.close(session.sid)
                self._give_back(session)
        self._pool.shutdown(wait=True)

    # -- sessions -----------------------------------------------------------------------

    def _give_back(self, session: Session) -> None:
        """Undo a finished session's pins and leases (its counters are already dropped)."""
        for (model, key), count in session.pins.items():
            store = self.stores.get(model)
            for _ in range(count):
                if store is not None:
                    quietly(store.unpin, key)
        session.pins.clear()
        for (model, key), tokens in session.leases.items():
            store = self.stores.get(model)
            if store is not None:
                for token in tokens:
                    quietly(store.release, key, token)
        session.leases.clear()
        session.close_resources()

    def op_hello(self, request: Request, _session: Session | None) -> dict[str, Any]:
        client = request.args.get("client") or {}
        if not isinstance(client, Mapping):
            raise ProtocolError("hello's client must be a dict")
        arena = client.get("arena")
        mapping = None
        shm_error = None
        if arena is not None:
            try:
                mapping = ServerArenaMapping(arena["path"], arena["size"], arena["nonce"])
            except (ProtocolError, KeyError, TypeError) as exc:
                shm_error = str(exc)
        with self.state.lock:
            session = self.sessions.open({k: v for k, v in client.items() if k != "arena"})
            if mapping is not None:
                session.resources.append(mapping)
        self.counters["sessions_opened"] += 1
        return {
            "sid": session.sid,
            "protocol": PROTOCOL_VERSION,
            "models": sorted(self.stores),
            # Token hashing must use the store's chunk size, or lookups quietly miss.
            "chunk_sizes": {m: getattr(s, "chunk_size", None) for m, s in self.stores.items()},
            "hash_schemes": {m: getattr(s, "hash_scheme", None) for m, s in self.stores.items()},
            "node": self.node,
            "members": list(self.members) if self.members is not None else None,
            "lanes": list(self.lanes),
            "lease_ttl_s": self.lease_ttl_s,
            "message_part_bytes": self.message_part_bytes,
            "max_inflight": self.max_inflight,
            "shm": mapping is not None,
            "shm_error": shm_error,
            "local_channel": self.local_channel if mapping is not None else None,
            "pool": self._pool_of(request.model) if mapping is not None else None,
            "bulk": None if self.bulk is None else {**self.bulk, **session.credential.to_wire()},
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
        with self.state.lock:
            leases = [(h, t) for h, tokens in session.leases.items() for t in tokens]
        for (model, key), token in leases:  # push the store's own lease deadlines out too
            store = self.stores.get(model)
            if store is not None:
                quietly(store.renew, key, token, self.lease_ttl_s)
        return {"pins": sum(session.pins.values()), "leases": len(leases)}

    def op_withdraw(self, request: Request, session: Session | None) -> list[int]:
        """The client's tickets whose arena pages this server will never touch again."""
        assert session is not None
        with self.state.lock:
            return self.sessions.withdraw(session, request.args["tickets"])

    def service_figures(self) -> dict[str, Any]:
        """Requests by operation, errors by code, sessions, pins and leases: what the
        metrics endpoint exports for the service itself."""
        with self.state.lock:
            counters = dict(self.counters)
            figures: dict[str, Any] = {
                "sessions": len(self.sessions),
                "pins": self.sessions.pin_count,
                "leases": self.sessions.lease_count,
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
                "leases": self.sessions.lease_count,
                "staged_bytes": self.sessions.staged_bytes,
                **dict(self.counters),
            }
        extra = {name: plain_stats(fn()) for name, fn in list(self.extra_stats.items())}
        return {"node": self.node, "service": service, **extra}


__all__ = ["StorageHandler"]
