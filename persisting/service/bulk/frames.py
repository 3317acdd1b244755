"""The data path's stream protocol: the one framing every value moves in.

Values (never control messages) move on data connections: TCP to a server's data port
(TLS 1.3 unless the connection is on loopback or the operator turned encryption off:
:mod:`.tls`) or, on the server's host, its Unix socket. All speak these bytes:

* a **frame** is ``<u32 length>`` and a msgpack map of plain values, at most
  :data:`MAX_FRAME_BYTES` (nothing is unpickled; :func:`unpack` refuses anything else);
* a **payload** is raw bytes whose length the frame before it announced.

A connection opens with the client's ``{"id", "secret"}`` frame (the session credential
``hello`` handed out on the control path); the server answers ``{"ok": true}``, an error
frame (its caps are full), or closes without a byte (anything else). Then requests, one at
a time, each answered in step:

``get`` ``{"op": "get", "model", "keys", "expect"?, "pool"?, "learn"?}``: per key a frame
  ``{"miss": true}``, or ``{"layout", "checksum", "tier"}`` and the payload, or (Unix
  socket) ``{"layout", "checksum", "tier", "file": [offset, nbytes]}`` with the open payload
  file passed along (``SCM_RIGHTS``), or, asked ``pool``, ``{"layout", "pool": [offset,
  generation]}`` where the value lies in the server's shared pool (the client copies it
  out); then, asked ``learn``, one frame ``{"told", "layouts"}`` of recent placements.
``put`` ``{"op": "put", "model", "fmt", "items": [{"key", "layout", "parent"}], "pool"?}``:
  then per item its payload and ``<u64 xxh3>`` of it; answered ``{"results": [...]}``.

An error the server answers is ``{"error": {"code", "message"}}`` and ends the request;
a refused put's payloads are still read, so the connection stays in step.

This module is the one codec of these bytes, for the server's blocking threads and the
client's event loop alike, and does no I/O of its own. A reader (:func:`read_frame`,
:func:`read_payload`, :func:`read_checksum`, :func:`skip`) is a generator that yields
each view it needs filled, whole, before it goes on, and returns what it decoded; the
views are the destination itself where a value's bytes land (no copy). The writer of a
put's stream (:func:`write_put`) yields the parts to hand the kernel next. Each side
drives them with its own loop: the server's threads (:mod:`.conn`), the client's event
loop (:mod:`persisting.service.client.link`), both moving bytes with :mod:`.stream`.
"""

from __future__ import annotations

import struct
from collections.abc import Generator, Sequence
from typing import Any, TypeAlias, TypeVar

import msgpack
import xxhash

from persisting.errors import PersistingError, ProtocolError, error_class_for
from persisting.kv import Layout, SharedLocation
from persisting.service.protocol import is_plain

#: Largest frame either side accepts (4096 keys of ~100 bytes fit easily).
MAX_FRAME_BYTES = 4 << 20
#: Items in one put request.
MAX_PUT_ITEMS = 1024
#: Bytes of a payload a receiver takes, and a sender hands the kernel, before hashing them
#: (the streaming xxh3 of the pieces equals the checksum of the whole). A piece of the
#: wire, not of the store's copies and files (``persisting.kv.layout.HASH_PIECE``).
WIRE_PIECE = 512 << 10

LENGTH = struct.Struct("<I")
CHECKSUM = struct.Struct("<Q")

T = TypeVar("T")
#: A reader: yields the views to fill, each whole before it is resumed; returns a ``T``.
Reader: TypeAlias = Generator[memoryview, None, T]


class ConnectionLost(Exception):
    """The connection ended, timed out or carried something unreadable mid-request: what
    it was carrying is lost (a miss), and the connection is not used again. ``timed_out``:
    the peer moved no bytes within the deadline."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def pack(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {len(body)}-byte frame exceeds the data path's limit")
    return LENGTH.pack(len(body)) + body


def frame_length(head: bytes | bytearray) -> int:
    (length,) = LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ConnectionLost(f"a {length}-byte frame exceeds the data path's limit")
    return int(length)


def unpack(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, timestamp=0)
    except Exception as exc:  # garbled bytes: unpack's errors are many
        raise ConnectionLost(f"undecodable frame: {exc}") from exc
    if not isinstance(message, dict) or not is_plain(message):
        raise ConnectionLost("a frame must be a map of plain values")
    return message


def error_frame(exc: PersistingError) -> dict[str, Any]:
    return {"error": {"code": exc.code, "message": str(exc)}}


def raise_error(frame: dict[str, Any]) -> None:
    """Raise the error a frame carries, as its persisting.errors type."""
    error = frame.get("error")
    if error is None:
        return
    if not isinstance(error, dict):
        raise ConnectionLost("a malformed error frame")
    raise error_class_for(str(error.get("code", "")))(str(error.get("message", "")))


def value_header(frame: dict[str, Any]) -> tuple[Layout, int, str]:
    """(layout, checksum, tier) of a value's frame; ConnectionLost if it is not one."""
    try:
        return Layout.from_dict(frame["layout"]), int(frame["checksum"]), str(frame["tier"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConnectionLost(f"unreadable value header: {exc}") from exc


def pool_location(frame: dict[str, Any]) -> SharedLocation:
    """Where a get's value lies in the member's shared pool (a ``pool`` frame)."""
    try:
        offset, generation = frame["pool"]
        return SharedLocation(Layout.from_dict(frame["layout"]), int(offset), int(generation))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConnectionLost(f"unreadable pool location: {exc}") from exc


def placements(frame: dict[str, Any]) -> list[tuple[str, SharedLocation]]:
    """The placements a get's last frame told (key, location)."""
    raise_error(frame)
    rows = frame.get("told") or []
    try:
        layouts = [Layout.from_dict(d) for d in frame.get("layouts") or []]
        return [
            (str(key), SharedLocation(layouts[index], int(offset), int(generation)))
            for key, index, offset, generation in rows
        ]
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ConnectionLost(f"malformed placements: {exc}") from exc


# -- the codec: readers and the put writer, driven by each side's loop --------------------


def read_frame() -> Reader[dict[str, Any]]:
    """A frame: its length, then its body (a receiver that takes files passed along takes
    them with these bytes: they come with a frame's first byte)."""
    head = bytearray(LENGTH.size)
    yield memoryview(head)
    body = bytearray(frame_length(head))
    yield memoryview(body)
    return unpack(body)


def read_payload(view: memoryview) -> Reader[int]:
    """A payload received into ``view`` (its destination), a piece at a time, each piece
    hashed once it landed; returns the checksum of the whole (the streaming xxh3 of the
    pieces equals the checksum of the whole)."""
    hasher = xxhash.xxh3_64()
    for start in range(0, len(view), WIRE_PIECE):
        piece = view[start : start + WIRE_PIECE]
        yield piece
        hasher.update(piece)
    return int(hasher.intdigest())


def read_checksum() -> Reader[int]:
    """The ``<u64 xxh3>`` after a put's payload."""
    raw = bytearray(CHECKSUM.size)
    yield memoryview(raw)
    return int(CHECKSUM.unpack(raw)[0])


def skip(nbytes: int, scratch: memoryview) -> Reader[None]:
    """``nbytes`` read into ``scratch`` and dropped (a payload nobody takes)."""
    while nbytes > 0:
        piece = scratch[: min(len(scratch), nbytes)]
        yield piece
        nbytes -= len(piece)


def write_put(
    message: dict[str, Any], payloads: Sequence[memoryview]
) -> Generator[list[bytes | memoryview], None, None]:
    """A put's stream: its frame, then each payload followed by its checksum. Yields the
    parts to send next (a payload's pieces are its own memory, never copied); resumed once
    they were handed to the kernel, it hashes the piece just sent (the receiver compares
    what landed with what was hashed, so bytes that changed on the way are never stored)."""
    lead = pack(message)
    for payload in payloads:
        view = memoryview(payload).cast("B")
        hasher = xxhash.xxh3_64()
        for start in range(0, len(view), WIRE_PIECE):
            piece = view[start : start + WIRE_PIECE]
            yield [lead, piece]
            hasher.update(piece)
            lead = b""
        lead = CHECKSUM.pack(hasher.intdigest())
    yield [lead]


__all__ = [
    "CHECKSUM",
    "LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_PUT_ITEMS",
    "WIRE_PIECE",
    "ConnectionLost",
    "Reader",
    "error_frame",
    "frame_length",
    "pack",
    "placements",
    "pool_location",
    "raise_error",
    "read_checksum",
    "read_frame",
    "read_payload",
    "skip",
    "unpack",
    "value_header",
    "write_put",
]
