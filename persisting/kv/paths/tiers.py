"""One store's tiers: what the put and read paths share, and the operations over both tiers.

:class:`Tiers` holds the memory tier, the optional disk tier and shared pool, the one lock
that orders every change to the tiers' indexes, and the operation statistics. The put
paths (:mod:`persisting.kv.paths.puts`) and the read paths
(:mod:`persisting.kv.paths.reads`) work on it, and so do the queries and changes that span
both tiers (membership, pins, the key listing, the figures of ``stats()``);
:class:`~persisting.kv.store.KVStore` is the facade that composes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from persisting.cuda.host import StoreHostMemory
from persisting.errors import InvalidKeyError
from persisting.kv.budget.root import RootUsage
from persisting.kv.disk.leases import Clock
from persisting.kv.disk.tier import DiskTier, EvictionListener, Location
from persisting.kv.eviction.policy import EvictionPolicy
from persisting.kv.index import DiskEntry, LruIndex, MemoryEntry
from persisting.kv.keys import ChunkKey, key_string
from persisting.kv.lock_order import Rank, ordered
from persisting.kv.memory_tier import MemoryTier
from persisting.kv.namespace.record import write_record
from persisting.kv.paths.load_plan import TierBandwidth
from persisting.kv.stats import StoreStats
from persisting.lance_store import StorageRoot
from persisting.lance_store.namespace_lock import NamespaceHold
from persisting.shm import RecycledBuffers, SharedPool, aligned_buffer, seqlock_safe

KeyLike = ChunkKey | str


@dataclass(frozen=True, slots=True)
class Indexes:
    """Both tiers' indexes, read while :meth:`Tiers.indexes` holds their locks."""

    memory: LruIndex[MemoryEntry]
    disk: LruIndex[DiskEntry] | None

    def __contains__(self, key: str) -> bool:
        return key in self.memory or (self.disk is not None and key in self.disk)


@dataclass(frozen=True, slots=True)
class PoolFile:
    """Where same-host readers map a store's shared memory pool: its file and byte size
    (offsets of :class:`~persisting.kv.paths.reads.SharedLocation` are into it)."""

    path: Path
    size: int


def _open_pool(memory_bytes: int) -> SharedPool | None:
    """A shared pool for the memory tier, where this host allows one (else None)."""
    if memory_bytes <= 0 or not seqlock_safe():
        return None
    try:
        return SharedPool(memory_bytes)
    except OSError:  # no /dev/shm, or no room for the pool's header
        return None


class Tiers:
    """One model's tiers and the lock and counters their users share."""

    def __init__(
        self,
        model: str,
        memory: MemoryTier,
        disk: DiskTier | None,
        pool: SharedPool | None,
        op_stats: StoreStats,
        host: StoreHostMemory,
        arena: RecycledBuffers | None = None,
        namespace: NamespaceHold | None = None,
        clock: Clock = time.monotonic,
    ):
        self.model = model
        #: The monotonic clock leases and the write-behind's lag are timed by.
        self.clock = clock
        self.memory = memory
        self.disk = disk
        self.pool = pool
        self.op_stats = op_stats
        #: Pinned memory and device copiers (plain memory on hosts without CUDA).
        self.host = host
        #: Private memory-tier buffers whose pages are reused (and huge where the kernel
        #: allows) when neither the shared pool nor pinned memory holds the tier.
        self.arena = arena
        #: The hold on the model's namespace while a disk tier is open (None without one).
        self._namespace = namespace
        #: Read bandwidth each tier achieved (load-or-recompute plans use it).
        self.bandwidth = TierBandwidth()
        #: Guards the memory tier's index and entries, and makes a step over both tiers
        #: one (a put's presence check and insert, a lookup of both); never held across
        #: disk I/O or big copies. The disk tier's index has its own lock, which its every
        #: reader and writer takes: under this one when both are held (lock order,
        #: persisting.kv.lock_order: after the directory's file locks, before the disk
        #: tier's lock).
        self.lock = ordered(Rank.TIERS, threading.RLock())

    @classmethod
    def open(
        cls,
        root: StorageRoot,
        model: str,
        *,
        memory_bytes: int,
        disk_bytes: int,
        policy: EvictionPolicy,
        op_stats: StoreStats,
        on_disk_evict: EvictionListener | None = None,
        shared_memory: bool = False,
        pinned_memory: str = "auto",
        pinned_staging_bytes: int = 0,
        describe: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        clock: Clock = time.monotonic,
        direct_io: bool = False,
    ) -> Tiers:
        """The tiers of ``model`` under ``root``: a memory tier of ``memory_bytes`` (in a
        shared pool with ``shared_memory``, else pinned memory or a private arena) and, with
        ``disk_bytes``, a disk tier, whose namespace is held until :meth:`close` and whose
        record (:mod:`~persisting.kv.namespace.record`) says ``describe``. The namespace
        is ``model``'s own unless ``namespace`` names another directory (one per weights
        version of a model, see :func:`~persisting.kv.namespace.identity.weights_namespace`).
        ``direct_io``: payloads move with O_DIRECT where they can
        (:mod:`~persisting.kv.disk.direct_io`)."""
        directory = namespace or model
        held: NamespaceHold | None = None
        disk: DiskTier | None = None
        pool: SharedPool | None = None
        try:
            if disk_bytes > 0:
                held = root.hold_model(directory)
                write_record(root.kv_path(directory), model, disk_bytes, describe, root.modes)
                disk = DiskTier(
                    root.kv_path(directory),
                    disk_bytes,
                    policy,
                    on_disk_evict,
                    root.modes,
                    keys=root.kv_keys(),
                    root_usage=RootUsage(root, directory),
                    clock=clock,
                )
                disk.files.direct = direct_io  # O_DIRECT payloads (persisting.kv.disk.direct_io)
            pool = _open_pool(memory_bytes) if shared_memory else None
            host = StoreHostMemory(
                mode=pinned_memory,
                memory_bytes=memory_bytes,
                staging_bytes=pinned_staging_bytes,
                pool=pool,
            )
        except BaseException:
            _release(disk, held, pool)
            raise
        # Private memory-tier buffers (used when no shared pool or pinned region holds it).
        # Twice the budget in address space: a put copies its value before it evicts, and
        # write-behinds and readers hold evicted buffers a while, so a full tier still
        # takes recycled pages; only what is touched is resident.
        arena = RecycledBuffers(2 * memory_bytes) if memory_bytes > 0 else None
        memory = MemoryTier(memory_bytes, policy)
        return cls(model, memory, disk, pool, op_stats, host, arena, held, clock)

    def key_text(self, key: KeyLike) -> str:
        """``key`` as a string, after checking that it belongs to this store's model."""
        text = key_string(key)
        model = key.model if isinstance(key, ChunkKey) else text.split("@", 1)[0]
        if model != self.model:
            raise InvalidKeyError(f"key {text!r} belongs to model {model!r}, not {self.model!r}")
        return text

    def on_disk(self, key: str) -> bool:
        return self.disk is not None and key in self.disk

    @contextmanager
    def indexes(self) -> Iterator[Indexes]:
        """Both tiers' indexes under one hold of each lock (``lock``, then the disk tier's),
        for a lookup of many keys; to read inside the block only."""
        with self.lock:
            if self.disk is None:
                yield Indexes(self.memory.index, None)
                return
            with self.disk.holding() as disk:
                yield Indexes(self.memory.index, disk)

    # -- queries over both tiers ------------------------------------------------------

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored in either tier, under one hold of the locks."""
        with self.indexes() as held:
            return [key in held for key in keys]

    def in_memory(self, key: str) -> bool:
        with self.lock:
            return key in self.memory

    def stored_keys(self) -> list[tuple[str, int]]:
        """Every stored key with its payload size: the disk tier's from the first to the
        last eviction candidate, then those held in memory only."""
        with self.lock:
            out = self.disk.sizes() if self.disk is not None else []
            on_disk = {key for key, _n in out}
            out += [(key, n) for key, n in self.memory.sizes() if key not in on_disk]
        return out

    def figures(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The memory tier's figures and the disk tier's (empty without one), read
        together under the lock."""
        with self.lock:
            memory = self.memory.figures()
            disk = self.disk.figures() if self.disk is not None else {}
        return memory, disk

    @property
    def pinned(self) -> bool:
        """Whether the memory tier lives in page-locked memory."""
        return self.host.pinned

    @property
    def pool_file(self) -> PoolFile | None:
        return PoolFile(self.pool.path, self.pool.size) if self.pool is not None else None

    # -- pins and leases --------------------------------------------------------------

    def pin(self, key: str) -> bool:
        """Pin ``key`` in each tier holding it; True if one did."""
        with self.lock:
            in_memory = self.memory.pin(key)
            on_disk = self.disk.pin(key) if self.disk is not None else False
            return in_memory or on_disk

    def unpin(self, key: str) -> bool:
        with self.lock:
            in_memory = self.memory.unpin(key)
            on_disk = self.disk.unpin(key) if self.disk is not None else False
            return in_memory or on_disk

    def lease(self, key: str, ttl_s: float) -> Location | None:
        return self.disk.lease(key, ttl_s) if self.disk is not None else None

    def renew(self, key: str, token: int, ttl_s: float) -> bool:
        if self.disk is None:
            return False
        with self.disk.holding():
            return self.disk.leases.renew(key, token, ttl_s)

    def release(self, key: str, token: int) -> bool:
        if self.disk is None:
            return False
        with self.disk.holding():
            return self.disk.leases.release(key, token)

    # -- the disk tier's upkeep ---------------------------------------------------------

    def flush(self) -> None:
        """Commit the disk tier's pending metadata (a no-op without one)."""
        if self.disk is not None:
            self.disk.flush()

    def refresh(self) -> int:
        return self.disk.refresh() if self.disk is not None else 0

    def disk_used_bytes(self) -> int:
        return self.disk.used_bytes() if self.disk is not None else 0

    # -- memory ------------------------------------------------------------------------

    def memory_buffer(self, nbytes: int) -> np.ndarray:
        """Room for a memory-tier value: in the shared pool while it has room, else in the
        pinned region (where CUDA is), else in the private arena, else fresh pageable
        memory.

        The arena matters most: a fresh array faults a zeroed page per 4 KiB on first
        touch (costing more than the copy itself), the arena's pages are faulted 2 MiB at
        a time once and then reused by later values.
        """
        if self.pool is not None:
            buffer = self.pool.allocate(nbytes)
            if buffer is not None:
                return buffer
            self.op_stats.count("pool_full")
        elif self.host.pin:
            buffer = self.host.memory_buffer(nbytes)
            if buffer is not None:
                return buffer
            self.op_stats.count("pinned_full")
        if self.arena is not None:
            buffer = self.arena.take(nbytes)
            if buffer is not None:
                return buffer
            self.op_stats.count("arena_full")
        return aligned_buffer(nbytes)

    def prefault_memory(self) -> bool:
        """Start faulting the memory tier's pages in: the shared pool's (committed and
        mapped) or the private arena's (see ``KVStore.prefault_memory``); False when the
        tier lives in pinned memory, or there is none."""
        target = None if self.host.pinned else self._prefaulting()
        return target is not None and target.start_prefault(self.memory.capacity) is not None

    def _prefaulting(self) -> SharedPool | RecycledBuffers | None:
        """Where a prefault of the memory tier runs: the pool when there is one."""
        return self.pool if self.pool is not None else self.arena

    def prefaulted_bytes(self, *, wait: bool = False) -> int:
        """Bytes of the memory tier's pages faulted in so far (0 without a pool or an
        arena); with ``wait``, once its prefault finished."""
        target = self._prefaulting()
        if target is None:
            return 0
        if wait:
            target.wait_prefault()
        return target.prefaulted

    def stop_prefault(self) -> None:
        target = self._prefaulting()
        if target is not None:
            target.stop_prefault()

    def close(self) -> None:
        """Close the tiers' memory and files and let go of the namespace (the caller has
        finished every write)."""
        self.host.close()  # copies done and pages unlocked before the pool goes
        _release(self.disk, self._namespace, self.pool)


def _release(
    disk: DiskTier | None, namespace: NamespaceHold | None, pool: SharedPool | None
) -> None:
    if disk is not None:
        disk.close()
    if namespace is not None:
        namespace.release()
    if pool is not None:
        pool.close()


__all__ = ["Indexes", "KeyLike", "PoolFile", "Tiers"]
