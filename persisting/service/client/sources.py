"""Where a value a client reads comes from: one small class per read path.

A ``get`` reply names, per key, where its value is (a typed entry of
:mod:`~persisting.service.client.replies`); :func:`source_of` turns that entry into a
source, and the source's ``async read`` puts the bytes into a :class:`Destination` and
returns the value -- or :data:`AGAIN` when the value moved before it could be read (its pool pages
were freed, its file was evicted, it is in memory but there was no room), so the reader
asks once more. A value that fails its checksum is a miss (None), never wrong data.

* :class:`PoolCopy` -- copied out of the server's shared pool (read-only mapping), its
  generation checked after the copy (a seqlock);
* :class:`ArenaWindow` -- already copied by the server into a window of our arena;
* :class:`LeasedFile` -- read by us from the payload file the server leased to us;
* :class:`Message` -- the bytes came in the reply, or are read out of a transfer in parts.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from persisting.errors import PersistingError, ProtocolError, StorageIOError
from persisting.kv import SharedLocation
from persisting.kv.layout import checksum, decode_value
from persisting.service.client.destination import Destination, copy_into
from persisting.service.client.member import Member
from persisting.service.client.replies import (
    Entry,
    InFile,
    Inline,
    InMemoryNoRoom,
    InPool,
    InWindow,
    Transfer,
)
from persisting.service.same_host import ClientArena, read_file_into
from persisting.shm import RecycledBuffers, aligned_buffer


class Again(enum.Enum):
    """A read that found the value gone from where the reply said: ask the server again."""

    AGAIN = "again"


AGAIN = Again.AGAIN


@dataclass
class ReadContext:
    """What a source needs to read one member's values."""

    member: Member
    arena: ClientArena | None
    results: RecycledBuffers | None
    counters: Counter[str]
    readers: Executor
    call: Callable[..., Awaitable[Any]]
    message_part_bytes: int


class Source(Protocol):
    """Reads one value from where a ``get`` reply said it is."""

    async def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
        """The value (the layout when ``out`` was given), None for a miss (damaged bytes),
        or :data:`AGAIN` when the value moved before it could be read."""
        ...


class PoolCopy:
    """A memory-tier value copied out of the server's shared pool."""

    def __init__(self, location: SharedLocation):
        self.location = location

    async def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
        return self.read_now(ctx, out)

    def read_now(self, ctx: ReadContext, out: memoryview | None) -> Any:
        """:meth:`read` without the event loop (a remembered location is read this way)."""
        pool = ctx.member.pool
        if pool is None:
            return AGAIN
        layout = self.location.layout
        dest = Destination(ctx.results, layout.nbytes, out)
        copied = pool.read_into(
            self.location.offset,
            layout.nbytes,
            self.location.generation,
            np.frombuffer(dest.target, np.uint8),
        )
        if not copied:  # freed before or during the copy
            dest.discard()
            ctx.counters["pool_retries"] += 1
            return AGAIN
        ctx.counters["get_bytes_pool"] += layout.nbytes
        return dest.value(layout)


class ArenaWindow:
    """A memory-tier value the server copied into a window of our arena."""

    def __init__(self, entry: InWindow):
        self.layout = entry.layout
        self.offset = entry.offset

    async def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
        """The value; its pages leave the window (the reader frees the rest of it)."""
        assert ctx.arena is not None
        nbytes = self.layout.nbytes
        ctx.counters["get_bytes_arena"] += nbytes
        if out is not None:
            copy_into(out, ctx.arena.view[self.offset : self.offset + nbytes])
            return self.layout
        return decode_value(self.layout, ctx.arena.hand_out(self.offset, nbytes))


class LeasedFile:
    """A value on disk: we read its payload file ourselves, under the server's read lease,
    and verify its checksum. Payload files are immutable and eviction unlinks them, so a
    file we managed to open is whole; one gone before we opened it means: ask again.

    ``spread``: read on a reader thread (several files of one reply then read at once, on
    several cores); a lone read is faster without the thread hop."""

    def __init__(self, entry: InFile, spread: bool = False):
        self.entry = entry
        self.spread = spread

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    async def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
        entry = self.entry
        dest = Destination(ctx.results, entry.nbytes, out)
        args = (entry.path, entry.offset, dest.target, entry.checksum)
        try:
            if self.spread:
                loop = asyncio.get_running_loop()
                ok = await loop.run_in_executor(ctx.readers, _read_and_verify, *args)
            else:
                ok = _read_and_verify(*args)
        except (FileNotFoundError, StorageIOError):
            dest.discard()
            return AGAIN
        if not ok:
            dest.discard()
            ctx.counters["checksum_misses"] += 1
            return None
        ctx.counters["get_bytes_file"] += entry.nbytes
        return dest.value(entry.layout)


class Message:
    """A value sent in the reply, or as a transfer read in parts; verified by checksum."""

    def __init__(self, entry: Inline | Transfer):
        self.entry = entry

    async def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
        entry = self.entry
        layout = entry.layout
        buffer = aligned_buffer(layout.nbytes)
        if isinstance(entry, Inline):
            if len(entry.data) != layout.nbytes:
                ctx.counters["checksum_misses"] += 1
                return None
            buffer[:] = np.frombuffer(entry.data, np.uint8)
        else:
            await self._read_transfer(ctx, buffer, entry.transfer)
        if checksum(buffer) != entry.checksum:
            ctx.counters["checksum_misses"] += 1
            return None
        ctx.counters["get_bytes_message"] += layout.nbytes
        if out is None:
            return decode_value(layout, buffer)
        dest = Destination(None, layout.nbytes, out)  # checks the size
        copy_into(dest.target, buffer.data)
        return layout

    async def _read_transfer(self, ctx: ReadContext, buffer: np.ndarray, transfer: str) -> None:
        part = ctx.message_part_bytes
        nbytes = self.entry.layout.nbytes

        async def read(offset: int) -> None:
            length = min(part, nbytes - offset)
            data = await ctx.call(
                ctx.member, "read_part", transfer=transfer, offset=offset, length=length
            )
            if not isinstance(data, bytes) or len(data) != length:
                raise ProtocolError(f"read_part returned {len(data)} bytes, not {length}")
            buffer[offset : offset + length] = np.frombuffer(data, np.uint8)

        try:
            await asyncio.gather(*(read(off) for off in range(0, nbytes, part)))
        except PersistingError:
            try:
                await ctx.call(ctx.member, "end_transfer", transfer=transfer)
            except Exception:  # the transfer expires with the session anyway
                ctx.counters["transfers_left_open"] += 1
            raise


def source_of(entry: Entry, pooled: bool) -> Source | None:
    """The source that reads the value an entry names; None when it must be asked for again
    with room (in memory, no room offered; or a pool location we did not ask for)."""
    if isinstance(entry, InPool):
        return PoolCopy(entry.location) if pooled else None
    if isinstance(entry, InWindow):
        return ArenaWindow(entry)
    if isinstance(entry, InFile):
        return LeasedFile(entry)
    if isinstance(entry, InMemoryNoRoom):
        return None
    return Message(entry)


def _read_and_verify(path: str, offset: int, out: memoryview, digest: int) -> bool:
    read_file_into(path, offset, out)
    return checksum(out) == digest


__all__ = [
    "AGAIN",
    "Again",
    "ArenaWindow",
    "Destination",
    "LeasedFile",
    "Message",
    "PoolCopy",
    "ReadContext",
    "Source",
    "copy_into",
    "source_of",
]
