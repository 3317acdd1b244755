"""One disk budget for a whole storage root, however many namespaces it holds.

A namespace is opened per model, per weights version and, for engines, per KV layout: a
changed dtype or block size opens a new one and leaves the old one on disk. Were each
bounded only by its own ``disk_bytes``, a root would grow to N times what the operator
set. So a writer keeps the root's namespaces together within its ``disk_bytes`` (read from
their usage counters), and when a reservation would take the root over it, room is taken
chunk by chunk:

- **first from namespaces idle past the grace period**: no store has held them for
  :data:`GRACE_S` (an old layout, a weights version or a model not served now). The one
  held longest ago goes first, its least valuable chunks first; once it holds no chunk,
  its directory (metadata, counters) is dropped whole.
- **then from whichever namespace is most over its floor, the writer's own included**, a
  chunk or a few at a time, so that they level. The floor of a *protected* namespace -- one
  a live store holds, or an idle one within its grace period (a model restarting: loading
  its weights, fingerprinting them) -- is its fair share of what ``disk_bytes`` leaves for
  chunks: ``disk_bytes`` less every namespace's metadata, side files and reservations
  (which taking chunks cannot free), divided by the number of protected namespaces, the
  writer's own included, and counted in chunks. So namespaces all at their floors hold
  ``disk_bytes``, not ``disk_bytes`` plus their metadata. A namespace whose metadata and
  side files alone come to more than a fair share of ``disk_bytes`` (side files sized for a
  larger ``disk_bytes`` than this writer's) is not charged for them: no taking of chunks
  could bring the root within the budget, and the others keep their chunks all the same,
  while the root holds those bytes on top. A protected namespace loses only chunks above
  its floor, least valuable first; a writer below its floor is never refused for the
  root's sake (it may grow to its floor even while the one over its floor cannot give at
  once: its usage lock held longer than :data:`LOCK_WAIT_S`).

The grace period counts from when the namespace was last seen held: a store opening or
closing it marks its namespace lock file (its mtime; the opening is in its record too),
and so does every writer of the root that finds it held while reading the root (its own
included, at most every :data:`REFRESH_S` while it writes).

The chunks taken from another namespace are that namespace's least valuable by the order
the ``prefix`` policy uses (and the ``value`` policy does without reuse counts, which
another namespace's process keeps): chunks cut off from their prefix first, then the tips
of chains, least recently written first -- read from the headers of its oldest payload
files (at most :data:`VIEW_FILES` at a time), since reads in another process leave no
trace on disk; a file whose header does not verify under this root's key is never taken.
They are removed as that namespace's own eviction removes them: the payload file unlinked
and its usage counter lowered, under its usage lock (and, for an idle namespace, with its
namespace lock held exclusively, so a store opening it waits). Its stores, live or
opening, see the files gone as they see another process's evictions: a miss, a stale
metadata row dropped on their next open.

Every reservation reads the other namespaces' usage counters (one ``pread`` each); the
root's listing and who holds what are read at most every :data:`REFRESH_S`, and as soon
as a namespace is made or dropped (``kv/`` changed). So writers of different namespaces
exceed the budget only by the reservations they make at the same moment (a writer's
batch, and its metadata commit's bound on the table's own thread), and by what a writer
below its floor adds while the namespace over its floor cannot give; either is taken
back by the next reservation that finds the root over.

Each writer judges by its own ``disk_bytes``: writers of one root are meant to be given
the same (a root's processes share a config); with different ones, the floors differ.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from persisting.errors import NamespaceInUseError, PersistingError
from persisting.kv.disk.file_header import FileHeader
from persisting.kv.disk.payload_files import file_size, round_to_block, scan_payload
from persisting.kv.disk.quarantine import DIR_NAME as QUARANTINE_DIR
from persisting.kv.eviction.policy import PrefixAwareEviction
from persisting.kv.index import DiskEntry, LruIndex
from persisting.kv.keys import key_hash
from persisting.kv.namespace.record import read_record
from persisting.lance_store import StorageRoot, disk_usage
from persisting.lance_store.namespace_lock import LOCK_NAME
from persisting.lance_store.root import KV_DIR

log = logging.getLogger(__name__)

#: Seconds the root's listing (its namespaces, who holds them) is reused before it is read
#: again; the usage counters are read at every reservation.
REFRESH_S = 1.0
#: Seconds an idle namespace keeps its floor after it was last seen held (a model
#: restarting: its engine loads the weights and fingerprints them before it opens it).
GRACE_S = 600.0
#: The longest a writer waits for the usage lock of a namespace it takes room from.
LOCK_WAIT_S = 1.0
#: Payload files of another namespace read at a time to choose its victims (its oldest).
VIEW_FILES = 4096
#: Seconds a namespace's chosen victims are reused before its files are read again.
VIEW_S = 5.0
#: The usage counter of a namespace (see :mod:`persisting.kv.budget.shared_usage`): three int64
#: slots, payload, overhead and metadata reservations; and its lock.
_COUNTER = "usage.bin"
_USAGE_LOCK = ".lock"
_SLOTS = struct.Struct("<qqq")
_PAYLOAD = struct.Struct("<q")
_ORDER = PrefixAwareEviction()

#: Reads a payload file's header, verified under the root's key (``PayloadFiles.read_header``).
HeaderReader = Callable[[Path], FileHeader]


@dataclass(slots=True)
class Neighbour:
    """Another namespace of the root: its name and directory, the bytes its counter holds,
    whether a live store holds it, and when it was last seen held (wall clock)."""

    name: str
    directory: Path
    bytes: int
    live: bool
    held_at: float
    #: Whether it has a usage counter (a store's layout; else its files are counted).
    counted: bool = True
    #: Of ``bytes``, what taking chunks cannot free: metadata, side files, reservations.
    fixed: int = 0

    @property
    def payload(self) -> int:
        """The chunks' bytes: what taking chunks can free, and what a floor protects."""
        return self.bytes - self.fixed

    def protected(self, now: float, grace_s: float) -> bool:
        """Live, or idle within its grace period: it keeps its floor."""
        return self.live or now - self.held_at < grace_s


@dataclass(slots=True)
class _View:
    """Another namespace's oldest chunks, as read from their headers: an index to choose
    victims from, and each chunk's file."""

    index: LruIndex[DiskEntry]
    paths: dict[str, Path] = field(default_factory=dict)
    read_at: float = 0.0


class RootUsage:
    """What the root's namespaces other than ``own`` hold, and taking room from them.

    ``clock`` times the caches (monotonic), ``wall`` the grace period (it is compared with
    file times); ``grace_s`` is :data:`GRACE_S` unless told."""

    def __init__(
        self,
        root: StorageRoot,
        own: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        grace_s: float = GRACE_S,
        wall: Callable[[], float] = time.time,
    ):
        self.root = root
        self.own = own
        self.grace_s = grace_s
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._kv_dir = str(root.root / KV_DIR)
        #: The mtime of ``kv/`` when it was listed (a namespace made or dropped changes it).
        self._listed = 0
        self._others: list[Neighbour] = []
        #: The others' usage counters, open (closed with this object, or at the next listing).
        self._counters: dict[str, int] = {}
        weakref.finalize(self, _close_all, self._counters)
        self._views: dict[str, _View] = {}
        self._read_header: HeaderReader | None = None
        #: Idle namespaces this writer dropped whole (they held no chunk any more).
        self.dropped = 0
        #: Chunks (and their bytes) this writer took from other namespaces.
        self.taken = 0
        self.taken_bytes = 0

    def bind(self, read_header: HeaderReader) -> None:
        """How to read another namespace's payload headers (without it, chunks are taken
        from no other namespace: only empty idle ones are dropped)."""
        self._read_header = read_header

    def others_bytes(self, *, fresh: bool = False) -> int:
        """Bytes the other namespaces hold (their counters read now; the listing at most
        every REFRESH_S unless ``fresh``)."""
        return sum(n.bytes for n in self._neighbours(fresh))

    def forget(self) -> None:
        """Read the root afresh at the next reservation (a reservation made while opening
        must not stand for the root as it is once writing starts)."""
        with self._lock:
            self._read_at = None

    def floor(
        self, capacity: int, others: list[Neighbour] | None = None, own_fixed: int = 0
    ) -> int:
        """The chunks' bytes the writer's namespace may hold whatever the others hold: its
        fair share, among the protected namespaces (its own included), of what ``capacity``
        leaves once every namespace's bytes that are not chunks (``own_fixed`` and the
        others' ``fixed``) are set aside -- but for those of a namespace whose fixed bytes
        alone exceed a fair share of ``capacity``, which no taking of chunks could make
        fit (side files sized for a larger budget): they are not held against anyone."""
        now = self._wall()
        if others is None:
            others = self._neighbours(False)
        count = 1 + sum(n.protected(now, self.grace_s) for n in others)
        share = capacity // count
        charged = sum(f for f in (own_fixed, *(n.fixed for n in others)) if f <= share)
        return max(0, capacity - charged) // count

    def room(
        self,
        capacity: int,
        own: int,
        need: int,
        evict_own: Callable[[int], int],
        own_fixed: int = 0,
    ) -> int:
        """The bytes the writer's namespace (holding ``own``, ``own_fixed`` of them not
        chunks) may hold once ``need`` more are added: ``capacity`` less what the others
        hold, after room was taken where the root would go over (``evict_own(n)`` evicts
        ``n`` bytes of the writer's own chunks, returns what it freed); never less than its
        floor of chunks. Caller holds its usage lock."""
        others = self._neighbours(False)
        over = own + need + sum(n.bytes for n in others) - capacity
        if over > 0:
            self._make_room(over, capacity, own - own_fixed, evict_own, own_fixed)
            others = self._neighbours(False)
        held = sum(n.bytes for n in others)
        floor = self.floor(capacity, others, own_fixed)
        return min(capacity, max(capacity - held, floor + own_fixed))

    # -- reading the root -----------------------------------------------------------------

    def _neighbours(self, fresh: bool) -> list[Neighbour]:
        with self._lock:
            now = self._clock()
            listed = _mtime_ns(self._kv_dir)  # a namespace made or dropped
            stale = self._read_at is None or now - self._read_at >= REFRESH_S
            if fresh or stale or listed != self._listed:
                self._others = [n for n in map(self._survey, self._names()) if n is not None]
                self._read_at, self._listed = now, listed
                self._open_counters()
                _touch(self.root.kv_path(self.own) / LOCK_NAME)  # seen held: by us
            else:
                for n in self._others:
                    counter = self._counters.get(n.name)
                    if counter is not None:
                        n.bytes, n.fixed = _read_counter(counter, (n.bytes, n.fixed))
            return list(self._others)

    def _open_counters(self) -> None:
        """Keep the others' counter files open until the next listing: a reservation reads
        each with one ``pread`` (a dropped namespace changes ``kv/``, and the listing)."""
        _close_all(self._counters)
        for n in self._others:
            if n.counted:
                with contextlib.suppress(OSError):
                    path = n.directory / _COUNTER
                    self._counters[n.name] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def _names(self) -> list[str]:
        return [name for name in self.root.list_models() if name != self.own]

    def _survey(self, name: str) -> Neighbour | None:
        directory = self.root.kv_path(name)
        try:
            raw = (directory / _COUNTER).read_bytes()
            slots = _SLOTS.unpack(raw) if len(raw) == _SLOTS.size else (0, 0, 0)
            held, fixed = sum(max(0, v) for v in slots), max(0, slots[1]) + max(0, slots[2])
            counted = True
        except FileNotFoundError:
            if not directory.is_dir():
                return None
            held, fixed, counted = disk_usage(directory), 0, False  # not a store's: its files
        except OSError:
            return None
        live, held_at = _probe(directory, self._wall)
        record = read_record(directory)  # its last opening, should its lock file say less
        if record is not None and record.opened_at > held_at:
            held_at = record.opened_at
        return Neighbour(name, directory, held, live, held_at, counted, fixed)

    # -- taking room --------------------------------------------------------------------

    def _make_room(
        self,
        over: int,
        capacity: int,
        own: int,
        evict_own: Callable[[int], int],
        own_fixed: int = 0,
    ) -> int:
        """Free ``over`` bytes of the root: idle namespaces past their grace period first,
        then the namespace most over its floor (the writer's own included; ``own`` is its
        chunks' bytes, ``own_fixed`` the rest), chunk by chunk; returns the bytes freed
        (fewer when nothing more may go)."""
        others = self._neighbours(fresh=True)
        now = self._wall()
        share = self.floor(capacity, others, own_fixed)
        stuck: set[str] = set()
        freed = 0
        while freed < over:
            expired = [
                n
                for n in others
                if n.name not in stuck and n.bytes > 0 and not n.protected(now, self.grace_s)
            ]
            if expired:
                neighbour = min(expired, key=lambda n: n.held_at)
                got = self._take_expired(neighbour, over - freed)
                name = neighbour.name
            else:
                levels: list[tuple[int, str, Neighbour | None]] = [
                    (n.payload - share, n.name, n)
                    for n in others
                    if n.name not in stuck and n.protected(now, self.grace_s)
                ]
                if self.own not in stuck:
                    levels.append((own - share, self.own, None))
                levels.sort(key=lambda level: level[0], reverse=True)
                if not levels or levels[0][0] <= 0:
                    break  # every namespace at or below its floor
                excess, name, pick = levels[0]
                below = max(levels[1][0], 0) if len(levels) > 1 else 0
                step = max(1, min(over - freed, excess - below))  # level with the next
                if pick is None:
                    got = evict_own(step)
                    own -= got
                else:
                    got = self._take(pick, step, idle=not pick.live)
            if got <= 0:
                stuck.add(name)
                continue
            freed += got
        return freed

    def _take_expired(self, neighbour: Neighbour, need: int) -> int:
        """Take up to ``need`` bytes of an idle namespace past its grace period, and drop
        it whole once it holds no chunk (nor a file set aside for its operator)."""
        got = self._take(neighbour, need, idle=True) if neighbour.counted else 0
        if got < need and not _holds_files(neighbour.directory):
            got += self._drop(neighbour)
        return got

    def _take(self, neighbour: Neighbour, need: int, *, idle: bool) -> int:
        """Unlink ``neighbour``'s least valuable chunks until ``need`` bytes are freed, and
        lower its counter by them; returns the bytes freed (0: its locks were busy, or it
        has nothing we may take)."""
        if self._read_header is None:
            return 0
        directory = neighbour.directory
        with contextlib.ExitStack() as held:
            if idle:  # a store opening it waits until we are done
                hold = held.enter_context(_locked(directory / LOCK_NAME, wait_s=0.0))
                if hold is None:
                    return 0  # held since the listing (or another writer is at it)
            usage = held.enter_context(_locked(directory / _USAGE_LOCK, wait_s=LOCK_WAIT_S))
            if usage is None:
                return 0
            freed, chunks = self._unlink_victims(neighbour, need)
            if freed:
                _lower_counter(directory, freed)
        if freed:
            neighbour.bytes = max(0, neighbour.bytes - freed)
            self.taken += chunks
            self.taken_bytes += freed
            log.info(
                "took %d chunks (%d bytes) of %s namespace %r to keep %s within its disk budget",
                chunks,
                freed,
                "idle" if idle else "live",
                neighbour.name,
                self.root.root,
            )
        return freed

    def _unlink_victims(self, neighbour: Neighbour, need: int) -> tuple[int, int]:
        """Unlink ``neighbour``'s chunks, least valuable first, until ``need`` bytes are
        freed or it has none left to give. A victim its own store evicted meanwhile (it
        evicts the same oldest chunks first) frees nothing: the next ones are chosen, and
        a view that runs out is read afresh, once -- else such a namespace would pass
        for one that cannot give, and a writer below its floor would write on regardless,
        taking the root over its budget."""
        cached = self._views.get(neighbour.name)
        view = self._view(neighbour)
        reread = view is not cached  # read just now: reading again would find the same
        freed = chunks = 0
        while freed < need:
            victims = _ORDER.victims(view.index, need - freed, _file_bytes)
            if not victims:
                if reread:
                    break
                self._views.pop(neighbour.name, None)
                view, reread = self._view(neighbour), True
                continue
            for key, _entry in victims:
                view.index.pop(key)
                path = view.paths.pop(key)
                try:
                    size = os.stat(path).st_size
                    os.unlink(path)
                except FileNotFoundError:
                    continue  # evicted by its own store meanwhile
                except OSError as exc:
                    log.warning("cannot evict %s: %s", path, exc)
                    continue
                freed += round_to_block(size)
                chunks += 1
        if not view.paths:
            self._views.pop(neighbour.name, None)
        return freed, chunks

    def _view(self, neighbour: Neighbour) -> _View:
        """``neighbour``'s oldest chunks (caller holds its usage lock), reused for VIEW_S."""
        now = self._clock()
        view = self._views.get(neighbour.name)
        if view is not None and view.paths and now - view.read_at < VIEW_S:
            return view
        assert self._read_header is not None
        oldest: list[tuple[int, Path, int, int]] = []
        for path, h, tag in scan_payload(neighbour.directory):
            with contextlib.suppress(FileNotFoundError):
                oldest.append((os.stat(path).st_mtime_ns, path, h, tag))
        oldest.sort(key=lambda f: f[0])
        view = _View(LruIndex(), read_at=now)
        for _mtime, path, h, tag in oldest[:VIEW_FILES]:
            try:
                header = self._read_header(path)
            except (PersistingError, OSError, ValueError, KeyError):
                continue  # gone, damaged or not verified: not ours to judge
            if key_hash(header.key) != h or header.key in view.paths:
                continue
            entry = DiskEntry(header.layout, header.checksum, header.parent, tag)
            view.index.add(header.key, entry, sighting=False)  # oldest written first
            view.paths[header.key] = path
        self._views[neighbour.name] = view
        return view

    def _drop(self, neighbour: Neighbour) -> int:
        """Drop an idle namespace that holds no chunk whole; returns the bytes freed."""
        try:
            dropped = self.root.drop_model(neighbour.name)
        except NamespaceInUseError:
            return 0  # opened meanwhile: it keeps its floor now
        except PersistingError as exc:
            log.warning("cannot drop idle namespace %s: %s", neighbour.name, exc)
            return 0
        if not dropped:
            return 0
        freed, neighbour.bytes = neighbour.bytes, 0
        self.dropped += 1
        self._views.pop(neighbour.name, None)
        log.warning(
            "dropped idle namespace %r (%d bytes, no chunk left; last held %s) to keep %s"
            " within its disk budget",
            neighbour.name,
            freed,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(neighbour.held_at)),
            self.root.root,
        )
        return freed


def _probe(directory: Path, wall: Callable[[], float]) -> tuple[bool, float]:
    """Whether a live store holds ``directory`` (its namespace lock taken shared), and
    when it was last seen held; a hold seen now is marked on the lock file."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False, _mtime(directory)
    except OSError:
        return True, wall()  # cannot tell: taken as held
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # held exclusively: a drop, or a writer taking room
                return False, os.fstat(fd).st_mtime
            fcntl.flock(fd, fcntl.LOCK_UN)
            with contextlib.suppress(OSError):
                os.utime(fd)
            return True, wall()
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, os.fstat(fd).st_mtime
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path, *, wait_s: float) -> Iterator[int | None]:
    """Hold ``path``'s ``flock`` exclusively, waiting up to ``wait_s`` for it (never
    blocking: the caller holds its own namespace's locks); yields None if it stayed busy
    or the file is gone (or was replaced)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        yield None
        return
    try:
        deadline = time.monotonic() + wait_s
        pause = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield None
                    return
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        yield fd if same else None
    finally:
        os.close(fd)  # and with it the lock


def _read_counter(fd: int, default: tuple[int, int]) -> tuple[int, int]:
    """The bytes an open usage counter holds, and of them what is not chunks (overhead and
    reservations), or ``default`` if it cannot be read."""
    try:
        raw = os.pread(fd, _SLOTS.size, 0)
    except OSError:
        return default
    if len(raw) != _SLOTS.size:
        return default
    payload, overhead, reserved = _SLOTS.unpack(raw)
    fixed = max(0, overhead) + max(0, reserved)
    return max(0, payload) + fixed, fixed


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _holds_files(directory: Path) -> bool:
    """Whether namespace ``directory`` holds a payload file, or a quarantined file (kept
    for its operator: never removed by a writer, see :mod:`persisting.kv.disk.quarantine`)."""
    if next(iter(scan_payload(directory)), None) is not None:
        return True
    try:
        with os.scandir(directory / QUARANTINE_DIR) as entries:
            return next(iter(entries), None) is not None
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: kept


def _lower_counter(directory: Path, freed: int) -> None:
    """Take ``freed`` payload bytes off ``directory``'s counter (its usage lock held)."""
    try:
        fd = os.open(directory / _COUNTER, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        log.warning("cannot lower the usage counter of %s: %s", directory, exc)
        return
    try:
        raw = os.pread(fd, _PAYLOAD.size, 0)
        value = _PAYLOAD.unpack(raw)[0] if len(raw) == _PAYLOAD.size else 0
        os.pwrite(fd, _PAYLOAD.pack(max(0, value - freed)), 0)
    finally:
        os.close(fd)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _mtime(path: os.PathLike[str]) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _file_bytes(entry: DiskEntry) -> int:
    return file_size(entry.layout.nbytes)


__all__ = ["GRACE_S", "REFRESH_S", "Neighbour", "RootUsage"]
