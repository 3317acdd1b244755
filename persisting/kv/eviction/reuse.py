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
``reuse.bin`` beside the metadata, read and written in place with ``pread``/``pwrite``
(:class:`SharedReuseStats`; never mapped, so no size or content of the file can fault a
process): every process writing the namespace counts into it and sees the others' counts
at once, and it survives a restart. Updates take no lock: two processes counting at the
same instant may lose a count, which can change an eviction choice and never data.

Its size follows the budget a store opens the namespace with (:func:`slots_for`: 1/256 of
it, rounded up to a power of two), judged before anything of the namespace is counted
(:func:`prepare`): a file of another size is replaced by one of the right size holding its
counts (re-bucketed, the most recent kept), a damaged one or one of another version by an
empty one (only history is lost). A file is only ever replaced -- written whole beside its
place, synced, renamed over it -- never shortened in place, so a process still counting
into the old one keeps a whole file until it notices and moves to the new one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np

from persisting.errors import CapacityError, StorageIOError
from persisting.lance_store.access import CONTROL_FILE_MODE, open_private, storage_error
from persisting.shm.pages import pages_resident

log = logging.getLogger(__name__)

FILE_NAME = "reuse.bin"
#: A new table is written under a name ending so, then renamed into place.
TMP_SUFFIX = ".tmp"
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


def slots_for(capacity_bytes: int, minimum: int = MIN_SLOTS) -> int:
    """Table slots for a tier of ``capacity_bytes``: one per 4 KiB of budget (a table of 16
    bytes per slot is 1/256 of the budget), a power of two in [``minimum``, ``MAX_SLOTS``]."""
    want = max(minimum, capacity_bytes // 4096)
    slots = 1 << max(0, want - 1).bit_length()
    return max(minimum, min(MAX_SLOTS, slots))


def file_bytes(slots: int) -> int:
    return 8 * (_HEAD_WORDS + _SLOT_WORDS * slots)


class ReuseStats:
    """Sighting counts and last sightings per key hash, on a clock of sightings: a table
    in this process's memory (:meth:`in_memory`), or the namespace's file
    (:meth:`open_file`, a :class:`SharedReuseStats`)."""

    def __init__(self, slots: int):
        self._owner = buffer = bytearray(file_bytes(slots))
        struct.pack_into("<QQ", buffer, 0, _MAGIC, slots)
        self._words = memoryview(buffer).cast("Q")
        self.path: Path | None = None
        self.slots = slots
        self._mask = slots - 1

    # -- making one -------------------------------------------------------------------

    @classmethod
    def in_memory(cls, slots: int) -> ReuseStats:
        """Private state (a memory tier: its contents die with the process too)."""
        return cls(slots)

    @classmethod
    def open_file(
        cls, directory: Path, slots: int, table: np.ndarray | None = None
    ) -> SharedReuseStats:
        """The shared state in ``directory``: the existing file if it is whole (of whatever
        size it was made with), else a new one of ``slots`` slots (holding ``table``, a
        whole table's words, when given) made beside it and renamed over it."""
        return SharedReuseStats(directory / FILE_NAME, slots, table)

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

    def sighted_many(self, khashes: Sequence[int]) -> list[int]:
        """Count a sighting of each of ``khashes``, in order; returns their clocks."""
        return [self.sighted(khash) for khash in khashes]

    # -- upkeep -----------------------------------------------------------------------

    def flush(self) -> None:
        """Write a shared file's counts through (nothing to do in memory)."""

    def wait_prefault(self) -> None:
        """Wait until a shared file's table is read into the page cache (see
        :class:`SharedReuseStats`; nothing to wait for in memory)."""

    def resident(self) -> bool:
        """Whether every page of the table is in memory (False where it cannot be told)."""
        return pages_resident(np.frombuffer(self._owner, np.uint8))

    def close(self) -> None:
        self._words.release()


def _place(bucket: Sequence[int], khash: int, now: int) -> tuple[int, int]:
    """Where in ``bucket`` (its words) a sighting of ``khash`` at ``now`` goes, and the
    slot's new count-and-clock word: the key's own slot, else the empty one, else the one
    sighted longest ago."""
    slot, refs, oldest = 0, 0, -1
    for at in range(0, _SLOT_WORDS * WAYS, _SLOT_WORDS):
        if bucket[at] == khash:
            slot, refs = at, (bucket[at + 1] >> _TICK_BITS) & _REFS_MAX
            break
        age = (now - bucket[at + 1]) & TICK_MASK if bucket[at] else TICK_MASK + 1
        if age > oldest:
            slot, oldest = at, age
    return slot, (min(refs + 1, _REFS_MAX) << _TICK_BITS) | now


class SharedReuseStats(ReuseStats):
    """A namespace's table in ``reuse.bin``, shared by every process writing it, read and
    written with ``pread``/``pwrite`` on a descriptor: never mapped, so no size or content
    of the file can fault the process (a mapped file truncated under it raised SIGBUS on
    the next sighting, killing the process).

    A sighting costs four system calls (read the clock and the bucket, write them back),
    a lookup one. The file is never shortened in place by a store: one of the wrong size
    or damaged is replaced by a new file renamed over it, and a process holding the old
    one goes on counting into it (its inode stays whole while open) until it notices the
    new one -- every ``CHECK_EVERY`` sightings and on :meth:`flush` it compares the path's
    inode with its own -- and moves to it (counts in between are lost, never data). A file
    shortened by someone else reads as empty where it is missing, and a sighting that
    finds its bucket missing writes nothing.
    """

    CHECK_EVERY = 4096

    def __init__(self, path: Path, slots: int, table: np.ndarray | None = None):
        self.path = self._path = path
        self._lock = threading.Lock()
        self._warm: threading.Thread | None = None
        self._stop = threading.Event()
        self._since_check = 0
        self._last = 0
        try:
            fd = open_private(path, os.O_RDWR, CONTROL_FILE_MODE)
        except StorageIOError:  # absent, a link, ...: made afresh
            fd = -1
        try:
            found = None if fd < 0 else _valid_slots(fd, os.fstat(fd).st_size)
            if found is None:
                if fd >= 0:
                    log.warning("%s is damaged or of another version: starting it afresh", path)
                    os.close(fd)
                    fd = -1
                fd, found, fresh = _create(path, slots, table), slots, True
            else:
                fresh = False
                with contextlib.suppress(OSError):  # blocks a crafted sparse file lacks
                    os.posix_fallocate(fd, 0, file_bytes(found))
            self._ident = _identity(os.fstat(fd))
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            raise storage_error(f"cannot open {path}", exc) from exc
        self._fd = fd
        self.slots = found
        self._mask = found - 1
        if not fresh:  # a new file was just written whole: its pages are in the cache
            self._start_warming(fd)

    # -- counting ---------------------------------------------------------------------

    def _read(self, fd: int, nbytes: int, offset: int) -> bytes:
        try:
            return os.pread(fd, nbytes, offset)
        except OSError:
            return b""

    @property
    def now(self) -> int:
        with self._lock:
            raw = self._read(self._fd, 8, 8 * _CLOCK)
            if len(raw) == 8:
                self._last = _WORD.unpack(raw)[0] & TICK_MASK
            return self._last

    def state(self, khash: int) -> tuple[int, int]:
        with self._lock:
            at = self._bucket(khash)
            raw = self._read(self._fd, _BUCKET.size, 8 * at)
        if len(raw) != _BUCKET.size:
            return 0, 0
        words = _BUCKET.unpack(raw)
        for i in range(0, _SLOT_WORDS * WAYS, _SLOT_WORDS):
            if words[i] == khash:
                value = words[i + 1]
                return (value >> _TICK_BITS) & _REFS_MAX, value & TICK_MASK
        return 0, 0

    def sighted(self, khash: int) -> int:
        return self.sighted_many([khash])[0]

    def sighted_many(self, khashes: Sequence[int]) -> list[int]:
        """Count a batch of sightings: the clock is read and written once for the batch
        (two system calls per key instead of four). Another process counting meanwhile
        loses none of its clock's advance: the clock is read again at the end and moved on
        by this batch's count from there (the two may hand out the same clock values,
        which only makes those sightings look simultaneous)."""
        if not khashes:
            return []
        self._since_check += len(khashes)
        if self._since_check >= self.CHECK_EVERY:
            self._follow()
        ticks: list[int] = []
        with self._lock:
            fd = self._fd
            raw = self._read(fd, 8, 8 * _CLOCK)
            now = _WORD.unpack(raw)[0] if len(raw) == 8 else self._last
            whole = True
            for khash in khashes:
                now = (now + 1) & TICK_MASK
                ticks.append(now)
                base = self._bucket(khash)
                raw = self._read(fd, _BUCKET.size, 8 * base)
                if len(raw) != _BUCKET.size:  # shortened under us: count nothing
                    whole = False
                    continue
                at, value = _place(_BUCKET.unpack(raw), khash, now)
                with contextlib.suppress(OSError):
                    os.pwrite(fd, _PAIR.pack(khash, value), 8 * (base + at))
            self._last = now
            raw = self._read(fd, 8, 8 * _CLOCK)
            if not whole or len(raw) != 8:
                return ticks  # a shortened file is never written into: it stays short
            self._last = now = max(now, (_WORD.unpack(raw)[0] + len(khashes)) & TICK_MASK)
            with contextlib.suppress(OSError):
                os.pwrite(fd, _WORD.pack(now), 8 * _CLOCK)
        return ticks

    # -- upkeep -----------------------------------------------------------------------

    def _follow(self) -> None:
        """Move to the file now at the path if another process replaced ours and the new
        one is whole (else keep counting into ours)."""
        self._since_check = 0
        try:
            if _identity(os.stat(self._path)) == self._ident:
                return
            fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return
        try:
            slots = _valid_slots(fd, os.fstat(fd).st_size)
            ident = _identity(os.fstat(fd))
        except OSError:
            slots = None
        if slots is None:
            os.close(fd)
            return
        self._stop_warming()  # it reads the old descriptor
        with self._lock:
            if self._fd < 0:  # closed meanwhile
                os.close(fd)
                return
            old, self._fd, self._ident = self._fd, fd, ident
            self.slots, self._mask = slots, slots - 1
        os.close(old)
        self._start_warming(fd)
        log.info("%s was replaced: counting into the new table (%d slots)", self._path, slots)

    def _start_warming(self, fd: int) -> None:
        """Read the table through once in the background, so that sightings find its
        pages in the page cache."""
        self._stop = threading.Event()
        self._warm = threading.Thread(target=_read_through, args=(fd, self._stop), daemon=True)
        self._warm.start()

    def _stop_warming(self) -> None:
        self._stop.set()
        if self._warm is not None:
            self._warm.join()
            self._warm = None

    def flush(self) -> None:
        """Ask the kernel to write the table's pages now (they reach the file anyway), and
        move to a table another process put in its place."""
        if self._fd < 0:
            return
        self._follow()
        with self._lock, contextlib.suppress(OSError):
            os.fdatasync(self._fd)

    def wait_prefault(self) -> None:
        if self._warm is not None:
            self._warm.join()

    def resident(self) -> bool:
        with self._lock:
            size = os.fstat(self._fd).st_size
            if not size:
                return False
            # mincore only: no page of the mapping is touched, so none can fault
            with mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as view:
                pages = np.frombuffer(view, np.uint8)
                try:
                    return pages_resident(pages)
                finally:
                    del pages

    def close(self) -> None:
        self._stop_warming()
        self.flush()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


_WORD = struct.Struct("<Q")
_PAIR = struct.Struct("<QQ")
_BUCKET = struct.Struct(f"<{_SLOT_WORDS * WAYS}Q")
#: What the background read-through reads at a time.
_READ_STEP = 4 << 20


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _read_through(fd: int, stop: threading.Event) -> None:
    """Read the file once, so its pages are in the page cache when sightings need them."""
    buffer = bytearray(_READ_STEP)
    offset = 0
    with contextlib.suppress(OSError):
        while not stop.is_set():
            got = os.preadv(fd, [buffer], offset)
            if got <= 0:
                break
            offset += got


def _create(path: Path, slots: int, table: np.ndarray | None) -> int:
    """A new table file of ``slots`` slots (``table``'s words, else empty) written whole
    beside ``path``, synced, then renamed over it; returns it open."""
    size = file_bytes(slots)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = open_private(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, CONTROL_FILE_MODE)
    try:
        with contextlib.suppress(OSError):  # allocated now, so its size is measured
            os.posix_fallocate(fd, 0, size)
        if table is not None and len(table) * 8 == size:
            os.pwrite(fd, table.tobytes(), 0)
        else:
            os.pwrite(fd, struct.pack("<QQQ", _MAGIC, slots, 0), 0)
            zeros = bytes(min(size, _READ_STEP))
            for offset in range(8 * _HEAD_WORDS, size, len(zeros)):
                os.pwrite(fd, zeros[: size - offset], offset)
        os.fdatasync(fd)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


def open_shared(
    directory: Path,
    capacity: int,
    growth: Callable[[Callable[[], int]], AbstractContextManager[None]],
    table: np.ndarray | None = None,
) -> ReuseStats:
    """A disk tier's stats: the namespace's file (see :func:`prepare`, run before the
    namespace was counted), made the first time inside ``growth`` (the disk budget's
    reservation of a metadata change, given its bound: the new file's size, or the blocks
    a sparse one still lacks) from ``table`` if given; in this process only when the
    budget has no room for it."""
    slots = slots_for(capacity)
    path = directory / FILE_NAME

    def bound() -> int:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return file_bytes(slots)
        return max(0, st.st_size - 512 * st.st_blocks)

    try:
        with growth(bound):
            return ReuseStats.open_file(directory, slots, table)
    except CapacityError as exc:
        log.warning("reuse stats of %s kept in memory only: %s", directory, exc)
        return ReuseStats.in_memory(slots)


def prepare(directory: Path, slots: int, *, keep: bool) -> np.ndarray | None:
    """Judge ``reuse.bin`` before the namespace is counted, for a budget that calls for
    ``slots`` slots (the caller holds the namespace's metadata lock, so no other store is
    making one): a file that is whole and of ``slots`` slots stays; any other is removed
    -- unlinked, never shortened, so a process counting into it keeps a whole file until
    it moves to the new one -- and, with ``keep`` (this store ranks by it), its counts
    are returned re-bucketed into ``slots`` slots when it was whole, for
    :func:`open_shared` to write into the new file. Without ``keep`` a whole file of fewer
    slots stays too (another process's, for a smaller budget). Leftovers of a store that
    died making a file are removed."""
    for leftover in directory.glob(f".{FILE_NAME}.*{TMP_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
    path = directory / FILE_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise storage_error(f"cannot open {path}", exc) from exc
        log.warning("%s is a link, not a table: removing it", path)
        path.unlink()
        return None
    try:
        found = _valid_slots(fd, os.fstat(fd).st_size)
        if found == slots or (found is not None and found < slots and not keep):
            return None
        table = None
        if found is not None and keep:
            old = bytearray(file_bytes(found))
            if os.preadv(fd, [old], 0) == len(old):
                table = resized(np.frombuffer(old, np.uint64), slots)
    finally:
        os.close(fd)
    if found is None:
        log.warning("%s is damaged or of another version: replacing it", path)
    else:
        log.info("%s has %d slots, this budget %d: resizing it", path, found, slots)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return table


def resized(table: np.ndarray, slots: int) -> np.ndarray:
    """The words of a table of ``slots`` slots holding ``table``'s keys and clock: in each
    new bucket, the ``WAYS`` of its keys sighted last. Linear in the tables' sizes: a new
    bucket gathers whole old buckets (fewer slots: those whose index it ends, of which the
    most recent ``WAYS`` are kept) or part of one (more slots)."""
    now = int(table[_CLOCK]) & TICK_MASK
    old = table[_HEAD_WORDS:].reshape(-1, WAYS, _SLOT_WORDS)
    out = np.zeros(_HEAD_WORDS + _SLOT_WORDS * slots, np.uint64)
    out[:_HEAD_WORDS] = (_MAGIC, slots, now)
    new = out[_HEAD_WORDS:].reshape(-1, WAYS, _SLOT_WORDS)
    gathered = len(old) // len(new)
    if gathered >= 1:  # old bucket a * len(new) + b goes to new bucket b
        split = old.reshape(gathered, len(new), WAYS, _SLOT_WORDS).transpose(1, 0, 2, 3)
        rows: np.ndarray = split.reshape(len(new), gathered * WAYS, _SLOT_WORDS)
        if gathered > 1:
            mask = np.uint64(TICK_MASK)
            age = (np.uint64(now) - (rows[..., 1] & mask)) & mask
            age[rows[..., 0] == 0] = np.uint64(TICK_MASK + 1)  # empty: last
            pick = np.argpartition(age, WAYS - 1, axis=1)[:, :WAYS]
            rows = np.take_along_axis(rows, pick[..., None], axis=1)
        new[...] = rows
    else:  # each old bucket's keys spread over the new buckets their hashes pick
        hashes = old[..., 0]
        live = hashes != 0
        bucket = ((hashes & np.uint64(slots - 1)) >> np.uint64(2)).astype(np.int64)
        way = np.zeros(hashes.shape, np.int64)
        for w in range(1, WAYS):
            for earlier in range(w):
                way[:, w] += (bucket[:, earlier] == bucket[:, w]) & live[:, earlier]
        new[bucket[live], way[live]] = old[live]
    return out


def _valid_slots(fd: int, size: int) -> int | None:
    """The slot count of a whole table file, or None (absent, torn or another version)."""
    if size < file_bytes(MIN_SLOTS):
        return None
    magic, slots = struct.unpack("<QQ", os.pread(fd, 16, 0))
    if (
        magic != _MAGIC
        or slots & (slots - 1)
        or not MIN_SLOTS <= slots <= MAX_SLOTS
        or size != file_bytes(slots)
    ):
        return None
    return int(slots)


__all__ = [
    "FILE_NAME",
    "TICK_MASK",
    "ReuseStats",
    "SharedReuseStats",
    "file_bytes",
    "open_shared",
    "prepare",
    "resized",
    "slots_for",
]
