"""The disk tier's byte budget: every byte reserved before it lands.

The budget covers everything in the model directory, for all processes sharing it (through
:class:`~persisting.kv.budget.shared_usage.SharedUsage`), and every byte is reserved before it
lands: payload files, block-rounded, before they are created; a bound on what each
metadata change (a Lance commit, a compaction, the recency snapshot) can add, before it
runs -- afterwards the overhead (the Lance table, the ``payload/<hh>`` and other
directories, the lock and counter files, quarantined metadata) is measured and the
reservation given back; the directory blocks a new file adds, before its creation is
accounted. Room is made by the tier's eviction, which unlinks payload files before the
bytes they make room for are written, so ``du -s`` of the directory stays within the budget
(docs/reliability.md states the one exception: a directory block a rename may add,
accounted right after).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from persisting.errors import CapacityError
from persisting.kv.budget.root import RootUsage
from persisting.kv.budget.shared_usage import SharedUsage
from persisting.kv.disk.payload_files import BLOCK, PayloadFiles

log = logging.getLogger(__name__)


class DiskBudget:
    """Reservations and overhead accounting of one model directory against ``capacity``.

    ``evict(need)`` is the tier's eviction (it unlinks payload files until ``need`` bytes
    are freed, returns what it freed); ``refresh()`` makes the tier index files other
    processes wrote, so they can be evicted too. Both run with the usage lock held.
    """

    def __init__(
        self,
        directory: Path,
        capacity: int,
        files: PayloadFiles,
        usage: SharedUsage,
        evict: Callable[[int], int],
        refresh: Callable[[], int],
        root_usage: RootUsage | None = None,
    ):
        self.directory = directory
        self.capacity = capacity
        self.files = files
        self.usage = usage
        self._evict = evict
        self._refresh = refresh
        #: The root's other namespaces, which the same budget bounds (None: this
        #: namespace alone; see :mod:`persisting.kv.budget.root`).
        self.root_usage = root_usage
        if root_usage is not None:
            root_usage.bind(files.read_header)  # to choose another namespace's victims

    def room(self, need: int) -> int:
        """The bytes this namespace may hold once ``need`` more are added: its capacity,
        less what the root's other namespaces hold once room was taken where the root would
        go over -- from idle namespaces past their grace period first, then from the
        namespace most over its floor, this one included -- and never less than its floor
        (see :mod:`persisting.kv.budget.root`; caller holds the usage lock)."""
        if self.root_usage is None:
            return self.capacity
        total = self.usage.total()
        fixed = total - self.usage.get()  # metadata, side files, reservations: not chunks
        return self.root_usage.room(self.capacity, total, need, self._evict, fixed)

    def payload_room(self, nbytes: int, headroom: int) -> int:
        """The payload bytes this namespace may hold once ``nbytes`` more (and ``headroom``)
        are added: what the root leaves it (:meth:`room`, which may take room elsewhere),
        less its overhead, its reservations and ``headroom`` (caller holds the usage
        lock). A batch larger than this keeps its chains' heads (:mod:`.batch_fit`)."""
        fixed = self.usage.overhead() + self.usage.reserved()
        return self.room(nbytes + headroom) - fixed - headroom

    def reserve(self, nbytes: int, headroom: int = 0, *, metadata: bool = False) -> None:
        """Count ``nbytes`` in the shared usage (as payload, or with ``metadata`` as a
        metadata reservation), evicting first (caller holds the usage lock).

        Room is made for ``headroom`` more (the batch's metadata and new directories, which
        are counted once measured after the commit), so ``du`` stays within the budget
        while the batch is being written, not only once it is accounted. A directory that
        looks full first gives back dead writers' reservations, so a writer killed mid-batch
        does not make the survivors over-evict.
        """
        need = nbytes + headroom
        used = self.usage.total()
        if used + need > self.capacity and self.usage.reclaim_abandoned(self.files):
            used = self.usage.total()
        room = self.room(need)
        used = self.usage.total()  # room() may have evicted some of ours
        if used + need > room:
            self._evict(used + need - room)
            used = self.usage.total()
            if used + need > room:
                self._refresh()  # files of other processes we have not indexed yet
                self._evict(used + need - room)
                used = self.usage.total()
        if used + need > room:
            others = self.capacity - room
            shared = f"; the root's other namespaces keep {others}" if others else ""
            raise CapacityError(
                f"disk tier full: {used} of {self.capacity} bytes in use "
                f"({self.usage.overhead()} of them metadata and directories{shared}), "
                f"{nbytes} more needed and nothing evictable"
            )
        if metadata:
            self.usage.set_reserved(self.usage.reserved() + nbytes)
        else:
            self.usage.set(self.usage.get() + nbytes)

    def growth_of(self, subdirs: Iterable[Path]) -> int:
        """Room for the directory blocks a batch's files may add (measured and counted
        once created): a new ``payload/<hh>``, and a block more for each directory an
        entry goes into (its ``payload/<hh>``, and ``payload/`` for a new one)."""
        dirs = set(subdirs)
        new_dirs = sum(not d.is_dir() for d in dirs)
        return BLOCK * (2 * new_dirs + len(dirs) + 1)

    def measure_overhead(self) -> int:
        return self.usage.measure_overhead(self.directory)

    def account_overhead(self) -> None:
        """Measure the overhead and record it, evicting payload first where the whole would
        not fit the budget (so the counter is not seen over it)."""
        with self.usage.metadata_locked(), self.usage.locked():
            self.set_overhead(self.measure_overhead())

    def set_overhead(self, measured: int) -> None:
        """Record a measured overhead (caller holds both locks), evicting first if needed."""
        over = self.usage.get() + self.usage.reserved() + measured - self.capacity
        if over > 0:
            self._evict(over)
        self.usage.set_overhead(measured)

    def add_overhead(self, grown: int) -> None:
        """Count directory blocks just added (caller holds the usage lock)."""
        if grown <= 0:
            return
        over = self.usage.total() + grown - self.capacity
        if over > 0:
            self._evict(over)
        self.usage.set_overhead(self.usage.overhead() + grown)

    def account_renames(self, before: dict[Path, int]) -> None:
        """Count the blocks renames into place added to their directories (rare: a rename
        adds the new name before it drops the old one, and may need a block for it);
        ``before`` is each directory's :func:`allocated` bytes before the renames."""
        grown = sum(max(0, allocated(d) - size) for d, size in before.items())
        if grown:
            with self.usage.locked():
                self.add_overhead(grown)

    @contextmanager
    def metadata_growth(self, bound_of: Callable[[], int]) -> Iterator[None]:
        """Run a metadata change that may add up to ``bound_of()`` bytes (asked once the
        metadata lock is held, see :data:`~persisting.kv.disk.metadata.Guard`): reserve them first
        (evicting as needed, named by a locked file that outlives no holder: see
        :meth:`~persisting.kv.disk.payload_files.PayloadFiles.reserve_file`),
        then measure what it really added and give the reservation back. Changes of all
        processes take turns (the metadata lock), so no measurement sees one half-way."""
        with self.usage.metadata_locked():
            bound = bound_of() + BLOCK  # and the reservation file's own directory entry
            with self.usage.locked():
                self.reserve(bound, metadata=True)
                try:
                    reservation = self.files.reserve_file(bound)
                except BaseException:
                    self.usage.set_reserved(self.usage.reserved() - bound)
                    raise
            try:
                yield
            finally:
                with self.usage.locked():
                    self.files.release_file(reservation)
                    self.usage.set_reserved(self.usage.reserved() - bound)
                    try:
                        self.set_overhead(self.measure_overhead())
                    except OSError as exc:  # best effort: the next change measures again
                        log.warning("cannot measure the overhead of %s: %s", self.directory, exc)


def allocated(path: str | os.PathLike[str]) -> int:
    """Bytes the filesystem allocated to ``path`` itself (0 if it is gone)."""
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


__all__ = ["DiskBudget", "allocated"]
