"""What a disk tier's eviction remembers across restarts, and shares between processes.

Two files beside a namespace's metadata: ``recency.bin``, the snapshot of the tier's LRU
order (:mod:`persisting.kv.recency`; what ``lru`` and ``prefix`` need to evict after a
restart what they would have evicted before it), and ``reuse.bin``, the sighting counts and
last sightings the ``value`` policy ranks by (:mod:`persisting.kv.reuse`; mapped shared,
so it is always current for every process, and it survives any stop). Losing either costs
only eviction quality, never data.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from persisting.errors import PersistingError
from persisting.kv import recency, reuse
from persisting.kv.disk_budget import DiskBudget
from persisting.kv.index import DiskEntry, LruIndex
from persisting.kv.payload_files import key_hash, round_to_block
from persisting.kv.policy import EvictionPolicy

log = logging.getLogger(__name__)


class EvictionMemory:
    """Restores a disk tier's eviction state on open, saves it on flush and close."""

    def __init__(self, directory: Path, index: LruIndex[DiskEntry], budget: DiskBudget):
        self.directory = directory
        self.index = index
        self.budget = budget

    def restore(self, policy: EvictionPolicy, capacity: int) -> None:
        """Put the index back in the order the last close or flush saved, and attach the
        namespace's reuse stats when ``policy`` ranks by them, ordering by their last
        sightings then (caller holds the directory's locks)."""
        saved = recency.load_order(self.directory)
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
            self.index.attach(reuse.open_shared(self.directory, capacity, growth))
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
