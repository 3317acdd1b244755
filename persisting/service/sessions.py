"""Client sessions on a server, and the pins, read leases and buffers each one holds.

Everything a client takes through the service (a pin, a read lease on a stored payload, a
half-sent upload, a half-read transfer, a request using its shared-memory arena) belongs
to its session, and a session lives only
``ttl_s`` seconds past its last request or renewal. A client that crashes stops renewing,
its session expires, and the server gives back everything it held; nothing stays pinned
forever. This module is plain bookkeeping (no Pulsing, no store): the server applies what
:meth:`SessionTable.expire` returns to its stores.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from persisting.errors import CapacityError, ProtocolError, SessionExpiredError
from persisting.service.bulk.auth import Credential

#: (model, key) -- what a pin or a lease is taken on.
Holding = tuple[str, str]

#: Most tickets one withdraw may name, and withdrawn tickets a session remembers.
MAX_TICKETS = 4096


#: Staged bytes one session may hold at once, by default (the server's bound is separate).
SESSION_STAGED_BYTES = 256 << 20
#: How long an upload or a transfer may stay staged, however often its session renews.
STAGED_TTL_S = 120.0


@dataclass
class Staged:
    """A payload buffer being uploaded by, or read out to, one session.

    ``received`` counts distinct bytes: parts are kept by offset, so a part sent (or read)
    twice counts once, and a part overlapping another one is refused. A value is whole
    when its parts add up to ``nbytes`` (they cannot overlap, so they then cover it).
    """

    buffer: Any  # a writable uint8 numpy array
    nbytes: int
    checksum: int | None = None
    layout: dict[str, Any] | None = None
    received: int = 0
    #: When the server drops it (set when staged).
    deadline: float = math.inf
    #: Held while a part is noted and copied in (parts arrive on several threads).
    lock: threading.Lock = field(default_factory=threading.Lock)
    _starts: list[int] = field(default_factory=list)
    _lengths: dict[int, int] = field(default_factory=dict)

    def add_part(self, offset: int, length: int) -> bool:
        """Note the part ``[offset, offset + length)``; False when it was noted before (a
        repeat: nothing more counted). ProtocolError when it overlaps another part or
        leaves the value."""
        if offset < 0 or length <= 0 or offset + length > self.nbytes:
            raise ProtocolError(f"part [{offset}, {offset + length}) is outside 0..{self.nbytes}")
        known = self._lengths.get(offset)
        if known is not None:
            if known != length:
                raise ProtocolError(f"part at {offset} was {known} bytes, now {length}")
            return False
        i = bisect.bisect_left(self._starts, offset)
        before = self._starts[i - 1] if i else None
        after = self._starts[i] if i < len(self._starts) else None
        if (before is not None and before + self._lengths[before] > offset) or (
            after is not None and offset + length > after
        ):
            raise ProtocolError(f"part [{offset}, {offset + length}) overlaps another part")
        self._starts.insert(i, offset)
        self._lengths[offset] = length
        self.received += length
        return True

    @property
    def complete(self) -> bool:
        return self.received == self.nbytes


@dataclass
class Session:
    """One connected client and what it holds."""

    sid: str
    client: dict[str, Any]
    deadline: float
    pins: Counter[Holding] = field(default_factory=Counter)
    #: Read leases by what they are on: the store's lease tokens, oldest first.
    leases: dict[Holding, list[int]] = field(default_factory=dict)
    staged: dict[str, Staged] = field(default_factory=dict)
    staged_bytes: int = 0
    resources: list[Any] = field(default_factory=list)  # closed when the session ends
    #: Tickets of requests reading or writing the client's arena right now.
    tickets_running: set[int] = field(default_factory=set)
    #: Tickets the client withdrew, oldest first: such a request, arriving late, must not
    #: touch the arena. Only the last MAX_TICKETS are kept (a request is late by
    #: milliseconds, not by thousands of withdrawals).
    tickets_withdrawn: dict[int, None] = field(default_factory=dict)
    #: How far this session has been told of pool placements, per model (see
    #: :mod:`persisting.service.handler.placements`).
    placements_told: dict[str, int] = field(default_factory=dict)
    #: Its right to open data connections (:mod:`persisting.service.bulk`).
    credential: Credential = field(default_factory=Credential.new)

    def close_resources(self) -> None:
        for resource in self.resources:
            # A resource that fails to close must not block the others.
            with contextlib.suppress(Exception):
                resource.close()
        self.resources.clear()


class SessionTable:
    """The sessions of one server, with expiry after ``ttl_s`` without a renewal."""

    def __init__(
        self,
        ttl_s: float,
        max_staged_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_session_staged_bytes: int = SESSION_STAGED_BYTES,
        staged_ttl_s: float = STAGED_TTL_S,
    ):
        self.ttl_s = ttl_s
        self.max_staged_bytes = max_staged_bytes
        self.max_session_staged_bytes = max_session_staged_bytes
        self.staged_ttl_s = staged_ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._by_key_id: dict[bytes, str] = {}
        self._staged_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    # -- sessions ---------------------------------------------------------------------

    def open(self, client: dict[str, Any]) -> Session:
        sid = secrets.token_hex(16)
        session = Session(sid=sid, client=dict(client), deadline=self._clock() + self.ttl_s)
        self._sessions[sid] = session
        self._by_key_id[session.credential.key_id] = sid
        return session

    def by_key_id(self, key_id: bytes) -> Session | None:
        """The live session whose data-path credential is ``key_id`` (not renewed)."""
        session = self._sessions.get(self._by_key_id.get(key_id, ""))
        if session is None or session.deadline < self._clock():
            return None
        return session

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
        self._by_key_id.pop(session.credential.key_id, None)
        self._staged_total -= session.staged_bytes
        session.staged.clear()
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

    # -- read leases (each one a token of the store's) ----------------------------------

    @staticmethod
    def add_lease(session: Session, holding: Holding, token: int) -> None:
        session.leases.setdefault(holding, []).append(token)

    @staticmethod
    def drop_lease(session: Session, holding: Holding) -> int | None:
        """Take back this session's oldest lease on ``holding``: its token, for the store to
        release (None if the session holds none)."""
        tokens = session.leases.get(holding)
        if not tokens:
            session.leases.pop(holding, None)
            return None
        token = tokens.pop(0)
        if not tokens:
            del session.leases[holding]
        return token

    @property
    def lease_count(self) -> int:
        return sum(len(t) for s in self._sessions.values() for t in s.leases.values())

    @property
    def pin_count(self) -> int:
        return sum(sum(s.pins.values()) for s in self._sessions.values())

    # -- arena tickets -----------------------------------------------------------------
    #
    # A same-host request that reads or writes the client's arena carries a ticket. A
    # client whose request was cancelled or timed out cannot know whether the server has
    # read (or written) those pages yet, so it keeps them out of use and *withdraws* the
    # ticket: the server answers which of its tickets it will never touch the arena for
    # again (not running now; one arriving later is refused), and only those pages go back
    # into use.

    @staticmethod
    def begin_ticket(session: Session, ticket: object) -> None:
        """Mark a request as using the arena; refused if its ticket was withdrawn."""
        if isinstance(ticket, bool) or not isinstance(ticket, int):
            raise ProtocolError(f"a ticket must be an int, got {ticket!r}")
        if ticket in session.tickets_withdrawn:
            del session.tickets_withdrawn[ticket]
            raise ProtocolError(f"request {ticket} was withdrawn by the client")
        if ticket in session.tickets_running:
            raise ProtocolError(f"ticket {ticket} is already in use")
        session.tickets_running.add(ticket)

    @staticmethod
    def end_ticket(session: Session, ticket: int) -> None:
        session.tickets_running.discard(ticket)

    @staticmethod
    def withdraw(session: Session, tickets: object) -> list[int]:
        """The tickets among ``tickets`` whose arena pages the client may reuse now."""
        if not isinstance(tickets, list) or len(tickets) > MAX_TICKETS:
            raise ProtocolError(f"tickets must be a list of at most {MAX_TICKETS} ints")
        safe = []
        for ticket in tickets:
            if isinstance(ticket, bool) or not isinstance(ticket, int):
                raise ProtocolError(f"a ticket must be an int, got {ticket!r}")
            if ticket in session.tickets_running:
                continue
            session.tickets_withdrawn[ticket] = None
            if len(session.tickets_withdrawn) > MAX_TICKETS:
                del session.tickets_withdrawn[next(iter(session.tickets_withdrawn))]
            safe.append(ticket)
        return safe

    # -- staged buffers (uploads and message-path transfers) ---------------------------

    def stage(self, session: Session, staged: Staged) -> str:
        """Keep ``staged`` for this session, until ``staged_ttl_s`` from now at most;
        CapacityError past the session's bound or the server's."""
        if session.staged_bytes + staged.nbytes > self.max_session_staged_bytes:
            raise CapacityError(
                f"{staged.nbytes} more staged bytes would exceed a session's bound of "
                f"{self.max_session_staged_bytes} (it holds {session.staged_bytes})"
            )
        if self._staged_total + staged.nbytes > self.max_staged_bytes:
            raise CapacityError(
                f"{staged.nbytes} more staged bytes would exceed the server's bound of "
                f"{self.max_staged_bytes}"
            )
        staged_id = secrets.token_hex(8)
        staged.deadline = self._clock() + self.staged_ttl_s
        session.staged[staged_id] = staged
        session.staged_bytes += staged.nbytes
        self._staged_total += staged.nbytes
        return staged_id

    def staged(self, session: Session, staged_id: object) -> Staged:
        if not isinstance(staged_id, str) or staged_id not in session.staged:
            raise ProtocolError(f"no upload or transfer {staged_id!r} in this session")
        staged = session.staged[staged_id]
        if staged.deadline < self._clock():
            self.unstage(session, staged_id)
            raise ProtocolError(f"upload or transfer {staged_id!r} expired")
        return staged

    def expire_staged(self) -> int:
        """Drop uploads and transfers past their deadline in every session; returns how many
        (a session that renews for ever cannot keep staging space for ever)."""
        now = self._clock()
        gone = [
            (session, staged_id)
            for session in self._sessions.values()
            for staged_id, staged in session.staged.items()
            if staged.deadline < now
        ]
        for session, staged_id in gone:
            self.unstage(session, staged_id)
        return len(gone)

    def unstage(self, session: Session, staged_id: object) -> Staged | None:
        if not isinstance(staged_id, str):
            raise ProtocolError(f"no upload or transfer {staged_id!r} in this session")
        staged = session.staged.pop(staged_id, None)
        if staged is not None:
            session.staged_bytes -= staged.nbytes
            self._staged_total -= staged.nbytes
        return staged

    @property
    def staged_bytes(self) -> int:
        return self._staged_total


__all__ = [
    "MAX_TICKETS",
    "SESSION_STAGED_BYTES",
    "STAGED_TTL_S",
    "Holding",
    "Session",
    "SessionTable",
    "Staged",
]
