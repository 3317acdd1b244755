"""Client sessions on a server, and what each one holds.

Everything a client takes through the service (a pin, data connections, bytes of a put in
flight) belongs to its session, and a session lives only ``ttl_s`` seconds past its last
request or renewal. A client that crashes stops renewing, its session expires, and the
server gives back everything it held; nothing stays pinned forever. This module is plain
bookkeeping (no Pulsing, no store): the server applies what :meth:`SessionTable.expire`
returns to its stores.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from persisting.errors import CapacityError, ProtocolError, SessionExpiredError

#: (model, key) -- what a pin is taken on.
Holding = tuple[str, str]

#: Bytes of puts one session may have in flight at once, by default (the server's bound
#: is separate).
SESSION_STAGED_BYTES = 256 << 20


@dataclass
class Session:
    """One connected client and what it holds."""

    sid: str
    #: What the client said of itself in ``hello`` (host, pid): for reports only, never
    #: for a cap (the data path's caps count what the kernel says of the peer).
    client: dict[str, Any]
    deadline: float
    pins: Counter[Holding] = field(default_factory=Counter)
    #: Bytes of this session's puts being received on data connections.
    staged_bytes: int = 0
    #: Its data connections (shut down when the session ends).
    connections: set[Any] = field(default_factory=set)
    #: How far this session has been told of pool placements, per model (see
    #: :mod:`persisting.service.handler.placements`).
    placements_told: dict[str, int] = field(default_factory=dict)
    #: Its right to open data connections: an id and a secret ``hello`` hands out.
    key_id: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))


class SessionTable:
    """The sessions of one server, with expiry after ``ttl_s`` without a renewal."""

    def __init__(
        self,
        ttl_s: float,
        max_staged_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_session_staged_bytes: int = SESSION_STAGED_BYTES,
    ):
        self.ttl_s = ttl_s
        self.max_staged_bytes = max_staged_bytes
        self.max_session_staged_bytes = max_session_staged_bytes
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._by_key_id: dict[bytes, str] = {}
        self._staged_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, client: dict[str, Any]) -> Session:
        sid = secrets.token_hex(16)
        session = Session(sid=sid, client=dict(client), deadline=self._clock() + self.ttl_s)
        self._sessions[sid] = session
        self._by_key_id[session.key_id] = sid
        return session

    def authenticate(self, key_id: object, secret: object) -> Session | None:
        """The live session whose data-path credential this is (None if none is)."""
        if not isinstance(key_id, bytes) or not isinstance(secret, bytes):
            return None
        session = self._sessions.get(self._by_key_id.get(key_id, ""))
        if session is None or session.deadline < self._clock():
            return None
        return session if hmac.compare_digest(session.secret, secret) else None

    def touch(self, sid: str | None) -> Session:
        """The live session ``sid``, renewed; SessionExpiredError if it is gone."""
        if sid is None:
            raise ProtocolError("this operation needs a session (send hello first)")
        session = self._sessions.get(sid)
        now = self._clock()
        if session is None or session.deadline < now:
            raise SessionExpiredError(f"session {sid[:8]}... is unknown or expired")
        session.deadline = now + self.ttl_s
        return session

    def close(self, sid: str | None) -> Session | None:
        """End a session at once; the caller gives back what it held."""
        session = self._sessions.pop(sid, None) if sid else None
        if session is not None:
            self._forget(session)
        return session

    def expire(self) -> list[Session]:
        """Remove and return every session past its deadline."""
        now = self._clock()
        gone = [s for s in self._sessions.values() if s.deadline < now]
        for session in gone:
            del self._sessions[session.sid]
            self._forget(session)
        return gone

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def _forget(self, session: Session) -> None:
        self._by_key_id.pop(session.key_id, None)
        self._staged_total -= session.staged_bytes
        session.staged_bytes = 0

    # -- pins -------------------------------------------------------------------------

    @staticmethod
    def add_pin(session: Session, holding: Holding) -> None:
        session.pins[holding] += 1

    @staticmethod
    def drop_pin(session: Session, holding: Holding) -> bool:
        """Take back one of this session's pins on ``holding``; False if it held none."""
        if session.pins[holding] <= 0:
            session.pins.pop(holding, None)
            return False
        session.pins[holding] -= 1
        if not session.pins[holding]:
            del session.pins[holding]
        return True

    @property
    def pin_count(self) -> int:
        return sum(sum(s.pins.values()) for s in self._sessions.values())

    # -- bytes of puts in flight --------------------------------------------------------

    def stage(self, session: Session, nbytes: int) -> None:
        """Count ``nbytes`` of a put in flight against the session's bound and the
        server's; CapacityError past either (nothing counted then)."""
        if session.staged_bytes + nbytes > self.max_session_staged_bytes:
            raise CapacityError(
                f"{nbytes} more bytes in flight would exceed a session's bound of "
                f"{self.max_session_staged_bytes} (it holds {session.staged_bytes})"
            )
        if self._staged_total + nbytes > self.max_staged_bytes:
            raise CapacityError(
                f"{nbytes} more bytes in flight would exceed the server's bound of "
                f"{self.max_staged_bytes}"
            )
        session.staged_bytes += nbytes
        self._staged_total += nbytes

    def unstage(self, session: Session, nbytes: int) -> None:
        if session.sid not in self._sessions:
            return  # ended meanwhile: its bytes were dropped with it
        session.staged_bytes -= nbytes
        self._staged_total -= nbytes

    @property
    def staged_bytes(self) -> int:
        return self._staged_total


__all__ = ["SESSION_STAGED_BYTES", "Holding", "Session", "SessionTable"]
