"""A data connection's non-blocking socket, for the server's threads and the client's event
loop alike: the system calls that move bytes, and what each waits for when it cannot.

:class:`Stream` never waits. Each of its attempts (:meth:`~Stream.recv_some`,
:meth:`~Stream.send_some`, :meth:`~Stream.handshake_some`) makes what progress the socket
allows at once, or answers :data:`READ` or :data:`WRITE`: what the socket must become
ready for before the caller tries again. The server's connection (:mod:`.conn`) waits on
``poll`` with a deadline, the client's (:mod:`persisting.service.client.link`) on its
event loop; the readers and the put writer of :mod:`.frames` say which bytes to move.

A TCP receiver waits for the rest of a view with the socket's low-water mark at the bytes
still missing (``SO_RCVLOWAT``), so it is woken once per piece instead of once per
segment. Bytes are received straight into the view they were asked for and sent from the
caller's memory (``sendmsg`` of all the parts at once; TLS one part at a time).
"""

from __future__ import annotations

import array
import contextlib
import socket
import ssl
from collections.abc import Sequence

from persisting.service.bulk.frames import ConnectionLost

#: What a peer that went away or sent garbage raises on a socket.
BROKEN = (OSError, ValueError)

#: An attempt's answer when the socket must become readable, or writable, first.
READ = -1
WRITE = -2

#: Room for the one file descriptor a frame may carry.
_RIGHTS_SPACE = socket.CMSG_SPACE(array.array("i", [0]).itemsize)


class Stream:
    """One data connection's socket (see the module docstring). ``kind``: "tcp", "tls" or
    "unix"."""

    def __init__(self, sock: socket.socket, kind: str):
        sock.setblocking(False)
        self.sock = sock
        self.kind = kind
        self._lowat = 1

    def recv_some(self, view: memoryview, files: list[int] | None = None) -> int:
        """Receive into ``view`` what has arrived: the number of bytes (at least one), or
        READ / WRITE; ConnectionLost if the peer ended or broke the connection. With
        ``files``, a Unix socket's files passed along with these bytes are added to it."""
        try:
            if files is not None and self.kind == "unix":
                n, ancillary, _flags, _addr = self.sock.recvmsg_into([view], _RIGHTS_SPACE)
                _keep_files(ancillary, files)
            else:
                n = self.sock.recv_into(view)
        except (BlockingIOError, ssl.SSLWantReadError):
            self._mark(len(view))
            return READ
        except ssl.SSLWantWriteError:
            return WRITE
        except BROKEN as exc:
            raise ConnectionLost(f"receive failed: {exc}") from exc
        if n == 0:
            raise ConnectionLost("the peer closed the connection")
        if n == len(view):
            self._mark(1)
        return int(n)

    def _mark(self, nbytes: int) -> None:
        """Wake the reader once ``nbytes`` are queued (plain TCP; others on any byte)."""
        if self.kind == "tcp" and nbytes != self._lowat:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self._lowat = nbytes

    def send_some(self, views: list[memoryview]) -> int:
        """Send what the socket takes of ``views`` (bytes, not empty) and drop it from
        them: the number of bytes, or READ / WRITE."""
        try:
            tls = self.kind == "tls"  # no sendmsg on TLS
            sent = self.sock.send(views[0]) if tls else self.sock.sendmsg(views)
        except (BlockingIOError, ssl.SSLWantWriteError):
            return WRITE
        except ssl.SSLWantReadError:
            return READ
        except BROKEN as exc:
            raise ConnectionLost(f"send failed: {exc}") from exc
        done = sent
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
        return done

    def handshake_some(self) -> int:
        """Go on with the TLS handshake of an SSL socket: 0 once it is complete, or READ /
        WRITE (its errors are raised as they are)."""
        assert isinstance(self.sock, ssl.SSLSocket)
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            return READ
        except ssl.SSLWantWriteError:
            return WRITE
        return 0

    def shutdown(self) -> None:
        """End the connection, from any thread: the one using it wakes, fails, and closes
        it itself (closing it from another could let a new connection reuse the descriptor
        under that thread)."""
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        with contextlib.suppress(OSError):
            self.sock.close()


def outgoing(parts: Sequence[bytes | memoryview]) -> list[memoryview]:
    """The views :meth:`Stream.send_some` takes: the parts' bytes, empty ones left out."""
    return [memoryview(p).cast("B") for p in parts if len(p)]


def _keep_files(ancillary: list[tuple[int, int, bytes]], files: list[int]) -> None:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            files.extend(fds)


__all__ = ["BROKEN", "READ", "WRITE", "Stream", "outgoing"]
