"""One data connection as the server's thread sees it: every wait bounded by a deadline.

The socket (plain TCP, TLS, or the Unix socket) is non-blocking and each operation takes
a deadline for the whole of it: bytes that trickle in or a reader that takes a little now
and then do not extend it (a kernel timeout per system call would be restarted by every
partial send). Past the deadline the operation fails with ``ConnectionLost(timed_out)``.

A TCP receiver waits for a payload piece with the socket's low-water mark at the bytes
still missing (``SO_RCVLOWAT``), so it is woken once per piece instead of once per
segment. A value on disk goes out with ``sendfile`` (plain TCP), read and sent (TLS), or
as the open file itself passed to the client (Unix socket, ``SCM_RIGHTS``).
"""

from __future__ import annotations

import array
import contextlib
import os
import select
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any

import xxhash

from persisting.service.bulk.frames import (
    CHECKSUM,
    LENGTH,
    WIRE_PIECE,
    ConnectionLost,
    frame_length,
    pack,
    unpack,
)

#: What a peer that went away or sent garbage raises on a socket.
_BROKEN = (OSError, ValueError)


def _lost(what: str, exc: BaseException) -> ConnectionLost:
    return ConnectionLost(f"{what}: {exc}")


class Conn:
    """A server's data connection (see the module docstring). ``kind``: "tcp", "tls" or
    "unix"."""

    def __init__(self, sock: socket.socket, kind: str):
        sock.setblocking(False)
        self.sock = sock
        self.kind = kind
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._events = select.POLLIN
        self._lowat = 1
        self._scratch: memoryview | None = None

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, events: int, deadline: float | None) -> None:
        """Wait until the socket is ready for ``events``; ConnectionLost(timed_out) past
        ``deadline`` (None: no deadline)."""
        if events != self._events:
            self._poller.modify(self.sock, events)
            self._events = events
        timeout = -1
        if deadline is not None:
            timeout = int((deadline - time.monotonic()) * 1000)
            if timeout <= 0:
                raise ConnectionLost("the peer moved no bytes within the deadline", True)
        if not self._poller.poll(timeout):
            raise ConnectionLost("the peer moved no bytes within the deadline", True)

    def wait_request(self) -> None:
        """Wait, as long as it takes, for the next request or the end of the connection."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return
        self.wait(select.POLLIN, None)

    def handshake(self, deadline: float) -> None:
        """Complete the TLS handshake of an SSL socket within ``deadline``."""
        assert isinstance(self.sock, ssl.SSLSocket)
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                self.wait(select.POLLIN, deadline)
            except ssl.SSLWantWriteError:
                self.wait(select.POLLOUT, deadline)
            except _BROKEN as exc:
                raise _lost("TLS handshake failed", exc) from exc

    # -- receiving --------------------------------------------------------------------------

    def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` (all of it, or ConnectionLost)."""
        got, size = 0, len(view)
        while got < size:
            try:
                n = self.sock.recv_into(view[got:], size - got)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._mark(size - got)
                self.wait(select.POLLIN, deadline)
                continue
            except ssl.SSLWantWriteError:
                self.wait(select.POLLOUT, deadline)
                continue
            except _BROKEN as exc:
                raise _lost("receive failed", exc) from exc
            if n == 0:
                raise ConnectionLost("the peer closed the connection")
            got += n
        self._mark(1)

    def _mark(self, nbytes: int) -> None:
        """The low-water mark of a plain TCP socket (other kinds wake on any byte)."""
        if self.kind == "tcp" and nbytes != self._lowat:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self._lowat = nbytes

    def recv_frame(self, deadline: float) -> dict[str, Any]:
        head = bytearray(LENGTH.size)
        self.recv_into(memoryview(head), deadline)
        body = bytearray(frame_length(head))
        self.recv_into(memoryview(body), deadline)
        return unpack(body)

    def recv_payload(self, view: memoryview, deadline: float) -> int:
        """Receive a payload into ``view`` (its destination), hashing each piece as it
        lands; returns the checksum of the whole."""
        hasher = xxhash.xxh3_64()
        for start in range(0, len(view), WIRE_PIECE):
            piece = view[start : start + WIRE_PIECE]
            self.recv_into(piece, deadline)
            hasher.update(piece)
        return int(hasher.intdigest())

    def recv_checksum(self, deadline: float) -> int:
        raw = bytearray(CHECKSUM.size)
        self.recv_into(memoryview(raw), deadline)
        return int(CHECKSUM.unpack(raw)[0])

    def discard(self, nbytes: int, deadline: float) -> None:
        """Read and drop ``nbytes`` (a refused put's payloads)."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        while nbytes > 0:
            piece = self._scratch[: min(len(self._scratch), nbytes)]
            self.recv_into(piece, deadline)
            nbytes -= len(piece)

    # -- sending ----------------------------------------------------------------------------

    def send(self, parts: Sequence[bytes | memoryview], deadline: float) -> None:
        """Send every byte of ``parts``."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            try:
                tls = self.kind == "tls"  # no sendmsg on TLS
                sent = self.sock.send(views[0]) if tls else self.sock.sendmsg(views)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self.wait(select.POLLOUT, deadline)
                continue
            except ssl.SSLWantReadError:
                self.wait(select.POLLIN, deadline)
                continue
            except _BROKEN as exc:
                raise _lost("send failed", exc) from exc
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def send_frame(
        self, message: dict[str, Any], deadline: float, payload: memoryview | None = None
    ) -> None:
        """A frame, and the payload it announces if given."""
        frame = pack(message)
        self.send([frame] if payload is None else [frame, payload], deadline)

    def send_with_file(self, message: dict[str, Any], fd: int, deadline: float) -> None:
        """A frame with the open file ``fd`` passed along (Unix socket only)."""
        frame = memoryview(pack(message))
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        while True:
            try:
                sent = self.sock.sendmsg([frame], rights)
                break
            except BlockingIOError:
                self.wait(select.POLLOUT, deadline)
            except _BROKEN as exc:
                raise _lost("send failed", exc) from exc
        self.send([frame[sent:]], deadline)

    def send_file(self, fd: int, offset: int, nbytes: int, deadline: float) -> None:
        """Send ``nbytes`` of the file ``fd`` from ``offset``."""
        end = offset + nbytes
        if isinstance(self.sock, ssl.SSLSocket):  # the bytes must pass through the cipher
            if self._scratch is None:
                self._scratch = memoryview(bytearray(1 << 20))
            while offset < end:
                n = os.preadv(fd, [self._scratch[: min(len(self._scratch), end - offset)]], offset)
                if n <= 0:
                    raise ConnectionLost("the payload file ended early")
                self.send([self._scratch[:n]], deadline)
                offset += n
            return
        while offset < end:
            try:
                sent = os.sendfile(self.sock.fileno(), fd, offset, end - offset)
            except BlockingIOError:
                self.wait(select.POLLOUT, deadline)
                continue
            except _BROKEN as exc:
                raise _lost("sendfile failed", exc) from exc
            if sent == 0:
                raise ConnectionLost("the payload file ended early")
            offset += sent

    # -- the end ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End the connection from another thread: the thread serving it wakes, fails, and
        closes it itself (closing here could let a new connection reuse the descriptor
        under that thread)."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        with contextlib.suppress(OSError):
            self.sock.close()


__all__ = ["Conn"]
