"""The write-ahead log that makes an acknowledged put survive a crash before its flush.

A put is written to the log (one ``write`` call for the whole batch) before it is
acknowledged, so a ``kill -9`` of the process cannot lose it; ``fsync`` makes it survive a
power cut too, either before every acknowledgement (group commit: concurrent puts share one
fsync) or every ``fsync_interval_ms`` (the backend's worker calls :meth:`WriteAheadLog.sync`).
The log is a directory of segments named by their first offset; every frame carries its
record's offset and a CRC::

    segment = MAGIC frame*
    frame   = u32 payload_len | u32 crc32(payload, offset, ts) | i64 offset | i64 ts_us | payload

The magic ``PQWAL002`` names the payloads' format (msgpack, :mod:`persisting.queue.codec`);
a segment with another magic is refused, never cut off. On start the segments are replayed in
order; a torn or corrupt tail (a crash mid-write) ends the log and is cut off. A flush rotates
to a new segment; once the flush is durable in Lance the segments it covered are deleted, so
the log only ever holds unflushed records.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from persisting.errors import CorruptValueError, StorageIOError
from persisting.lance_store.durable import fsync_dir, fsync_fd, makedirs_durable

logger = logging.getLogger(__name__)

#: The magic of a segment (msgpack payloads).
MAGIC = b"PQWAL002"
SUFFIX = ".wal"
UNREPLAYED_DIR = "unreplayed"
_HEADER = struct.Struct("<IIqq")
_TAIL = struct.Struct("<qq")
HEADER_SIZE = _HEADER.size


@dataclass(frozen=True)
class LogEntry:
    """One replayed record: its offset, put time and encoded payload."""

    offset: int
    timestamp_us: int
    payload: bytes


def payload_crc(payload: bytes) -> int:
    """The CRC of a payload alone (computed outside the writer's lock)."""
    return zlib.crc32(payload)


def encode_frame(offset: int, timestamp_us: int, payload: bytes, crc: int | None = None) -> bytes:
    """One log frame; ``crc`` is :func:`payload_crc` of ``payload`` if already known."""
    base = payload_crc(payload) if crc is None else crc
    full = zlib.crc32(_TAIL.pack(offset, timestamp_us), base)
    return _HEADER.pack(len(payload), full, offset, timestamp_us) + payload


def _segment_path(directory: Path, first_offset: int) -> Path:
    return directory / f"{first_offset:020d}{SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """``(first_offset, path)`` of every segment in ``directory``, in offset order."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        stem = name[: -len(SUFFIX)]
        if name.endswith(SUFFIX) and stem.isdigit():
            out.append((int(stem), directory / name))
    return sorted(out)


class WriteAheadLog:
    """Segments of length-prefixed, checksummed frames under ``directory``.

    :meth:`append` and :meth:`rotate` must be called by one thread at a time (the backend
    holds its lock); :meth:`sync` may be called from any thread and batches callers.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        makedirs_durable(self.directory)
        self._closed: list[tuple[int, Path]] = list_segments(self.directory)
        self._fd: int | None = None
        self._active: tuple[int, Path] | None = None
        self._active_frames = 0
        self._written = 0
        self._synced = 0
        self._sync_lock = threading.Lock()
        self._directory_dirty = False
        self.fsyncs = 0

    # -- replay -----------------------------------------------------------------------------

    def replay(self) -> list[LogEntry]:
        """Every intact record of the existing segments, in offset order.

        Reading stops at the first torn, corrupt or out-of-sequence frame; a torn tail of the
        last segment is truncated away (the crash that tore it came before its ack).
        """
        entries: list[LogEntry] = []
        expected: int | None = None
        segments = list(self._closed)
        for index, (_, path) in enumerate(segments):
            data = path.read_bytes()
            is_last = index == len(segments) - 1
            good, stop_reason = self._read_segment(data, entries, expected)
            if entries:
                expected = entries[-1].offset + 1
            if stop_reason is None:
                continue
            if is_last:
                logger.warning("log %s: %s; cut off at byte %d", path, stop_reason, good)
                self._truncate(path, good)
            else:
                logger.error(
                    "write-ahead log %s: %s; records after offset %s cannot be replayed",
                    path,
                    stop_reason,
                    expected,
                )
            break
        return entries

    @staticmethod
    def _read_segment(
        data: bytes, entries: list[LogEntry], expected: int | None
    ) -> tuple[int, str | None]:
        magic = data[: len(MAGIC)]
        if magic != MAGIC:
            if len(magic) == len(MAGIC) and not MAGIC.startswith(magic.rstrip(b"\0")):
                # Whole and foreign: not a torn tail to cut off but a file this version
                # cannot read; deleting it could lose acknowledged records.
                raise CorruptValueError(f"log segment with unknown format {magic!r}")
            return 0, "missing or torn segment header"
        pos = len(MAGIC)
        view = memoryview(data)
        while pos < len(data):
            if pos + HEADER_SIZE > len(data):
                return pos, "torn frame header"
            length, crc, offset, ts = _HEADER.unpack_from(view, pos)
            end = pos + HEADER_SIZE + length
            if end > len(data):
                return pos, "torn frame"
            payload = bytes(view[pos + HEADER_SIZE : end])
            if zlib.crc32(_TAIL.pack(offset, ts), zlib.crc32(payload)) != crc:
                return pos, f"checksum mismatch at offset {offset}"
            if expected is not None and offset != expected:
                return pos, f"offset {offset} where {expected} was expected"
            entries.append(LogEntry(offset, ts, payload))
            expected = offset + 1
            pos = end
        return pos, None

    @staticmethod
    def _truncate(path: Path, size: int) -> None:
        try:
            if size < len(MAGIC):
                path.unlink()
                fsync_dir(path.parent)
                return
            fd = os.open(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, size)
                fsync_fd(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StorageIOError(f"cannot cut the torn tail off {path}: {exc}") from exc

    # -- writing ----------------------------------------------------------------------------

    def start(self, first_offset: int) -> None:
        """Open a new, empty active segment whose first record will be ``first_offset``."""
        with self._sync_lock:
            self._close_active()
            path = _segment_path(self.directory, first_offset)
            self._closed = [(f, p) for f, p in self._closed if p != path]
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
                _write_all(fd, MAGIC)
            except OSError as exc:
                raise StorageIOError(f"cannot create log segment {path}: {exc}") from exc
            # Made durable (file and directory entry) by the first sync of a record in it:
            # until a record is acknowledged the segment holds nothing anyone relies on.
            self._directory_dirty = True
            self._fd = fd
            self._active = (first_offset, path)
            self._active_frames = 0

    def append(self, frames: bytes, count: int) -> int:
        """Write ``count`` encoded frames; return the log position to pass to :meth:`sync`."""
        if self._fd is None:
            raise StorageIOError("the write-ahead log is not open")
        try:
            _write_all(self._fd, frames)
        except OSError as exc:
            raise StorageIOError(f"write to the log in {self.directory} failed: {exc}") from exc
        self._active_frames += count
        self._written += len(frames)
        return self._written

    def append_records(
        self, first_offset: int, timestamp_us: int, payloads: list[bytes], crcs: list[int]
    ) -> int:
        """Log ``payloads`` as the records at ``first_offset, first_offset + 1, ...``, all put
        at ``timestamp_us`` (``crcs``: their :func:`payload_crc`); see :meth:`append`."""
        frames = b"".join(
            encode_frame(first_offset + i, timestamp_us, payload, crc)
            for i, (payload, crc) in enumerate(zip(payloads, crcs, strict=True))
        )
        return self.append(frames, len(payloads))

    def sync(self, upto: int | None = None) -> None:
        """Make everything written so far durable (at least up to position ``upto``).

        Callers that arrive while another fsync runs wait for it and usually find their
        frames already covered: one fsync acknowledges a whole group of puts.
        """
        with self._sync_lock:
            if upto is not None and self._synced >= upto:
                return
            self._sync_locked()

    def _sync_locked(self) -> None:
        target = self._written
        if self._fd is None or self._synced >= target:
            return
        try:
            fsync_fd(self._fd)
            if self._directory_dirty:
                fsync_dir(self.directory)
                self._directory_dirty = False
        except OSError as exc:
            raise StorageIOError(f"fsync of the log in {self.directory} failed: {exc}") from exc
        self.fsyncs += 1
        self._synced = target

    @property
    def dirty(self) -> bool:
        return self._synced < self._written

    def rotate(self, next_offset: int) -> None:
        """Close the active segment (after fsync) and start one at ``next_offset``."""
        if self._active is None or self._active_frames == 0:
            return
        self.start(next_offset)

    def _close_active(self) -> None:
        if self._fd is None:
            return
        try:
            self._sync_locked()
        finally:
            os.close(self._fd)
            self._fd = None
        if self._active is not None:
            self._closed.append(self._active)
            self._active = None

    def drop_flushed(self, persisted_next: int) -> int:
        """Delete closed segments holding only offsets below ``persisted_next``; return count."""
        with self._sync_lock:
            ordered = sorted(self._closed)
            if self._active is not None:
                ordered.append(self._active)
            # A segment ends where the next begins: drop it once that is persisted.
            doomed = [
                path
                for (_, path), (next_first, _) in itertools.pairwise(ordered)
                if next_first <= persisted_next
            ]
            if not doomed:
                return 0
            # No directory fsync: a deletion lost to a power cut only leaves records that
            # replay skips (their offsets are already in Lance).
            for path in doomed:
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise StorageIOError(f"cannot delete log segment {path}: {exc}") from exc
            gone = set(doomed)
            self._closed = [(f, p) for f, p in self._closed if p not in gone]
            return len(doomed)

    def drop_all_closed(self) -> None:
        """Delete every closed segment (all of their records are durable elsewhere)."""
        with self._sync_lock:
            for _, path in self._closed:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            self._closed = []

    def set_aside_closed(self) -> Path | None:
        """Move every closed segment into ``unreplayed/`` (kept for a person to look at,
        never replayed again); returns that directory, or None if there was nothing."""
        with self._sync_lock:
            if not self._closed:
                return None
            aside = self.directory / UNREPLAYED_DIR
            makedirs_durable(aside)
            for _, path in self._closed:
                with contextlib.suppress(FileNotFoundError):
                    os.replace(path, aside / f"{int(time.time())}-{path.name}")
            self._closed = []
            fsync_dir(aside)
            fsync_dir(self.directory)
            return aside

    # -- inspection -------------------------------------------------------------------------

    def size_bytes(self) -> int:
        total = 0
        for _, path in list_segments(self.directory):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                continue
        return total

    def segment_count(self) -> int:
        return len(list_segments(self.directory))

    def close(self) -> None:
        with self._sync_lock:
            self._close_active()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "LogEntry",
    "WriteAheadLog",
    "encode_frame",
    "list_segments",
    "payload_crc",
]
