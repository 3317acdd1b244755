"""What the server's request paths share: its stores, sessions and counters, and checks.

:class:`ServerState` is handed to the put paths, the get paths and the index operations;
the dispatcher (:mod:`.dispatch`) owns it. Every mutation of the session table happens
under :attr:`ServerState.lock`, since requests run on several threads at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from persisting.errors import AccessDeniedError, InvalidValueError, PersistingError, ProtocolError
from persisting.kv import KVStore, Layout
from persisting.lance_store.names import validate_name
from persisting.service.handler.placements import PlacementFeed
from persisting.service.same_host import ServerArenaMapping
from persisting.service.sessions import Session, SessionTable

#: Largest payload part one message carries on the message path (by default).
DEFAULT_MESSAGE_PART_BYTES = 4 << 20

#: A stored value whose layout differs from what the reader expects: a miss, not a hit.
LAYOUT_MISS = object()


class ServerState:
    """The stores a server serves and the sessions of its clients."""

    def __init__(
        self,
        stores: Mapping[str, KVStore],
        sessions: SessionTable,
        *,
        lease_ttl_s: float,
        message_part_bytes: int,
    ):
        self.stores = dict(stores)
        self.sessions = sessions
        self.lease_ttl_s = lease_ttl_s
        self.message_part_bytes = message_part_bytes
        self.lock = threading.Lock()  # guards the session table across threads
        self.counters: Counter[str] = Counter()
        #: Recent pool placements, told to same-host readers with their gets.
        self.placements = PlacementFeed()

    def store(self, model: str | None) -> KVStore:
        """The store of ``model``; AccessDeniedError if this server does not serve it."""
        validate_name(model, "model")
        assert model is not None
        store = self.stores.get(model)
        if store is None:
            raise AccessDeniedError(
                f"this server does not serve model {model!r} (it serves {sorted(self.stores)})"
            )
        return store

    @contextlib.contextmanager
    def ticket(self, session: Session, ticket: object, needed: bool) -> Iterator[None]:
        """Hold ``ticket`` while a request reads or writes the client's arena (see
        :meth:`SessionTable.begin_ticket`); ``needed`` says whether the request touches it."""
        if not needed:
            yield
            return
        if ticket is None:
            raise ProtocolError("a request that uses the shared-memory arena needs a ticket")
        with self.lock:
            self.sessions.begin_ticket(session, ticket)
        try:
            yield
        finally:
            with self.lock:
                self.sessions.end_ticket(session, ticket)  # type: ignore[arg-type]


def arena_of(session: Session, required: bool = True) -> ServerArenaMapping | None:
    """The client's arena as this server mapped it (None, or ProtocolError, if none)."""
    for resource in session.resources:
        if isinstance(resource, ServerArenaMapping):
            return resource
    if required:
        raise ProtocolError("this session has no shared-memory arena")
    return None


def layout_from(value: object) -> Layout:
    if not isinstance(value, Mapping):
        raise ProtocolError("a layout must be a dict")
    try:
        layout = Layout.from_dict(dict(value))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed layout {value!r}: {exc}") from exc
    if layout.nbytes <= 0 or layout.kind not in ("torch", "numpy", "bytes"):
        raise InvalidValueError(f"unusable layout {value!r}")
    return layout


def optional_layout(value: object) -> Layout | None:
    return None if value is None else layout_from(value)


def plain_stats(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Store stats reduced to plain values (the wire carries nothing else)."""
    out: dict[str, Any] = {}
    for name, value in stats.items():
        if isinstance(value, Mapping):
            out[str(name)] = plain_stats(value)
        elif isinstance(value, bool | int | float | str) or value is None:
            out[str(name)] = value
        else:
            out[str(name)] = str(value)
    return out


def quietly(fn: Callable[..., Any], *args: Any) -> None:
    with contextlib.suppress(PersistingError):
        fn(*args)


__all__ = [
    "DEFAULT_MESSAGE_PART_BYTES",
    "LAYOUT_MISS",
    "ServerState",
    "arena_of",
    "layout_from",
    "optional_layout",
    "plain_stats",
    "quietly",
]
