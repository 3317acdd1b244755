"""One storage node as a client sees it: its actors, session and same-host resources.

A member's failure (no connection, a broken socket, no answer in time) is
:class:`MemberFailed`, distinct from an error the server *answered* with: the first takes
the member out of use until a probe reaches it again, the second is the caller's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pulsing

from persisting.kv import SharedLocation
from persisting.service.client.bulk import BulkLink
from persisting.service.local_channel import LocalChannel
from persisting.service.same_host import Region
from persisting.shm import SharedPoolReader, pid_alive

#: Failures of the transport (not of the request): the member is treated as gone.
TRANSPORT_ERRORS = (RuntimeError, OSError, asyncio.TimeoutError, pulsing.PulsingError)


class MemberFailed(Exception):
    """A member could not be reached or did not answer in time."""

    def __init__(self, member: str, cause: BaseException):
        super().__init__(f"{member}: {describe_failure(cause)}")
        self.member = member
        #: The cause in one plain line (no Pulsing JSON), for logs.
        self.reason = describe_failure(cause)


_PULSING_MARK = "__PULSING_ERROR__:"


def describe_failure(cause: BaseException) -> str:
    """``cause`` in one plain line: Pulsing's ``__PULSING_ERROR__:{json}`` errors become
    their ``message`` (a log line must not carry escaped JSON)."""
    text = str(cause)
    if _PULSING_MARK in text:
        detail = text.partition(_PULSING_MARK)[2]
        try:
            data = json.loads(detail)
            text = str(data.get("message") or data.get("kind") or detail)
        except ValueError:
            text = detail
    text = " ".join(text.split())
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__


@dataclass
class Loan:
    """Arena regions lent to a member for one request of session ``sid`` (to the server
    process ``pid``, on this host): the server may still read or write them, so they stay
    out of use until it says it never will (see :mod:`~persisting.service.client.regions`)."""

    sid: str | None
    pid: int | None
    regions: list[Region]


@dataclass
class Member:
    """One storage node: its actors, session and same-host data path."""

    addr: str
    node_id: int
    refs: list[Any]
    semaphore: asyncio.Semaphore
    sid: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: The same-host paths are in use (the server mapped this client's arena).
    same_host: bool = False
    channel: LocalChannel | None = None
    pool: SharedPoolReader | None = None
    #: Data connections for values (another host: the bulk data path), if the server has one.
    bulk: BulkLink | None = None
    #: Where memory-tier values lay in the member's shared pool when last reported. A hit
    #: here needs no request; the generation check proves it current.
    locations: OrderedDict[str, SharedLocation] = field(default_factory=OrderedDict)
    #: Keys read through ``locations`` that the server has not been told of yet (recency).
    touched: list[str] = field(default_factory=list)
    #: Read leases to give back with the next request.
    pending_release: list[str] = field(default_factory=list)
    #: Arena regions the server may still touch, by the ticket of their request.
    loans: dict[int, Loan] = field(default_factory=dict)
    #: The pool and local channel were dropped when the member failed: restore them once
    #: it answers again.
    needs_restore: bool = False
    lane: itertools.count = field(default_factory=itertools.count)
    hello_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def next_ref(self) -> Any:
        return self.refs[next(self.lane) % len(self.refs)]

    @property
    def pid(self) -> int | None:
        pid = self.info.get("node", {}).get("pid")
        return pid if isinstance(pid, int) else None

    def process_gone(self) -> bool:
        """True when the member is a process on this host that no longer exists (one
        syscall: remembered locations are read without asking, so this is how a killed
        server's keys become misses at once rather than at the next keepalive)."""
        pid = self.pid
        return self.same_host and pid is not None and not pid_alive(pid)


__all__ = ["TRANSPORT_ERRORS", "Loan", "Member", "MemberFailed", "describe_failure"]
