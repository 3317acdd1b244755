"""A ``get`` reply as typed values: what the server said about each key.

The server answers a ``get`` with one entry per key (see
:mod:`persisting.service.handler.gets`), and a pooled get that asked to ``learn`` with the
entries plus the placements other clients' puts made lately. :func:`parse_get_reply` turns
that plain-dict reply into the classes below, checking its shape once, so the reader never
guesses it: a malformed reply is a :class:`~persisting.errors.ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from persisting.errors import ProtocolError
from persisting.kv import Layout, SharedLocation


@dataclass(frozen=True, slots=True)
class InPool:
    """A memory-tier value in the server's shared pool: the client copies it out."""

    location: SharedLocation

    @property
    def layout(self) -> Layout:
        return self.location.layout


@dataclass(frozen=True, slots=True)
class InWindow:
    """A memory-tier value the server copied into the arena window the client offered."""

    layout: Layout
    offset: int


@dataclass(frozen=True, slots=True)
class InFile:
    """A value on disk, leased to the client: it reads the payload file itself."""

    layout: Layout
    path: str
    offset: int
    nbytes: int
    checksum: int


@dataclass(frozen=True, slots=True)
class InMemoryNoRoom:
    """A value only in memory where the client offered no room for it: ask again with room."""

    layout: Layout


@dataclass(frozen=True, slots=True)
class Inline:
    """A value sent in the reply itself (message path)."""

    layout: Layout
    data: bytes
    checksum: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """A value staged on the server, read out in parts (message path)."""

    layout: Layout
    transfer: str
    checksum: int


#: What the server said about one key (None: a miss).
Entry = InPool | InWindow | InFile | InMemoryNoRoom | Inline | Transfer


@dataclass(frozen=True, slots=True)
class Told:
    """A placement another client's put made, told so this client can read it unasked."""

    key: str
    location: SharedLocation


@dataclass(frozen=True, slots=True)
class GetReply:
    """The entries of a ``get`` (one per key asked, None for a miss) and what was told."""

    entries: list[Entry | None]
    told: list[Told] = field(default_factory=list)


def parse_get_reply(raw: object, keys: int) -> GetReply:
    """The typed form of a ``get`` reply for ``keys`` keys; ProtocolError if malformed."""
    told: list[Told] = []
    if isinstance(raw, Mapping):  # a reply to ``learn``
        told = _told(raw)
        raw = raw.get("entries")
    if not isinstance(raw, list) or len(raw) != keys:
        raise ProtocolError(f"a get reply needs {keys} entries, got {_describe(raw)}")
    try:
        return GetReply([None if e is None else _entry(e) for e in raw], told)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed get reply entry: {exc}") from exc


def _entry(raw: Mapping[str, Any]) -> Entry:
    layout = Layout.from_dict(raw["layout"])
    if "pool" in raw:
        offset, generation = raw["pool"]
        return InPool(SharedLocation(layout, int(offset), int(generation)))
    if "arena" in raw:
        return InWindow(layout, int(raw["arena"]))
    if "file" in raw:
        path, offset, nbytes, digest = raw["file"]
        return InFile(layout, str(path), int(offset), int(nbytes), int(digest))
    if raw.get("memory"):
        return InMemoryNoRoom(layout)
    if "data" in raw:
        data = raw["data"]
        if not isinstance(data, bytes):
            raise TypeError("inline data must be bytes")
        return Inline(layout, data, int(raw["checksum"]))
    return Transfer(layout, str(raw["transfer"]), int(raw["checksum"]))


def _told(raw: Mapping[str, Any]) -> list[Told]:
    placements = raw.get("told")
    if not placements:
        return []
    try:
        layouts = [Layout.from_dict(d) for d in raw["layouts"]]
        return [
            Told(str(key), SharedLocation(layouts[index], int(offset), int(generation)))
            for key, index, offset, generation in placements
        ]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"malformed placements in a get reply: {exc}") from exc


def _describe(value: object) -> str:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return f"{len(value)}"
    return type(value).__name__


__all__ = [
    "Entry",
    "GetReply",
    "InFile",
    "InMemoryNoRoom",
    "InPool",
    "InWindow",
    "Inline",
    "Told",
    "Transfer",
    "parse_get_reply",
]
