"""The header of a payload file: what the file says about itself, sealed by its root.

A payload file (:mod:`persisting.kv.disk.payload_files`) starts with a :data:`HEADER_BYTES`
header: magic, the length and xxh64 of a JSON body, then the body -- the chunk's key,
layout, payload checksum and parent, and ``mac``, an HMAC-SHA256 of those fields under one
of the storage root's keys, named by ``kid`` (:mod:`persisting.lance_store.root_keys`). The
xxh64 catches a damaged header; the seal tells a file a store of this root wrote from one
planted or copied in, which is never indexed or served.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

from persisting.errors import CorruptValueError, StorageIOError
from persisting.kv.layout import Layout
from persisting.lance_store.root_keys import RootKeys, SealingKey

MAGIC = b"PKVCHNK1"
#: The payload format's block: header size and payload alignment, and the unit disk use is
#: counted in. Part of the file format, so it does not follow the host's memory page size
#: (files move between hosts); 4 KiB is also what O_DIRECT and most filesystems want.
BLOCK = 4096
HEADER_BYTES = BLOCK
_PREFIX = struct.Struct("<8sIQ")  # magic, json length, xxh64 of the json
#: The sealed text's encoder (sorted keys, compact), and the plain one: built once, where
#: ``json.dumps`` with arguments builds an encoder per call (a third of a header's cost).
_SEALED_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_PLAIN_JSON = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class FileHeader:
    """What a payload file says about itself.

    Its fields are sealed with the storage root's key (an HMAC-SHA256 over them, in the
    header as ``mac``): a file whose seal does not verify was not written by a store of
    this root -- planted, or copied in from elsewhere -- and is never indexed or served.
    The payload's checksum is among the sealed fields, so its bytes are covered too.
    """

    key: str
    layout: Layout
    checksum: int
    parent: str | None

    def _fields(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "layout": self.layout.to_dict(),
            "checksum": self.checksum,
            "parent": self.parent,
        }

    def with_checksum(self, checksum: int) -> FileHeader:
        """This header for a payload whose checksum is ``checksum``."""
        return FileHeader(self.key, self.layout, checksum, self.parent)

    def seal(self, secret: bytes) -> str:
        return _mac(secret, _SEALED_JSON.encode(self._fields()))

    def encode(self, sealing: SealingKey) -> bytes:
        # The body is the sealed text (the fields, keys sorted) with ``kid`` and ``mac``
        # appended: one encoding of the fields serves both (readers parse it as JSON).
        text = _SEALED_JSON.encode(self._fields())
        mac = _mac(sealing.key, text)
        extra = f',"kid":{_PLAIN_JSON.encode(sealing.id)},"mac":"{mac}"}}'
        body = (text[:-1] + extra).encode("utf-8")
        if _PREFIX.size + len(body) > HEADER_BYTES:
            raise StorageIOError(f"header of {self.key!r} does not fit in {HEADER_BYTES} bytes")
        head = _PREFIX.pack(MAGIC, len(body), xxhash.xxh64_intdigest(body)) + body
        return head + b"\0" * (HEADER_BYTES - len(head))

    @classmethod
    def decode(cls, raw: bytes, keys: RootKeys | None) -> FileHeader:
        """The header in ``raw``; with ``keys``, only if sealed with one of them (else
        :class:`UnsealedFileError`)."""
        if len(raw) < _PREFIX.size:
            raise CorruptValueError("payload header is truncated")
        magic, length, digest = _PREFIX.unpack_from(raw)
        body = raw[_PREFIX.size : _PREFIX.size + length]
        if magic != MAGIC or len(body) != length or xxhash.xxh64_intdigest(body) != digest:
            raise CorruptValueError("payload header is damaged")
        d = json.loads(body)
        header = cls(d["key"], Layout.from_dict(d["layout"]), int(d["checksum"]), d["parent"])
        if keys is not None and not header._sealed_by(d.get("mac"), d.get("kid"), keys):
            raise UnsealedFileError("payload file is not sealed with a key of this storage root")
        return header

    def _sealed_by(self, mac: object, kid: object, keys: RootKeys) -> bool:
        if not isinstance(mac, str):
            return False
        if isinstance(kid, str):
            key = keys.find(kid)
            candidates = [] if key is None else [key]
        else:  # written before headers named their key
            candidates = keys.all()
        return any(hmac.compare_digest(mac, self.seal(key)) for key in candidates)


def _mac(secret: bytes, text: str) -> str:
    return hmac.new(secret, b"persisting-chunk\0" + text.encode(), hashlib.sha256).hexdigest()


class UnsealedFileError(CorruptValueError):
    """A payload file that a store of this root did not write (its seal does not verify)."""


__all__ = ["BLOCK", "HEADER_BYTES", "MAGIC", "FileHeader", "UnsealedFileError"]
