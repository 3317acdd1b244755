"""Positioned reads of a file range straight into a caller's buffer.

One open, then ``preadv`` calls into the destination (no intermediate buffer), optionally
hashed piece by piece as the bytes land (while still in cache); a large range may be read
as several parts at once on an executor. A destination's pages not yet touched fault in
as the bytes land, inside the reads. Payload files (:mod:`persisting.kv.payload_files`),
leased payloads read by same-host clients and Lance blob files are all read this way.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor

import xxhash

from persisting.errors import CorruptValueError, StorageIOError

#: Parts of a range read at once start at multiples of this (the payload format's block,
#: what O_DIRECT and most filesystems want).
PART_ALIGN = 4096

#: Bytes per positioned read where a read is also hashed. Larger than the
#: :data:`~persisting.kv.layout.HASH_PIECE` of writes and copies: each read is a system
#: call that lets go of the GIL, and the loading threads then queue to get it back; the
#: piece is still hashed while in cache (``docs/benchmarks.md``, cold reads).
READ_PIECE = 1 << 20


def read_file_range(
    path: str | os.PathLike[str],
    offset: int,
    out: memoryview,
    *,
    executor: Executor | None = None,
    parts: int = 1,
    hashed: bool = False,
) -> int | None:
    """Fill ``out`` with exactly ``len(out)`` bytes of ``path`` from ``offset``; with
    ``hashed``, return the xxh3-64 of those bytes (:func:`persisting.kv.layout.checksum`):
    read in one part, each piece is hashed as it lands, while still in cache.

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
