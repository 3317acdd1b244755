"""LMCache storage plugin: a persistent, tiered Persisting KV store behind LMCache.

Enable it with configuration only::

    storage_plugins: ["PersistingBackend"]
    extra_config:
      storage_plugin.PersistingBackend.module_path: persisting.lmcache_backend
      storage_plugin.PersistingBackend.class_name: PersistingKVBackend
      persisting.storage_path: /var/lib/persisting

Chunks are stored under their LMCache key string in ``<storage_path>/kv/<model>/``, so they
survive engine restarts (LMCache's own local-disk backend forgets everything on restart).
Puts run on a writer pool and keep a reference on each ``MemoryObj`` until written; gets
allocate from LMCache's ``LocalCPUBackend`` without waiting (a full allocator is a miss) and
read the payload straight into the object's buffer.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lmcache import torch_device_type
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from persisting._lmcache_compat import LayoutGuard, format_name, memory_format, tensor_of
from persisting.config import KVSettings, PersistingSettings
from persisting.errors import (
    ConfigError,
    InvalidKeyError,
    InvalidNameError,
    InvalidValueError,
    PersistingError,
    StoreClosedError,
)
from persisting.kv import KVStore, Layout

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.abstract_backend import AllocatorBackendInterface
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

logger = logging.getLogger(__name__)

CompletionCallback = Callable[[CacheEngineKey], None]

#: extra_config keys start with this prefix.
PREFIX = "persisting."
_KV_FIELDS = frozenset(KVSettings.model_fields)
_DEFAULT_IO_THREADS = 4
#: LMCache keys Persisting cannot represent (e.g. worker_id >= world_size): never stored here.
UNREPRESENTABLE = (InvalidKeyError, InvalidNameError)


@dataclass(frozen=True, slots=True)
class _Put:
    """One chunk being written: its key, key string, parent chunk, object and future."""

    key: CacheEngineKey
    text: str
    parent: str | None
    obj: MemoryObj
    future: Future[None]


@dataclass(frozen=True)
class PluginOptions:
    """Settings of the plugin itself (not of the store)."""

    #: Threads writing puts, and threads reading batched gets in parallel.
    io_threads: int = _DEFAULT_IO_THREADS


def settings_from_extra_config(
    extra_config: Mapping[str, Any] | None, chunk_size: int | None = None
) -> tuple[PersistingSettings, PluginOptions]:
    """Persisting settings from LMCache's ``extra_config`` keys ``persisting.*``.

    ``persisting.config`` names a TOML file; ``persisting.storage_path`` and any KV setting
    (``persisting.memory_bytes`` or ``persisting.kv.memory_bytes``...) override it, the
    ``PERSISTING_*`` environment and the defaults. LMCache's ``chunk_size`` is the store's
    chunk size unless ``persisting.chunk_size`` says otherwise. Unknown keys are an error.
    """
    toml_file: str | None = None
    top: dict[str, Any] = {}
    kv: dict[str, Any] = {}
    io_threads: Any = _DEFAULT_IO_THREADS
    if chunk_size is not None:
        kv["chunk_size"] = chunk_size
    for raw_key, value in (extra_config or {}).items():
        if not isinstance(raw_key, str) or not raw_key.startswith(PREFIX):
            continue
        name = raw_key[len(PREFIX) :]
        if name.startswith("kv."):
            name = name[3:]
            if name not in _KV_FIELDS:
                raise ConfigError(f"unknown extra_config key {raw_key!r}")
        if name == "config":
            toml_file = str(value)
        elif name == "storage_path":
            top["storage_path"] = value
        elif name == "io_threads":
            io_threads = value
        elif name in _KV_FIELDS:
            kv[name] = value
        else:
            known = sorted(["config", "storage_path", "io_threads", *_KV_FIELDS])
            raise ConfigError(
                f"unknown extra_config key {raw_key!r}; known: {[PREFIX + k for k in known]}"
            )
    try:
        threads = int(io_threads)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"persisting.io_threads must be an int, got {io_threads!r}") from exc
    if threads < 1:
        raise ConfigError(f"persisting.io_threads must be >= 1, got {threads}")
    settings = PersistingSettings.load(toml_file, **top, kv=kv)
    if "durability" not in settings.kv.model_fields_set and settings.kv.memory_bytes > 0:
        # Unless told otherwise, complete puts like LMCache's own backends do: once the chunk
        # is stored and readable (memory tier), with its disk write following behind.
        settings = settings.model_copy(
            update={"kv": settings.kv.model_copy(update={"durability": "async"})}
        )
    return settings, PluginOptions(io_threads=threads)


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
        self._guard = LayoutGuard(metadata)
        self._lock = threading.Lock()  # in-flight puts, lookup pins, counters
        self._stores_lock = threading.Lock()
        self._stores: dict[str, KVStore] = {}
        self._inflight: dict[str, Future[None]] = {}
        self._lookup_pins: dict[str, list[tuple[CacheEngineKey, str]]] = {}
        self._counters = {"layout_mismatch": 0, "allocation_failed": 0, "put_failed": 0}
        self._closed = False
        threads = self.options.io_threads
        self._writer = ThreadPoolExecutor(threads, thread_name_prefix="persisting-put")
        self._reader = ThreadPoolExecutor(threads, thread_name_prefix="persisting-get")
        if metadata is not None:
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

        cpu.close = close  # type: ignore[method-assign]

    def wait_for_puts(self) -> None:
        """Block until every put submitted so far has been written (or has failed)."""
        with self._lock:
            pending = list(self._inflight.values())
        for future in pending:
            future.exception()

    # -- stores -------------------------------------------------------------------------

    def _store(self, model: str) -> KVStore:
        store = self._stores.get(model)
        if store is not None:
            return store
        with self._stores_lock:
            if self._closed:
                raise StoreClosedError("PersistingKVBackend is closed")
            store = self._stores.get(model)
            if store is None:
                store = KVStore.from_settings(self.settings, model)
                self._stores[model] = store
            return store

    def store_for(self, key: CacheEngineKey) -> KVStore:
        """The Persisting store that holds ``key``'s model namespace."""
        return self._store(key.model_name)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def stats(self) -> dict[str, Any]:
        """Plugin counters plus each open store's stats, keyed by model."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
        with self._stores_lock:
            stores = dict(self._stores)
        out["stores"] = {model: store.stats() for model, store in stores.items()}
        return out

    # -- lookups ------------------------------------------------------------------------

    def _stored_layout(self, key: CacheEngineKey) -> Layout | None:
        """The layout stored under ``key`` if this engine may load it, else None."""
        try:
            layout = self.store_for(key).layout(key.to_string())
        except UNREPRESENTABLE:
            return None  # never stored either: see batched_submit_put_task
        if layout is None:
            return None
        if not self._guard.accepts(key, layout):
            self._count("layout_mismatch")
            return None
        return layout

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        if self._stored_layout(key) is None:
            return False
        if pin:
            return self.pin(key)
        return True

    def batched_contains(self, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many leading ``keys`` are present (stops at the first miss)."""
        hits = 0
        for key in keys:
            if not self.contains(key, pin):
                break
            hits += 1
        return hits

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        text = key.to_string()
        with self._lock:
            if text in self._inflight:
                return True
        try:
            return self.store_for(key).exists_in_put_tasks(text)
        except UNREPRESENTABLE:
            return False

    def pin(self, key: CacheEngineKey) -> bool:
        """Counted: each successful pin needs its own unpin before the chunk is evictable."""
        try:
            return self.store_for(key).pin(key.to_string())
        except UNREPRESENTABLE:
            return False

    def unpin(self, key: CacheEngineKey) -> bool:
        try:
            return self.store_for(key).unpin(key.to_string())
        except UNREPRESENTABLE:
            return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """Drop ``key``; with ``force=False`` a pinned chunk survives."""
        try:
            return self.store_for(key).remove(key.to_string(), force=force)
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
        if len(keys) != len(objs):
            raise InvalidValueError(f"{len(keys)} keys but {len(objs)} memory objects")
        futures: list[Future[None]] = []
        batch: list[_Put] = []
        already_stored: list[CacheEngineKey] = []
        joined: list[tuple[Future[None], CacheEngineKey]] = []
        with self._lock:
            if self._closed:
                raise StoreClosedError("PersistingKVBackend is closed")
            previous: tuple[str, str] | None = None  # (model, key string) of the last key
            for key, obj in zip(keys, objs, strict=True):
                text = key.to_string()
                same_model = previous is not None and previous[0] == key.model_name
                parent = previous[1] if previous is not None and same_model else None
                previous = (key.model_name, text)
                pending = self._inflight.get(text)
                if pending is not None:
                    futures.append(pending)
                    joined.append((pending, key))
                    continue
                try:
                    present = self.store_for(key).contains(text)
                except UNREPRESENTABLE as exc:
                    futures.append(self._refused(text, exc))
                    previous = None  # never a parent: it cannot be stored
                    continue
                if present:
                    already_stored.append(key)
                    continue
                future: Future[None] = Future()
                future.set_running_or_notify_cancel()
                self._inflight[text] = future
                obj.ref_count_up()
                batch.append(_Put(key, text, parent, obj, future))
                futures.append(future)
            if batch:
                self._writer.submit(self._write, batch, on_complete_callback)
        if on_complete_callback is not None:
            for pending, key in joined:
                pending.add_done_callback(_after_success(on_complete_callback, key))
        for key in already_stored:
            _notify(on_complete_callback, key)
        return futures or None

    def _refused(self, text: str, exc: BaseException) -> Future[None]:
        """A failed future for a put that cannot even start (its key is unrepresentable)."""
        self._counters["put_failed"] += 1  # caller holds self._lock
        logger.warning("Persisting cannot store %s: %s", text, exc)
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        future.set_exception(exc)
        return future

    def _write(self, batch: list[_Put], on_complete: CompletionCallback | None) -> None:
        """Writer thread: store one submitted batch, then release and report every key."""
        outcomes: list[BaseException | None] = [None] * len(batch)
        groups: dict[tuple[str, str], list[int]] = {}
        for i, put in enumerate(batch):
            groups.setdefault((put.key.model_name, format_name(put.obj.metadata.fmt)), []).append(i)
        for (model, fmt), members in groups.items():
            try:
                self._write_group(model, fmt, [batch[i] for i in members], members, outcomes)
            except Exception as exc:  # an I/O failure must not leak references or futures
                for i in members:
                    outcomes[i] = exc
        for put, outcome in zip(batch, outcomes, strict=True):
            put.obj.ref_count_down()
            with self._lock:
                self._inflight.pop(put.text, None)
            if outcome is None:
                put.future.set_result(None)
                _notify(on_complete, put.key)
            else:
                self._count("put_failed")
                logger.warning("Persisting put of %s failed: %s", put.text, outcome)
                put.future.set_exception(outcome)

    def _write_group(
        self,
        model: str,
        fmt: str,
        items: list[_Put],
        positions: list[int],
        outcomes: list[BaseException | None],
    ) -> None:
        """Store items of one model and format in one batch (one by one if one is bad)."""
        store = self._store(model)
        try:
            store.batched_put(
                [put.text for put in items],
                [tensor_of(put.obj) for put in items],
                fmt=fmt,
                # A submitted batch is one request's chunks in order: each one's parent is
                # the chunk submitted before it (prefix-aware eviction drops suffixes first).
                parents=[put.parent for put in items],
                check_shape=False,  # LMCache owns its layouts; store them as they are
            )
            return
        except PersistingError as exc:
            if len(items) == 1:
                outcomes[positions[0]] = exc
                return
        for put, pos in zip(items, positions, strict=True):
            try:
                store.put(
                    put.text, tensor_of(put.obj), fmt=fmt, parent=put.parent, check_shape=False
                )
            except Exception as exc:
                outcomes[pos] = exc

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
        """Fill ``obj`` with the payload stored under ``key``; False (obj released) on a miss."""
        try:
            buffer = obj.byte_array.cast("B")
            if len(buffer) != layout.nbytes:
                got = None
            else:
                got = self.store_for(key).get_into(key.to_string(), buffer, expect=layout)
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
        """Layouts and fresh objects for the leading keys that are stored and fit in memory."""
        out: list[tuple[Layout, MemoryObj]] = []
        for key in keys:
            layout = self._stored_layout(key)
            if layout is None:
                break
            obj = self._allocate(layout)
            if obj is None:
                break
            out.append((layout, obj))
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
            loaded = list(
                self._reader.map(
                    self._read_into,
                    keys[: len(planned)],
                    [layout for layout, _obj in planned],
                    objs,
                )
            )
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
        """Leading stored keys; pins taken here are released by the lookup's load."""
        hits = self.batched_contains(keys, pin)
        if pin and hits:
            with self._lock:
                pinned = self._lookup_pins.setdefault(lookup_id, [])
                pinned.extend((key, key.to_string()) for key in keys[:hits])
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
                )
            )
            return self._keep_prefix([obj for _l, obj in planned], list(loaded))
        finally:
            self._release_lookup_pins(lookup_id, keys)

    def _release_lookup_pins(self, lookup_id: str, keys: Sequence[CacheEngineKey]) -> None:
        """Drop the pins ``batched_async_contains`` took for ``lookup_id`` on ``keys``."""
        with self._lock:
            pinned = self._lookup_pins.pop(lookup_id, [])
        wanted = {key.to_string() for key in keys}
        for key, text in pinned:
            if text in wanted:
                self.store_for(key).unpin(text)

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
            store.flush()

    def close(self) -> None:
        """Wait for in-flight puts, then close the stores (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        with self._stores_lock:
            stores = list(self._stores.values())
            self._stores.clear()
        with self._lock:
            self._lookup_pins.clear()
        for store in stores:
            store.close()


def _notify(callback: CompletionCallback | None, key: CacheEngineKey) -> None:
    if callback is None:
        return
    try:
        callback(key)
    except Exception:
        logger.exception("on_complete_callback failed for %s", key)


def _after_success(
    callback: CompletionCallback, key: CacheEngineKey
) -> Callable[[Future[None]], None]:
    def done(future: Future[None]) -> None:
        if not future.cancelled() and future.exception() is None:
            _notify(callback, key)

    return done


__all__ = ["PersistingKVBackend", "PluginOptions", "settings_from_extra_config"]
