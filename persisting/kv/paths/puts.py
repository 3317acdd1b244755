"""The put paths of a KV store, and the bookkeeping of values not yet on disk.

Completion modes (``durability``):

- ``"sync"``  (write-through): a put returns once the bytes are fsynced on disk (with
  ``fsync=False``: once they are written and renamed into place, in the page cache).
- ``"async"`` (write-behind):  a put returns once the value is in memory; a background
  writer makes it durable.
- ``"write_back"``:             the value stays in memory and is written to disk only when
  the memory tier evicts it (or on close).

Both memory-first modes write through :mod:`persisting.kv.disk.write_behind`, on its threads
(a put that evicts a dirty value queues its write there, it does not write it): its two
bounds (``write_behind_lag_s``, ``write_behind_bytes``) say how long and how many bytes a
value may stay acknowledged but not on disk; a put that finds more than
``write_behind_bytes`` waiting waits for them first.

In both memory-first modes a value is *in the put tasks* (``exists_in_put_tasks``) until it
is on disk, and ``on_complete`` fires once it is (``durable=True``) or once it is known it
will not be (``stored=False``: a failed write, a remove, a dropped write-back).

A remove wins over a write still in progress: the remove cancels it (see
:class:`~persisting.kv.disk.tier.WriteItem`), so a removed key never comes back from disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from persisting.errors import CapacityError, InvalidValueError
from persisting.kv.disk.tier import WriteItem
from persisting.kv.disk.write_behind import Bounds, WriteBehind
from persisting.kv.eviction.policy import AdmissionPolicy
from persisting.kv.index import MemoryEntry
from persisting.kv.layout import (
    BYTE_FORMATS,
    Gathered,
    Layout,
    Payload,
    check_layout,
    encode_value,
    is_device_tensor,
    owned_copy,
    owned_copy_hashed,
    tensor_layout,
)
from persisting.kv.paths.tiers import KeyLike, Tiers

log = logging.getLogger(__name__)

Durability = Literal["sync", "async", "write_back"]
Tier = Literal["memory", "disk"]
OnComplete = Callable[["PutResult"], None]


@dataclass(frozen=True, slots=True)
class PutResult:
    """Where a put completed: ``tier`` and whether the value is ``durable`` on disk yet.

    ``stored`` is False when nothing was stored by this put: the key was already present
    (first writer wins; ``contains`` is then true), or no tier could take the value (a
    memory tier full of pinned or busy chunks and no disk tier; ``contains`` is false).
    ``conflict`` tells the first case apart when the value already stored under the key
    has another layout (shape, dtype, format or size) than the one put: it was *not*
    replaced, and a reader expecting the new layout misses.
    """

    key: str
    tier: Tier
    durable: bool
    stored: bool = True
    conflict: bool = False


@dataclass(eq=False, slots=True)
class PendingWrite:
    """A value on its way to disk: a write-behind, or (``evicted``) the write-back of a
    dirty value the memory tier let go."""

    item: WriteItem
    on_complete: OnComplete | None
    evicted: bool = False


def notify(callback: OnComplete | None, result: PutResult, tiers: Tiers) -> None:
    """Run a caller's completion callback; one that raises is logged and counted, never
    propagated (it runs on the put path or the write-behind thread)."""
    if callback is None:
        return
    try:
        callback(result)
    except Exception:
        tiers.op_stats.count("on_complete_errors")
        log.exception("on_complete callback for %r raised", result.key)


def check_key_dtypes(texts: Sequence[str], layouts: Sequence[Layout]) -> None:
    """InvalidValueError for the first value whose dtype is not its key's: a key names the
    dtype of what it holds (``...@bfloat16``), and a reader hashing with that dtype must
    find values of it. Opaque bytes (``binary`` formats, ``bytes`` values) are exempt."""
    for text, layout in zip(texts, layouts, strict=True):
        if layout.kind == "bytes" or layout.fmt in BYTE_FORMATS:
            continue
        key_dtype = text.split("@", 5)[4]
        if layout.dtype != key_dtype:
            raise InvalidValueError(
                f"a {layout.dtype} value under key {text!r}, whose dtype is {key_dtype}: "
                f"store it under a key of dtype {layout.dtype} (TokenHasher(..., "
                f"dtype=...)), or convert it"
            ).about("dtype")


class Writes:
    """Puts in every mode, the write-behind thread, and what is not yet on disk."""

    def __init__(
        self,
        tiers: Tiers,
        durability: Durability,
        admission: AdmissionPolicy,
        max_value_bytes: int,
        fsync: bool = True,
        bounds: Bounds = Bounds(),
    ):
        self._t = tiers
        #: Whether write-through puts fsync before they complete. False leaves them in the
        #: page cache (whole and renamed into place: they survive a crash of this process,
        #: not of the machine), as LMCache's own disk backends do.
        self.fsync = fsync
        self.durability: Durability = durability
        self.admission = admission
        admission.attach(tiers.disk.index.reuse if tiers.disk is not None else None)  # ghosts
        self.max_value_bytes = max_value_bytes
        #: Keys with a write to disk in progress (write-behind or write-back).
        self._inflight: dict[str, PendingWrite] = {}
        #: Write-back mode: callbacks of dirty memory entries, fired when written back.
        self._dirty_callbacks: dict[str, OnComplete] = {}
        disk = tiers.disk
        # Write-through puts write on the caller's thread and nothing is ever dirty: a
        # write-behind would only make every disk read mark itself for a writer that
        # never writes.
        self._writer = (
            WriteBehind(disk, self._written, bounds, clock=tiers.clock)
            if disk is not None and durability != "sync"
            else None
        )

    # -- put ----------------------------------------------------------------------------

    def batched_put(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        *,
        fmt: str,
        parents: Sequence[KeyLike | None] | None,
        chain: bool,
        on_complete: OnComplete | None,
        check_shape: bool,
    ) -> list[PutResult]:
        if len(keys) != len(values):
            raise InvalidValueError(f"{len(keys)} keys but {len(values)} values")
        if parents is not None and len(parents) != len(keys):
            raise InvalidValueError(f"{len(keys)} keys but {len(parents)} parents")
        start = time.perf_counter()
        texts = [self._t.key_text(k) for k in keys]
        if parents is not None:
            parent_texts = [self._t.key_text(p) if p is not None else None for p in parents]
        elif chain:
            parent_texts = [None, *texts[:-1]]
        else:
            parent_texts = [None] * len(texts)
        encoded = self._encode_all(values, fmt, check_shape)
        if check_shape:
            check_key_dtypes(texts, [layout for layout, _view in encoded])
        # Each value is hashed where its bytes are first copied -- written to disk, or
        # copied into the memory tier -- piece by piece as they go: one pass over the
        # caller's memory, not two.
        items = [
            WriteItem(k, layout, view, None, parent)
            for k, (layout, view), parent in zip(texts, encoded, parent_texts, strict=True)
        ]
        if self.durability == "sync":
            results = self._put_sync(items)
        else:
            results = [self._put_memory_first(it, on_complete) for it in items]
        nbytes = sum(it.layout.nbytes for it, r in zip(items, results, strict=True) if r.stored)
        self._t.op_stats.record(
            "put", results[0].tier if results else "", time.perf_counter() - start, nbytes, "stored"
        )
        if on_complete is not None:
            for r in results:
                if r.durable or not r.stored or self._t.disk is None:
                    notify(on_complete, r, self._t)
        return results

    def batched_put_owned(
        self,
        keys: Sequence[KeyLike],
        buffers: Sequence[np.ndarray],
        layouts: Sequence[Layout],
        checksums: Sequence[int],
        parents: Sequence[KeyLike | None],
    ) -> list[PutResult]:
        """Store values whose bytes already lie in memory-tier buffers (``Tiers.memory_buffer``)
        with known checksums: the memory tier keeps those buffers instead of copying them
        (and a write to disk trusts the checksum instead of hashing again)."""
        if not len(keys) == len(buffers) == len(layouts) == len(checksums) == len(parents):
            raise InvalidValueError(
                "keys, buffers, layouts, checksums and parents differ in length"
            )
        start = time.perf_counter()
        items = [
            WriteItem(
                self._t.key_text(key),
                self._check_size(_owned_layout(layout, buffer)),
                buffer.data,
                int(digest),
                self._t.key_text(parent) if parent is not None else None,
            )
            for key, buffer, layout, digest, parent in zip(
                keys, buffers, layouts, checksums, parents, strict=True
            )
        ]
        if self.durability == "sync":
            results = self._put_sync(items, owned=list(buffers))
        else:
            results = [
                self._put_memory_first(it, None, owned=b)
                for it, b in zip(items, buffers, strict=True)
            ]
        nbytes = sum(it.layout.nbytes for it, r in zip(items, results, strict=True) if r.stored)
        self._t.op_stats.record(
            "put", results[0].tier if results else "", time.perf_counter() - start, nbytes, "stored"
        )
        return results

    def _encode_all(
        self, values: Sequence[Any], fmt: str, check_shape: bool
    ) -> list[tuple[Layout, Payload]]:
        """Every value's layout and host bytes, all validated before any byte moves.

        Tensors on a device are copied down here, on a side stream into the pinned staging
        ring (:meth:`~persisting.cuda.DeviceCopier.to_host`; non-contiguous ones are made
        contiguous on the device), never through pageable ``.to("cpu")`` copies.
        """
        on_device: dict[str, list[int]] = {}
        layouts: list[Layout | None] = []
        views: list[Payload | None] = []
        for i, value in enumerate(values):
            if isinstance(value, Gathered):  # written from its parts, never joined first
                layouts.append(self._check_size(value.layout(fmt)))
                views.append(value)
            elif is_device_tensor(value):
                layouts.append(self._check_size(tensor_layout(value, fmt, check_shape=check_shape)))
                views.append(None)
                on_device.setdefault(str(value.device), []).append(i)
            else:
                layout, view = encode_value(value, fmt, check_shape=check_shape)
                layouts.append(self._check_size(layout))
                views.append(view)
        for device, indexes in on_device.items():
            copier = self._t.host.copier(device)
            landed = copier.to_host(values[i] for i in indexes)
            for i, host in zip(indexes, landed, strict=True):
                views[i] = host.data
        return [(lay, view) for lay, view in zip(layouts, views, strict=True)]  # type: ignore[misc]

    def _check_size(self, layout: Layout) -> Layout:
        if layout.nbytes > self.max_value_bytes:
            raise CapacityError(
                f"value of {layout.nbytes} bytes exceeds the {self.max_value_bytes}-byte limit"
            )
        disk = self._t.disk
        if layout.nbytes > max(self._t.memory.capacity, disk.capacity if disk else 0):
            raise CapacityError(f"value of {layout.nbytes} bytes cannot fit any tier")
        return layout

    def _put_sync(
        self, items: list[WriteItem], owned: list[np.ndarray] | None = None
    ) -> list[PutResult]:
        t = self._t
        to_disk: list[WriteItem] = []
        results: dict[int, PutResult] = {}
        with t.lock:
            for i, it in enumerate(items):
                present = self._present_result(it.key, it.layout, writes=False)
                if present is not None and present.tier == "disk":
                    results[i] = present
                elif t.disk is not None and self.admission.admit(it.key):
                    to_disk.append(it)  # also a key held in memory only (second sighting)
                elif present is not None:
                    results[i] = present
        if to_disk:
            assert t.disk is not None
            t.disk.write(to_disk, durable=self.fsync)
        # Copies for the memory tier are made outside the lock (they are the big cost).
        copies: dict[int, np.ndarray] = {}
        for i, it in enumerate(items):
            if i in results or not t.memory.fits(it.layout.nbytes):
                continue
            if owned is not None:  # already in a memory-tier buffer: kept as it is
                copies[i] = owned[i]
            elif it.checksum is None:  # not written to disk just now: hash it as it is copied
                copies[i], it.checksum = owned_copy_hashed(it.data, t.memory_buffer)
            else:
                copies[i] = owned_copy(it.data, t.memory_buffer)
        with t.lock:
            for i, it in enumerate(items):
                if i in results:
                    continue
                inserted = False
                if i in copies:
                    assert it.checksum is not None
                    inserted, _ = t.memory.insert(
                        it.key, it.layout, copies[i], it.checksum, it.parent, dirty=False
                    )
                on_disk = t.on_disk(it.key)
                results[i] = PutResult(
                    it.key, "disk" if on_disk else "memory", on_disk, stored=inserted or on_disk
                )
        return [results[i] for i in range(len(items))]

    def _present_result(self, key: str, layout: Layout, writes: bool = True) -> PutResult | None:
        """The no-op result of putting a key that is already stored (or, with ``writes``,
        being written), flagged ``conflict`` when what is there has another layout."""
        t = self._t
        disk = t.disk.present(key) if t.disk is not None else None
        if disk is not None:
            return PutResult(key, "disk", True, False, not disk.layout.matches(layout))
        entry = t.memory.index.get(key, touch=False)
        pending = self._inflight.get(key) if writes else None
        if entry is not None or pending is not None:
            there = entry.layout if entry is not None else pending.item.layout  # type: ignore[union-attr]
            return PutResult(key, "memory", False, False, not there.matches(layout))
        return None

    def _put_memory_first(
        self, it: WriteItem, on_complete: OnComplete | None, owned: np.ndarray | None = None
    ) -> PutResult:
        t = self._t
        if self._writer is not None:
            self._writer.throttle()  # more than write_behind_bytes not on disk: wait
        with t.lock:
            present = self._present_result(it.key, it.layout)
        if present is not None:
            return present
        if owned is not None:  # already in a memory-tier buffer, its checksum known
            buffer = owned
        else:  # outside the lock: the copy is the big cost (the checksum is made on the way)
            buffer, it.checksum = owned_copy_hashed(it.data, t.memory_buffer)
        assert it.checksum is not None
        with t.lock:
            present = self._present_result(it.key, it.layout)
            if present is not None:
                return present
            inserted, evicted = t.memory.insert(
                it.key, it.layout, buffer, it.checksum, it.parent, dirty=t.disk is not None
            )
            if self._writer is None:
                if not inserted:  # no disk tier, and memory could not take it
                    t.op_stats.count("put_not_stored")
                    return PutResult(it.key, "memory", False, stored=False)
            elif self.durability == "async" or not inserted:
                # Write-behind (or straight to disk: memory could not hold the value).
                item = WriteItem(it.key, it.layout, buffer.data, it.checksum, it.parent)
                self._inflight[it.key] = PendingWrite(item, on_complete)
                self._writer.submit(item)
            elif on_complete is not None:  # write-back: told when the value reaches disk
                self._dirty_callbacks[it.key] = on_complete
        self.write_back(evicted)
        return PutResult(it.key, "memory", False)

    # -- completion -----------------------------------------------------------------------

    def _written(self, item: WriteItem, stored: bool, error: BaseException | None) -> None:
        """Called by the write-behind thread once ``item`` is durable, refused or failed."""
        t = self._t
        with t.lock:
            pending = self._inflight.get(item.key)
            if pending is None or pending.item is not item:
                return  # cancelled by a remove, which has told its caller
            del self._inflight[item.key]
            durable = stored or t.on_disk(item.key)
            entry = t.memory.index.get(item.key)
            if entry is not None and durable:
                entry.dirty = False
        if pending.evicted and not durable:
            t.op_stats.count("writeback_dropped")
        elif not stored:
            t.op_stats.count("writeback_failures")
        if error is not None:
            log.warning("write-behind of %r failed: %r", item.key, error)
        result = PutResult(item.key, "disk" if durable else "memory", durable, stored=stored)
        notify(pending.on_complete, result, t)

    def write_back(self, evicted: list[tuple[str, MemoryEntry]]) -> None:
        """Queue evicted dirty entries for the write-behind (clean ones just go). A
        write-back that cannot be stored (disk full, I/O error) is dropped and counted: the
        value was a cache entry."""
        t = self._t
        if self._writer is None or not evicted:
            return
        with t.lock:
            for key, entry in evicted:
                if not entry.dirty or key in self._inflight:
                    continue  # clean, or a write-behind already has its bytes
                item = WriteItem(key, entry.layout, entry.buffer.data, entry.checksum, entry.parent)
                on_complete = self._dirty_callbacks.pop(key, None)
                self._inflight[key] = PendingWrite(item, on_complete, evicted=True)
                self._writer.submit(item)

    # -- removal --------------------------------------------------------------------------

    def remove(self, key: str, *, force: bool) -> bool:
        """Drop ``key`` from both tiers, cancelling a write of it in progress (whose
        ``on_complete`` is told ``stored=False``); False when nothing was there, or it is
        being read, or (without ``force``) pinned."""
        t = self._t
        with t.lock:
            if not t.memory.removable(key, force=force):
                return False
            removed = t.memory.remove(key) is not None
            cancelled, callbacks = self.cancel(key)
        if t.disk is not None:
            removed = t.disk.remove(key, force=force) or removed
        for callback in callbacks:
            notify(callback, PutResult(key, "memory", False, stored=False), t)
        return removed or cancelled

    # -- what is not on disk yet ----------------------------------------------------------

    def cancel(self, key: str) -> tuple[bool, list[OnComplete]]:
        """Make a write of ``key`` in progress lose to a remove (caller holds the lock);
        returns whether there was one and the callbacks to tell (``stored=False``)."""
        pending = self._inflight.pop(key, None)
        callbacks: list[OnComplete] = []
        if pending is not None:
            pending.item.cancelled = True
            if pending.on_complete is not None:
                callbacks.append(pending.on_complete)
        dirty_callback = self._dirty_callbacks.pop(key, None)
        if dirty_callback is not None:
            callbacks.append(dirty_callback)
        return pending is not None, callbacks

    def in_put_tasks(self, key: str) -> bool:
        """True while ``key``'s value is stored in memory but not yet on disk."""
        with self._t.lock:
            if key in self._inflight:
                return True
            if self.durability != "write_back" or self._t.disk is None:
                return False
            entry = self._t.memory.index.get(key)
            return entry is not None and entry.dirty

    def disk_reading(self) -> AbstractContextManager[None]:
        """Mark a get reading from the disk while the block runs (the write-behind's
        low-priority writer stays off the disk meanwhile)."""
        return self._writer.reading() if self._writer is not None else nullcontext()

    @property
    def pending(self) -> int:
        """Writes to disk in progress."""
        return len(self._inflight)

    def figures(self) -> dict[str, float]:
        """The writes' figures for ``stats()``: writes in progress, bytes acknowledged and
        not yet on disk, how long the oldest has waited, the writer's errors, low-priority
        batches handed over, and times the low-priority writer waited for disk reads."""
        writer = self._writer
        return {
            "pending_puts": self.pending,
            "pending_bytes": writer.pending_bytes if writer else 0,
            "pending_age_s": round(writer.pending_age_s(), 3) if writer else 0.0,
            "writer_errors": writer.errors + writer.hook_errors if writer else 0,
            "writer_handovers": writer.handovers if writer else 0,
            "writer_deferrals": writer.deferrals if writer else 0,
        }

    def drain(self) -> None:
        """Wait for every write-behind (each completes, stored or not; none hangs)."""
        if self._writer is not None:
            self._writer.drain()

    def close(self) -> None:
        """Write back dirty memory (write-back mode), write everything queued, stop."""
        if self.durability == "write_back" and self._t.disk is not None:
            with self._t.lock:
                dirty = [(k, e) for k, e in self._t.memory.index.items() if e.dirty]
            self.write_back(dirty)
        if self._writer is not None:
            self._writer.close()


def _owned_layout(layout: Layout, buffer: np.ndarray) -> Layout:
    """``layout``, checked against the bytes of ``buffer`` as :func:`encode_value` checks a
    value's (dtype, format, size); InvalidValueError if they do not agree."""
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.nbytes != layout.nbytes:
        raise InvalidValueError(f"a {buffer.nbytes}-byte buffer for a {layout.nbytes}-byte layout")
    check_layout(layout)
    return layout


__all__ = ["Durability", "OnComplete", "PendingWrite", "PutResult", "Tier", "Writes", "notify"]
