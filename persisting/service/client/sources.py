"""Where a value a client reads comes from: one small class per read path.

A ``get`` reply names, per key, where its value is (see
:mod:`persisting.service.handler.gets`); :func:`source_of` turns that entry into a
source, and the source's ``read`` puts the bytes into a :class:`Destination` and returns
the value -- or :data:`AGAIN` when the value moved before it could be read (its pool pages
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
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from persisting.errors import InvalidValueError, PersistingError, StorageIOError
from persisting.kv import Layout, SharedLocation
from persisting.kv.layout import checksum, decode_value
from persisting.service.client.member import Member
from persisting.service.same_host import ClientArena, read_file_into
from persisting.shm import RecycledBuffers, aligned_buffer, copy_bytes

#: A read that found the value gone from where the reply said: ask the server again.
AGAIN = object()


class Destination:
    """Where one value's bytes go: the caller's buffer (``get_into``), else recycled private
    pages (as the in-process store returns values in: no page faults once warm, and the
    value owns them until it is dropped), else a fresh page-aligned buffer."""

    def __init__(self, results: RecycledBuffers | None, nbytes: int, out: memoryview | None):
        self.out = out
        self.buffer: np.ndarray | None = None
        if out is not None:
            if len(out) != nbytes:
                raise InvalidValueError(
                    f"get_into needs a buffer of {nbytes} bytes, got {len(out)}"
                )
            self.target = out
            return
        buffer = results.take(nbytes) if results is not None else None
        self.buffer = buffer if buffer is not None else aligned_buffer(nbytes)
        self.target = self.buffer.data

    def value(self, layout: Layout) -> Any:
        """What the get returns once the bytes are in: the layout for ``get_into``, else
        the decoded value."""
        if self.out is not None:
            return layout
        assert self.buffer is not None
        return decode_value(layout, self.buffer)

    def discard(self) -> None:
        """The bytes are not wanted (the value moved, or failed its checksum)."""
        self.buffer = None  # its pages go back when the array is collected


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


class PoolCopy:
    """A memory-tier value copied out of the server's shared pool."""

    def __init__(self, location: SharedLocation):
        self.location = location

    def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
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

    def __init__(self, layout: Layout, offset: int):
        self.layout = layout
        self.offset = offset

    def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
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
    file we managed to open is whole; one gone before we opened it means: ask again."""

    def __init__(self, layout: Layout, location: list[Any]):
        self.layout = layout
        self.path, self.offset, self.nbytes, self.checksum = location

    async def read(self, ctx: ReadContext, out: memoryview | None, alone: bool) -> Any:
        dest = Destination(ctx.results, self.nbytes, out)
        try:
            if alone:  # a lone read is faster without the thread hop
                ok = _read_and_verify(self.path, self.offset, dest.target, self.checksum)
            else:  # several reads: spread them over threads (and cores)
                loop = asyncio.get_running_loop()
                args = (self.path, self.offset, dest.target, self.checksum)
                ok = await loop.run_in_executor(ctx.readers, _read_and_verify, *args)
        except (FileNotFoundError, StorageIOError):
            dest.discard()
            return AGAIN
        if not ok:
            dest.discard()
            ctx.counters["checksum_misses"] += 1
            return None
        ctx.counters["get_bytes_file"] += self.nbytes
        return dest.value(self.layout)


class Message:
    """A value sent in the reply, or as a transfer read in parts; verified by checksum."""

    def __init__(self, layout: Layout, entry: dict[str, Any]):
        self.layout = layout
        self.entry = entry

    async def read(self, ctx: ReadContext, out: memoryview | None) -> Any:
        layout, entry = self.layout, self.entry
        buffer = aligned_buffer(layout.nbytes)
        if "data" in entry:
            buffer[:] = np.frombuffer(entry["data"], np.uint8)
        else:
            await self._read_transfer(ctx, buffer, entry["transfer"])
        if checksum(buffer) != entry["checksum"]:
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
        nbytes = self.layout.nbytes

        async def read(offset: int) -> None:
            length = min(part, nbytes - offset)
            data = await ctx.call(
                ctx.member, "read_part", transfer=transfer, offset=offset, length=length
            )
            buffer[offset : offset + len(data)] = np.frombuffer(data, np.uint8)

        try:
            await asyncio.gather(*(read(off) for off in range(0, nbytes, part)))
        except PersistingError:
            try:
                await ctx.call(ctx.member, "end_transfer", transfer=transfer)
            except Exception:  # the transfer expires with the session anyway
                ctx.counters["transfers_left_open"] += 1
            raise


Source = PoolCopy | ArenaWindow | LeasedFile | Message


def source_of(entry: dict[str, Any], pooled: bool) -> Source | None:
    """The source a ``get`` reply entry names (None for ``memory``: in memory, no room)."""
    layout = Layout.from_dict(entry["layout"])
    if "arena" in entry:
        return ArenaWindow(layout, int(entry["arena"]))
    if "file" in entry:
        return LeasedFile(layout, entry["file"])
    if "pool" in entry:
        if not pooled:
            return None
        offset, generation = entry["pool"]
        return PoolCopy(SharedLocation(layout, int(offset), int(generation)))
    if entry.get("memory"):
        return None
    return Message(layout, entry)


def copy_into(dst: memoryview, src: memoryview) -> None:
    copy_bytes(np.frombuffer(dst, np.uint8), src)


def _read_and_verify(path: str, offset: int, out: memoryview, digest: int) -> bool:
    read_file_into(path, offset, out)
    return checksum(out) == digest


__all__ = [
    "AGAIN",
    "ArenaWindow",
    "Destination",
    "LeasedFile",
    "Message",
    "PoolCopy",
    "ReadContext",
    "source_of",
]
