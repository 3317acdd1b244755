"""Who may open a data connection: a per-session credential and the handshake that proves it.

``hello`` (on the control path, under Pulsing's TLS passphrase) hands each session a
:class:`Credential`: a 16-byte key id and a 32-byte secret. A data connection starts with
the client's :data:`HELLO` (80 bytes): the key id, a counter, a random nonce and an
HMAC-SHA256 of all of them under the secret. The server

* reads exactly those 80 bytes within :data:`HANDSHAKE_TIMEOUT_S`, and nothing else;
* looks the key id up among live sessions, checks the MAC, and accepts the counter only if
  it was never accepted for that credential before (:class:`ReplayWindow`), so a sniffed
  handshake cannot be replayed, and one of another session proves nothing here;
* only then answers with :data:`WELCOME`: its own nonce and an HMAC that proves to the
  client it holds the secret too. Any failure closes the connection without a byte sent.

Nothing is unpickled, and the handshake's size is fixed. With sealing (AES-GCM), each
direction's key is derived from the secret and both nonces (:func:`stream_keys`).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
import struct
from dataclasses import dataclass, field

from persisting.errors import ProtocolError

MAGIC = b"PKVB"
VERSION = 1
#: magic, version, mode (0 plain, 1 sealed), reserved, key id, counter, nonce, MAC.
HELLO = struct.Struct("<4sBBH16sQ16s32s")
#: magic, version, mode, status (:data:`OK` or :data:`BUSY`), server nonce, MAC.
WELCOME = struct.Struct("<4sBBH16s32s")
#: How long an unauthenticated connection may take to send its hello.
HANDSHAKE_TIMEOUT_S = 3.0
#: Counters remembered per credential above the floor (older ones are refused outright).
REPLAY_WINDOW = 4096

PLAIN, SEALED = 0, 1
#: A welcome's status: the connection is open, or the server holds all it may (caps).
OK, BUSY = 0, 1

_HELLO_LABEL = b"persisting-bulk-hello\0"
_WELCOME_LABEL = b"persisting-bulk-welcome\0"


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


@dataclass
class ReplayWindow:
    """Counters accepted for one credential: each at most once. Counters at or below the
    floor are refused; above it, the last :data:`REPLAY_WINDOW` accepted ones are kept
    (several connections of one client may arrive out of order)."""

    floor: int = 0
    _seen: set[int] = field(default_factory=set)
    _order: list[int] = field(default_factory=list)

    def accept(self, counter: int) -> bool:
        if counter <= self.floor or counter in self._seen:
            return False
        self._seen.add(counter)
        heapq.heappush(self._order, counter)
        while len(self._order) > REPLAY_WINDOW:
            oldest = heapq.heappop(self._order)
            self._seen.discard(oldest)
            self.floor = max(self.floor, oldest)
        return True


@dataclass
class Credential:
    """A session's right to open data connections (the server's copy)."""

    key_id: bytes
    secret: bytes
    replay: ReplayWindow = field(default_factory=ReplayWindow)

    @classmethod
    def new(cls) -> Credential:
        return cls(secrets.token_bytes(16), secrets.token_bytes(32))

    def to_wire(self) -> dict[str, bytes]:
        """What ``hello`` tells the client (over the control path only)."""
        return {"id": self.key_id, "secret": self.secret}


@dataclass(frozen=True)
class Proof:
    """What a verified hello establishes: the mode, and the client's MAC (which binds the
    server's answer and the stream keys to this very connection)."""

    mode: int
    client_mac: bytes


def client_hello(key_id: bytes, secret: bytes, counter: int, mode: int) -> bytes:
    """The first bytes a client sends on a new data connection."""
    nonce = secrets.token_bytes(16)
    body = HELLO.pack(MAGIC, VERSION, mode, 0, key_id, counter, nonce, b"\0" * 32)[:-32]
    return body + _mac(secret, _HELLO_LABEL, body)


def parse_hello(data: bytes) -> tuple[bytes, int, int, bytes, bytes]:
    """(key id, counter, mode, the signed body, its MAC) of a hello; ProtocolError if it is
    not one (nothing is trusted yet)."""
    if len(data) != HELLO.size:
        raise ProtocolError("short hello")
    magic, version, mode, _reserved, key_id, counter, _nonce, mac = HELLO.unpack(data)
    if magic != MAGIC or version != VERSION or mode not in (PLAIN, SEALED):
        raise ProtocolError("not a data-path hello")
    return key_id, counter, mode, data[:-32], mac


def verify_hello(credential: Credential, data: bytes) -> Proof | None:
    """The proof a hello carries for ``credential``, or None if its MAC is wrong or its
    counter was used before."""
    _key_id, counter, mode, body, mac = parse_hello(data)
    if not hmac.compare_digest(mac, _mac(credential.secret, _HELLO_LABEL, body)):
        return None
    if not credential.replay.accept(counter):
        return None
    return Proof(mode, mac)


def welcome(secret: bytes, proof: Proof, status: int = OK) -> tuple[bytes, bytes]:
    """The server's answer to a verified hello, and its nonce."""
    nonce = secrets.token_bytes(16)
    body = WELCOME.pack(MAGIC, VERSION, proof.mode, status, nonce, b"\0" * 32)[:-32]
    return body + _mac(secret, _WELCOME_LABEL, proof.client_mac, body), nonce


def check_welcome(secret: bytes, hello: bytes, data: bytes) -> tuple[int, int, bytes]:
    """(mode, status, server nonce) of the server's answer to ``hello``; ProtocolError if
    it does not prove the server holds the secret."""
    if len(data) != WELCOME.size:
        raise ProtocolError("short answer to the data-path hello")
    magic, version, mode, status, nonce, mac = WELCOME.unpack(data)
    body = data[:-32]
    expected = _mac(secret, _WELCOME_LABEL, hello[-32:], body)
    if magic != MAGIC or version != VERSION or not hmac.compare_digest(mac, expected):
        raise ProtocolError("the data-path server did not prove it holds the session's secret")
    return mode, status, nonce


def stream_keys(secret: bytes, client_mac: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server, server-to-client) AES-256 keys of one sealed connection."""
    base = client_mac + server_nonce
    return (
        _mac(secret, b"persisting-bulk-c2s\0", base),
        _mac(secret, b"persisting-bulk-s2c\0", base),
    )


__all__ = [
    "BUSY",
    "HANDSHAKE_TIMEOUT_S",
    "HELLO",
    "OK",
    "PLAIN",
    "SEALED",
    "WELCOME",
    "Credential",
    "Proof",
    "ReplayWindow",
    "check_welcome",
    "client_hello",
    "parse_hello",
    "stream_keys",
    "verify_hello",
    "welcome",
]
