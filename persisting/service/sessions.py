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

import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from persisting.errors import CapacityError, ProtocolError, SessionExpiredError

#: (model, key) -- what a pin or a lease is taken on.
Holding = tuple[str, str]

#: Most tickets one withdraw may name, and withdrawn tickets a session remembers.
MAX_TICKETS = 4096


@dataclass
class Staged:
    """A payload buffer being uploaded by, or read out to, one session."""

    buffer: Any  # a writable uint8 numpy array
    nbytes: int
    checksum: int | None = None
    layout: dict[str, Any] | None = None
    received: int = 0


@dataclass
class Session:
    """One connected client and what it holds."""

    sid: str
    client: dict[str, Any]
    deadline: float
    pins: Counter[Holding] = field(default_factory=Counter)
    leases: Counter[Holding] = field(default_factory=Counter)
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
    ):
        self.ttl_s = ttl_s
        self.max_staged_bytes = max_staged_bytes
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._lease_counts: Counter[Holding] = Counter()
        self._staged_total = 0

    def __len__(self) -> int:
        return len(self._sessions)

    # -- sessions ---------------------------------------------------------------------

    def open(self, client: dict[str, Any]) -> Session:
        sid = secrets.token_hex(16)
        session = Session(sid=sid, client=dict(client), deadline=self._clock() + self.ttl_s)
        self._sessions[sid] = session
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
        for holding, count in session.leases.items():
            self._lease_counts[holding] -= count
            if self._lease_counts[holding] <= 0:
                del self._lease_counts[holding]
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

    # -- read leases (counted across sessions) ----------------------------------------

    def add_lease(self, session: Session, holding: Holding) -> None:
        session.leases[holding] += 1
        self._lease_counts[holding] += 1

    def drop_lease(self, session: Session, holding: Holding) -> bool:
        """Drop one lease; True if no session leases ``holding`` any more."""
        if session.leases[holding] <= 0:
            session.leases.pop(holding, None)
            return False
        session.leases[holding] -= 1
        if not session.leases[holding]:
            del session.leases[holding]
        self._lease_counts[holding] -= 1
        if self._lease_counts[holding] <= 0:
            del self._lease_counts[holding]
            return True
        return False

    def is_leased(self, holding: Holding) -> bool:
        return self._lease_counts.get(holding, 0) > 0

    @property
    def lease_count(self) -> int:
        return sum(self._lease_counts.values())

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
        """Keep ``staged`` for this session; CapacityError past the server's bound."""
        if self._staged_total + staged.nbytes > self.max_staged_bytes:
            raise CapacityError(
                f"{staged.nbytes} more staged bytes would exceed the server's bound of "
                f"{self.max_staged_bytes}"
            )
        staged_id = secrets.token_hex(8)
        session.staged[staged_id] = staged
        session.staged_bytes += staged.nbytes
        self._staged_total += staged.nbytes
        return staged_id

    @staticmethod
    def staged(session: Session, staged_id: object) -> Staged:
        if not isinstance(staged_id, str) or staged_id not in session.staged:
            raise ProtocolError(f"no upload or transfer {staged_id!r} in this session")
        return session.staged[staged_id]

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


__all__ = ["MAX_TICKETS", "Holding", "Session", "SessionTable", "Staged"]
