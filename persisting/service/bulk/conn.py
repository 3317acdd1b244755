"""One data connection as the server's thread sees it: every wait bounded by a deadline.

The socket (plain TCP, TLS, or the Unix socket) is non-blocking and each operation takes
a deadline for the whole of it: bytes that trickle in or a reader that takes a little now
and then do not extend it (a kernel timeout per system call would be restarted by every
partial send). Past the deadline the operation fails with ``ConnectionLost(timed_out)``.

The bytes move, and are framed, as on the client's side (:mod:`.stream`, :mod:`.frames`);
what is the server's own is the waiting (``poll``, up to the deadline) and how a value on
disk goes out: with ``sendfile`` (plain TCP), read and sent (TLS), or as the open file
itself passed to the client (Unix socket, ``SCM_RIGHTS``).
"""

from __future__ import annotations

import array
import os
import select
import socket
import ssl
import time
from collections.abc import Sequence
from typing import Any, TypeVar

from persisting.service.bulk.frames import (
    ConnectionLost,
    Reader,
    pack,
    read_checksum,
    read_frame,
    read_payload,
    skip,
)
from persisting.service.bulk.stream import BROKEN, READ, Stream, outgoing

T = TypeVar("T")


def _lost(what: str, exc: BaseException) -> ConnectionLost:
    return ConnectionLost(f"{what}: {exc}")


class Conn(Stream):
    """A server's data connection (see the module docstring). ``kind``: "tcp", "tls" or
    "unix"."""

    def __init__(self, sock: socket.socket, kind: str):
        super().__init__(sock, kind)
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)
        self._events = select.POLLIN
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

    def _wait_for(self, want: int, deadline: float) -> None:
        self.wait(select.POLLIN if want == READ else select.POLLOUT, deadline)

    def wait_request(self) -> None:
        """Wait, as long as it takes, for the next request or the end of the connection."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return
        self.wait(select.POLLIN, None)

    def handshake(self, deadline: float) -> None:
        """Complete the TLS handshake of an SSL socket within ``deadline``."""
        try:
            while want := self.handshake_some():
                self._wait_for(want, deadline)
        except BROKEN as exc:
            raise _lost("TLS handshake failed", exc) from exc

    # -- receiving --------------------------------------------------------------------------

    def recv_into(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` (all of it, or ConnectionLost)."""
        got, size = 0, len(view)
        while got < size:
            n = self.recv_some(view[got:])
            if n > 0:
                got += n
            else:
                self._wait_for(n, deadline)

    def decode(self, reader: Reader[T], deadline: float) -> T:
        """Fill each view a reader of :mod:`.frames` asks for; what it decoded."""
        while True:
            try:
                view = next(reader)
            except StopIteration as done:
                return done.value
            self.recv_into(view, deadline)

    def recv_frame(self, deadline: float) -> dict[str, Any]:
        return self.decode(read_frame(), deadline)

    def recv_payload(self, view: memoryview, deadline: float) -> int:
        """Receive a payload into ``view`` (its destination), hashing each piece as it
        lands; returns the checksum of the whole."""
        return self.decode(read_payload(view), deadline)

    def recv_checksum(self, deadline: float) -> int:
        return self.decode(read_checksum(), deadline)

    def discard(self, nbytes: int, deadline: float) -> None:
        """Read and drop ``nbytes`` (a refused put's payloads)."""
        self.decode(skip(nbytes, self._buffer()), deadline)

    def _buffer(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 20))
        return self._scratch

    # -- sending ----------------------------------------------------------------------------

    def send(self, parts: Sequence[bytes | memoryview], deadline: float) -> None:
        """Send every byte of ``parts``."""
        views = outgoing(parts)
        while views:
            n = self.send_some(views)
            if n < 0:
                self._wait_for(n, deadline)

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
            except BROKEN as exc:
                raise _lost("send failed", exc) from exc
        self.send([frame[sent:]], deadline)

    def send_file(self, fd: int, offset: int, nbytes: int, deadline: float) -> None:
        """Send ``nbytes`` of the file ``fd`` from ``offset``."""
        end = offset + nbytes
        if isinstance(self.sock, ssl.SSLSocket):  # the bytes must pass through the cipher
            scratch = self._buffer()
            while offset < end:
                n = os.preadv(fd, [scratch[: min(len(scratch), end - offset)]], offset)
                if n <= 0:
                    raise ConnectionLost("the payload file ended early")
                self.send([scratch[:n]], deadline)
                offset += n
            return
        while offset < end:
            try:
                sent = os.sendfile(self.sock.fileno(), fd, offset, end - offset)
            except BlockingIOError:
                self.wait(select.POLLOUT, deadline)
                continue
            except BROKEN as exc:
                raise _lost("sendfile failed", exc) from exc
            if sent == 0:
                raise ConnectionLost("the payload file ended early")
            offset += sent


__all__ = ["Conn"]
