"""The bytes of one data connection: header frames and payloads.

A **frame** is ``<u32 length>`` and a msgpack map of plain values (checked with
:func:`~persisting.service.protocol.is_plain`; nothing is unpickled), at most
:data:`MAX_FRAME_BYTES`. A **payload** is raw bytes whose length a frame announced.
:class:`Stream` is the server's side (a thread per connection): blocking sockets with
kernel timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``), so a transfer that makes no progress
for that long fails instead of hanging; an end of stream or a timeout in the middle of
anything is :class:`ConnectionLost`. A client speaks the same bytes from its event loop
(:mod:`persisting.service.bulk.loop_stream`).

Payload bytes never pass through an intermediate buffer on the plain stream: a receiver
``recv_into``\\s the destination itself, in pieces of :data:`WIRE_PIECE`, and hashes each
piece as it lands while the peer's next bytes arrive (streaming xxh3: the same checksum
as one hash of the whole). Measured per 8 MiB over loopback on the quiet 2-core machine,
15 interleaved rounds of 16: one receive then one hash ran at 0.86-0.89x of a plain
receive, 512 KiB pieces at 0.96-0.98x, 256 KiB 0.96x, 1 MiB 0.93x, 2 MiB 0.88x. (Under load,
1 MiB pieces had measured slower than one receive; that was the load.) A receiver
waits for a piece with the socket's low-water mark at the bytes still missing, so it is
woken once per piece rather than once per segment (:class:`LowWater`); a server's thread
first polls for the piece for up to ``poll_s`` (``service.bulk_poll_us``), and sleeps only
if it has not come by then (:class:`Stream`). A server sends a
memory-tier value from the tier's own buffer (``sendmsg`` with the frame before it, one
call) and a value on disk with ``os.sendfile`` from its payload file; a sender of
payloads with checksums (:meth:`Stream.send_payloads`) hashes each after it went out.

:class:`SealedStream` encrypts everything after the handshake in AES-256-GCM
:class:`Records` (at most :data:`RECORD` bytes each, a per-direction key and a record
counter as nonce, the length as associated data): a record that fails its tag is
:class:`ConnectionLost`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import xxhash

from persisting.errors import ProtocolError
from persisting.service.protocol import is_plain

#: Largest header frame either side accepts (4096 keys of ~100 bytes fit easily).
MAX_FRAME_BYTES = 4 << 20
#: Bytes a data connection moves per system call and hashes before the next (the
#: streaming xxh3 of the pieces equals the one-shot checksum of the payload). A piece of
#: the wire, not of the store's copies and files (``persisting.kv.layout.HASH_PIECE``).
WIRE_PIECE = 512 << 10
#: Largest plaintext of one sealed record.
RECORD = 1 << 20
TAG_BYTES = 16

LENGTH = struct.Struct("<I")
CHECKSUM = struct.Struct("<Q")
TIMEVAL = struct.Struct("ll")


class ConnectionLost(Exception):
    """The connection ended, timed out or carried something unreadable mid-request: what
    it was carrying is lost (a miss), and the connection is not used again. ``timed_out``:
    the peer stopped moving bytes for longer than the timeout (a hung member)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def lost(what: str, exc: OSError) -> ConnectionLost:
    return ConnectionLost(
        f"{what}: {exc}", timed_out=isinstance(exc, BlockingIOError | TimeoutError)
    )


def set_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """Kernel send and receive timeouts on a blocking socket (None: wait for ever)."""
    sock.settimeout(None)
    whole = int(seconds or 0)
    micros = int(((seconds or 0) - whole) * 1_000_000)
    value = TIMEVAL.pack(whole, micros)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def tune(sock: socket.socket) -> None:
    """No Nagle delay on small frames (a reply's frame must not wait for an ACK)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def pack(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {len(body)}-byte frame exceeds the data path's limit")
    return LENGTH.pack(len(body)) + body


def unpack(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            timestamp=0,
        )
    except Exception as exc:  # garbled bytes: unpack's errors are many
        raise ConnectionLost(f"undecodable frame: {exc}") from exc
    if not isinstance(message, dict) or not is_plain(message):
        raise ConnectionLost("a frame must be a map of plain values")
    return message


class LowWater:
    """How many queued bytes wake a reader of a TCP socket (``SO_RCVLOWAT``).

    By default the kernel wakes a waiting reader for every segment that arrives: over
    loopback one per 64 KiB, 128 per 8 MiB value, each a wake-up paid on the sender's core
    (the receive path runs there) and a sleep and a return on the reader's. A reader that
    expects ``n`` more bytes of a payload sets the mark to ``n`` and is woken once. The mark
    is only ever the number of bytes the reader still expects, so a peer that sends them all
    always wakes it, and it goes back to 1 before a frame or a checksum is read. Measured
    on the 2-core machine (two processes, 8 MiB values sent and received in hashed 512 KiB
    pieces, 10 rounds of 16 each, medians): 2.78-2.99 ms per value with a wake-up per
    segment, 2.22-2.25 ms with the mark, on two cores; 4.43-4.64 against 2.66-3.10 ms with
    both processes on one core."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.mark = 1

    def set(self, nbytes: int) -> None:
        if nbytes != self.mark:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self.mark = nbytes


class PollGate:
    """Whether a server's connection thread may poll now (``Stream.poll_s``): only while no
    other connection of the server is in the middle of a request and no other thread
    polls. With several transfers at once the cores are busy anyway, and a polling thread
    takes CPU (and the GIL) from the transfers it waits for: a batch of 16 values of 8 MiB
    spread over 4 connections took 2.72-2.78 ms a value with every thread polling, against
    2.41-2.45 ms with none."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0
        self._polling = False

    def request(self, delta: int) -> None:
        """A request began (+1) or ended (-1) on one of the server's connections."""
        with self._lock:
            self._requests += delta

    def enter(self, in_request: bool) -> bool:
        """Start polling, if allowed: the caller's own request (``in_request``) aside,
        none in flight, and nobody polling. True: call :meth:`leave` when done."""
        with self._lock:
            if self._polling or self._requests > int(in_request):
                return False
            self._polling = True
            return True

    def leave(self) -> None:
        with self._lock:
            self._polling = False


class Stream:
    """One data connection, plain: see the module docstring.

    ``poll_s``: how long the thread that owns the connection polls it for the next bytes
    (of a payload, or of the next request) before it sleeps. A thread that sleeps is woken
    by the sender's system call, and the kernel tends to run the woken thread on the
    sender's core; on a machine with few cores the two sides then take turns on one core
    for dozens of values. A thread that is still polling needs no wake-up and stays where
    it runs. The cost is at most ``poll_s`` of CPU per wait."""

    sealed = False

    def __init__(self, sock: socket.socket, poll_s: float = 0.0, gate: PollGate | None = None):
        self.sock = sock
        self.poll_s = poll_s
        #: Shared by the streams of one server: when they may poll.
        self.gate = gate if gate is not None else PollGate()
        #: Waits for bytes that polling ended, and those that still slept after it.
        self.polled = 0
        self.slept = 0

    # -- primitives (the sealed stream replaces these) ------------------------------------

    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        """Send every byte of ``parts``, in as few system calls as the kernel takes."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        try:
            while views:
                sent = self.sock.sendmsg(views)
                while views and sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                if views and sent:
                    views[0] = views[0][sent:]
        except OSError as exc:
            raise lost("send failed", exc) from exc

    def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` from the connection (all of it, or ConnectionLost)."""
        got, size = 0, len(view)
        try:
            while got < size:
                n = self.sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
                if n == 0:
                    raise ConnectionLost("the peer closed the connection")
                got += n
        except OSError as exc:  # a reset, or the kernel timeout (EAGAIN)
            raise lost("receive failed", exc) from exc

    def send_file(self, fd: int, offset: int, nbytes: int) -> None:
        """Send ``nbytes`` of the file ``fd`` from ``offset``, kernel to kernel."""
        end = offset + nbytes
        try:
            while offset < end:
                sent = os.sendfile(self.sock.fileno(), fd, offset, end - offset)
                if sent == 0:
                    raise ConnectionLost("the payload file ended early")
                offset += sent
        except OSError as exc:
            raise lost("sendfile failed", exc) from exc

    # -- frames and payloads --------------------------------------------------------------

    def send_frame(self, message: dict[str, Any], payload: memoryview | None = None) -> None:
        """A frame, and the payload it announces if given (together, in one call)."""
        frame = pack(message)
        self.send([frame] if payload is None else [frame, payload])

    def recv_frame(self) -> dict[str, Any]:
        head = bytearray(LENGTH.size)
        self.recv_into(memoryview(head))
        (length,) = LENGTH.unpack(head)
        if length > MAX_FRAME_BYTES:
            raise ConnectionLost(f"a {length}-byte frame exceeds the data path's limit")
        body = bytearray(length)
        self.recv_into(memoryview(body))
        return unpack(body)

    def recv_payload(self, view: memoryview) -> int:
        """Receive a payload into ``view`` (the destination itself) in pieces of
        :data:`WIRE_PIECE`, hashing each piece as it lands while the peer's next bytes are
        on their way; returns the checksum of the whole."""
        hasher = xxhash.xxh3_64()
        try:
            for start in range(0, len(view), WIRE_PIECE):
                piece = view[start : start + WIRE_PIECE]
                self.recv_piece(piece)
                hasher.update(piece)
        finally:
            self._low_water.set(1)  # frames and checksums: wake on the first byte again
        return int(hasher.intdigest())

    def recv_piece(self, view: memoryview) -> None:
        """Fill ``view``: polling for up to ``poll_s``, then waking once, when all that is
        missing is queued (:class:`LowWater`), not once per segment as a blocking receive
        does; the socket's receive timeout bounds each wait."""
        got, size = self._recv_polling(view), len(view)
        if self.poll_s:
            if got == size:
                self.polled += 1
                return
            self.slept += 1
        timeout_ms = self._timeout_ms()
        try:
            while got < size:
                self._low_water.set(size - got)
                if not self._poller.poll(timeout_ms):
                    raise ConnectionLost("no receive progress within the timeout", True)
                try:
                    n = self.sock.recv_into(view[got:], size - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue  # woken for something else (an error is raised on the retry)
                if n == 0:
                    raise ConnectionLost("the peer closed the connection")
                got += n
        except OSError as exc:
            raise lost("receive failed", exc) from exc

    def _recv_polling(self, view: memoryview) -> int:
        """Receive into ``view`` what arrives within ``poll_s`` without sleeping; bytes
        received. It polls readiness with the low-water mark at the bytes still missing
        (a check that takes no lock on the socket, unlike a receive, so it does not hold up
        the kernel's delivery of the bytes it waits for) and receives once they are all
        queued."""
        got, size = 0, len(view)
        if not self.poll_s or not self.gate.enter(in_request=True):
            return 0
        poller = self._poller
        deadline = time.perf_counter() + self.poll_s
        try:
            while got < size:
                self._low_water.set(size - got)
                if not poller.poll(0):
                    if time.perf_counter() >= deadline:
                        break
                    continue
                try:
                    n = self.sock.recv_into(view[got:], size - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if n == 0:
                    raise ConnectionLost("the peer closed the connection")
                got += n
        except OSError as exc:
            raise lost("receive failed", exc) from exc
        finally:
            self.gate.leave()
        return got

    def wait_request(self, poll: bool) -> None:
        """Wait until the next request's bytes (or the end of the connection) arrive: with
        ``poll``, polling for up to ``poll_s`` first, then sleeping for as long as it takes."""
        poller = self._poller
        if poll and self.poll_s and self.gate.enter(in_request=False):
            try:
                deadline = time.perf_counter() + self.poll_s
                while time.perf_counter() < deadline:
                    if poller.poll(0):
                        self.polled += 1
                        return
            finally:
                self.gate.leave()
            self.slept += 1
        poller.poll()

    @functools.cached_property
    def _low_water(self) -> LowWater:
        return LowWater(self.sock)

    @functools.cached_property
    def _poller(self) -> select.poll:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return poller

    def _timeout_ms(self) -> int | None:
        """The socket's receive timeout (:func:`set_timeouts`) in ms; None: none."""
        raw = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, TIMEVAL.size)
        seconds, micros = TIMEVAL.unpack(raw)
        total = seconds * 1000 + micros // 1000
        return total or None

    def send_payload(self, view: memoryview) -> int:
        """Send a payload; returns its checksum (made after it was handed to the kernel)."""
        self.send([view])
        return xxhash.xxh3_64_intdigest(view)

    def send_payloads(self, message: dict[str, Any], payloads: Sequence[memoryview]) -> None:
        """A frame, then each payload it announces followed by its checksum: one call per
        payload (the frame, or the previous payload's checksum, in front of it), each
        payload hashed after it went out -- the receiver hashes what landed and compares,
        so bytes that changed between being sent and being hashed fail the comparison and
        are never stored."""
        lead = pack(message)
        for payload in payloads:
            self.send([lead, payload])
            lead = CHECKSUM.pack(xxhash.xxh3_64_intdigest(payload))
        self.send([lead])

    def send_checksum(self, value: int) -> None:
        self.send([CHECKSUM.pack(value)])

    def recv_checksum(self) -> int:
        raw = bytearray(CHECKSUM.size)
        self.recv_into(memoryview(raw))
        return int(CHECKSUM.unpack(raw)[0])

    def discard(self, nbytes: int, scratch: memoryview) -> None:
        """Read and drop ``nbytes`` (a refused put's payload), through ``scratch``."""
        while nbytes > 0:
            piece = scratch[: min(len(scratch), nbytes)]
            self.recv_into(piece)
            nbytes -= len(piece)

    def shutdown(self) -> None:
        """End the connection from another thread: a thread blocked on it wakes up and
        fails, and closes it itself (closing here could let the descriptor be reused under
        that thread by a new connection)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Shut the connection down and close it (by the thread that uses it)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class Records:
    """The AES-256-GCM records of a sealed connection, without the I/O: each direction
    has its own key and counts its records (the nonce), the length is associated data, so
    an altered, replayed, reordered or cut record fails. Used by :class:`SealedStream`
    and by the client's :class:`~persisting.service.bulk.loop_stream.LoopSealedStream`."""

    def __init__(self, send_key: bytes, recv_key: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._sealer = AESGCM(send_key)
        self._opener = AESGCM(recv_key)
        self._sent = 0
        self._received = 0
        self._out = bytearray(LENGTH.size + RECORD + TAG_BYTES)
        self._in = bytearray(RECORD + TAG_BYTES)
        self._plain = bytearray(RECORD)
        #: Plaintext of the last record opened but not yet taken by a reader.
        self.left = memoryview(self._plain)[:0]

    @staticmethod
    def _nonce(counter: int) -> bytes:
        return b"\0\0\0\0" + counter.to_bytes(8, "little")

    def pieces(self, parts: Sequence[bytes | memoryview]) -> Iterator[memoryview]:
        """The plaintext of ``parts`` cut into record-sized pieces."""
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), RECORD):
                yield view[start : start + RECORD]

    def seal(self, piece: memoryview) -> memoryview:
        """One record (length, ciphertext, tag) of ``piece``, in a buffer reused by the next."""
        header = LENGTH.pack(len(piece))
        out = memoryview(self._out)
        out[: LENGTH.size] = header
        sealed = out[LENGTH.size : LENGTH.size + len(piece) + TAG_BYTES]
        self._sealer.encrypt_into(self._nonce(self._sent), piece, header, sealed)
        self._sent += 1
        return out[: LENGTH.size + len(piece) + TAG_BYTES]

    def take_left(self, view: memoryview) -> int:
        """Fill the start of ``view`` from plaintext already opened; bytes filled."""
        n = min(len(self.left), len(view))
        view[:n] = self.left[:n]
        self.left = self.left[n:]
        return n

    def incoming(self, header: bytes | bytearray) -> memoryview:
        """Where the record that ``header`` announces is to be received."""
        (length,) = LENGTH.unpack(header)
        if length > RECORD:
            raise ConnectionLost(f"a {length}-byte sealed record exceeds the limit")
        return memoryview(self._in)[: length + TAG_BYTES]

    def open(self, header: bytes | bytearray, sealed: memoryview, room: memoryview) -> int:
        """Decrypt a received record: straight into ``room`` when it fits there (returns
        the bytes written), else into :attr:`left` for the next reads (returns 0)."""
        length = len(sealed) - TAG_BYTES
        direct = length <= len(room)
        target = room[:length] if direct else memoryview(self._plain)[:length]
        try:
            self._opener.decrypt_into(self._nonce(self._received), sealed, bytes(header), target)
        except Exception as exc:  # InvalidTag: altered, replayed or reordered bytes
            raise ConnectionLost("a sealed record failed its authentication") from exc
        self._received += 1
        if direct:
            return length
        self.left = memoryview(self._plain)[:length]
        return 0


class SealedStream(Stream):
    """A data connection whose bytes are AES-256-GCM :class:`Records`."""

    sealed = True

    def __init__(
        self,
        sock: socket.socket,
        send_key: bytes,
        recv_key: bytes,
        poll_s: float = 0.0,
        gate: PollGate | None = None,
    ):
        super().__init__(sock, poll_s, gate)
        self._records = Records(send_key, recv_key)

    def send(self, parts: Sequence[bytes | memoryview]) -> None:
        for piece in self._records.pieces(parts):
            super().send([self._records.seal(piece)])

    def recv_into(self, view: memoryview) -> None:
        records = self._records
        filled = records.take_left(view)
        while filled < len(view):
            header = bytearray(LENGTH.size)
            super().recv_into(memoryview(header))
            sealed = records.incoming(header)
            super().recv_into(sealed)
            filled += records.open(header, sealed, view[filled:])
            filled += records.take_left(view[filled:])

    def recv_piece(self, view: memoryview) -> None:
        self.recv_into(view)  # records are read whole, each announced by its length

    def send_file(self, fd: int, offset: int, nbytes: int) -> None:
        scratch = bytearray(min(nbytes, RECORD))
        view = memoryview(scratch)
        end = offset + nbytes
        try:
            while offset < end:
                n = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
                if n <= 0:
                    raise ConnectionLost("the payload file ended early")
                self.send([view[:n]])
                offset += n
        except OSError as exc:
            raise ConnectionLost(f"reading the payload file failed: {exc}") from exc


__all__ = [
    "MAX_FRAME_BYTES",
    "RECORD",
    "WIRE_PIECE",
    "ConnectionLost",
    "LowWater",
    "PollGate",
    "Records",
    "SealedStream",
    "Stream",
    "pack",
    "set_timeouts",
    "tune",
    "unpack",
]
