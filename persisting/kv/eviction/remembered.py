"""What a disk tier's eviction remembers across restarts, and shares between processes.

Two files beside a namespace's metadata: ``recency.bin``, the snapshot of the tier's LRU
order (:mod:`persisting.kv.eviction.recency`; what ``lru`` and ``prefix`` need to evict after a
restart what they would have evicted before it), and ``reuse.bin``, the sighting counts and
last sightings the ``value`` policy ranks by (:mod:`persisting.kv.eviction.reuse`; read and written
in place by every process, so it is always current for each, and it survives any stop).
Losing either costs only eviction quality, never data.

Both are bounded by the budget the namespace is opened with, and judged on open before
anything of the namespace is counted (:meth:`EvictionMemory.prepare`): a damaged,
oversized or crafted file is cut, rebuilt or dropped then, so no chunk is ever evicted to
make room for it.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from persisting.errors import PersistingError
from persisting.kv.budget.disk import DiskBudget, allocated
from persisting.kv.disk.payload_files import BLOCK, round_to_block
from persisting.kv.eviction import recency, reuse
from persisting.kv.eviction.policy import EvictionPolicy
from persisting.kv.index import DiskEntry, LruIndex
from persisting.kv.keys import key_hash

log = logging.getLogger(__name__)


class EvictionMemory:
    """Restores a disk tier's eviction state on open, saves it on flush and close."""

    def __init__(self, directory: Path, index: LruIndex[DiskEntry], budget: DiskBudget):
        self.directory = directory
        self.index = index
        self.budget = budget
        #: What :meth:`prepare` read, for :meth:`restore`: the saved order, and the reuse
        #: counts to write into a new table.
        self._order: dict[tuple[int, int], int] | None = None
        self._table: np.ndarray | None = None

    def prepare(self, policy: EvictionPolicy, capacity: int) -> None:
        """Bring both files within what a budget of ``capacity`` calls for before anything
        of the namespace is counted (caller holds the directory's locks): a damaged or
        oversized snapshot is cut or dropped, a reuse table that is damaged or not of the
        size this budget calls for is replaced (its counts carried over when whole), so no
        chunk is evicted to make room for them. The overhead counter is measured again when
        a file went, so nothing is evicted for what is no longer there."""
        before = self._side_bytes()
        self._order = recency.prepare(self.directory, capacity // BLOCK)
        self._table = reuse.prepare(
            self.directory, reuse.slots_for(capacity), keep=policy.uses_reuse_stats
        )
        if self._side_bytes() < before:
            self.budget.usage.set_overhead(self.budget.measure_overhead())

    def _side_bytes(self) -> int:
        """Bytes allocated to the two files and their leftovers."""
        names = (recency.FILE_NAME, reuse.FILE_NAME)
        return sum(
            allocated(entry.path)
            for entry in os.scandir(self.directory)
            if entry.name in names or entry.name.startswith(tuple(f".{n}." for n in names))
        )

    def restore(self, policy: EvictionPolicy, capacity: int) -> None:
        """Put the index back in the order the last close or flush saved, and attach the
        namespace's reuse stats when ``policy`` ranks by them, ordering by their last
        sightings then (caller holds the directory's locks; :meth:`prepare` ran first)."""
        saved = self._order if self._order is not None else recency.load_order(self.directory)
        self._order = None
        if saved:
            self.index.reorder(
                {
                    key: rank
                    for key, entry in self.index.items()
                    if (rank := saved.get((key_hash(key), entry.tag))) is not None
                }
            )
        if policy.uses_reuse_stats:
            growth = self.budget.metadata_growth
            table, self._table = self._table, None
            self.index.attach(
                reuse.open_shared(self.directory, capacity, growth, table), deferred=True
            )
            # The namespace's table holds every process's last sighting of each chunk,
            # fresher than a snapshot saved at some close: order by it (the snapshot only
            # orders the chunks it forgot, as the oldest).
            self.index.reorder({key: entry.tick for key, entry in self.index.items()})
            if self.budget.root_usage is not None:  # not the root as it was while opening
                self.budget.root_usage.forget()

    def save(self, lock: threading.RLock) -> None:
        """Snapshot the LRU order (under the index's ``lock``), so a reopened store evicts
        what this one would, and ask for the reuse stats' pages to be written."""
        with lock:
            order = [(key_hash(key), entry.tag) for key, entry in self.index.items()]
        # The new snapshot is written beside the old one, then renamed over it.
        try:
            bound = round_to_block(recency.file_bytes(len(order)))
            with self.budget.metadata_growth(lambda: bound):
                recency.save_order(self.directory, order)
        except PersistingError as exc:  # only the order is lost: the store evicts by age
            log.warning("eviction order of %s not saved: %s", self.directory, exc)
        if self.index.reuse is not None:
            self.index.reuse.flush()

    def close(self) -> None:
        """Let go of the reuse stats (after the tier's last metadata commit: it may evict)."""
        if self.index.reuse is not None:
            self.index.reuse.close()


__all__ = ["EvictionMemory"]
