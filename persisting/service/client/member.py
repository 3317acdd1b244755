"""One storage node as a client sees it: its actor, session, data connections and pool.

A member's failure (no connection, a broken socket, no answer in time) is
:class:`MemberFailed`, distinct from an error the server *answered* with: the first takes
the member out of use until a probe reaches it again, the second is the caller's.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import pulsing

from persisting.kv import SharedLocation
from persisting.service.client.link import DataLink
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
class Member:
    """One storage node: its actor, session, data connections and shared pool."""

    addr: str
    node_id: int
    ref: Any
    semaphore: asyncio.Semaphore
    sid: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: Its data connections (None until ``hello`` named them).
    link: DataLink | None = None
    #: Its shared pool, mapped read-only (same host only).
    pool: SharedPoolReader | None = None
    #: Where memory-tier values lay in the pool when last reported. A hit here needs no
    #: request; the generation check proves it current.
    locations: OrderedDict[str, SharedLocation] = field(default_factory=OrderedDict)
    #: Keys read through ``locations`` that the server has not been told of yet (recency).
    touched: list[str] = field(default_factory=list)
    #: The pool was dropped when the member failed: map it again once it answers.
    needs_restore: bool = False
    hello_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def same_host(self) -> bool:
        """Its data connections go over its Unix socket (it runs on this host)."""
        return self.link is not None and self.link.unix

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


__all__ = ["TRANSPORT_ERRORS", "Member", "MemberFailed", "describe_failure"]
