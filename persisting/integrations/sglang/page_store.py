"""One rank's pages in a namespace's store, counted for SGLang's metrics.

A page is one value of the store: its parts (from :class:`~persisting.integrations.sglang.
pages.HostPages`) moved by the engine adapters' one interface
(:class:`~persisting.integrations.common.store.EngineStore`): on a local root, one
vectored write per piece into one payload file, and positioned vectored reads back into the
parts under a read lease, the checksum made as the bytes land; in a cluster, one request
per member per batch. The store may be shared by processes.

Nothing here raises into the caller for a page: a page that cannot be written is ``False``;
a page that is missing, damaged (checksum), of another size, or unreadable is ``False``,
and a damaged or mis-sized one is removed, so it is a miss from then on. Counters say
what happened. Nothing here imports SGLang.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from persisting.integrations.common.store import EngineStore, LocalStore, leading
from persisting.integrations.counters import LockedCounters

#: Batches remembered for SGLang's storage metrics between two of its scrapes.
RECENT_BATCHES = 1024


@dataclass
class Counters(LockedCounters):
    """What the backend did in this process (all monotonic)."""

    pages_set: int = 0
    bytes_set: int = 0
    pages_present: int = 0
    set_failures: int = 0
    pages_got: int = 0
    bytes_got: int = 0
    get_misses: int = 0
    pages_damaged: int = 0
    exists_queries: int = 0
    exists_pages: int = 0
    refreshes: int = 0
    errors: int = 0


@dataclass
class Batch:
    """One batch moved, for SGLang's per-batch histograms (pages, GB/s)."""

    pages: int
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class PageStore:
    """One rank's pages in a namespace's store."""

    def __init__(self, store: EngineStore, page_bytes: int, refresh_interval_s: float):
        self.store = store
        self.page_bytes = page_bytes
        self.refresh_interval_s = refresh_interval_s
        self.counters = Counters()
        self.recent_sets: deque[Batch] = deque(maxlen=RECENT_BATCHES)
        self.recent_gets: deque[Batch] = deque(maxlen=RECENT_BATCHES)
        self._last_refresh = time.monotonic()
        self._refresh_lock = threading.Lock()

    def write(
        self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]], parent: str | None
    ) -> list[bool]:
        """Store each page (keys in prefix order; ``parent``: the page before the first);
        True per page now stored, whether by this call or before it."""
        start = time.perf_counter()
        results = self.store.write_from(keys, [list(p) for p in parts], parent)
        stored = results.count("stored")
        present = results.count("present")
        self.counters.add(
            pages_set=stored,
            bytes_set=stored * self.page_bytes,
            pages_present=present,
            set_failures=len(results) - stored - present,
        )
        ok = [r != "failed" for r in results]
        kept = sum(ok)
        self.recent_sets.append(Batch(kept, time.perf_counter() - start, kept * self.page_bytes))
        return ok

    def read(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Read each page into its parts; True per page read whole with its checksum."""
        start = time.perf_counter()
        results = self.store.read_into(keys, [list(p) for p in parts])
        got = results.count("hit")
        self.counters.add(
            pages_got=got,
            bytes_got=got * self.page_bytes,
            get_misses=results.count("miss"),
            pages_damaged=results.count("damaged"),
            errors=results.count("failed"),
        )
        self.recent_gets.append(Batch(got, time.perf_counter() - start, got * self.page_bytes))
        return [r == "hit" for r in results]

    def leading_run(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` from the first are stored (each page is one whole value).
        A miss rescans the namespace for other processes' pages, at most every
        ``refresh_interval_s``, and counts again."""
        count = leading(self.store.exists(keys))
        if count < len(keys) and self._refresh_due():
            count = leading(self.store.exists(keys))
        self.counters.add(exists_queries=1, exists_pages=count)
        return count

    def _refresh_due(self) -> bool:
        if self.store.kind != "local":
            return False  # a cluster's members see every client's pages
        with self._refresh_lock:
            now = time.monotonic()
            if now - self._last_refresh < self.refresh_interval_s:
                return False
            self._last_refresh = now
        self.store.refresh()
        self.counters.add(refreshes=1)
        return True

    def clear(self) -> int:
        """Remove every page of the namespace (every rank's, other processes' included;
        in a cluster, the pages this process knows of are not listed: none)."""
        return self.store.clear() if isinstance(self.store, LocalStore) else 0

    def figures(self) -> dict[str, Any]:
        """This process's counters and the store's figures."""
        return {**self.counters.snapshot(), "store": self.store.stats()}

    def close(self) -> None:
        self.store.close()


__all__ = ["Batch", "Counters", "PageStore"]
