"""KVStore: the facade over a model's memory and disk tiers, with LMCache-like semantics.

The store checks it is open, turns keys into their text and composes the modules that do
the work: :mod:`~persisting.kv.paths.tiers` (the tiers, their lock, and what spans both:
membership, pins, leases, figures), :mod:`~persisting.kv.paths.puts` (puts in each completion
mode, and removal, which cancels them), :mod:`~persisting.kv.paths.reads` (gets) and
:mod:`~persisting.kv.paths.lookups` (prefix and token lookups, load plans). The order of the
locks underneath is written in :mod:`~persisting.kv.lock_order`.

Content-addressed keys never change value: putting an existing key is a no-op success.

Over 500 lines on purpose: this is the public surface (every method with the docstring a
user reads); each body is a few lines delegating to the modules above.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from persisting.config import DEFAULT_EVICTION, KVSettings, PersistingSettings, size_bytes
from persisting.cuda import DEFAULT_STAGING_BYTES
from persisting.errors import StoreClosedError
from persisting.kv import at_exit
from persisting.kv.api import KVApi, in_thread
from persisting.kv.disk.leases import Clock
from persisting.kv.disk.tier import EvictionListener, Location
from persisting.kv.disk.write_behind import LAG_S, MAX_BYTES, Bounds
from persisting.kv.eviction.policy import (
    AdmissionPolicy,
    EvictionPolicy,
    admission_policy,
    eviction_policy,
)
from persisting.kv.keys import HashScheme, TokenHasher
from persisting.kv.keys import key_dtype as key_dtype_name
from persisting.kv.layout import Layout
from persisting.kv.options import SETTINGS_OPTIONS, check_options
from persisting.kv.paths.load_plan import LoadPlan, TierBandwidth
from persisting.kv.paths.lookups import Lookups
from persisting.kv.paths.puts import Durability, OnComplete, PutResult, Tier, Writes
from persisting.kv.paths.reads import MemoryPayload, Reads, SharedLocation
from persisting.kv.paths.tiers import KeyLike, PoolFile, Tiers
from persisting.kv.stats import StoreStats
from persisting.lance_store import StorageRoot
from persisting.shm import RecycledBuffers


class KVStore(KVApi):
    """A model namespace's KV chunks: memory tier over a Lance-indexed disk tier.

    Thread-safe. Use :func:`open_kv_store` to make one; close it (or use ``with``). While
    it is open (with a disk tier) it holds its namespace: ``StorageRoot.drop_model`` of
    its model refuses with :class:`~persisting.errors.NamespaceInUseError`.

    Options (``open_kv_store`` takes the same keywords; those left out come from the
    ``kv`` settings): what each means is in :mod:`persisting.kv.options`.
    """

    def __init__(
        self,
        storage_path: str | Path,
        model: str,
        *,
        memory_bytes: int | str,
        disk_bytes: int | str,
        durability: Durability = "sync",
        eviction: str | EvictionPolicy = DEFAULT_EVICTION,
        admission: str | AdmissionPolicy = "always",
        max_value_bytes: int | str | None = None,
        chunk_size: int = 256,
        hash_scheme: HashScheme = "persisting",
        key_dtype: Any = "bfloat16",
        shared_memory: bool = False,
        result_buffer_bytes: int | str = 256 << 20,
        storage_access: str = "owner",
        fsync: bool = True,
        on_disk_evict: EvictionListener | None = None,
        read_threads: int = 8,
        pinned_memory: str = "auto",
        pinned_staging_bytes: int | str = DEFAULT_STAGING_BYTES,
        describe: Mapping[str, Any] | None = None,
        namespace: str | None = None,
        write_behind_lag_s: float = LAG_S,
        write_behind_bytes: int | str = MAX_BYTES,
        clock: Clock = time.monotonic,
        direct_io: bool = False,
    ):
        memory = size_bytes(memory_bytes, "memory_bytes")
        disk = size_bytes(disk_bytes, "disk_bytes")
        results_bytes = size_bytes(result_buffer_bytes, "result_buffer_bytes")
        staging_bytes = size_bytes(pinned_staging_bytes, "pinned_staging_bytes")
        behind = Bounds(write_behind_lag_s, size_bytes(write_behind_bytes, "write_behind_bytes"))
        largest = size_bytes(max_value_bytes, "max_value_bytes") if max_value_bytes else 0
        check_options(model, durability, memory, disk, read_threads, hash_scheme)
        self.model = model
        self.durability: Durability = durability
        self.chunk_size = chunk_size
        #: How :meth:`lookup_tokens` hashes token ids when no hasher is given.
        self.hash_scheme: HashScheme = hash_scheme
        self.max_value_bytes = largest or max(memory, disk)
        self.root = StorageRoot(storage_path, storage_access)
        #: The directory under ``<root>/kv/`` holding this store's chunks.
        self.namespace = namespace or model
        self.directory = self.root.kv_path(self.namespace)
        policy = eviction_policy(eviction)
        self.admission = admission_policy(admission)
        #: Counters and per-operation timings; metrics exporters add listeners here.
        self.op_stats = StoreStats()
        self._tiers = Tiers.open(
            self.root,
            model,
            memory_bytes=memory,
            disk_bytes=disk,
            policy=policy,
            op_stats=self.op_stats,
            on_disk_evict=on_disk_evict,
            shared_memory=shared_memory,
            pinned_memory=pinned_memory,
            pinned_staging_bytes=staging_bytes,
            describe=describe,
            namespace=namespace,
            clock=clock,
            direct_io=direct_io,
        )
        self._writes = Writes(
            self._tiers, durability, self.admission, self.max_value_bytes, fsync, behind
        )
        # Result pages without huge pages: a kept result's range is touched once, on the
        # get's path, where fresh huge pages cost more than 4 KiB ones in VMs that give
        # free memory back (persisting.shm.aligned_buffer); recycled ranges cost nothing.
        results = RecycledBuffers(results_bytes, huge_pages=False) if results_bytes > 0 else None
        self._reads = Reads(self._tiers, results, self._writes, read_threads)
        self._lookups = Lookups(self._tiers, chunk_size, hash_scheme, key_dtype_name(key_dtype))
        self._closed = False
        at_exit.track(self, at_exit.STORE)  # closed at interpreter exit if still open

    @classmethod
    def from_settings(cls, settings: PersistingSettings, model: str, **overrides: Any) -> KVStore:
        """A store of ``model`` with the options ``settings`` give (those of its ``kv``
        section named in :data:`~persisting.kv.options.SETTINGS_OPTIONS`, and the root's
        ``storage_access``); ``overrides`` win."""
        kv: KVSettings = settings.kv
        options: dict[str, Any] = {name: getattr(kv, name) for name in SETTINGS_OPTIONS}
        options["storage_access"] = settings.storage_access
        options.update(overrides)
        return cls(settings.storage_path, model, **options)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"KV store for {self.model!r} is closed")

    def _key(self, key: KeyLike) -> str:
        return self._tiers.key_text(key)

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
        """Store one value; :mod:`persisting.kv.paths.puts` says what completion means."""
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
        validated before anything is stored: its format's shape rule, and its dtype against
        its key's (a float32 tensor under a ``...@bfloat16`` key is an InvalidValueError;
        ``binary`` values are exempt). A :class:`~persisting.kv.layout.Gathered` value
        (``fmt="binary"``) is stored from its parts, end to end, without joining them first
        (read back as one ``bytes`` value, or into one buffer or several by place through
        :meth:`lease`). ``check_shape=False`` skips both (for layouts
        another system defines, such as LMCache's MemoryObjs and the L2 adapter's opaque
        object keys).
        ``on_complete`` gets each key's final result once; one that raises is logged and
        counted (``on_complete_errors``), never propagated.
        """
        self._check_open()
        return self._writes.batched_put(
            keys,
            values,
            fmt=fmt,
            parents=parents,
            chain=chain,
            on_complete=on_complete,
            check_shape=check_shape,
        )

    # -- get ----------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> np.ndarray:
        """A page-aligned buffer of the memory tier's own kind (its shared pool while it has
        room), for a value's bytes to land in before :meth:`batched_put_owned` keeps it."""
        self._check_open()
        return self._tiers.memory_buffer(nbytes)

    def batched_put_owned(
        self,
        keys: Sequence[KeyLike],
        buffers: Sequence[np.ndarray],
        layouts: Sequence[Layout],
        checksums: Sequence[int],
        parents: Sequence[KeyLike | None] | None = None,
    ) -> list[PutResult]:
        """:meth:`batched_put` of values that already lie in buffers from :meth:`allocate`,
        with their checksums (computed as their bytes arrived): the memory tier keeps the
        buffers instead of copying them. The caller must not write them afterwards. Each
        layout is checked against its buffer (dtype, format, size) as a put checks a value."""
        self._check_open()
        return self._writes.batched_put_owned(
            keys, buffers, layouts, checksums, parents or [None] * len(keys)
        )

    def get(self, key: KeyLike, *, expect: Layout | None = None, device: Any = None) -> Any:
        """The value (same kind as was put) or None on a miss, a layout mismatch or damage;
        with ``device`` (``"cuda:0"``...) a tensor on that device."""
        return self.batched_get([key], expect=expect, device=device)[0]

    def batched_get(
        self, keys: Sequence[KeyLike], *, expect: Layout | None = None, device: Any = None
    ) -> list[Any]:
        """One value (or None) per key. Disk hits are read ``read_threads`` at a time.

        ``device`` other than the CPU returns torch tensors on that device: memory hits go
        up in one asynchronous copy each from (pinned) host memory, disk hits through the
        pinned staging ring. The copies are ordered before the work the caller queues next
        on its current stream (no host-side wait).
        """
        self._check_open()
        return self._reads.batched_get(keys, expect, device)

    def get_into(self, key: KeyLike, out: Any, *, expect: Layout | None = None) -> Layout | None:
        """Copy ``key``'s payload into ``out``: a writable host buffer or CPU tensor, or a
        tensor on a device, of exactly the value's byte size (another size is an
        InvalidValueError, ``out`` untouched). Returns the layout read, or None on a miss, a
        layout mismatch, or damage (a device ``out`` is then left untouched; a host one may
        hold part of a damaged read, never reported as a hit)."""
        self._check_open()
        return self._reads.get_into(key, out, expect)

    def batched_get_into(
        self, keys: Sequence[KeyLike], outs: Sequence[Any], *, expect: Layout | None = None
    ) -> list[Layout | None]:
        """:meth:`get_into` for a batch (host and device destinations may be mixed): every
        destination is checked before anything is read, disk hits are read ``read_threads``
        at a time, device destinations are filled as in :meth:`batched_get`."""
        self._check_open()
        return self._reads.batched_get_into(keys, outs, expect)

    def shared_location(
        self, key: KeyLike, *, expect: Layout | None = None, count: bool = True
    ) -> SharedLocation | None:
        """Where a memory-tier value lies in :attr:`shared_pool`, for a same-host reader to copy
        itself (:class:`~persisting.shm.SharedPoolReader`); None when it is not in
        memory, not in the pool, or laid out differently from ``expect``.

        Counts as a memory hit (the value becomes the most recently used) unless ``count``
        is False: a location told ahead of any read (after a put, for a lookup) is not a
        read; the reader reports its reads later with :meth:`touch`. No lease is taken:
        the reader checks the generation.
        """
        self._check_open()
        return self._reads.shared_location(key, expect, count)

    def memory_payload(self, key: KeyLike, *, expect: Layout | None = None) -> MemoryPayload | None:
        """A memory-tier value's own buffer and stored checksum, for a server to send from
        without copying (see :class:`~persisting.kv.paths.reads.MemoryPayload`); None when it is
        not in memory or is laid out differently from ``expect``. Counts a memory hit."""
        self._check_open()
        return self._reads.memory_payload(key, expect)

    def touch(self, keys: Sequence[KeyLike]) -> int:
        """Count reads that happened elsewhere: each key still in the memory tier becomes
        its most recently used and counts as a memory hit. Returns how many were there.

        Same-host readers that copy values out of :attr:`shared_pool` by a remembered location
        report their hits this way, so eviction still sees what is being read.
        """
        self._check_open()
        return self._reads.touch(keys)

    def layout(self, key: KeyLike) -> Layout | None:
        """The stored layout of ``key`` (no payload read), or None."""
        self._check_open()
        return self._reads.layout_of(self._key(key))

    def prefetch(self, keys: Sequence[KeyLike]) -> int:
        """Load disk hits into the memory tier; returns how many of ``keys`` are in memory."""
        self._check_open()
        return self._reads.prefetch(keys)

    # -- lookups ------------------------------------------------------------------------

    def contains(self, key: KeyLike) -> bool:
        self._check_open()
        return self._lookups.contains(key)

    def lookup_prefix(self, keys: Sequence[KeyLike] | Sequence[Sequence[KeyLike]]) -> int:
        """How many leading chunks are present; stops at the first miss.

        Given one key list per TP rank, a chunk counts only if every rank's piece is there.
        """
        self._check_open()
        return self._lookups.lookup_prefix(keys)

    @property
    def key_dtype(self) -> str:
        """The key dtype token lookups hash with by default (LMCache's spelling): the
        ``kv.key_dtype`` setting, or the dtype :func:`persisting.integrations.transformers.
        save_prefix` last saved a cache of into this store. Settable with any spelling
        (``"float32"``, ``torch.float16``)."""
        return self._lookups.key_dtype

    @key_dtype.setter
    def key_dtype(self, dtype: Any) -> None:
        self._lookups.key_dtype = key_dtype_name(dtype)

    def token_hasher(self, dtype: Any = None) -> TokenHasher:
        """The hasher token lookups use by default: this store's chunk size, scheme and
        :attr:`key_dtype` (or ``dtype``)."""
        return self._lookups.default_hasher(dtype)

    def lookup_tokens(
        self,
        tokens: Sequence[int] | np.ndarray,
        hasher: TokenHasher | None = None,
        *,
        dtype: Any = None,
    ) -> int:
        """How many leading tokens are covered by stored chunks (hashed by ``hasher``, by
        default with the store's chunk size, :attr:`hash_scheme` and :attr:`key_dtype`,
        or ``dtype``: the model's KV dtype, e.g. ``torch.float32``).

        How many of them are worth loading rather than recomputing is
        :meth:`plan_tokens`'s ``load_tokens``. Tokens must be integers that fit 64 bits
        (else InvalidValueError).
        """
        self._check_open()
        if hasher is None and dtype is not None:
            hasher = self.token_hasher(dtype)
        return self._lookups.lookup_tokens(tokens, hasher)

    def plan_tokens(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        recompute_tokens_per_s: float,
        hasher: TokenHasher | None = None,
        min_saving_s: float = 0.0,
        dtype: Any = None,
    ) -> LoadPlan:
        """Load or recompute: of the stored prefix of ``tokens`` (hashed as for
        :meth:`lookup_tokens`), the leading part worth loading at a prefill rate of
        ``recompute_tokens_per_s``.

        Each hit chunk costs its bytes over the read bandwidth its tier achieved lately
        (:attr:`bandwidth`; a tier never read yet counts as free) and saves its tokens'
        prefill; the plan loads the prefix that saves the most (see
        :mod:`persisting.kv.paths.load_plan`). A disk hit slower than recomputing is not loaded
        unless faster chunks after it pay for it. Counts ``load_plan_load_tokens`` and
        ``load_plan_recompute_tokens`` (and ``_chunks``) in :attr:`op_stats`.
        """
        self._check_open()
        if hasher is None and dtype is not None:
            hasher = self.token_hasher(dtype)
        return self._lookups.plan_tokens(tokens, recompute_tokens_per_s, hasher, min_saving_s)

    @property
    def bandwidth(self) -> TierBandwidth:
        """The read bandwidth each tier achieved on this store's gets (a moving average)."""
        return self._tiers.bandwidth

    def stored_keys(self) -> list[tuple[str, int]]:
        """Every stored key with its payload size: the disk tier's keys from the first to the
        last eviction candidate, then keys held in memory only."""
        self._check_open()
        return self._tiers.stored_keys()

    def in_memory(self, key: KeyLike) -> bool:
        """Whether ``key`` is in the memory tier now (a hint: it may be evicted any time)."""
        self._check_open()
        return self._tiers.in_memory(self._key(key))

    def batched_contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        """:meth:`contains` for a batch, under one hold of the store's lock."""
        self._check_open()
        return self._tiers.contains([self._key(key) for key in keys])

    def exists_in_put_tasks(self, key: KeyLike) -> bool:
        """True while ``key`` was put but is not yet on disk: a write-behind in progress
        (``async``), or a dirty memory entry not yet written back (``write_back``)."""
        return self._writes.in_put_tasks(self._key(key))

    # -- removal, pins, leases ----------------------------------------------------------

    def remove(self, key: KeyLike, *, force: bool = True) -> bool:
        """Drop ``key`` from both tiers; with ``force=False`` a pinned key survives.

        A remove wins over a write of ``key`` still in progress: that write is cancelled
        (its ``on_complete`` is told ``stored=False``) and the key stays absent, also on disk
        and after a reopen.
        """
        self._check_open()
        return self._writes.remove(self._key(key), force=force)

    def batched_remove(self, keys: Sequence[KeyLike], *, force: bool = True) -> int:
        return sum(self.remove(k, force=force) for k in keys)

    def pin(self, key: KeyLike) -> bool:
        """Protect ``key`` from eviction until a matching :meth:`unpin` (pins are counted)."""
        self._check_open()
        return self._tiers.pin(self._key(key))

    def unpin(self, key: KeyLike) -> bool:
        self._check_open()
        return self._tiers.unpin(self._key(key))

    def lease(self, key: KeyLike, ttl_s: float) -> Location | None:
        """A read lease: ``key``'s file is not evicted for ``ttl_s`` s (none if ``<= 0``);
        where its bytes are, and the ``token`` only :meth:`release` of it ends."""
        self._check_open()
        return self._tiers.lease(self._key(key), ttl_s)

    def renew(self, key: KeyLike, token: int, ttl_s: float) -> bool:
        """Extend lease ``token`` of ``key`` to ``ttl_s`` s from now; False if not held."""
        return self._tiers.renew(self._key(key), token, ttl_s)

    def release(self, key: KeyLike, token: int) -> bool:
        """End lease ``token`` of ``key`` alone (another holder's stays); False if not held."""
        return self._tiers.release(self._key(key), token)

    # -- lifecycle ----------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every write-behind and commit pending metadata.

        Never hangs: a write that fails completes (its ``on_complete`` says so, and
        ``stats()`` counts it) rather than raising here. A no-op once closed.
        """
        if self._closed:
            return
        self._writes.drain()
        self._tiers.flush()

    def refresh(self) -> int:
        """Pick up chunks other processes sharing this directory wrote or removed."""
        self._check_open()
        return self._tiers.refresh()

    def stats(self) -> dict[str, Any]:
        """Counters and tier figures. ``disk_bytes`` is everything the model directory
        holds (payload files plus ``disk_overhead_bytes`` of metadata and directories)."""
        self._check_open()
        counters = self.op_stats.snapshot()
        memory, disk = self._tiers.figures()
        out: dict[str, Any] = {
            "model": self.model,
            "durability": self.durability,
            **memory,
            "memory_prefaulted": self._tiers.prefaulted_bytes(),
            **self._writes.figures(),
            **disk,
            "read_threads": self._reads.read_threads,
            "pinned": self._tiers.pinned,
        }
        rates = self._tiers.bandwidth.snapshot()
        for tier in ("memory", "disk") if disk else ("memory",):
            out[f"read_bandwidth_{tier}"] = int(rates.get(tier, 0))  # 0: not read yet
        out.update(counters)
        return out

    @property
    def has_disk_tier(self) -> bool:
        """Whether the store persists (it was opened with a disk budget)."""
        return self._tiers.disk is not None

    def disk_used_bytes(self) -> int:
        """What the model directory holds now, as counted against the disk budget (all
        processes sharing it; payload files plus metadata and directories): ``stats()``'s
        ``disk_bytes`` without the rest of the figures. 0 without a disk tier."""
        self._check_open()
        return self._tiers.disk_used_bytes()

    @property
    def shared_pool(self) -> PoolFile | None:
        """The shared pool file same-host readers map (``shared_memory=True``; None when
        the host allows none): :meth:`shared_location` gives offsets into it."""
        return self._tiers.pool_file

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (its files are closed; :meth:`stats` raises)."""
        return self._closed

    def prefault_memory(self) -> bool:
        """Fault the memory tier's pages in now, on a background thread, so puts copy into
        mapped memory instead of paying a page fault per page: the private arena's (see
        :meth:`~persisting.shm.RecycledBuffers.start_prefault`) or, for a store that
        serves same-host readers, the shared pool's (committed and mapped,
        :meth:`~persisting.shm.SharedPool.start_prefault`).

        Resident memory grows to ``memory_bytes`` at once (the arena's headroom above it
        is faulted only if used). False (nothing done) when the tier lives in pinned
        memory (committed its own way), or there is no memory tier.
        """
        self._check_open()
        return self._tiers.prefault_memory()

    def prefaulted_bytes(self, *, wait: bool = False) -> int:
        """Bytes of the memory tier's pages :meth:`prefault_memory` faulted in so far (0
        when there is nothing to fault); with ``wait``, once it finished."""
        return self._tiers.prefaulted_bytes(wait=wait)

    def close(self) -> None:
        """Finish write-behind work, write back dirty memory (write-back mode), close files
        and let go of the namespace. A store still open when the interpreter exits is
        closed then (:mod:`persisting.kv.at_exit`)."""
        if self._closed:
            return
        at_exit.untrack(self, at_exit.STORE)
        self._tiers.stop_prefault()
        try:
            self._writes.close()
        finally:
            self._closed = True
            self._reads.close()
            self._tiers.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- async mirror: each method of the contract, run in a worker thread ---------------

    aput = in_thread(put)
    abatched_put = in_thread(batched_put)
    aget = in_thread(get)
    abatched_get = in_thread(batched_get)
    aget_into = in_thread(get_into)
    alayout = in_thread(layout)
    acontains = in_thread(contains)
    abatched_contains = in_thread(batched_contains)
    alookup_prefix = in_thread(lookup_prefix)
    alookup_tokens = in_thread(lookup_tokens)
    aremove = in_thread(remove)
    abatched_remove = in_thread(batched_remove)
    apin = in_thread(pin)
    aunpin = in_thread(unpin)
    aprefetch = in_thread(prefetch)
    astats = in_thread(stats)
    aclose = in_thread(close)


def open_kv_store(
    storage_path: str | Path,
    model: str,
    *,
    memory_bytes: int | str | None = None,
    disk_bytes: int | str | None = None,
    durability: Durability | None = None,
    settings: PersistingSettings | None = None,
    **options: Any,
) -> KVStore:
    """Open (or create) the KV namespace of ``model`` under ``storage_path``.

    Unspecified options come from ``settings`` (or ``PersistingSettings()``: env/TOML).
    Sizes take units as the settings do: ``memory_bytes="64 MB"``, ``disk_bytes="8GiB"``.
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
