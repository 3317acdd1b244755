"""Persisting as an L2 adapter of LMCache's multiprocess mode (``L2AdapterInterface``).

Loaded by configuration only, through LMCache's plugin adapter entry::

    --l2-adapter '{"type": "plugin", "module_path": "persisting.integrations.lmcache",
                   "class_name": "PersistingL2Adapter",
                   "adapter_params": {"storage_path": "/var/lib/persisting",
                                      "capacity": "500GiB", "durability": "sync"}}'

What LMCache's own disk adapters do not give, this one does: chunks, usage and eviction
order survive a restart; capacity is enforced in bytes on disk; a store that failed or was
torn is never visible; every load is checked against the chunk's checksum (damage is a
counted miss); I/O errors are counted, logged with their errno and reported by
``report_status``; a lookup's lock keeps its chunk from eviction until the unlock (or
``lock_ttl_s``); ``cache_salt`` separates tenants (:mod:`.object_keys`).

Threads: LMCache's controller threads only submit and collect. Store and load tasks run on
``io_threads`` workers (a load task's keys are read in parallel); lookups, unlocks and
deletes run in order on one control thread, so a lookup never waits behind a store or a
load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from sortedcontainers import SortedDict

from persisting.errors import InvalidKeyError, InvalidNameError, StoreClosedError
from persisting.integrations.common.store import LocalStore
from persisting.integrations.lmcache.compat import seed_adapter_usage
from persisting.integrations.lmcache.health import IOErrors, errno_of, logger
from persisting.integrations.lmcache.l2_io import L2Counters, Stored, load_object, store_objects
from persisting.integrations.lmcache.l2_store import (
    PersistingL2AdapterConfig,
    claim_adapter,
    open_adapter_store,
)
from persisting.integrations.lmcache.l2_tasks import KeyLocks, TaskBoard, next_task_id
from persisting.integrations.lmcache.object_keys import object_key_of, object_key_text
from persisting.integrations.lmcache.settings import l2_params
from persisting.kv import key_string
from persisting.kv.disk.payload_files import file_size

#: An I/O error within this many seconds makes ``report_status`` say unhealthy.
UNHEALTHY_AFTER_IO_ERROR_S = 60.0
#: How often (at most) the adapter rewrites its status into its namespace's owner record.
STATUS_EVERY_S = 5.0


class PersistingL2Adapter(L2AdapterInterface):
    """LMCache 0.5.6 ``L2AdapterInterface`` on a Persisting KV store; thread-safe."""

    def __init__(
        self, config: PersistingL2AdapterConfig | Mapping[str, Any], **_kwargs: object
    ) -> None:
        params = (
            config.params
            if isinstance(config, PersistingL2AdapterConfig)
            else l2_params(dict(config))
        )
        super().__init__(max_capacity_bytes=params.capacity)
        self.params = params
        self._lock = threading.Lock()  # the key mirror, counters, closing
        self._evicted: deque[tuple[str, int]] = deque()  # filled on the writing thread
        # One adapter (or server) per namespace: a second one is refused here, naming the
        # process that holds it; the record also tells `persisting stats` our capacity.
        self._claim = claim_adapter(params)
        self._status_written = 0.0
        try:
            #: The adapter's store (local root or cluster); ``store`` its typed calls.
            self.engine_store = open_adapter_store(params, self._evicted.extend)
            self.store = self.engine_store.kv
            self.local = isinstance(self.engine_store, LocalStore)
        except BaseException:
            self._claim.release()
            raise
        #: Key string -> payload bytes of every chunk this adapter holds (sorted: pages).
        self._sizes: SortedDict = SortedDict()
        #: Chunks in the books whose store LMCache has not been told of yet, and deletions
        #: of such chunks, told once it has (see :meth:`_take`).
        self._announcing: Counter[str] = Counter()
        self._deferred: dict[str, list[tuple[ObjectKey, int]]] = {}
        self._counters = L2Counters()
        self.io_errors = IOErrors()
        self._locks = KeyLocks(params.lock_ttl_s)
        self._store_tasks: TaskBoard[L2StoreResult] = TaskBoard()
        self._lookup_tasks: TaskBoard[Bitmap] = TaskBoard()
        self._load_tasks: TaskBoard[Bitmap] = TaskBoard()
        self._io = ThreadPoolExecutor(params.io_threads, thread_name_prefix="persisting-l2-io")
        self._control = ThreadPoolExecutor(1, thread_name_prefix="persisting-l2-control")
        self._closed = False
        self._restore()
        self._record_status(force=True)
        logger.info(
            "PersistingL2Adapter on %s (namespace %s): %d chunks, %d of %d bytes",
            self._where(),
            params.namespace,
            len(self._sizes),
            self.store.disk_used_bytes() if self.local else 0,
            params.capacity,
        )

    def _where(self) -> str:
        cluster = self.params.cluster
        return str(self.params.storage_path) if cluster is None else f"cluster {cluster.seeds}"

    # -- what a restart brings back ---------------------------------------------------------

    def _restore(self) -> None:
        """Index what an earlier process stored and seed LMCache's usage counters with it
        (a cluster's chunks are the members' to keep: the books start empty)."""
        if not self.local:
            return
        by_salt: Counter[str] = Counter()
        for text, nbytes in self.store.stored_keys():
            try:
                key = object_key_of(text)
            except InvalidKeyError:
                continue  # not an object key: something else shares the namespace
            self._sizes[text] = nbytes
            by_salt[key.cache_salt] += file_size(nbytes)
        seed_adapter_usage(self, by_salt)

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Register ``listener`` and tell it of every chunk already stored, least recently
        used first, so an eviction policy listening from now on starts in the order this
        store kept across restarts. One key per call: LMCache's policies read a batch's
        first key as its most recent one."""
        super().register_listener(listener)
        keys, sizes = self._resident()
        for key, size in zip(keys, sizes, strict=True):
            listener.on_l2_keys_stored([key], [size])

    def _resident(self) -> tuple[list[ObjectKey], list[int]]:
        keys: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            known = set(self._sizes)
            if not self.local:
                return [object_key_of(t) for t in known], [file_size(self._sizes[t]) for t in known]
        for text, nbytes in self.store.stored_keys():
            if text in known:
                keys.append(object_key_of(text))
                sizes.append(file_size(nbytes))
        return keys, sizes

    # -- event fds ----------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_tasks.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_tasks.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_tasks.fileno()

    # -- store ----------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = next_task_id()
        self._submit(self._io, self._run_store, task_id, list(keys), list(objects))
        return task_id

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._store_tasks.pop_all()

    def _run_store(self, task_id: int, keys: list[ObjectKey], objs: list[MemoryObj]) -> None:
        ok = len(keys) == len(objs)
        stored: list[Stored] = []
        try:
            self._expire_locks()  # an abandoned lock must not keep chunks from eviction
            items = []
            for key, obj in zip(keys, objs, strict=False):
                text = self._text_to_store(key)
                if text is None:
                    ok = False
                else:
                    items.append((key, text, obj))
            all_stored, stored = store_objects(self.store, items, self._store_failed)
            ok = ok and all_stored
        except Exception as exc:
            ok = False
            logger.warning("Persisting L2 store task %d failed: %s", task_id, exc)
        # Evictions first: a key this task stored again may have been evicted just before.
        self._report_evictions()
        with self._lock:
            unknown = [item for item in stored if item.text not in self._sizes]
        there = self._present([item.text for item in unknown])
        with self._lock:  # new to LMCache's books: written now, or found already stored
            fresh = [
                item
                for item, flag in zip(unknown, there, strict=True)
                if flag and item.text not in self._sizes
            ]
            for item in fresh:
                self._sizes[item.text] = item.nbytes
                self._announcing[item.text] += 1
        if fresh:
            try:
                self._notify_keys_stored(
                    [item.key for item in fresh], [file_size(item.nbytes) for item in fresh]
                )
            finally:
                self._announced([item.text for item in fresh])
        written = sum(item.nbytes for item in stored if item.written)
        self._store_tasks.finish(task_id, L2StoreResult(ok, written))
        self._record_status()

    def _present(self, texts: list[str]) -> list[bool]:
        """Which of ``texts`` are stored: one question (per member holding some of them),
        none stored where the store does not answer."""
        try:
            return self.engine_store.exists(texts) if texts else []
        except Exception as exc:
            logger.warning("Persisting L2: asking for %d chunks failed: %s", len(texts), exc)
            return [False] * len(texts)

    def _store_failed(self, text: str, exc: BaseException) -> None:
        with self._lock:
            self._counters.store_failures += 1
        if errno_of(exc) is not None:
            self.io_errors.record("store", text, exc)
        else:
            logger.warning("Persisting L2 store of %s failed: %s", text, exc)

    # -- lookup and lock --------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        task_id = next_task_id()
        self._submit(self._control, self._run_lookup, task_id, list(keys))
        return task_id

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._lookup_tasks.pop(task_id)

    def _run_lookup(self, task_id: int, keys: list[ObjectKey]) -> None:
        bitmap = Bitmap(len(keys))
        try:
            self._expire_locks()
            if not self.local:  # one question per member; locks are this adapter's own
                texts = [self._text(key) for key in keys]
                asked = [t for t in texts if t is not None]
                found = dict(zip(asked, self._present(asked), strict=True))
                for i, text in enumerate(texts):
                    if text is not None and found[text]:
                        self._locks.lock(text)
                        bitmap.set(i)
                keys = []
            for i, key in enumerate(keys):
                text = self._text(key)
                if text is not None and self.store.pin(text):
                    self._locks.lock(text)
                    bitmap.set(i)
        except Exception as exc:  # a closed store: what was found so far stays locked
            logger.warning("Persisting L2 lookup task %d failed: %s", task_id, exc)
        self._lookup_tasks.finish(task_id, bitmap)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._submit(self._control, self._run_unlock, list(keys))

    def _run_unlock(self, keys: list[ObjectKey]) -> None:
        for key in keys:
            text = self._text(key)
            if text is not None and self._locks.unlock(text):
                self._unpin(text)

    def _expire_locks(self) -> None:
        expired = self._locks.expire()
        if expired:
            logger.warning(
                "Persisting L2 released %d lock(s) LMCache did not unlock within %gs",
                len(expired),
                self._locks.ttl_s,
            )
            for text in expired:
                self._unpin(text)

    def _unpin(self, text: str) -> None:
        if not self.local:
            return  # nothing is pinned on a cluster's members
        with contextlib.suppress(StoreClosedError):  # closing: pins go with the store
            self.store.unpin(text)

    # -- load ---------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        task_id = next_task_id()
        keys, objects = list(keys), list(objects)
        bitmap = Bitmap(len(keys))
        parts = _split(len(keys), self.params.io_threads)
        remaining = [len(parts)]
        done_lock = threading.Lock()

        def load(lo: int, hi: int) -> None:
            hits = [i for i in range(lo, hi) if self._load_one(keys[i], objects[i])]
            with done_lock:
                for i in hits:
                    bitmap.set(i)
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                accessed = [keys[i] for i in bitmap.get_indices_list()]
                if accessed:
                    self._notify_keys_accessed(accessed)
                self._report_evictions()
                self._load_tasks.finish(task_id, bitmap)

        if not parts:
            self._load_tasks.finish(task_id, bitmap)
        for lo, hi in parts:
            self._submit(self._io, load, lo, hi)
        return task_id

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._load_tasks.pop(task_id)

    def _load_one(self, key: ObjectKey, obj: MemoryObj) -> bool:
        """Read one chunk into ``obj`` (checksum verified); False on any kind of miss."""
        text = self._text(key)
        if text is None:
            return False
        outcome = load_object(self.store, text, obj, self._load_failed)
        if outcome in ("absent", "miss"):
            self._forget_if_gone(text)
        if outcome != "hit":
            with self._lock:
                self._counters.count_load(outcome)
        return outcome == "hit"

    def _load_failed(self, text: str, exc: BaseException) -> None:
        if errno_of(exc) is not None:
            self.io_errors.record("load", text, exc)
        else:
            logger.warning("Persisting L2 load of %s failed: %s", text, exc)

    # -- delete, listing, usage -------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove chunks in the background; a chunk a lookup locked is kept. Deletes run on
        the control thread, in order with lookups and unlocks: a lookup submitted after a
        delete misses, and a delete submitted after an unlock finds the chunk unlocked."""
        self._submit(self._control, self._run_delete, list(keys))

    def _run_delete(self, keys: list[ObjectKey]) -> None:
        gone: list[tuple[ObjectKey, int]] = []
        for key in keys:
            text = self._text(key)
            if text is None or self._locks.locked(text):
                continue
            try:
                removed = self.store.remove(text, force=False)
            except Exception as exc:
                logger.warning("Persisting L2 delete of %s failed: %s", text, exc)
                continue
            if removed:
                nbytes = self._take(text, key)
                if nbytes is not None:
                    gone.append((key, nbytes))
        if gone:
            self._notify_keys_deleted([k for k, _n in gone], [n for _k, n in gone])

    def _take(self, text: str, key: ObjectKey) -> int | None:
        """Take a chunk out of the books; the bytes (its file's) to tell LMCache of its
        deletion now, or None: not in the books, or its store not yet told,
        in which case the deletion is told right after the store (:meth:`_announced`).
        LMCache clamps a salt's usage at zero, so a deletion told before the store it
        undoes would leave that salt overstated by the chunk, and its listeners would see
        the chunk stored after it was deleted."""
        with self._lock:
            nbytes = self._sizes.pop(text, None)
            if nbytes is None:
                return None
            if self._announcing[text] > 0:
                self._deferred.setdefault(text, []).append((key, file_size(nbytes)))
                return None
            self._announcing.pop(text, None)
        return file_size(nbytes)

    def _announced(self, texts: list[str]) -> None:
        """LMCache was told of these chunks' stores: tell it of their deletions since."""
        late: list[tuple[ObjectKey, int]] = []
        with self._lock:
            for text in texts:
                self._announcing[text] -= 1
                if self._announcing[text] <= 0:
                    del self._announcing[text]
                    if text in self._deferred:
                        late += self._deferred.pop(text)
        if late:
            self._notify_keys_deleted([k for k, _n in late], [n for _k, n in late])

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """Stored keys in key-string order, ``page_size`` at a time; ``cursor`` is the
        ``next_page_token`` of the previous page."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        if cursor is not None and not isinstance(cursor, str):
            raise ValueError(f"malformed cursor {cursor!r}")
        self._report_evictions()
        entries: list[KeyEntry] = []
        last: str | None = None
        with self._lock:
            texts = self._sizes.irange(minimum=cursor, inclusive=(False, True))
            for text in texts:
                key = object_key_of(text)
                if model_name is None or key.model_name == model_name:
                    entries.append(KeyEntry(key.to_encoded_object_key(), self._sizes[text]))
                    last = text
                    if len(entries) == page_size:
                        break
            more = last is not None and self._sizes.bisect_right(last) < len(self._sizes)
        return KeyListPage(entries=tuple(entries), next_page_token=last if more else None)

    def get_usage(self) -> AdapterUsage:
        """Bytes on disk as the store counts them against ``capacity``, and per salt."""
        if self._closed or not self.local or not self.store.has_disk_tier:
            return super().get_usage()
        self._report_evictions()
        used = self.store.disk_used_bytes()
        books = super().get_usage()  # the per-salt bytes LMCache's base class keeps
        return AdapterUsage(
            total_bytes_used=used,
            total_capacity_bytes=books.total_capacity_bytes,
            bytes_by_cache_salt=books.bytes_by_cache_salt,
        )

    def _report_evictions(self) -> None:
        """Tell LMCache of the chunks the store evicted to stay within ``capacity``."""
        gone: list[tuple[ObjectKey, int]] = []
        while self._evicted:
            text, _disk_bytes = self._evicted.popleft()  # the file's bytes, as _take says
            key = object_key_of(text)
            nbytes = self._take(text, key)
            if nbytes is not None:
                gone.append((key, nbytes))
        if gone:
            with self._lock:
                self._counters.evictions += len(gone)
            self._notify_keys_deleted([k for k, _n in gone], [n for _k, n in gone])

    def debug_has_key(self, key: ObjectKey) -> bool:
        """Whether ``key`` is stored now (LMCache's adapter tests ask this; no lock taken)."""
        text = self._text(key)
        return text is not None and self.store.contains(text)

    def _forget_if_gone(self, text: str) -> None:
        """A chunk that vanished from the store (dropped as damaged) leaves LMCache's books."""
        if self._present([text]) != [False]:
            return
        key = object_key_of(text)
        nbytes = self._take(text, key)
        if nbytes is not None:
            self._notify_keys_deleted([key], [nbytes])

    # -- status, lifecycle ------------------------------------------------------------------

    def _record_status(self, force: bool = False) -> None:
        """Keep the claim's record current (at most every STATUS_EVERY_S seconds, or now),
        so ``persisting stats``/``inspect`` on this root show our capacity, usage and
        counters without asking LMCache."""
        now = time.monotonic()
        if not force and now - self._status_written < STATUS_EVERY_S:
            return
        self._status_written = now
        try:
            status = self.report_status(record=False)
        except Exception:  # informative only: never fail a task over it
            return
        if self._closed:  # the last record: stopped, not unhealthy
            status.pop("is_healthy", None)
        status["state"] = "stopped" if self._closed else "running"
        self._claim.update(status=status, status_time=time.time())

    def report_status(self, record: bool = True) -> dict:
        """LMCache's ``/status`` view of the adapter (also kept in the namespace's owner
        record, for ``persisting stats``)."""
        if record:
            self._record_status()
        self._report_evictions()
        stats = self._stats()
        with self._lock:
            counters = dataclasses.replace(self._counters)
            objects = len(self._sizes)
        io = self.io_errors.snapshot()
        healthy = not self._closed and not self.io_errors.recent(UNHEALTHY_AFTER_IO_ERROR_S)
        return {
            "is_healthy": healthy,
            "type": "PersistingL2Adapter",
            "storage_path": self._where(),
            "namespace": self.params.namespace,
            "durability": self.params.durability,
            "fsync": self.params.fsync,
            "stored_object_count": objects,
            "used_bytes": stats.get("disk_bytes", 0),
            "capacity_bytes": self.params.capacity,
            "locked_key_count": self._locks.count(),
            "expired_locks": self._locks.expired,
            "checksum_failures": stats.get("corruptions", 0),
            **dataclasses.asdict(counters),
            **io,
        }

    def _stats(self) -> dict[str, Any]:
        if self.local and self.store.closed:
            return {}
        try:
            stats: dict[str, Any] = self.engine_store.stats()
        except Exception as exc:  # a member that does not answer: no figures from it
            logger.debug("Persisting L2 stats: %s", exc)
            return {}
        return stats

    def close(self) -> None:
        """Finish the tasks submitted so far, then close the store (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._control.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._report_evictions()
        self._locks.clear()
        with contextlib.suppress(Exception):
            self._status_written = 0.0
            self._record_status(force=True)
        self.engine_store.close()
        self._claim.release()
        for board in (self._store_tasks, self._lookup_tasks, self._load_tasks):
            board.close()

    # -- helpers ----------------------------------------------------------------------------

    def _submit(self, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> None:
        if self._closed:
            raise StoreClosedError("PersistingL2Adapter is closed")
        pool.submit(_logged, fn, *args)

    def _text(self, key: ObjectKey) -> str | None:
        """The key string of ``key``, or None if Persisting cannot represent it (such a key
        is never stored, so a lookup or load of it is a miss)."""
        try:
            return self._key_string(key)
        except (InvalidKeyError, InvalidNameError):
            return None

    def _text_to_store(self, key: ObjectKey) -> str | None:
        """:meth:`_text` for a store: a key Persisting cannot represent is a counted store
        failure."""
        try:
            return self._key_string(key)
        except (InvalidKeyError, InvalidNameError) as exc:
            self._store_failed(repr(key), exc)
            return None

    def _key_string(self, key: ObjectKey) -> str:
        return key_string(object_key_text(self.params.namespace, key))


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` in at most ``parts`` contiguous, non-empty ranges."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def _logged(fn: Any, *args: Any) -> None:
    """Run a task body; an exception it lets out is logged, never lost silently."""
    try:
        fn(*args)
    except Exception:
        logger.exception("Persisting L2 task %s failed", getattr(fn, "__name__", fn))


__all__ = ["PersistingL2Adapter", "PersistingL2AdapterConfig"]
