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

:class:`RecencyDuel` decides, per tier and process, whether frequency counts: it runs LRU
and the value policy beside the tier on key hashes alone and follows whichever hit more.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import random
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
    """Whether frequency counts in a tier: ``weight`` 1 (the ``value`` policy's density
    weighs a chunk's sighting count) or 0 (recency alone: LRU's order among the leaves).

    Beside the tier it runs two caches on key hashes alone, each as large as the tier is
    in chunks and admitting every sighting: one evicting LRU, one evicting by the value
    density at full weight (the least of ``SAMPLES`` keys drawn at random). Per window of
    as many sightings as the tier holds chunks, each adds its hits to a score that halves
    every window (``DECAY``: the last few windows count). Frequency goes on when the
    density's shadow leads by ``Z_ON`` standard deviations, off when LRU's leads by
    ``Z_OFF``, and stays as it is in between. Hits come in runs (a prompt's chunks hit
    together), so the deviation is that of a count of runs: the runs' squares summed, not
    the hits -- one long prompt that one shadow happened to keep is not evidence. It starts
    on recency: frequency must first show it would have hit more. So the tier does not
    fall behind LRU where frequency predicts nothing (a tier large for its workload, a
    stretch with little reuse), and keeps frequency where it pays. Turning it off is the
    quicker: falling behind LRU is what a user of the default must not see.

    Per process and tier, in memory: two integers per chunk in each shadow, and
    ``SAMPLES`` table lookups per sighting once the shadows are full.
    """

    DECAY, Z_ON, Z_OFF, SAMPLES = 0.5, 1.5, 1.0, 16

    def __init__(self, seed: int = 0) -> None:
        self.weight = 0.0
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._value: list[int] = []
        self._value_at: dict[int, int] = {}
        self._rng = random.Random(seed)
        self._lru_hits = self._value_hits = self._seen = 0
        self._lru_score = self._value_score = 0.0
        #: Hits come in runs (a prompt's chunks hit together): the current run of each
        #: shadow, and the runs' squares summed -- the variance of a count of runs.
        self._lru_run = self._value_run = 0
        self._squares = self._spread = 0.0

    def sighted(self, khash: int, entries: int, reuse: ReuseStats) -> None:
        """A sighting of the key hashed ``khash`` (already counted in ``reuse``); the
        tier holds ``entries`` chunks."""
        size = max(1, entries)
        lru = self._lru
        if khash in lru:
            lru.move_to_end(khash)
            self._lru_hits += 1
            self._lru_run += 1
        else:
            self._squares += self._lru_run**2
            self._lru_run = 0
            lru[khash] = None
            while len(lru) > size:
                lru.popitem(last=False)
        if khash in self._value_at:
            self._value_hits += 1
            self._value_run += 1
        else:
            self._squares += self._value_run**2
            self._value_run = 0
            self._value_at[khash] = len(self._value)
            self._value.append(khash)
            while len(self._value) > size:
                self._evict_value(reuse, size)
        self._seen += 1
        if self._seen >= size:
            self._decide()

    def _evict_value(self, reuse: ReuseStats, size: int) -> None:
        """Drop the value shadow's least dense of ``SAMPLES`` random keys (never the one
        just added, the last)."""
        keys = self._value
        now, horizon = reuse.now, 2 * size
        victim, least = -1, math.inf
        for _ in range(self.SAMPLES):
            i = self._rng.randrange(len(keys) - 1)
            refs, last = reuse.state(keys[i])
            density = max(1, refs) / (((now - last) & TICK_MASK) + horizon)
            if density < least:
                victim, least = i, density
        gone, tail = keys[victim], keys.pop()
        del self._value_at[gone]
        if victim < len(keys):
            keys[victim] = tail
            self._value_at[tail] = victim

    def _decide(self) -> None:
        lru = self._lru_score = self.DECAY * self._lru_score + self._lru_hits
        value = self._value_score = self.DECAY * self._value_score + self._value_hits
        self._squares += self._lru_run**2 + self._value_run**2
        self._lru_run = self._value_run = 0
        self._spread = self.DECAY**2 * self._spread + self._squares
        spread = math.sqrt(self._spread + 1)
        if value - lru > self.Z_ON * spread:
            self.weight = 1.0
        elif lru - value > self.Z_OFF * spread:
            self.weight = 0.0
        self._lru_hits = self._value_hits = self._seen = 0
        self._squares = 0.0


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
