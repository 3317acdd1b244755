"""LMCache in-process storage plugin: a persistent, tiered Persisting KV store behind LMCache.

Enable it with configuration only::

    storage_plugins: ["PersistingBackend"]
    extra_config:
      storage_plugin.PersistingBackend.module_path: persisting.lmcache_backend
      storage_plugin.PersistingBackend.class_name: PersistingKVBackend
      persisting.storage_path: /var/lib/persisting

Chunks are stored under their LMCache key string in ``<storage_path>/kv/<model>/``, so they
survive engine restarts (LMCache's own local-disk backend forgets everything on restart).
Puts run on a writer pool (:mod:`persisting.integrations.lmcache.puts`); gets allocate from
LMCache's ``LocalCPUBackend`` without waiting (a full allocator is a miss) and read the
payload straight into the object's buffer.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lmcache import torch_device_type
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from persisting.errors import ConfigError, ServiceUnavailableError, StoreClosedError
from persisting.integrations.common.opener import open_engine_store, open_local
from persisting.integrations.common.store import EngineStore, LocalStore
from persisting.integrations.lmcache.compat import LayoutGuard, memory_format
from persisting.integrations.lmcache.health import IOErrors, errno_of, logger
from persisting.integrations.lmcache.pins import LookupPins
from persisting.integrations.lmcache.puts import UNREPRESENTABLE, CompletionCallback, PutWriter
from persisting.integrations.lmcache.settings import engine_settings, settings_from_extra_config
from persisting.kv import Layout
from persisting.kv.api import KVApi
from persisting.kv.namespace.identity import weights_namespace

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.abstract_backend import AllocatorBackendInterface
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend


#: How long a cluster that did not answer is left alone before it is asked again.
REOPEN_S = 10.0


class PersistingKVBackend(StoragePluginInterface):
    """LMCache ``StoragePluginInterface`` on a persistent Persisting KV store.

    Constructed by LMCache with ``(config, dst_device, metadata, local_cpu_backend, loop)``.
    The store's model namespace is each key's model name (LMCache's ``model_name``).
    """

    def __init__(
        self,
        config: LMCacheEngineConfig | None = None,
        dst_device: str = torch_device_type,
        metadata: LMCacheMetadata | None = None,
        local_cpu_backend: LocalCPUBackend | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(
            dst_device=dst_device,
            config=config,
            metadata=metadata,
            local_cpu_backend=local_cpu_backend,
            loop=loop,
        )
        chunk_size = getattr(config, "chunk_size", None) if config is not None else None
        extra = getattr(config, "extra_config", None) if config is not None else None
        self.settings, self.options = settings_from_extra_config(extra, chunk_size)
        self.engine = engine_settings(self.settings, self.options)
        self._guard = LayoutGuard(metadata)
        self._lock = threading.Lock()  # counters, closing
        self._stores_lock = threading.Lock()
        #: Namespaces whose cluster did not answer: when, and what it said.
        self._failed_opens: dict[str, tuple[float, ServiceUnavailableError]] = {}
        self._stores: dict[str, EngineStore] = {}
        self._lookup_pins: LookupPins[CacheEngineKey] = LookupPins(self.options.lookup_pin_ttl_s)
        self._counters = {"layout_mismatch": 0, "allocation_failed": 0, "put_failed": 0}
        self.io_errors = IOErrors()
        self._closed = False
        threads = self.options.io_threads
        self.puts = PutWriter(self._store, self._put_failed, threads, self.key_text)
        self._reader = ThreadPoolExecutor(threads, thread_name_prefix="persisting-get")
        if metadata is not None and self.engine.cluster is None:
            self._store(metadata.model_name)  # open eagerly: a bad root fails construction
        if local_cpu_backend is not None:
            self._finish_puts_before_closing(local_cpu_backend)

    def __str__(self) -> str:
        return "PersistingKVBackend"

    def _finish_puts_before_closing(self, cpu: LocalCPUBackend) -> None:
        """Make closing LMCache's CPU pool wait for the puts that still read from it.

        ``StorageManager.close`` closes ``LocalCPUBackend`` (which frees its memory arena)
        before it closes storage plugins, while puts in flight still hold MemoryObjs in
        that arena: without this, a write at shutdown reads freed memory.
        """
        close_pool = cpu.close

        def close() -> None:
            self.wait_for_puts()
            close_pool()

        cpu.close = close

    def wait_for_puts(self) -> None:
        """Block until every put submitted so far has been written (or has failed)."""
        self.puts.wait()

    # -- stores -------------------------------------------------------------------------

    @property
    def clustered(self) -> bool:
        """Whether the chunks are in a cluster of ``persisting serve`` members."""
        return self.engine.cluster is not None

    def engine_store(self, model: str) -> EngineStore:
        """The store of ``model``'s namespace, opened on first use. A cluster that did
        not answer is not asked again for :data:`REOPEN_S`: meanwhile every call fails at
        once (a miss to LMCache), never waiting out a connect per chunk."""
        store = self._stores.get(model)
        if store is not None:
            return store
        with self._stores_lock:
            if self._closed:
                raise StoreClosedError("PersistingKVBackend is closed")
            store = self._stores.get(model)
            if store is None:
                failed = self._failed_opens.get(model)
                if failed is not None and time.monotonic() - failed[0] < REOPEN_S:
                    raise failed[1]
                try:
                    store = self._open(model)
                except ServiceUnavailableError as exc:
                    self._failed_opens[model] = (time.monotonic(), exc)
                    raise
                self._failed_opens.pop(model, None)
                self._stores[model] = store
            return store

    def _open(self, model: str) -> EngineStore:
        namespace, weights = weights_namespace(model, self.settings.kv.model_version)
        if self.engine.cluster is not None:
            return open_engine_store(self.engine, namespace, reconnect=False)  # needs .kv
        kv = self.settings.kv
        store = open_local(
            self.engine,
            model,
            directory=namespace,
            memory_bytes=kv.memory_bytes,
            durability=kv.durability,
            kv_settings=self.settings,  # the rest of the kv section and storage_access
            read_threads=kv.read_threads,
            describe={"engine": "LMCache plugin", "model": model, **weights},
        )
        if self.options.prefault_memory:
            store.prefault_memory()
        return LocalStore(store, self.engine.io_threads, memory_tier=kv.memory_bytes > 0)

    def _store(self, model: str) -> KVApi:
        return self.engine_store(model).kv

    def store_for(self, key: CacheEngineKey) -> KVApi:
        """The store that holds ``key``'s model namespace (a local :class:`KVStore`, or the
        cluster's client): both take the typed calls this plugin makes."""
        return self._store(key.model_name)

    def key_text(self, key: CacheEngineKey) -> str:
        """``key``'s string in its store: LMCache's own, except that in a cluster it starts
        with the namespace (the model's name, with its weights' digest where known)."""
        text = key.to_string()
        if self.engine.cluster is None:
            return text
        namespace = self.engine_store(key.model_name).namespace
        model = key.model_name
        return text if namespace == model else namespace + text[len(model) :]

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _put_failed(self, text: str, exc: BaseException) -> None:
        self._count("put_failed")
        if errno_of(exc) is not None:
            self.io_errors.record("put", text, exc)
        else:
            logger.warning("Persisting put of %s failed: %s", text, exc)

    def stats(self) -> dict[str, Any]:
        """Plugin counters (I/O errors with the last one's errno, expired lookup pins) plus
        each open store's stats, keyed by model."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        out.update(self.io_errors.snapshot())
        out["lookup_pins_expired"] = self._lookup_pins.expired
        with self._stores_lock:
            stores = dict(self._stores)
        out["stores"] = {model: store.stats() for model, store in stores.items()}
        return out

    # -- lookups ------------------------------------------------------------------------

    def _stored_layout(self, key: CacheEngineKey) -> Layout | None:
        """The layout stored under ``key`` if this engine may load it, else None."""
        try:
            layout = self.store_for(key).layout(self.key_text(key))
        except UNREPRESENTABLE:
            return None  # never stored either: see batched_submit_put_task
        except Exception as exc:  # a store that does not answer: a miss, never an error
            logger.warning("Persisting lookup of %s failed: %s", key.to_string(), exc)
            return None
        if layout is None:
            return None
        if not self._guard.accepts(key, layout):
            self._count("layout_mismatch")
            return None
        return layout

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        if self.clustered:
            return self._cluster_leading([key]) == 1
        if self._stored_layout(key) is None:
            return False
        if pin:
            return self.pin(key)
        return True

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many leading ``keys`` are present (stops at the first miss)."""
        if self.clustered:
            return self._cluster_leading(keys)
        hits = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hits += 1
        return hits

    def _cluster_leading(self, keys: list[CacheEngineKey]) -> int:
        """Leading stored ``keys`` of a cluster: one question per member holding some of
        them per model (a member that does not answer: misses). Nothing is pinned there
        (a chunk evicted before its load is a miss then), and a chunk's layout is checked
        when it is loaded."""
        hits = 0
        while hits < len(keys):
            model = keys[hits].model_name
            run = list(itertools.takewhile(partial(_of_model, model), keys[hits:]))
            try:
                found = self.engine_store(model).leading([self.key_text(k) for k in run])
            except Exception as exc:  # unrepresentable, or closing: a miss
                logger.debug("Persisting lookup in the cluster failed: %s", exc)
                found = 0
            hits += found
            if found < len(run):
                break
        return hits

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        try:
            text = self.key_text(key)
            if self.puts.in_flight(text):
                return True
            store = self.engine_store(key.model_name)
        except UNREPRESENTABLE:
            return False
        return isinstance(store, LocalStore) and store.kv.exists_in_put_tasks(text)

    def pin(self, key: CacheEngineKey) -> bool:
        """Counted: each successful pin needs its own unpin before the chunk is evictable."""
        try:
            return self.store_for(key).pin(self.key_text(key))
        except UNREPRESENTABLE:
            return False
        except Exception as exc:  # a member that does not answer: not pinned
            logger.warning("Persisting pin of %s failed: %s", key.to_string(), exc)
            return False

    def unpin(self, key: CacheEngineKey) -> bool:
        text = key.to_string()
        self._lookup_pins.released_elsewhere(text)
        return self._unpin(key, text)

    def _unpin(self, key: CacheEngineKey, text: str) -> bool:
        try:
            return self.store_for(key).unpin(self.key_text(key))
        except UNREPRESENTABLE:
            return False
        except StoreClosedError:
            return False  # closing: the store and its pins are gone
        except Exception as exc:  # a member that does not answer: its pins end with it
            logger.warning("Persisting unpin of %s failed: %s", text, exc)
            return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Drop ``key``; with ``force=False`` a pinned chunk survives."""
        try:
            return self.store_for(key).remove(self.key_text(key), force=force)
        except UNREPRESENTABLE:
            return False

    def touch_cache(self) -> None:
        """Recency is updated by the store on every hit; nothing is deferred to here."""

    # -- puts ---------------------------------------------------------------------------

    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: list[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: CompletionCallback | None = None,
    ) -> list[Future[None]] | None:
        """Write ``objs`` asynchronously; one future per key that is (being) written.

        Each object's reference count is held until its write finished or failed.
        ``on_complete_callback(key)`` runs once per key when the chunk is stored (at once
        for a key already stored, on completion of the earlier put for a key in flight).
        Returns None when no key needed writing.
        """
        self._expire_lookup_pins()  # puts may evict: abandoned lookups must not pin chunks
        return self.puts.submit(keys, objs, on_complete_callback)

    # -- gets ---------------------------------------------------------------------------

    def _allocate(self, layout: Layout) -> MemoryObj | None:
        """A MemoryObj for ``layout`` from LMCache's CPU pool, or None if it is full."""
        allocator = self.local_cpu_backend
        fmt = memory_format(layout.fmt)
        if allocator is None or fmt is None:
            return None
        obj = allocator.allocate(
            torch.Size(layout.shape), layout.torch_dtype, fmt, eviction=True, busy_loop=False
        )
        if obj is None:
            self._count("allocation_failed")
        return obj

    def _read_into(self, key: CacheEngineKey, layout: Layout, obj: MemoryObj) -> bool:
        """Fill ``obj`` with the payload stored under ``key``; False (obj released) on a miss.

        A failed read is a miss too (LMCache recomputes): an I/O error is counted and logged
        with its errno, anything else logged. ``obj`` is released whatever happens.
        """
        text = key.to_string()
        try:
            buffer = obj.byte_array.cast("B")
            if len(buffer) != layout.nbytes:
                got = None
            else:
                got = self.store_for(key).get_into(self.key_text(key), buffer, expect=layout)
        except Exception as exc:
            obj.ref_count_down()
            if errno_of(exc) is not None:
                self.io_errors.record("read", text, exc)
            else:
                logger.warning("Persisting read of %s failed: %s", text, exc)
            return False
        except BaseException:
            obj.ref_count_down()
            raise
        if got is None:
            obj.ref_count_down()
            return False
        return True

    def get_blocking(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk in a new MemoryObj the caller owns one reference of, or None."""
        layout = self._stored_layout(key)
        if layout is None:
            return None
        obj = self._allocate(layout)
        if obj is None:
            return None
        return obj if self._read_into(key, layout, obj) else None

    def _allocate_prefix(self, keys: Sequence[CacheEngineKey]) -> list[tuple[Layout, MemoryObj]]:
        """Layouts and fresh objects for the leading keys that are stored and fit in memory
        (if this raises, what it allocated is released first)."""
        out: list[tuple[Layout, MemoryObj]] = []
        try:
            for key in keys:
                layout = self._stored_layout(key)
                if layout is None:
                    break
                obj = self._allocate(layout)
                if obj is None:
                    break
                out.append((layout, obj))
        except BaseException:
            for _layout, obj in out:
                obj.ref_count_down()
            raise
        return out

    @staticmethod
    def _keep_prefix(objs: list[MemoryObj], loaded: list[bool]) -> list[MemoryObj]:
        """The objects before the first failed load; loaded ones after it are released."""
        n = next((i for i, ok in enumerate(loaded) if not ok), len(loaded))
        for obj, ok in zip(objs[n:], loaded[n:], strict=True):
            if ok:
                obj.ref_count_down()
        return objs[:n]

    def batched_get_blocking(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Chunks of the leading stored keys, read in parallel; None from the first miss on."""
        planned = self._allocate_prefix(keys)
        if not planned:
            return [None] * len(keys)
        objs = [obj for _layout, obj in planned]
        if len(planned) == 1:
            loaded = [self._read_into(keys[0], planned[0][0], objs[0])]
        else:
            # Every read runs to its end (each releases its object on a miss), so the loaded
            # ones past a failure are released by _keep_prefix, never dropped.
            futures = [
                self._reader.submit(self._read_into, key, layout, obj)
                for key, (layout, obj) in zip(keys, planned, strict=False)
            ]
            loaded = [_succeeded(future) for future in futures]
        kept = self._keep_prefix(objs, loaded)
        return [*kept, *([None] * (len(keys) - len(kept)))]

    # -- asynchronous loading -------------------------------------------------------------

    def get_non_blocking(
        self, key: CacheEngineKey, location: str | None = None
    ) -> Future[MemoryObj | None] | None:
        """A future of :meth:`get_blocking`'s result, or None if ``key`` is not stored."""
        if not self.contains(key):
            return None
        return self._reader.submit(self.get_blocking, key)

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """Leading stored keys. Pins taken here are released by this lookup's load (all of
        them, loaded or not), by LMCache's own ``unpin``, or after ``lookup_pin_ttl_s``."""
        self._expire_lookup_pins()
        hits = self.batched_contains(keys, pin)
        if pin and hits and not self.clustered:  # nothing is pinned in a cluster
            self._lookup_pins.add(lookup_id, [(key, key.to_string()) for key in keys[:hits]])
        return hits

    async def batched_get_non_blocking(
        self, lookup_id: str, keys: list[CacheEngineKey], transfer_spec: Any = None
    ) -> list[MemoryObj]:
        """Load the leading stored ``keys``; returns the loaded prefix (maybe shorter)."""
        try:
            planned = self._allocate_prefix(keys)
            loop = asyncio.get_running_loop()
            loaded = await asyncio.gather(
                *(
                    loop.run_in_executor(self._reader, self._read_into, key, layout, obj)
                    for key, (layout, obj) in zip(keys, planned, strict=False)
                ),
                return_exceptions=True,  # a failed read released its own object
            )
            return self._keep_prefix([obj for _l, obj in planned], [ok is True for ok in loaded])
        finally:
            self._release_pins(self._lookup_pins.finish(lookup_id))
            self._expire_lookup_pins()

    def _expire_lookup_pins(self) -> None:
        expired = self._lookup_pins.expire()
        if expired:
            logger.warning(
                "Persisting released %d pin(s) of LMCache lookups never loaded within %gs",
                len(expired),
                self._lookup_pins.ttl_s,
            )
            self._release_pins(expired)

    def _release_pins(self, pins: list[tuple[CacheEngineKey, str]]) -> None:
        for key, text in pins:
            self._unpin(key, text)

    # -- lifecycle ------------------------------------------------------------------------

    def get_allocator_backend(self) -> AllocatorBackendInterface:
        if self.local_cpu_backend is None:
            raise ConfigError(
                "PersistingKVBackend needs LMCache's LocalCPUBackend (max_local_cpu_size > 0)"
            )
        return self.local_cpu_backend

    def flush(self) -> None:
        """Wait until every put submitted so far is written and durable on disk."""
        self.wait_for_puts()
        with self._stores_lock:
            stores = list(self._stores.values())
        for store in stores:
            if isinstance(store, LocalStore):
                store.kv.flush()

    def close(self) -> None:
        """Wait for in-flight puts, then close the stores (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.puts.close()
        self._reader.shutdown(wait=True)
        self._release_pins(self._lookup_pins.clear())
        with self._stores_lock:
            stores = list(self._stores.values())
            self._stores.clear()
        for store in stores:
            store.close()


def _of_model(model: str, key: CacheEngineKey) -> bool:
    return bool(key.model_name == model)


def _succeeded(future: Future[bool]) -> bool:
    """A read's outcome; one that raised (its object already released) is a miss."""
    try:
        return future.result()
    except Exception:
        return False


__all__ = ["PersistingKVBackend"]
