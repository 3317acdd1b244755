"""The data path's server: a TCP listener and a Unix socket, admission, and one thread per
connection.

It listens on the host the settings name, at ``service.bulk_port`` (nowhere else), and on a
Unix socket in a private folder for clients on this host. A connection goes through:

1. **Admission.** At most :data:`MAX_PENDING` connections are unauthenticated at once, and
   at most :data:`MAX_PENDING_PER_SOURCE` from one address (one process, on the Unix
   socket; another user's connection is closed at once); one more is closed unread.
2. **Handshake**, within :data:`HANDSHAKE_TIMEOUT_S` in all, however slowly bytes come:
   TLS 1.3 on TCP off loopback unless encryption is turned off (:mod:`.tls`), then the
   session's credential frame. Anything else: closed without a byte sent.
3. **Caps** on authenticated connections, keyed by what the server verifies, never by
   what a client says (``hello``'s host and pid are the client's word):
   :data:`MAX_PER_SESSION` per session (its credential), :data:`MAX_PER_CLIENT` per client
   process on the Unix socket (the peer's pid from ``SO_PEERCRED``), ``max_per_address``
   per peer address over TCP (half of ``max_connections`` by default, so one host never
   holds them all), ``max_connections`` per server. Over one, the answer is an error frame
   saying which, and the connection ends.
4. **Requests**, one at a time (:mod:`.requests`), each renewing its session; each value of
   a reply or a put must move within ``io_timeout_s`` or the connection is closed.
5. **End**: the client closes, its session ends (its connections are shut down with it),
   garbage arrives, or a deadline passes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from persisting.errors import CapacityError, PersistingError, ProtocolError
from persisting.service.bulk.conn import Conn
from persisting.service.bulk.frames import ConnectionLost, error_frame
from persisting.service.bulk.requests import Requests
from persisting.service.bulk.tls import ServerIdentity
from persisting.service.handler.common import ServerState
from persisting.service.sessions import Session
from persisting.shm import pid_alive

logger = logging.getLogger("persisting.service.bulk")

#: Connections that may be unauthenticated at once, and of them from one address.
MAX_PENDING = 128
MAX_PENDING_PER_SOURCE = 16
#: How long a connection may take, in all, from its accept to its credential.
HANDSHAKE_TIMEOUT_S = 5.0
#: Authenticated connections one session, and one client process (on the Unix socket, by
#: its kernel-reported pid), may hold.
MAX_PER_SESSION = 16
MAX_PER_CLIENT = 32
#: Folders of the Unix sockets: ``persisting-kv-<pid>-...`` in the temporary directory.
SOCKET_PREFIX = "persisting-kv-"

_PEERCRED = struct.Struct("3i")


def is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class BulkServer:
    """Serves gets and puts of the stores in ``state`` on data connections."""

    def __init__(
        self,
        state: ServerState,
        host: str,
        port: int,
        *,
        encrypt: bool = True,
        io_timeout_s: float = 30.0,
        max_connections: int = 256,
        handshake_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = MAX_PENDING,
        max_pending_per_source: int = MAX_PENDING_PER_SOURCE,
        max_per_session: int = MAX_PER_SESSION,
        max_per_client: int = MAX_PER_CLIENT,
        max_per_address: int | None = None,
    ):
        self.state = state
        self.host = host
        self.port = port
        #: TLS for TCP connections off loopback (None: plain everywhere).
        self.identity = ServerIdentity.generate() if encrypt and not is_loopback(host) else None
        self.max_connections = max_connections
        self.handshake_s = handshake_s
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending_per_source
        self.max_per_session = max_per_session
        self.max_per_client = max_per_client
        #: Authenticated TCP connections from one peer address (default: half the server's).
        self.max_per_address = (
            max_per_address if max_per_address is not None else max(1, max_connections // 2)
        )
        self.requests = Requests(state, io_timeout_s)
        self._listening: list[socket.socket] = []
        self._folder: Path | None = None
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        #: Authenticated connections per verified peer: ``pid:<n>`` (Unix) or an address.
        self._per_peer: Counter[str] = Counter()
        self._active = 0
        self._closed = False
        #: Refused connections by reason, and other figures (read by ``stats``).
        self.figures: Counter[str] = Counter()

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Listen; returns what ``hello`` tells clients (host, port, Unix socket, the
        certificate to pin or None)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        tcp = socket.socket(family, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((self.host, self.port))
        tcp.listen(128)
        self.port = int(tcp.getsockname()[1])
        self._listen(tcp, "tcp")
        remove_orphaned_sockets()
        # mode 0700; the pid in the name lets a later server remove it if this one is killed
        self._folder = Path(tempfile.mkdtemp(prefix=f"{SOCKET_PREFIX}{os.getpid()}-"))
        path = self._folder / "data.sock"
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(str(path))
        os.chmod(path, 0o600)
        unix.listen(128)
        self._listen(unix, "unix")
        return {
            "host": self.host,
            "port": self.port,
            "unix": str(path),
            "cert": self.identity.cert_pem if self.identity is not None else None,
        }

    def _listen(self, listener: socket.socket, kind: str) -> None:
        self._listening.append(listener)
        threading.Thread(
            target=self._accept, args=(listener, kind), name=f"kv-data-{kind}", daemon=True
        ).start()

    def close(self) -> None:
        self._closed = True
        for listener in self._listening:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            listener.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                **self.figures,
                "connections": self._active,
                "pending": sum(self._pending.values()),
            }

    # -- admission and handshake ----------------------------------------------------------

    def _accept(self, listener: socket.socket, kind: str) -> None:
        while not self._closed:
            try:
                sock, peer = listener.accept()
            except OSError:
                return  # closed
            source = _source(sock, peer, kind)
            with self._lock:
                admitted = (
                    source is not None
                    and not self._closed
                    and sum(self._pending.values()) < self.max_pending
                    and self._pending[source] < self.max_pending_per_source
                )
                if admitted:
                    self._pending[str(source)] += 1
                else:
                    self.figures["refused_pending" if source else "refused_user"] += 1
            if not admitted:
                sock.close()
                continue
            threading.Thread(
                target=self._connection,
                args=(sock, kind, str(source)),
                name="kv-data-conn",
                daemon=True,
            ).start()

    def _connection(self, sock: socket.socket, kind: str, source: str) -> None:
        try:
            opened = self._handshake(sock, kind, source)
        finally:
            with self._lock:
                self._pending[source] -= 1
                if not self._pending[source]:
                    del self._pending[source]
        if opened is None:
            return
        conn, session = opened
        try:
            self._serve(conn, session)
        except (ConnectionLost, OSError):
            pass  # the client went away, the session ended, garbage arrived, or too slow
        except Exception:  # a bug: log it, drop the connection, keep serving others
            logger.exception("data connection failed")
        finally:
            self._unregister(conn, session, source)
            conn.close()

    def _handshake(
        self, sock: socket.socket, kind: str, source: str
    ) -> tuple[Conn, Session] | None:
        """The authenticated connection and its session, or None (closed without a
        byte): TLS where needed and the credential, within the handshake's deadline."""
        deadline = time.monotonic() + self.handshake_s
        conn = Conn(sock, kind)
        try:
            if (
                kind == "tcp"
                and self.identity is not None
                and not is_loopback(str(sock.getsockname()[0]))
            ):
                tls = self.identity.context.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
                conn = Conn(tls, "tls")
                conn.handshake(deadline)
            frame = conn.recv_frame(deadline)
        except (ConnectionLost, OSError):
            self._count("refused_handshake")
            conn.close()
            return None
        with self.state.lock:
            session = self.state.sessions.authenticate(frame.get("id"), frame.get("secret"))
        if session is None:
            self._count("refused_credential")
            conn.close()
            return None
        refusal = self._register(conn, session, source)
        try:
            if refusal is not None:
                self._count("refused_cap")
                conn.send_frame(error_frame(CapacityError(refusal)), deadline)
            else:
                conn.send_frame({"ok": True}, deadline)
        except (ConnectionLost, OSError):
            if refusal is None:  # registered: counted no more
                self._unregister(conn, session, source)
                refusal = "gone before it was answered"
        if refusal is not None:
            conn.close()
            return None
        if kind == "tcp":
            with contextlib.suppress(OSError):  # a reply's frame must not wait for an ACK
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._count("connections_opened")
        return conn, session

    def _register(self, conn: Conn, session: Session, source: str) -> str | None:
        """Count ``conn`` against the caps; why it is refused (None: it is not).
        ``source`` is the peer as the kernel names it (:func:`_source`): a Unix peer's
        pid, or a TCP peer's address -- never what the client said in ``hello``."""
        with self.state.lock, self._lock:
            if len(session.connections) >= self.max_per_session:
                return f"a session holds at most {self.max_per_session} data connections"
            if source.startswith("pid:"):
                if self._per_peer[source] >= self.max_per_client:
                    return f"a client process holds at most {self.max_per_client} data connections"
            elif self._per_peer[source] >= self.max_per_address:
                return f"an address holds at most {self.max_per_address} data connections"
            if self._active >= self.max_connections:
                return f"the server holds at most {self.max_connections} data connections"
            session.connections.add(conn)
            self._per_peer[source] += 1
            self._active += 1
        return None

    def _unregister(self, conn: Conn, session: Session, source: str) -> None:
        with self.state.lock, self._lock:
            session.connections.discard(conn)
            self._per_peer[source] -= 1
            if not self._per_peer[source]:
                del self._per_peer[source]
            self._active -= 1

    def _count(self, name: str) -> None:
        with self._lock:
            self.figures[name] += 1

    # -- requests -----------------------------------------------------------------------

    def _serve(self, conn: Conn, session: Session) -> None:
        while not self._closed:
            conn.wait_request()  # idle for as long as the session lives
            request = conn.recv_frame(self.requests.deadline())
            op = request.get("op")
            self.state.counters[f"op_{op}" if op in ("get", "put") else "op_unknown"] += 1
            try:
                with self.state.lock:
                    self.state.sessions.touch(session.sid)
                if op == "get":
                    self.requests.get(conn, session, request)
                elif op == "put":
                    self.requests.put(conn, session, request)
                else:
                    raise ProtocolError(f"unknown data-path operation {op!r}")
            except PersistingError as exc:
                self.state.counters["errors"] += 1
                self.state.counters[f"error_{exc.code}"] += 1
                conn.send_frame(error_frame(exc), self.requests.deadline())
                if op not in ("get", "put"):
                    return


def _source(sock: socket.socket, peer: Any, kind: str) -> str | None:
    """Whom a new connection counts against: its address (TCP) or process (Unix socket);
    None for a Unix peer of another user (refused unread)."""
    if kind == "tcp":
        return str(peer[0])
    try:
        pid, uid, _gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
    except OSError:
        return None
    return f"pid:{pid}" if uid == os.geteuid() else None


def remove_orphaned_sockets(directory: str | None = None) -> int:
    """Remove socket folders of servers that died without closing (SIGKILL); returns how
    many. Only folders named ``persisting-kv-<pid>-...`` whose pid is gone are touched."""
    base = Path(directory or tempfile.gettempdir())
    removed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        pid_text = name[len(SOCKET_PREFIX) :].split("-", 1)[0]
        if not name.startswith(SOCKET_PREFIX) or not pid_text.isdigit():
            continue
        if int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
            shutil.rmtree(base / name, ignore_errors=True)
            removed += 1
    return removed


__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "MAX_PENDING",
    "MAX_PENDING_PER_SOURCE",
    "MAX_PER_CLIENT",
    "MAX_PER_SESSION",
    "BulkServer",
    "is_loopback",
    "remove_orphaned_sockets",
]
