"""The disk tier's eviction order across restarts: a snapshot of its LRU order.

The payload files and the metadata table say *what* is stored, not in which order it was
last used; without this file a reopened store would evict in creation order and forget
which chunks were hot. The snapshot is a small file, ``recency.bin``, beside the metadata:
one ``(key hash, tag)`` pair per chunk, least recently used first, written whole to a
temporary file and renamed into place (a reader sees the old or the new snapshot, never a
mix). It is saved on close and on flush; chunks stored after the last snapshot rank as the
most recently used, in the order they were written. A missing or damaged snapshot costs
only the order (the store then evicts in creation order), never data.

It holds at most one entry per 4 KiB of the budget (every chunk takes a block at least):
on open, before anything is counted, a damaged snapshot is removed and a longer one cut to
its newest entries (:func:`prepare`), so none can make the store evict a chunk for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

FILE_NAME = "recency.bin"
_MAGIC = b"PKVRCY01"
_HEAD = struct.Struct("<8sQ")  # magic, entry count
_ENTRY = struct.Struct("<QI")  # key hash, file tag


def file_bytes(count: int) -> int:
    """The size of a snapshot of ``count`` chunks."""
    return _HEAD.size + count * _ENTRY.size


def save_order(directory: Path, order: Iterable[tuple[int, int]]) -> None:
    """Replace the snapshot with ``order`` (``(key hash, tag)``, least recent first)."""
    entries = list(order)
    body = bytearray(_HEAD.pack(_MAGIC, len(entries)))
    for key_hash, tag in entries:
        body += _ENTRY.pack(key_hash, tag)
    target = directory / FILE_NAME
    tmp = directory / f".{FILE_NAME}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(body))
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except OSError as exc:  # only the order is lost: say so, do not fail the caller
        log.warning("cannot save the eviction order of %s: %s", directory, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def prepare(directory: Path, most: int) -> dict[tuple[int, int], int]:
    """Judge the snapshot before the namespace is counted, for a budget that holds at most
    ``most`` chunks (the caller holds the namespace's metadata lock, under which every
    snapshot is saved): a damaged one is removed, one of more entries is cut to its
    ``most`` newest (read from its end, the rest never read) and removed, to be saved
    again by the next flush or close; what is kept is returned as :func:`load_order`
    does. Leftovers of a save that died are removed."""
    for leftover in directory.glob(f".{FILE_NAME}.*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
    path = directory / FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read the eviction order of %s: %s", directory, exc)
        return {}
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEAD.size, 0)
        magic, count = _HEAD.unpack(head) if len(head) == _HEAD.size else (b"", -1)
        whole = magic == _MAGIC and size == file_bytes(count)
        keep = max(0, min(count, most)) if whole else 0
        raw = os.pread(fd, keep * _ENTRY.size, file_bytes(count - keep)) if keep else b""
    except OSError as exc:
        log.warning("cannot read the eviction order of %s: %s", directory, exc)
        whole, keep, raw = False, 0, b""
    finally:
        os.close(fd)
    if not whole or keep < count or len(raw) != keep * _ENTRY.size:
        log.warning(
            "the eviction order of %s is %s; removed before it is counted",
            directory,
            f"longer than this budget's {most} chunks: kept its newest" if whole else "damaged",
        )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        if len(raw) != keep * _ENTRY.size:
            return {}
    return _ranks(raw)


def _ranks(raw: bytes | memoryview) -> dict[tuple[int, int], int]:
    ranks: dict[tuple[int, int], int] = {}
    for i, entry in enumerate(_ENTRY.iter_unpack(raw)):
        ranks.setdefault(entry, i)
    return ranks


def load_order(directory: Path) -> dict[tuple[int, int], int]:
    """The saved rank of each ``(key hash, tag)`` (0 = least recently used); empty when
    there is no snapshot or it is damaged."""
    try:
        raw = (directory / FILE_NAME).read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("cannot read the eviction order of %s: %s", directory, exc)
        return {}
    if len(raw) < _HEAD.size:
        return {}
    magic, count = _HEAD.unpack_from(raw)
    if magic != _MAGIC or len(raw) != _HEAD.size + count * _ENTRY.size:
        log.warning("the eviction order of %s is damaged; using creation order", directory)
        return {}
    return _ranks(memoryview(raw)[_HEAD.size :])


__all__ = [
    "FILE_NAME",
    "file_bytes",
    "load_order",
    "prepare",
    "save_order",
]
