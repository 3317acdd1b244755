"""A Unix-socket request channel between a server and the clients on its host.

A Pulsing ask costs 0.5-1 ms here, about as much as copying an 8 MiB chunk, so requests
of a same-host client skip it: after the client's ``hello`` (which goes through Pulsing,
and so through its TLS passphrase), the server tells it the path of this socket, and the
client sends its requests there. Payloads still travel through the shared-memory arena or
the leased payload files; the channel carries only the small protocol messages.

The socket is created mode 0600 in a fresh private directory, so only the server's user
can connect, and it refuses ``hello``: every request must carry a session id that a
``hello`` through Pulsing handed out. Frames are ``<u32 length><u64 request id><pickle>``,
and both sides decode them with :func:`~persisting.service.protocol.safe_loads` (plain
values only). Requests are answered concurrently and matched to callers by id.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from persisting.errors import ProtocolError, ServiceUnavailableError
from persisting.lance_store import pid_alive
from persisting.service.protocol import error_reply, safe_loads

_HEADER = struct.Struct("<IQ")
#: Largest frame either side accepts (message-path replies carry at most one chunk).
MAX_FRAME_BYTES = 64 << 20

Handler = Callable[[Any], Awaitable[dict[str, Any]]]


def _frame(request_id: int, message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {len(payload)}-byte message exceeds the channel's frame limit")
    return _HEADER.pack(len(payload), request_id) + payload


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, Any]:
    header = await reader.readexactly(_HEADER.size)
    length, request_id = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {length}-byte frame exceeds the channel's limit")
    return request_id, safe_loads(await reader.readexactly(length))


CHANNEL_PREFIX = "persisting-kv-"


def remove_orphaned_channels(directory: str | None = None) -> int:
    """Remove socket folders of servers that died without closing (SIGKILL); returns how
    many. Only folders named ``persisting-kv-<pid>-...`` whose pid is gone are touched."""
    base = Path(directory or tempfile.gettempdir())
    removed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        pid_text = name[len(CHANNEL_PREFIX) :].split("-", 1)[0]
        if not name.startswith(CHANNEL_PREFIX) or not pid_text.isdigit():
            continue
        if int(pid_text) != os.getpid() and not pid_alive(int(pid_text)):
            shutil.rmtree(base / name, ignore_errors=True)
            removed += 1
    return removed


class LocalChannelServer:
    """Answers protocol requests arriving on a private Unix socket with ``handler``."""

    def __init__(self, handler: Handler):
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._directory: Path | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.path: str | None = None

    async def start(self) -> str:
        remove_orphaned_channels()
        # mode 0700; the pid in the name lets a later server remove it if this one is killed
        self._directory = Path(tempfile.mkdtemp(prefix=f"{CHANNEL_PREFIX}{os.getpid()}-"))
        path = self._directory / "service.sock"
        self._server = await asyncio.start_unix_server(self._serve_connection, path=str(path))
        os.chmod(path, 0o600)
        self.path = str(path)
        return self.path

    def close(self) -> None:
        """Stop listening, drop every connection and remove the socket (no await needed)."""
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        pending: set[asyncio.Task[None]] = set()
        try:
            while True:
                request_id, message = await _read_frame(reader)
                job = asyncio.ensure_future(self._answer(request_id, message, writer))
                pending.add(job)
                job.add_done_callback(pending.discard)
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError):
            pass  # the client went away, or spoke garbage: drop the connection
        finally:
            for job in pending:
                job.cancel()
            writer.close()
            if task is not None:
                self._connections.discard(task)

    async def _answer(self, request_id: int, message: Any, writer: asyncio.StreamWriter) -> None:
        if isinstance(message, dict) and message.get("op") == "hello":
            reply = error_reply(ProtocolError("open a session through the actor, not here"))
        elif isinstance(message, dict) and message.get("sid") is None:
            reply = error_reply(ProtocolError("requests on the local channel need a session"))
        else:
            reply = await self._handler(message)
        with contextlib.suppress(ConnectionError):
            writer.write(_frame(request_id, reply))


class LocalChannel:
    """A client's connection to a server's local channel; requests are multiplexed on it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._next_id = 1
        self._broken: BaseException | None = None
        self._pump = asyncio.ensure_future(self._read_replies())

    @classmethod
    async def open(cls, path: str) -> LocalChannel:
        reader, writer = await asyncio.open_unix_connection(path, limit=MAX_FRAME_BYTES)
        return cls(reader, writer)

    async def ask(self, message: dict[str, Any]) -> Any:
        if self._broken is not None:
            raise ServiceUnavailableError(f"local channel is closed: {self._broken}")
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            self._writer.write(_frame(request_id, message))
            return await future
        finally:
            self._waiting.pop(request_id, None)

    async def _read_replies(self) -> None:
        try:
            while True:
                request_id, reply = await _read_frame(self._reader)
                future = self._waiting.get(request_id)
                if future is not None and not future.done():
                    future.set_result(reply)
        except BaseException as exc:  # the server went away: fail everyone still waiting
            self._broken = exc
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(
                        ServiceUnavailableError(f"local channel lost: {type(exc).__name__}")
                    )
            if isinstance(exc, asyncio.CancelledError):
                raise

    @property
    def broken(self) -> bool:
        return self._broken is not None

    async def close(self) -> None:
        self._pump.cancel()
        with contextlib.suppress(BaseException):
            await self._pump
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


__all__ = ["MAX_FRAME_BYTES", "LocalChannel", "LocalChannelServer"]
