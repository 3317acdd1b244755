"""The disk tier's eviction order across restarts: a snapshot of its LRU order.

The payload files and the metadata table say *what* is stored, not in which order it was
last used; without this file a reopened store would evict in creation order and forget
which chunks were hot. The snapshot is a small file, ``recency.bin``, beside the metadata:
one ``(key hash, tag)`` pair per chunk, least recently used first, written whole to a
temporary file and renamed into place (a reader sees the old or the new snapshot, never a
mix). It is saved on close and on flush; chunks stored after the last snapshot rank as the
most recently used, in the order they were written. A missing or damaged snapshot costs
only the order (the store then evicts in creation order), never data.
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
    ranks: dict[tuple[int, int], int] = {}
    for i, entry in enumerate(_ENTRY.iter_unpack(memoryview(raw)[_HEAD.size :])):
        ranks.setdefault(entry, i)
    return ranks


__all__ = [
    "FILE_NAME",
    "file_bytes",
    "load_order",
    "save_order",
]
