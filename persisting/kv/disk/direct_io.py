"""Payload bytes moved with O_DIRECT: straight between the caller's memory and the disk.

For a store whose values already live in a memory cache of their own -- vLLM's CPU tier,
in front of :class:`~persisting.integrations.vllm.tier.PersistingTier` -- the page cache
would hold every value a second time, and each byte would cost a CPU copy into or out of
it on top of the transfer, where O_DIRECT leaves the moving to the disk's DMA: on a host
whose cores the engine also needs, CPU per byte is throughput. With
``direct_io`` a store writes and reads payloads this way when the memory and the size allow
it (4 KiB-aligned address and length: O_DIRECT's rule) and the filesystem takes it (tmpfs
and some others refuse: then, and for any other value, the page cache is used). The
checksum is then made over the caller's memory before the write and after the read, since
no CPU copy passes the bytes through the cache on the way.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable

import numpy as np
import xxhash

from persisting.errors import CorruptValueError

#: O_DIRECT's alignment for memory, file offsets and lengths (safe for 512-byte and 4 KiB
#: logical blocks alike).
ALIGN = 4096
_FLAG = getattr(os, "O_DIRECT", 0)
#: errnos meaning "this filesystem (or this request) does not take O_DIRECT".
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)
#: Each writing thread's aligned header buffer.
_LOCAL = threading.local()


def aligned(view: memoryview, offset: int) -> bool:
    """Whether ``view`` may be moved with O_DIRECT at file offset ``offset``."""
    if not _FLAG or len(view) == 0 or len(view) % ALIGN or offset % ALIGN:
        return False
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return address % ALIGN == 0


def write(fd: int, view: memoryview, offset: int, head: bytes = b"") -> bool:
    """Write ``view`` at ``offset`` of ``fd``, a file opened with O_DIRECT (see
    :func:`open_flags`), and ``head`` (``offset`` bytes, the file's header) before it in
    the same call; False, having written nothing, if the filesystem refuses O_DIRECT (the
    caller writes through the page cache instead: :func:`buffered`). Other errors raise
    OSError.

    A header written through the page cache instead would leave each file a dirty page:
    its block allocated, written and journalled at the next flush, one file at a time,
    after the payload (on ext4 that flush took longer than every payload's write)."""
    views = [view]
    if head:
        if len(head) != offset or offset % ALIGN:
            raise ValueError(f"a {len(head)}-byte header before a payload at {offset}")
        views.insert(0, _head_block(offset))
        views[0][:] = head
        offset = 0
    done = 0
    while views:
        try:
            written = os.pwritev(fd, views, offset + done)
        except OSError as exc:
            if done == 0 and refused(exc):
                return False
            raise
        done += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]
    return True


def open_flags() -> int:
    """The flag that opens a file for O_DIRECT (0 where the platform has none)."""
    return _FLAG


def refused(exc: OSError) -> bool:
    """Whether ``exc`` says the filesystem does not take O_DIRECT."""
    return exc.errno in _REFUSED


def buffered(fd: int) -> None:
    """Take O_DIRECT off ``fd``: what is written next goes through the page cache (for a
    value O_DIRECT cannot move: unaligned memory or size)."""
    if _FLAG:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & _FLAG:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_FLAG)


def _head_block(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer of ``nbytes`` for a header (O_DIRECT moves only
    aligned memory)."""
    block: mmap.mmap | None = getattr(_LOCAL, "block", None)
    if block is None or len(block) < nbytes:
        block = _LOCAL.block = mmap.mmap(-1, max(nbytes, ALIGN))
    return memoryview(block)[:nbytes]


def read(path: str | os.PathLike[str], out: memoryview, offset: int) -> bool:
    """Fill ``out`` with the bytes of ``path`` from ``offset`` with O_DIRECT; False if the
    filesystem refuses O_DIRECT (nothing read). A file shorter than that is a
    CorruptValueError; FileNotFoundError passes through."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _FLAG)
    except OSError as exc:
        if refused(exc):
            return False
        raise
    try:
        done = 0
        while done < len(out):
            try:
                got = os.preadv(fd, [out[done:]], offset + done)
            except OSError as exc:
                if done == 0 and refused(exc):
                    return False
                raise
            if got == 0:
                raise CorruptValueError(
                    f"{path} is shorter than expected ({offset + done} < {offset + len(out)})"
                )
            done += got
    finally:
        os.close(fd)
    return True


def write_hashed(
    fd: int, view: memoryview, offset: int, header: Callable[[int], bytes] | None = None
) -> int | None:
    """:func:`write`, after hashing ``view`` (its xxh3-64, as every payload's checksum, is
    returned); with ``header``, the file's header made of that checksum is written before
    it in the same call. None, nothing written, if the filesystem refuses O_DIRECT."""
    digest = xxhash.xxh3_64_intdigest(view)
    head = header(digest) if header is not None else b""
    return digest if write(fd, view, offset, head) else None


def read_hashed(path: str | os.PathLike[str], out: memoryview, offset: int) -> int | None:
    """:func:`read`, then the xxh3-64 of what was read; None if O_DIRECT is refused."""
    return xxhash.xxh3_64_intdigest(out) if read(path, out, offset) else None


__all__ = [
    "ALIGN",
    "aligned",
    "buffered",
    "open_flags",
    "read",
    "read_hashed",
    "refused",
    "write",
    "write_hashed",
]
