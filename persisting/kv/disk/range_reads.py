"""Positioned reads of a file range straight into a caller's buffer.

One open, then ``preadv`` calls into the destination (no intermediate buffer), optionally
hashed piece by piece as the bytes land (while still in cache); a large range may be read
as several parts at once on an executor. A destination's pages not yet touched fault in
as the bytes land, inside the reads. Payload files (:mod:`persisting.kv.disk.payload_files`),
leased payloads read by same-host clients and Lance blob files are all read this way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Executor

import xxhash

from persisting.errors import CorruptValueError, StorageIOError

#: Parts of a range read at once start at multiples of this (the payload format's block,
#: what O_DIRECT and most filesystems want).
PART_ALIGN = 4096

#: Bytes per positioned read where a read is also hashed. Larger than the
#: :data:`~persisting.kv.layout.HASH_PIECE` of writes and copies: each read is a system
#: call that lets go of the GIL, and the loading threads then queue to get it back, so
#: fewer, larger reads mean fewer hand-offs; 1 MiB is still small enough to be hashed
#: while it is in the CPU's cache.
READ_PIECE = 1 << 20
#: Buffers one vectored read takes at most (Linux's IOV_MAX is 1024).
MAX_IOV = 512


def read_file_range(
    path: str | os.PathLike[str],
    offset: int,
    out: memoryview | Sequence[memoryview],
    *,
    executor: Executor | None = None,
    parts: int = 1,
    hashed: bool = False,
) -> int | None:
    """Fill ``out`` with exactly ``len(out)`` bytes of ``path`` from ``offset``; with
    ``hashed``, return the xxh3-64 of those bytes (:func:`persisting.kv.layout.checksum`):
    read in one part, each piece is hashed as it lands, while still in cache. ``out`` may
    be several buffers, filled in order from consecutive bytes (a value stored from a
    :class:`~persisting.kv.layout.Gathered` value's parts, read back into them): read in
    one part, with vectored reads of up to :data:`READ_PIECE` bytes.

    One open and positioned reads straight into the destination: no intermediate buffer.
    With an ``executor`` and ``parts > 1`` the range is read as that many block-aligned
    parts at once (a disk that serves several requests in flight reads one large value
    faster so; the calling thread must not be one of the executor's).

    FileNotFoundError propagates (the file was removed, e.g. evicted: a miss to the caller);
    a file shorter than the range is a CorruptValueError; any other failure a StorageIOError.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StorageIOError(f"cannot open {path}: {exc}") from exc
    try:
        if not isinstance(out, memoryview):
            return _pread_views(fd, path, list(out), offset, hashed)
        if executor is None or parts <= 1:
            return _pread_exact(fd, path, out, offset, hashed)
        per_part = -(-len(out) // parts)
        step = -(-per_part // PART_ALIGN) * PART_ALIGN  # parts start block-aligned
        futures = []
        try:
            for start in range(0, len(out), step):
                part = out[start : start + step]
                futures.append(executor.submit(_pread_exact, fd, path, part, offset + start))
        finally:
            first: BaseException | None = None
            for future in futures:  # every part, so none still writes ``out`` once we return
                first = first or future.exception()
        if first is not None:
            raise first
    except OSError as exc:
        raise StorageIOError(f"reading {path} failed: {exc}") from exc
    finally:
        os.close(fd)
    return xxhash.xxh3_64_intdigest(out) if hashed else None  # parts: hashed once all landed


def _pread_views(
    fd: int,
    path: str | os.PathLike[str],
    views: list[memoryview],
    offset: int,
    hashed: bool,
) -> int | None:
    """Fill ``views`` from consecutive bytes at ``offset``, in vectored reads of at most
    :data:`READ_PIECE` bytes (and :data:`MAX_IOV` buffers), each batch hashed right after
    it lands (returns the xxh3-64 of all of it with ``hashed``)."""
    digest = xxhash.xxh3_64() if hashed else None
    batch: list[memoryview] = []
    size = 0
    pieces = [v[i : i + READ_PIECE] for v in views for i in range(0, len(v), READ_PIECE)]
    for piece in [*pieces, None]:
        if batch and (piece is None or size + len(piece) > READ_PIECE or len(batch) == MAX_IOV):
            _preadv_all(fd, path, batch, offset)
            if digest is not None:
                for view in batch:
                    digest.update(view)
            offset += size
            batch, size = [], 0
        if piece is not None:
            batch.append(piece)
            size += len(piece)
    return digest.intdigest() if digest is not None else None


def _preadv_all(
    fd: int, path: str | os.PathLike[str], views: list[memoryview], offset: int
) -> None:
    """Read exactly the bytes ``views`` hold at ``offset`` (more calls only if short)."""
    pending = [v.cast("B") if v.format != "B" else v for v in views]
    want, done = sum(len(v) for v in pending), 0
    while pending:
        n = os.preadv(fd, pending, offset + done)
        if n == 0:
            raise CorruptValueError(
                f"{path} is shorter than expected ({offset + done} < {offset + want})"
            )
        done += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if pending and n:
            pending[0] = pending[0][n:]


def _pread_exact(
    fd: int,
    path: str | os.PathLike[str],
    out: memoryview,
    offset: int,
    hashed: bool = False,
) -> int | None:
    """Read exactly ``len(out)`` bytes at ``offset``; with ``hashed``, in
    :data:`READ_PIECE` pieces, each hashed right after it lands (returns the xxh3-64)."""
    digest = xxhash.xxh3_64() if hashed else None
    done, size = 0, len(out)
    while done < size:
        piece = out[done : done + READ_PIECE] if hashed else out[done:]
        n = os.preadv(fd, [piece], offset + done)
        if n == 0:
            raise CorruptValueError(
                f"{path} is shorter than expected ({offset + done} < {offset + size})"
            )
        if digest is not None:
            digest.update(piece[:n])
        done += n
    return digest.intdigest() if digest is not None else None


__all__ = ["READ_PIECE", "read_file_range"]
