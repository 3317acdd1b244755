"""Pages to and from a namespace's KV store, straight between host memory and the files.

A page is one value of the store: its parts (from :class:`~persisting.integrations.sglang.
pages.HostPages`) written end to end as a :class:`~persisting.kv.Gathered` value -- one
vectored write per piece, hashed as it goes, into one payload file of the store's usual
format, under the store's disk budget and eviction -- and read back by place: a read lease
on the file, positioned vectored reads into the page's parts, the checksum made as the
bytes land and compared with the stored one. The pages of a batch move on a thread pool.

Nothing here raises into the caller for a page: a page that cannot be written is ``False``;
a page that is missing, damaged (checksum), of another size, or unreadable is ``False``,
and a damaged or mis-sized one is removed, so it is a miss from then on. Counters say
what happened. Nothing here imports SGLang.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from persisting.errors import CapacityError, CorruptValueError, PersistingError
from persisting.integrations.counters import LockedCounters
from persisting.kv import Gathered, KVStore, PutResult
from persisting.kv.range_reads import read_file_range

log = logging.getLogger(__name__)

#: Seconds a read's lease keeps a page's file from being evicted while it is read.
LEASE_S = 60.0
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
    """One rank's pages in a namespace's store (the store may be shared by processes)."""

    def __init__(self, store: KVStore, page_bytes: int, io_threads: int, refresh_interval_s: float):
        self.store = store
        self.page_bytes = page_bytes
        self.io_threads = io_threads
        self.refresh_interval_s = refresh_interval_s
        self.counters = Counters()
        self.recent_sets: deque[Batch] = deque(maxlen=RECENT_BATCHES)
        self.recent_gets: deque[Batch] = deque(maxlen=RECENT_BATCHES)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="persisting-sglang-io")
        self._last_refresh = time.monotonic()
        self._refresh_lock = threading.Lock()

    # -- writes ---------------------------------------------------------------------------

    def write(
        self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]], parent: str | None
    ) -> list[bool]:
        """Store each page (keys in prefix order; ``parent``: the page before the first);
        True per page now stored, whether by this call or before it."""
        start = time.perf_counter()
        values = [Gathered(tuple(p)) for p in parts]
        parents = [parent, *keys[:-1]]
        step = -(-len(keys) // self.io_threads) if keys else 1
        spans = [(i, min(i + step, len(keys))) for i in range(0, len(keys), step)]
        futures = [
            self._pool.submit(self._put, keys[a:b], values[a:b], parents[a:b]) for a, b in spans
        ]
        ok: list[bool] = []
        for future in futures:
            ok += future.result()
        stored = sum(ok)
        self.recent_sets.append(
            Batch(stored, time.perf_counter() - start, stored * self.page_bytes)
        )
        return ok

    def _put(
        self, keys: Sequence[str], values: Sequence[Gathered], parents: Sequence[str | None]
    ) -> list[bool]:
        try:
            results = self.store.batched_put(
                keys, values, fmt="binary", parents=parents, check_shape=False
            )
        except CapacityError:  # more than the budget at once: one page at a time
            return [self._put_one(k, v, p) for k, v, p in zip(keys, values, parents, strict=True)]
        except Exception as exc:  # a failed set is a future miss, never an engine error
            log.warning("Persisting: storing %d pages failed: %s", len(keys), exc)
            self.counters.add(set_failures=len(keys))
            return [False] * len(keys)
        return [self._count(r) for r in results]

    def _put_one(self, key: str, value: Gathered, parent: str | None) -> bool:
        try:
            result = self.store.put(key, value, fmt="binary", parent=parent, check_shape=False)
        except Exception as exc:
            log.warning("Persisting: storing page %s failed: %s", key, exc)
            self.counters.add(set_failures=1)
            return False
        return self._count(result)

    def _count(self, result: PutResult) -> bool:
        if result.stored:
            self.counters.add(pages_set=1, bytes_set=self.page_bytes)
            return True
        present = result.durable and not result.conflict
        self.counters.add(**({"pages_present": 1} if present else {"set_failures": 1}))
        return present

    # -- reads ----------------------------------------------------------------------------

    def read(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Read each page into its parts; True per page read whole with its checksum."""
        start = time.perf_counter()
        futures = [
            self._pool.submit(self._read_one, key, page)
            for key, page in zip(keys[1:], parts[1:], strict=True)
        ]
        ok = [self._read_one(keys[0], parts[0])] if keys else []
        ok += [future.result() for future in futures]
        got = sum(ok)
        self.recent_gets.append(Batch(got, time.perf_counter() - start, got * self.page_bytes))
        return ok

    def _read_one(self, key: str, parts: Sequence[memoryview]) -> bool:
        try:
            location = self.store.lease(key, LEASE_S)
        except Exception as exc:
            return self._failed(key, exc)
        if location is None:
            self.counters.add(get_misses=1)
            return False
        try:
            want = sum(len(p) for p in parts)
            if location.nbytes != want:
                raise CorruptValueError(f"stored page is {location.nbytes} bytes, not {want}")
            digest = read_file_range(location.path, location.offset, parts, hashed=True)
            if digest != location.checksum:
                raise CorruptValueError(f"{location.path}: checksum mismatch")
        except FileNotFoundError:  # evicted by another process since the lease
            self.counters.add(get_misses=1)
            return False
        except Exception as exc:
            return self._failed(key, exc)
        finally:
            self._release(key, location.token)
        self.counters.add(pages_got=1, bytes_got=want)
        return True

    def _release(self, key: str, token: int) -> None:
        try:
            self.store.release(key, token)
        except Exception as exc:  # the lease only runs out later
            log.debug("Persisting: releasing %s: %s", key, exc)

    def _failed(self, key: str, exc: Exception) -> bool:
        if isinstance(exc, CorruptValueError):
            log.warning(
                "Persisting: page %s is damaged (%s): dropped, SGLang recomputes it", key, exc
            )
            self.counters.add(pages_damaged=1)
            try:
                self.store.remove(key)  # a miss from now on; the next set stores it afresh
            except PersistingError as remove_error:
                log.warning("Persisting: cannot remove damaged page %s: %s", key, remove_error)
        else:
            log.warning("Persisting: page %s not read: %s", key, exc)
            self.counters.add(errors=1)
        return False

    # -- lookups --------------------------------------------------------------------------

    def leading_run(self, keys: Sequence[str]) -> int:
        """How many of ``keys`` from the first are stored (each page is one whole value).
        A miss rescans the namespace for other processes' pages, at most every
        ``refresh_interval_s``, and counts again."""
        count = _run(self.store.batched_contains(keys))
        if count < len(keys) and self._refresh_due():
            count = _run(self.store.batched_contains(keys))
        self.counters.add(exists_queries=1, exists_pages=count)
        return count

    def _refresh_due(self) -> bool:
        with self._refresh_lock:
            now = time.monotonic()
            if now - self._last_refresh < self.refresh_interval_s:
                return False
            self._last_refresh = now
        self.store.refresh()
        self.counters.add(refreshes=1)
        return True

    # -- the rest -------------------------------------------------------------------------

    def clear(self) -> int:
        """Remove every page of the namespace (every rank's, other processes' included)."""
        self.store.refresh()
        return self.store.batched_remove([key for key, _size in self.store.stored_keys()])

    def figures(self) -> dict[str, Any]:
        """This process's counters and the store's figures."""
        return {**self.counters.snapshot(), "store": self.store.stats()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()


def _run(flags: Sequence[bool]) -> int:
    return flags.index(False) if False in flags else len(flags)


__all__ = ["LEASE_S", "Batch", "Counters", "PageStore"]
