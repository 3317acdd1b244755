"""KVStore: the facade over the memory and disk tiers, with LMCache-like semantics.

Completion modes (``durability``):

- ``"sync"``  (write-through): a put returns once the bytes are fsynced on disk (with
  ``fsync=False``: once they are written and renamed into place, in the page cache).
- ``"async"`` (write-behind):  a put returns once the value is in memory; a background
  writer makes it durable, ``exists_in_put_tasks`` is true until then, ``on_complete`` fires.
- ``"write_back"``:             the value stays in memory and is written to disk only when
  the memory tier evicts it (or on close).

Content-addressed keys never change value: putting an existing key is a no-op success.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from persisting.config import DURABILITY_ALIASES, KVSettings, PersistingSettings
from persisting.errors import (
    CapacityError,
    ConfigError,
    InvalidKeyError,
    InvalidValueError,
    StoreClosedError,
)
from persisting.kv.disk_tier import DiskTier, EvictionListener, Location, WriteItem
from persisting.kv.index import MemoryEntry
from persisting.kv.keys import ChunkKey, TokenHasher, key_string
from persisting.kv.layout import (
    Layout,
    checksum,
    decode_value,
    encode_value,
    owned_copy,
    writable_bytes,
)
from persisting.kv.memory_tier import MemoryTier
from persisting.kv.policy import (
    AdmissionPolicy,
    EvictionPolicy,
    admission_policy,
    eviction_policy,
)
from persisting.kv.stats import StoreStats
from persisting.kv.write_behind import WriteBehind
from persisting.lance_store import StorageRoot, validate_name
from persisting.shm import RecycledBuffers, SharedPool, aligned_buffer, copy_bytes, seqlock_safe

Durability = Literal["sync", "async", "write_back"]
Tier = Literal["memory", "disk"]
KeyLike = ChunkKey | str
OnComplete = Callable[["PutResult"], None]


@dataclass(frozen=True, slots=True)
class PutResult:
    """Where a put completed: ``tier`` and whether the value is ``durable`` on disk yet;
    ``stored`` is False when the key was already present (first writer wins)."""

    key: str
    tier: Tier
    durable: bool
    stored: bool = True


@dataclass(frozen=True, slots=True)
class SharedLocation:
    """A memory-tier value in the store's shared pool: its layout, byte offset in the
    pool file, and the generation the reader must still see after copying it."""

    layout: Layout
    offset: int
    generation: int


def _open_pool(memory_bytes: int) -> SharedPool | None:
    """A shared pool for the memory tier, where this host allows one (else None)."""
    if memory_bytes <= 0 or not seqlock_safe():
        return None
    try:
        return SharedPool(memory_bytes)
    except OSError:  # no /dev/shm, or no room for the pool's header
        return None


class KVStore:
    """A model namespace's KV chunks: memory tier over a Lance-indexed disk tier.

    Thread-safe. Use :func:`open_kv_store` to make one; close it (or use ``with``).
    """

    def __init__(
        self,
        storage_path: str | Path,
        model: str,
        *,
        memory_bytes: int,
        disk_bytes: int,
        durability: Durability = "sync",
        eviction: str | EvictionPolicy = "lru",
        admission: str | AdmissionPolicy = "always",
        max_value_bytes: int | None = None,
        chunk_size: int = 256,
        shared_memory: bool = False,
        result_buffer_bytes: int = 256 << 20,
        fsync: bool = True,
        on_disk_evict: EvictionListener | None = None,
    ):
        validate_name(model, "model")
        if "@" in model:
            raise InvalidKeyError(
                f"model name {model!r} must not contain '@' (it separates key parts)"
            )
        durability = DURABILITY_ALIASES.get(durability, durability)  # type: ignore[assignment]
        if durability not in ("sync", "async", "write_back"):
            raise ConfigError(f"durability must be sync, async or write_back, not {durability!r}")
        if memory_bytes < 0 or disk_bytes < 0:
            raise ConfigError("tier capacities must not be negative")
        if durability != "sync" and memory_bytes == 0:
            raise ConfigError(f"durability={durability!r} needs a memory tier (memory_bytes > 0)")
        self.model = model
        self.durability: Durability = durability
        self.chunk_size = chunk_size
        self.max_value_bytes = max_value_bytes or max(memory_bytes, disk_bytes)
        self.root = StorageRoot(storage_path)
        self.directory = self.root.kv_path(model)
        policy = eviction_policy(eviction)
        self.admission = admission_policy(admission)
        self.memory = MemoryTier(memory_bytes, policy)
        self.disk = (
            DiskTier(self.directory, disk_bytes, policy, on_disk_evict) if disk_bytes > 0 else None
        )
        #: Whether write-through puts fsync before they complete. False leaves them in the
        #: page cache (whole and renamed into place: they survive a crash of this process,
        #: not of the machine), as LMCache's own disk backends do.
        self.fsync = fsync
        #: Memory-tier buffers readable by same-host processes (see :meth:`shared_location`).
        self.pool = _open_pool(memory_bytes) if shared_memory else None
        self._results = RecycledBuffers(result_buffer_bytes) if result_buffer_bytes > 0 else None
        self.stats_ = StoreStats()
        self._lock = threading.RLock()
        self._pending: dict[str, Future[bool]] = {}
        self._callbacks: dict[str, OnComplete] = {}
        self._writer = WriteBehind(self.disk, self._written) if self.disk is not None else None
        self._closed = False

    @classmethod
    def from_settings(cls, settings: PersistingSettings, model: str, **overrides: Any) -> KVStore:
        kv: KVSettings = settings.kv
        options: dict[str, Any] = dict(
            memory_bytes=kv.memory_bytes,
            disk_bytes=kv.disk_bytes,
            durability=kv.durability,
            eviction=kv.eviction,
            admission=kv.admission,
            max_value_bytes=kv.max_value_bytes,
            chunk_size=kv.chunk_size,
            result_buffer_bytes=kv.result_buffer_bytes,
        )
        options.update(overrides)
        return cls(settings.storage_path, model, **options)

    # -- helpers ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"KV store for {self.model!r} is closed")

    def _key(self, key: KeyLike) -> str:
        text = key_string(key)
        model = key.model if isinstance(key, ChunkKey) else text.split("@", 1)[0]
        if model != self.model:
            raise InvalidKeyError(f"key {text!r} belongs to model {model!r}, not {self.model!r}")
        return text

    def _encode(self, value: Any, fmt: str, check_shape: bool = True) -> tuple[Layout, memoryview]:
        layout, view = encode_value(value, fmt, check_shape=check_shape)
        if layout.nbytes > self.max_value_bytes:
            raise CapacityError(
                f"value of {layout.nbytes} bytes exceeds the {self.max_value_bytes}-byte limit"
            )
        if layout.nbytes > max(self.memory.capacity, self.disk.capacity if self.disk else 0):
            raise CapacityError(f"value of {layout.nbytes} bytes cannot fit any tier")
        return layout, view

    def _memory_buffer(self, nbytes: int) -> np.ndarray:
        """Room for a memory-tier value: in the shared pool while it has room, else private."""
        if self.pool is not None:
            buffer = self.pool.allocate(nbytes)
            if buffer is not None:
                return buffer
            self.stats_.count("pool_full")
        return aligned_buffer(nbytes)

    def _result_buffer(self, nbytes: int) -> np.ndarray:
        """Room for a value :meth:`get` returns: reused pages while there are any free."""
        buffer = self._results.take(nbytes) if self._results is not None else None
        return buffer if buffer is not None else aligned_buffer(nbytes)

    def _on_disk(self, key: str) -> bool:
        return self.disk is not None and key in self.disk

    # -- put ----------------------------------------------------------------------------

    def put(
        self,
        key: KeyLike,
        value: Any,
        *,
        fmt: str = "KV_2LTD",
        parent: KeyLike | None = None,
        on_complete: OnComplete | None = None,
        check_shape: bool = True,
    ) -> PutResult:
        """Store one value; see the module docstring for what completion means per mode."""
        return self.batched_put(
            [key],
            [value],
            fmt=fmt,
            parents=[parent] if parent is not None else None,
            on_complete=on_complete,
            check_shape=check_shape,
        )[0]

    def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        *,
        fmt: str = "KV_2LTD",
        parents: Sequence[KeyLike | None] | None = None,
        chain: bool = False,
        on_complete: OnComplete | None = None,
        check_shape: bool = True,
    ) -> list[PutResult]:
        """Store a batch (one disk reservation and metadata commit); one result per key.

        ``chain=True`` says the keys are consecutive chunks of one prefix (each one's parent
        is the key before it), which the prefix-aware eviction policy uses. Every item is
        validated before anything is stored; ``check_shape=False`` skips the format's shape
        rule (for layouts another system defines, such as LMCache's MemoryObjs).
        """
        self._check_open()
        if len(keys) != len(values):
            raise InvalidValueError(f"{len(keys)} keys but {len(values)} values")
        if parents is not None and len(parents) != len(keys):
            raise InvalidValueError(f"{len(keys)} keys but {len(parents)} parents")
        start = time.perf_counter()
        texts = [self._key(k) for k in keys]
        if parents is not None:
            parent_texts = [self._key(p) if p is not None else None for p in parents]
        elif chain:
            parent_texts = [None, *texts[:-1]]
        else:
            parent_texts = [None] * len(texts)
        encoded = [self._encode(v, fmt, check_shape) for v in values]
        items = [
            WriteItem(k, layout, view, checksum(view), parent)
            for k, (layout, view), parent in zip(texts, encoded, parent_texts, strict=True)
        ]
        if self.durability == "sync":
            results = self._put_sync(items)
        else:
            results = [self._put_memory_first(it, on_complete) for it in items]
        nbytes = sum(it.layout.nbytes for it, r in zip(items, results, strict=True) if r.stored)
        self.stats_.record(
            "put", results[0].tier if results else "", time.perf_counter() - start, nbytes, "stored"
        )
        if on_complete is not None:
            for r in results:
                if r.durable or not r.stored or self.disk is None:
                    on_complete(r)
        return results

    def _put_sync(self, items: list[WriteItem]) -> list[PutResult]:
        to_disk: list[WriteItem] = []
        results: dict[int, PutResult] = {}
        with self._lock:
            for i, it in enumerate(items):
                if self._on_disk(it.key):
                    results[i] = PutResult(it.key, "disk", True, stored=False)
                elif self.disk is not None and self.admission.admit(it.key):
                    to_disk.append(it)
                elif it.key in self.memory.index:
                    results[i] = PutResult(it.key, "memory", False, stored=False)
        if to_disk:
            assert self.disk is not None
            self.disk.write(to_disk, durable=self.fsync)
        # Copies for the memory tier are made outside the lock (they are the big cost).
        copies = {
            i: owned_copy(it.data, self._memory_buffer)
            for i, it in enumerate(items)
            if i not in results and self.memory.fits(it.layout.nbytes)
        }
        with self._lock:
            for i, it in enumerate(items):
                if i in results:
                    continue
                inserted = False
                if i in copies:
                    inserted, _ = self.memory.insert(
                        it.key, it.layout, copies[i], it.checksum, it.parent, dirty=False
                    )
                on_disk = self._on_disk(it.key)
                results[i] = PutResult(
                    it.key, "disk" if on_disk else "memory", on_disk, stored=inserted or on_disk
                )
        return [results[i] for i in range(len(items))]

    def _present_result(self, key: str) -> PutResult | None:
        """The no-op result of putting a key that is already stored or being written."""
        if self._on_disk(key):
            return PutResult(key, "disk", True, stored=False)
        if key in self.memory.index or key in self._pending:
            return PutResult(key, "memory", False, stored=False)
        return None

    def _put_memory_first(self, it: WriteItem, on_complete: OnComplete | None) -> PutResult:
        with self._lock:
            present = self._present_result(it.key)
        if present is not None:
            return present
        # Outside the lock: the copy is the big cost.
        buffer = owned_copy(it.data, self._memory_buffer)
        with self._lock:
            present = self._present_result(it.key)
            if present is not None:
                return present
            inserted, evicted = self.memory.insert(
                it.key, it.layout, buffer, it.checksum, it.parent, dirty=True
            )
            if self._writer is not None and (self.durability == "async" or not inserted):
                # Write-behind (or straight to disk: memory could not hold the value).
                if on_complete is not None:
                    self._callbacks[it.key] = on_complete
                self._pending[it.key] = self._writer.submit(
                    WriteItem(it.key, it.layout, memoryview(buffer), it.checksum, it.parent)
                )
        self._write_back(evicted)
        return PutResult(it.key, "memory", False)

    def _written(self, item: WriteItem, stored: bool) -> None:
        """Called by the write-behind thread once ``item`` is durable (or failed)."""
        with self._lock:
            entry = self.memory.index.get(item.key)
            if entry is not None and (stored or self._on_disk(item.key)):
                entry.dirty = False
            self._pending.pop(item.key, None)
            callback = self._callbacks.pop(item.key, None)
        if not stored:
            self.stats_.count("writeback_failures")
        if callback is not None:
            durable = stored or self._on_disk(item.key)
            callback(PutResult(item.key, "disk" if durable else "memory", durable, stored=stored))

    def _write_back(self, evicted: list[tuple[str, MemoryEntry]]) -> None:
        """Write evicted dirty entries to disk (write-back mode); clean ones just go."""
        dirty = [(k, e) for k, e in evicted if e.dirty and k not in self._pending]
        if not dirty or self.disk is None:
            return
        try:
            self.disk.write(
                [
                    WriteItem(k, e.layout, memoryview(e.buffer), e.checksum, e.parent)
                    for k, e in dirty
                ],
                durable=True,
            )
        except CapacityError:
            self.stats_.count("writeback_dropped", len(dirty))

    # -- get ----------------------------------------------------------------------------

    def get(self, key: KeyLike, *, expect: Layout | None = None) -> Any:
        """The value (same kind as was put) or None on a miss, a layout mismatch or damage."""
        return self.batched_get([key], expect=expect)[0]

    def batched_get(self, keys: Sequence[KeyLike], *, expect: Layout | None = None) -> list[Any]:
        self._check_open()
        out: list[Any] = []
        for key in keys:
            text = self._key(key)
            layout = self._layout_of(text)
            if layout is None or not self._layout_ok(layout, expect):
                self.stats_.record("get", "", 0.0, 0, "miss")
                out.append(None)
                continue
            buffer = self._result_buffer(layout.nbytes)
            got = self._read(text, memoryview(buffer), expect)
            out.append(decode_value(got, buffer) if got is not None else None)
        return out

    def get_into(self, key: KeyLike, out: Any, *, expect: Layout | None = None) -> Layout | None:
        """Copy ``key``'s payload into the writable buffer ``out`` (exactly nbytes long)."""
        self._check_open()
        text = self._key(key)
        view = writable_bytes(out)
        layout = self._layout_of(text)
        if layout is None or not self._layout_ok(layout, expect) or layout.nbytes != len(view):
            self.stats_.record("get", "", 0.0, 0, "miss")
            return None
        return self._read(text, view, expect)

    def shared_location(
        self, key: KeyLike, *, expect: Layout | None = None
    ) -> SharedLocation | None:
        """Where a memory-tier value lies in :attr:`pool`, for a same-host reader to copy
        itself (:class:`~persisting.shm.SharedPoolReader`); None when it is not in
        memory, not in the pool, or laid out differently from ``expect``.

        Counts as a memory hit. No lease is taken: the reader checks the generation.
        """
        self._check_open()
        if self.pool is None:
            return None
        text = self._key(key)
        with self._lock:
            entry = self.memory.index.get(text, touch=True)
            if entry is None or not self._layout_ok(entry.layout, expect):
                return None
            found = self.pool.locate(entry.buffer)
        if found is None:
            return None
        self.stats_.record("get", "memory", 0.0, entry.layout.nbytes, "hit")
        return SharedLocation(entry.layout, found[0], found[1])

    def touch(self, keys: Sequence[KeyLike]) -> int:
        """Count reads that happened elsewhere: each key still in the memory tier becomes
        its most recently used and counts as a memory hit. Returns how many were there.

        Same-host readers that copy values out of :attr:`pool` by a remembered location
        report their hits this way, so eviction still sees what is being read.
        """
        self._check_open()
        texts = [self._key(key) for key in keys]
        sizes: list[int] = []
        with self._lock:
            for text in texts:
                entry = self.memory.index.get(text, touch=True)
                if entry is not None:
                    sizes.append(entry.layout.nbytes)
        for nbytes in sizes:
            self.stats_.record("get", "memory", 0.0, nbytes, "hit")
        return len(sizes)

    def _layout_ok(self, layout: Layout, expect: Layout | None) -> bool:
        if expect is None or layout.matches(expect):
            return True
        self.stats_.count("layout_mismatches")
        return False

    def _layout_of(self, text: str) -> Layout | None:
        with self._lock:
            entry = self.memory.index.get(text)
            if entry is not None:
                return entry.layout
            if self.disk is not None:
                disk_entry = self.disk.entry(text)
                if disk_entry is not None:
                    return disk_entry.layout
        return None

    def _read(self, text: str, view: memoryview, expect: Layout | None) -> Layout | None:
        start = time.perf_counter()
        with self._lock:
            entry = self.memory.index.get(text, touch=True)
            if entry is not None:
                entry.readers += 1
        if entry is not None:
            try:
                copy_bytes(np.frombuffer(view, dtype=np.uint8), entry.buffer)
            finally:
                with self._lock:
                    entry.readers -= 1
            self.stats_.record("get", "memory", time.perf_counter() - start, len(view), "hit")
            return entry.layout
        if self.disk is None:
            self.stats_.record("get", "", 0.0, 0, "miss")
            return None
        layout = self.disk.read_into(text, view)
        if layout is None:
            self.stats_.record("get", "disk", time.perf_counter() - start, 0, "miss")
            return None
        self.stats_.record("get", "disk", time.perf_counter() - start, len(view), "hit")
        return layout

    def layout(self, key: KeyLike) -> Layout | None:
        """The stored layout of ``key`` (no payload read), or None."""
        self._check_open()
        return self._layout_of(self._key(key))

    # -- lookups ------------------------------------------------------------------------

    def contains(self, key: KeyLike) -> bool:
        self._check_open()
        text = self._key(key)
        with self._lock:
            return text in self.memory.index or self._on_disk(text)

    def lookup_prefix(self, keys: Sequence[KeyLike] | Sequence[Sequence[KeyLike]]) -> int:
        """How many leading chunks are present; stops at the first miss.

        Given one key list per TP rank, a chunk counts only if every rank's piece is there.
        """
        self._check_open()
        if not keys:
            return 0
        per_rank = isinstance(keys[0], list | tuple)
        ranks: list[Sequence[KeyLike]] = list(keys) if per_rank else [keys]  # type: ignore[list-item]
        length = min(len(r) for r in ranks)
        hits = 0
        with self._lock:
            for i in range(length):
                if not all(self._present(r[i]) for r in ranks):
                    break
                hits += 1
        self.stats_.count("lookup_hit_chunks", hits)
        return hits

    def _present(self, key: KeyLike) -> bool:
        """Membership on the hot path: a stored string was validated when it was stored, so
        only a miss pays for parsing (which raises for a malformed key)."""
        text = key.to_string() if isinstance(key, ChunkKey) else key
        if isinstance(text, str) and (text in self.memory.index or self._on_disk(text)):
            return True
        self._key(key)
        return False

    def lookup_tokens(
        self, tokens: Sequence[int] | np.ndarray, hasher: TokenHasher | None = None
    ) -> int:
        """How many leading tokens are covered by stored chunks (hashed by Persisting)."""
        hasher = hasher or TokenHasher(self.model, chunk_size=self.chunk_size)
        chunks = hasher.process_tokens(tokens)
        n = self.lookup_prefix([key for _s, _e, key in chunks])
        hit_tokens = chunks[n - 1][1] if n else 0
        self.stats_.count("lookup_hit_tokens", hit_tokens)
        return hit_tokens

    def stored_keys(self) -> list[tuple[str, int]]:
        """Every stored key with its payload size: the disk tier's keys from the first to the
        last eviction candidate, then keys held in memory only."""
        self._check_open()
        with self._lock:
            out = [(k, e.layout.nbytes) for k, e in self.disk.index.items()] if self.disk else []
            on_disk = {k for k, _n in out}
            out += [(k, e.layout.nbytes) for k, e in self.memory.index.items() if k not in on_disk]
        return out

    def in_memory(self, key: KeyLike) -> bool:
        """Whether ``key`` is in the memory tier now (a hint: it may be evicted any time)."""
        self._check_open()
        text = self._key(key)
        with self._lock:
            return text in self.memory.index

    def exists_in_put_tasks(self, key: KeyLike) -> bool:
        return self._key(key) in self._pending

    # -- removal, pins, leases, prefetch -------------------------------------------------

    def remove(self, key: KeyLike, *, force: bool = True) -> bool:
        """Drop ``key`` from both tiers; with ``force=False`` a pinned key survives."""
        self._check_open()
        text = self._key(key)
        removed = False
        with self._lock:
            entry = self.memory.index.get(text)
            if entry is not None and (force or entry.pins == 0) and entry.readers == 0:
                self.memory.remove(text)
                removed = True
            elif entry is not None:
                return False
        if self.disk is not None:
            removed = self.disk.remove(text, force=force) or removed
        return removed

    def batched_remove(self, keys: Sequence[KeyLike], *, force: bool = True) -> int:
        return sum(self.remove(k, force=force) for k in keys)

    def pin(self, key: KeyLike) -> bool:
        """Protect ``key`` from eviction until a matching :meth:`unpin` (pins are counted)."""
        self._check_open()
        text = self._key(key)
        with self._lock:
            entry = self.memory.index.get(text)
            if entry is not None:
                entry.pins += 1
            on_disk = self.disk.pin(text) if self.disk is not None else False
            return entry is not None or on_disk

    def unpin(self, key: KeyLike) -> bool:
        self._check_open()
        text = self._key(key)
        with self._lock:
            entry = self.memory.index.get(text)
            done = False
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                done = True
            if self.disk is not None:
                done = self.disk.unpin(text) or done
            return done

    def lease(self, key: KeyLike, ttl_s: float) -> Location | None:
        """A read lease: ``key``'s file is not evicted for ``ttl_s`` s; where its bytes are."""
        self._check_open()
        text = self._key(key)
        return self.disk.lease(text, ttl_s) if self.disk is not None else None

    def release(self, key: KeyLike) -> None:
        if self.disk is not None:
            self.disk.release(self._key(key))

    def prefetch(self, keys: Sequence[KeyLike]) -> int:
        """Load disk hits into the memory tier; returns how many of ``keys`` are in memory."""
        self._check_open()
        in_memory = 0
        for key in keys:
            text = self._key(key)
            with self._lock:
                if text in self.memory.index:
                    in_memory += 1
                    continue
                entry = self.disk.entry(text) if self.disk is not None else None
            if entry is None or not self.memory.fits(entry.layout.nbytes):
                continue
            buffer = self._memory_buffer(entry.layout.nbytes)
            assert self.disk is not None
            layout = self.disk.read_into(text, memoryview(buffer))
            if layout is None:
                continue
            with self._lock:
                inserted, evicted = self.memory.insert(
                    text, layout, buffer, entry.checksum, entry.parent, dirty=False
                )
            self._write_back(evicted)
            in_memory += inserted or text in self.memory.index
        self.stats_.count("prefetched", in_memory)
        return in_memory

    # -- lifecycle ----------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every write-behind and commit pending metadata."""
        while True:
            with self._lock:
                futures = list(self._pending.values())
            if not futures:
                break
            for f in futures:
                f.result()
        if self.disk is not None:
            self.disk.meta.flush()
            self.disk.save_order()

    def refresh(self) -> int:
        """Pick up chunks other processes sharing this directory wrote or removed."""
        self._check_open()
        return self.disk.refresh() if self.disk is not None else 0

    def stats(self) -> dict[str, Any]:
        counters = self.stats_.snapshot()
        with self._lock:
            out: dict[str, Any] = {
                "model": self.model,
                "durability": self.durability,
                "memory_items": len(self.memory.index),
                "memory_bytes": self.memory.used,
                "memory_capacity": self.memory.capacity,
                "memory_evictions": self.memory.evictions,
                "pending_puts": len(self._pending),
            }
            if self.disk is not None:
                out.update(
                    disk_items=len(self.disk.index),
                    disk_bytes=self.disk.used_bytes(),
                    disk_capacity=self.disk.capacity,
                    disk_evictions=self.disk.evictions,
                    corruptions=self.disk.corruptions,
                    recovered_files=self.disk.recovered_files,
                )
        out.update(counters)
        return out

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (its files are closed; :meth:`stats` would fail)."""
        return self._closed

    def close(self) -> None:
        """Finish write-behind work, write back dirty memory (write-back mode), close files."""
        if self._closed:
            return
        self.flush()
        if self.durability == "write_back" and self.disk is not None:
            with self._lock:
                dirty = [(k, e) for k, e in self.memory.index.items() if e.dirty]
            self._write_back(dirty)
        if self._writer is not None:
            self._writer.close()
        self._closed = True
        if self.disk is not None:
            self.disk.close()
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async variants -----------------------------------------------------------------

    async def aput(self, key: KeyLike, value: Any, **kw: Any) -> PutResult:
        return await asyncio.to_thread(self.put, key, value, **kw)

    async def abatched_put(
        self, keys: Sequence[KeyLike], values: Sequence[Any], **kw: Any
    ) -> list[PutResult]:
        return await asyncio.to_thread(self.batched_put, keys, values, **kw)

    async def aget(self, key: KeyLike, **kw: Any) -> Any:
        return await asyncio.to_thread(self.get, key, **kw)

    async def abatched_get(self, keys: Sequence[KeyLike], **kw: Any) -> list[Any]:
        return await asyncio.to_thread(self.batched_get, keys, **kw)

    async def acontains(self, key: KeyLike) -> bool:
        return await asyncio.to_thread(self.contains, key)

    async def alookup_prefix(self, keys: Sequence[Any]) -> int:
        return await asyncio.to_thread(self.lookup_prefix, keys)

    async def aremove(self, key: KeyLike, **kw: Any) -> bool:
        return await asyncio.to_thread(self.remove, key, **kw)

    async def aprefetch(self, keys: Sequence[KeyLike]) -> int:
        return await asyncio.to_thread(self.prefetch, keys)


def open_kv_store(
    storage_path: str | Path,
    model: str,
    *,
    memory_bytes: int | None = None,
    disk_bytes: int | None = None,
    durability: Durability | None = None,
    settings: PersistingSettings | None = None,
    **options: Any,
) -> KVStore:
    """Open (or create) the KV namespace of ``model`` under ``storage_path``.

    Unspecified options come from ``settings`` (or ``PersistingSettings()``: env/TOML).
    """
    settings = settings or PersistingSettings()
    overrides: dict[str, Any] = dict(options)
    if memory_bytes is not None:
        overrides["memory_bytes"] = memory_bytes
    if disk_bytes is not None:
        overrides["disk_bytes"] = disk_bytes
    if durability is not None:
        overrides["durability"] = durability
    settings = settings.model_copy(update={"storage_path": Path(storage_path)})
    return KVStore.from_settings(settings, model, **overrides)


__all__ = ["Durability", "KVStore", "PutResult", "SharedLocation", "Tier", "open_kv_store"]
