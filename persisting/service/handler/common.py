"""What the server's request paths share: its stores, sessions and counters, and checks.

:class:`ServerState` is handed to the control operations (:mod:`.dispatch`,
:mod:`.index_ops`) and to the data path (:mod:`persisting.service.bulk`); the dispatcher
owns it. Every mutation of the session table happens under :attr:`ServerState.lock`,
since requests run on several threads at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from persisting.errors import AccessDeniedError, InvalidValueError, PersistingError, ProtocolError
from persisting.kv import KVStore, Layout
from persisting.lance_store.names import validate_name
from persisting.service.handler.placements import PlacementFeed
from persisting.service.sessions import SessionTable

#: Opens the namespace a client named (a server started without models serves any).
Opener = Callable[[str], KVStore]
#: Told which keys of a namespace were just read (``"read"``) or stored (``"put"``).
UseHook = Callable[[str, list[str], str], None]


class ServerState:
    """The stores a server serves and the sessions of its clients.

    With an ``opener`` (a server started without naming its models, as a fleet's members
    are) a namespace an authenticated client names is opened on first use and served from
    then on, with the same budget and identity checks as one named at start-up.
    """

    def __init__(
        self,
        stores: Mapping[str, KVStore],
        sessions: SessionTable,
        *,
        lease_ttl_s: float,
        opener: Opener | None = None,
    ):
        self.stores = dict(stores)
        self.opener = opener
        #: Told of reads and puts (a member's replicator, which copies what is used).
        self.on_use: UseHook | None = None
        self._opening = threading.Lock()  # one namespace opened at a time, once
        self.sessions = sessions
        self.lease_ttl_s = lease_ttl_s
        self.lock = threading.Lock()  # guards the session table across threads
        self.counters: Counter[str] = Counter()
        #: Recent pool placements, told to same-host readers with their gets.
        self.placements = PlacementFeed()

    def store(self, model: object) -> KVStore:
        """The store of ``model``; AccessDeniedError if this server does not serve it."""
        name = validate_name(model, "model")
        store = self.stores.get(name)
        if store is not None:
            return store
        if self.opener is None:
            raise AccessDeniedError(
                f"this server does not serve model {model!r} (it serves {sorted(self.stores)})"
            )
        with self._opening:
            store = self.stores.get(name)
            if store is None:
                store = self.opener(name)
                self.stores[name] = store  # one assignment: readers see it whole or not
        return store

    def used(self, model: object, keys: list[str], how: str) -> None:
        """Tell :attr:`on_use` that ``keys`` of ``model`` were read or stored (a hook that
        fails never fails the request)."""
        hook = self.on_use
        if hook is not None and keys and isinstance(model, str):
            with contextlib.suppress(Exception):
                hook(model, keys, how)

    def serves(self, model: object) -> bool:
        """Whether ``model`` is open here already (no opening)."""
        return isinstance(model, str) and model in self.stores


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
    "Opener",
    "ServerState",
    "UseHook",
    "layout_from",
    "optional_layout",
    "plain_stats",
    "quietly",
]
