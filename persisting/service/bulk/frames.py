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
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from persisting.errors import PersistingError, ProtocolError, error_class_for
from persisting.kv import Layout
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


__all__ = [
    "CHECKSUM",
    "LENGTH",
    "MAX_FRAME_BYTES",
    "MAX_PUT_ITEMS",
    "WIRE_PIECE",
    "ConnectionLost",
    "error_frame",
    "frame_length",
    "pack",
    "raise_error",
    "unpack",
    "value_header",
]
