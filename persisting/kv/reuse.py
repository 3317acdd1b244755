"""How often, and how lately, each key was used: the state the ``value`` eviction policy ranks by.

A *sighting* is a put that stores a key or a read that finds it (a tier's index reports
both). Per key :class:`ReuseStats` remembers, by its 64-bit hash, how many times it was
sighted and when last, on a logical clock that counts sightings; it remembers keys no tier
holds any more (ghosts), so a chunk evicted and put again comes back with its history.

Everything lives in one flat array of 64-bit words: a header (magic, slot count, clock)
and a table of slots in buckets of four, two words each: the key's hash (a slot never
mistakes one key for another) and the sighting count (8 bits, saturating) with the clock
at the last sighting (44 bits). A key new to a full bucket takes the slot sighted longest
ago: the table forgets the coldest keys first. For a disk tier the array is a file,
``reuse.bin`` beside the metadata, mapped shared: every process writing the namespace
counts into it and sees the others' counts at once, and it survives a restart. Updates
take no lock: two processes counting at the same instant may lose a count, which can
change an eviction choice and never data. A file that is damaged or of another version is
replaced by an empty one (only history is lost).

:class:`RecencyDuel` decides, per tier and process, how much frequency may count: it runs
LRU beside the tier on keys alone and weighs frequency down while LRU would have hit more.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import xxhash

from persisting.errors import CapacityError
from persisting.lance_store.access import CONTROL_FILE_MODE, open_private, storage_error
from persisting.shm.pages import (
    MADV_POPULATE_READ,
    MADV_POPULATE_WRITE,
    Prefault,
    pages_resident,
)

log = logging.getLogger(__name__)

FILE_NAME = "reuse.bin"
_MAGIC = int.from_bytes(b"PKVREUS2", "little")
#: Header words: magic, slot count, clock.
_HEAD_WORDS = 3
_CLOCK = 2
_REFS_BITS, _TICK_BITS = 8, 44
TICK_MASK = (1 << _TICK_BITS) - 1
_REFS_MAX = (1 << _REFS_BITS) - 1
#: Slots per bucket: a key may sit in any slot of its bucket, and a new key takes the
#: slot sighted longest ago, so a hot key is not pushed out by a cold one that collides.
WAYS = 4
#: Words per slot: the key's hash, then its count and last sighting.
_SLOT_WORDS = 2
MIN_SLOTS, MAX_SLOTS = 1 << 10, 1 << 23


def key_hash(key: str) -> int:
    """The 64-bit hash a key is remembered by (never 0: an empty slot's)."""
    return xxhash.xxh3_64_intdigest(key.encode()) or 1


def slots_for(capacity_bytes: int, minimum: int = MIN_SLOTS) -> int:
    """Table slots for a tier of ``capacity_bytes``: one per 4 KiB of budget (a table of 16
    bytes per slot is 1/256 of the budget), a power of two in [``minimum``, ``MAX_SLOTS``]."""
    want = max(minimum, capacity_bytes // 4096)
    slots = 1 << max(0, want - 1).bit_length()
    return max(minimum, min(MAX_SLOTS, slots))


def file_bytes(slots: int) -> int:
    return 8 * (_HEAD_WORDS + _SLOT_WORDS * slots)


class ReuseStats:
    """Sighting counts and last sightings per key hash, on a clock of sightings."""

    def __init__(self, owner: mmap.mmap | bytearray, path: Path | None):
        self._owner = owner
        self._words = words = memoryview(owner).cast("Q")
        self.path = path
        self.slots = int(words[1])
        self._mask = self.slots - 1
        self._prefault = Prefault()

    # -- making one -------------------------------------------------------------------

    @classmethod
    def in_memory(cls, slots: int) -> ReuseStats:
        """Private state (a memory tier: its contents die with the process too)."""
        buffer = bytearray(file_bytes(slots))
        struct.pack_into("<QQ", buffer, 0, _MAGIC, slots)
        return cls(buffer, None)

    @classmethod
    def open_file(cls, directory: Path, slots: int) -> ReuseStats:
        """The shared state in ``directory``: the existing file if it is whole (of whatever
        size it was made with), else a new one of ``slots`` slots, fully allocated."""
        path = directory / FILE_NAME
        fd = open_private(path, os.O_RDWR | os.O_CREAT, CONTROL_FILE_MODE)
        try:
            size = os.fstat(fd).st_size
            existing = _valid_slots(fd, size)
            fresh = existing is None
            if existing is None:
                if size:
                    log.warning("%s is damaged or of another version: starting it afresh", path)
                    os.ftruncate(fd, 0)
                size = file_bytes(slots)
                os.ftruncate(fd, size)
                with contextlib.suppress(OSError):  # allocated now, so its size is measured
                    os.posix_fallocate(fd, 0, size)
                os.pwrite(fd, struct.pack("<QQ", _MAGIC, slots), 0)
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise storage_error(f"cannot open {path}", exc) from exc
        finally:
            os.close(fd)
        stats = cls(mapped, path)
        # Every sighting writes a page of the table picked by a hash. Faulted in as it is
        # first written, each page of a new file cost a write fault in which ext4 turns
        # the preallocated extent into data under its journal (16-70 us alone, 200 us
        # beside a tier's O_DIRECT writes): that halved vLLM tier cascades (0.9-1.0 GB/s
        # against 2.0-2.4 with the pages populated, or with lru). So the table is faulted
        # in at open, in the background: a new file's pages written (zeros, once), an
        # existing file's read (a write to a page already on disk faults cheaply, 2 us).
        # It stays in memory: 1/256 of the disk budget, 128 MiB at most.
        address = np.frombuffer(mapped, np.uint8, count=1).ctypes.data
        advice = MADV_POPULATE_WRITE if fresh else MADV_POPULATE_READ
        stats._prefault.start(address, size, advice=advice)
        return stats

    # -- counting ---------------------------------------------------------------------

    @property
    def now(self) -> int:
        """The clock: sightings counted so far (all processes, modulo 2**44)."""
        return int(self._words[_CLOCK]) & TICK_MASK

    def _bucket(self, khash: int) -> int:
        """The word index of ``khash``'s bucket (``WAYS`` slots of two words)."""
        return _HEAD_WORDS + _SLOT_WORDS * (khash & self._mask & ~(WAYS - 1))

    def state(self, khash: int) -> tuple[int, int]:
        """``(sightings, clock at the last one)`` of a key hash; ``(0, 0)`` if forgotten."""
        words = self._words
        base = self._bucket(khash)
        for at in range(base, base + _SLOT_WORDS * WAYS, _SLOT_WORDS):
            if words[at] == khash:
                value = words[at + 1]
                return (value >> _TICK_BITS) & _REFS_MAX, value & TICK_MASK
        return 0, 0

    def sighted(self, khash: int) -> int:
        """Count a sighting of ``khash``; returns the clock."""
        words = self._words
        now = (int(words[_CLOCK]) + 1) & TICK_MASK
        words[_CLOCK] = now
        base = self._bucket(khash)
        slot, refs, oldest = base, 0, -1
        for at in range(base, base + _SLOT_WORDS * WAYS, _SLOT_WORDS):
            if words[at] == khash:
                slot, refs = at, (words[at + 1] >> _TICK_BITS) & _REFS_MAX
                break
            # else take the empty slot, or the one sighted longest ago
            age = (now - words[at + 1]) & TICK_MASK if words[at] else TICK_MASK + 1
            if age > oldest:
                slot, oldest = at, age
        words[slot] = khash
        words[slot + 1] = (min(refs + 1, _REFS_MAX) << _TICK_BITS) | now
        return now

    # -- upkeep -----------------------------------------------------------------------

    def flush(self) -> None:
        """Ask the kernel to write a shared file's pages now (they reach the file anyway)."""
        if isinstance(self._owner, mmap.mmap):
            with contextlib.suppress(OSError, ValueError):
                self._owner.flush()

    def wait_prefault(self) -> None:
        """Wait until the table's pages are all faulted in (see :meth:`open_file`)."""
        self._prefault.wait()

    def resident(self) -> bool:
        """Whether every page of the table is in memory (False where it cannot be told)."""
        return pages_resident(np.frombuffer(self._owner, np.uint8))

    def close(self) -> None:
        self._prefault.stop()
        self.flush()
        self._words.release()
        if isinstance(self._owner, mmap.mmap):
            with contextlib.suppress(BufferError):
                self._owner.close()


class RecencyDuel:
    """How much frequency may count in a tier: ``weight`` in [0, 1], the exponent of the
    sighting count in the ``value`` policy's density (0: recency alone, LRU's order).

    Beside the tier it runs LRU on keys alone (a shadow holding as many keys as the tier
    holds chunks, every sighting admitted) and counts, per window of as many sightings,
    the hits each had. A window the tier lost by more than chance would (``Z`` standard
    deviations of the hit counts) halves the weight; one it did not lose adds a tenth, up
    to 1. So where recency alone does better -- a tier large for the workload, a workload
    whose frequencies do not predict its next uses -- frequency fades until the tier keeps
    up with LRU, and comes back where it wins. Per process and tier, in memory (it costs a
    key reference and a dictionary entry per chunk).
    """

    DOWN, UP, Z = 0.5, 0.1, 2.0

    def __init__(self) -> None:
        self.weight = 1.0
        self._shadow: OrderedDict[str, None] = OrderedDict()
        self._hits = self._shadow_hits = self._seen = 0

    def sighted(self, key: str, hit: bool, entries: int) -> None:
        """A sighting of ``key``: a hit of the tier (``hit``) or a put; ``entries`` is the
        tier's size in chunks."""
        shadow = self._shadow
        if key in shadow:
            shadow.move_to_end(key)
            self._shadow_hits += 1
        else:
            shadow[key] = None
            while len(shadow) > max(1, entries):
                shadow.popitem(last=False)
        self._hits += hit
        self._seen += 1
        if self._seen >= max(1, entries):
            behind = self._shadow_hits - self._hits
            if behind > self.Z * math.sqrt(self._shadow_hits + self._hits + 1):
                self.weight *= self.DOWN
            elif behind <= 0:
                self.weight = min(1.0, self.weight + self.UP)
            self._hits = self._shadow_hits = self._seen = 0


def open_shared(
    directory: Path,
    capacity: int,
    growth: Callable[[Callable[[], int]], AbstractContextManager[None]],
) -> ReuseStats:
    """A disk tier's stats: the namespace's file, made the first time inside ``growth``
    (the disk budget's reservation of a metadata change, given its bound); in this process
    only when the budget has no room for it."""
    slots = slots_for(capacity)
    bound = 0 if (directory / FILE_NAME).exists() else file_bytes(slots)
    try:
        with growth(lambda: bound):
            return ReuseStats.open_file(directory, slots)
    except CapacityError as exc:
        log.warning("reuse stats of %s kept in memory only: %s", directory, exc)
        return ReuseStats.in_memory(slots)


def _valid_slots(fd: int, size: int) -> int | None:
    """The slot count of a whole table file, or None (absent, torn or another version)."""
    if size < file_bytes(MIN_SLOTS):
        return None
    magic, slots = struct.unpack("<QQ", os.pread(fd, 16, 0))
    if magic != _MAGIC or slots & (slots - 1) or size != file_bytes(slots):
        return None
    return int(slots)


__all__ = [
    "FILE_NAME",
    "TICK_MASK",
    "RecencyDuel",
    "ReuseStats",
    "file_bytes",
    "key_hash",
    "open_shared",
    "slots_for",
]
