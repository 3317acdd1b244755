"""The read paths of a KV store: gets, reads into a caller's buffers (host or device),
shared-pool locations, and prefetch from disk into memory.

A value is read from the memory tier when it is there (one copy, outside the lock, while
the entry is marked as being read so it cannot be evicted), else from the disk tier (a
positioned read into the destination, then a checksum check). A layout other than the one
the reader expects is a miss.

A batch keeps up to ``read_threads`` disk reads in flight (positioned reads release the
GIL), while the calling thread copies the batch's memory hits. Destinations on a device go
through :class:`~persisting.cuda.DeviceCopier`: a memory hit is one asynchronous copy up
from the (pinned) memory tier; a disk hit is read into the pinned staging ring and sent up
while later chunks are still being read, so a destination is written only once its read
succeeded. Every timed read feeds the store's :class:`~persisting.kv.paths.load_plan.TierBandwidth`.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from persisting.cuda import DeviceCopier
from persisting.errors import InvalidValueError
from persisting.kv.index import MemoryEntry
from persisting.kv.layout import Layout, decode_value, is_device_tensor, torch_dtype, writable_bytes
from persisting.kv.paths.tiers import KeyLike, Tiers
from persisting.shm import RecycledBuffers, aligned_buffer, copy_into


@dataclass(frozen=True, slots=True)
class SharedLocation:
    """A memory-tier value in the store's shared pool: its layout, byte offset in the
    pool file, and the generation the reader must still see after copying it."""

    layout: Layout
    offset: int
    generation: int


@dataclass(frozen=True, slots=True)
class MemoryPayload:
    """A memory-tier value's bytes for a server to send as they are (no copy): its layout,
    the checksum recorded when it was stored, and the tier's own buffer. The buffer stays
    valid while this object holds it -- the tier only lets go of its reference, and pages
    go back to the pool only once every view of them is garbage -- and its bytes never
    change (a value is written once, before it is indexed). Read it, do not write it."""

    layout: Layout
    checksum: int
    buffer: np.ndarray


def _tensor_nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _is_device(device: Any) -> bool:
    """Whether ``device`` names something other than the CPU (``"cuda:0"``, a torch device)."""
    return str(device).split(":", 1)[0] != "cpu"


def _gather(futures: list[tuple[int, Future[Layout | None]]], got: list[Layout | None]) -> int:
    """Wait for every disk read of a batch (all of them, even after one failed, so no
    reader still writes a destination once the call returns); record what each read,
    then raise the first failure. Returns the bytes read."""
    nbytes = 0
    first: BaseException | None = None
    for i, future in futures:
        try:
            layout = future.result()
        except BaseException as exc:
            first = first or exc
            continue
        got[i] = layout
        if layout is not None:
            nbytes += layout.nbytes
    if first is not None:
        raise first
    return nbytes


class WriteHooks(Protocol):
    """What the reads need of the put paths (:class:`~persisting.kv.paths.puts.Writes`)."""

    def write_back(self, evicted: list[tuple[str, MemoryEntry]]) -> None: ...

    def disk_reading(self) -> AbstractContextManager[None]: ...


#: The smallest part a value is split into when its reads run at once (see ``_split``).
SPLIT_BYTES = 1 << 20


class Reads:
    """Gets over the tiers; ``writes`` takes the dirty entries a prefetch evicts, and marks
    each read from the disk."""

    def __init__(
        self,
        tiers: Tiers,
        results: RecycledBuffers | None,
        writes: WriteHooks,
        read_threads: int = 8,
    ):
        self._t = tiers
        self._results = results
        self._write_back = writes.write_back
        #: Marks a read from the disk (the write-behind stays off the disk meanwhile).
        self._disk_reading = writes.disk_reading
        if read_threads < 1:
            raise InvalidValueError(f"read_threads must be at least 1, not {read_threads}")
        self.read_threads = read_threads
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def _readers(self) -> ThreadPoolExecutor | None:
        """The pool of disk readers, started on the first batch that needs it."""
        if self.read_threads <= 1:
            return None
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.read_threads, thread_name_prefix="persisting-kv-read"
                )
            return self._executor

    def close(self) -> None:
        with self._executor_lock:
            pool, self._executor = self._executor, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _result_buffer(self, nbytes: int) -> np.ndarray:
        """Room for a value :meth:`batched_get` returns: reused pages while any are free."""
        buffer = self._results.take(nbytes) if self._results is not None else None
        return buffer if buffer is not None else aligned_buffer(nbytes)

    # -- gets ---------------------------------------------------------------------------

    def _wanted(self, text: str, expect: Layout | None, nbytes: int | None = None) -> Layout | None:
        """``text``'s stored layout if a reader expecting ``expect`` (and a destination of
        ``nbytes``) may have it; else None, counted as a miss."""
        layout = self.layout_of(text)
        if layout is None or not self.layout_ok(layout, expect):
            self._t.op_stats.record("get", "", 0.0, 0, "miss")
            return None
        if nbytes is not None and layout.nbytes != nbytes:
            raise InvalidValueError(
                f"get_into needs a buffer of {layout.nbytes} bytes for {text}, got {nbytes}"
            )
        return layout

    def batched_get(
        self, keys: Sequence[KeyLike], expect: Layout | None, device: Any = None
    ) -> list[Any]:
        texts = [self._t.key_text(key) for key in keys]
        layouts = [self._wanted(text, expect) for text in texts]
        if device is not None and _is_device(device):
            import torch

            outs = [
                torch.empty(lay.shape, dtype=torch_dtype(lay.dtype), device=device)
                if lay is not None
                else None
                for lay in layouts
            ]
            got = self._fill(texts, outs)
            return [out if ok is not None else None for out, ok in zip(outs, got, strict=True)]
        buffers = [self._result_buffer(lay.nbytes) if lay is not None else None for lay in layouts]
        views = [b.data if b is not None else None for b in buffers]
        got = self._fill_host(texts, views)
        return [
            decode_value(layout, buffer) if layout is not None and buffer is not None else None
            for layout, buffer in zip(got, buffers, strict=True)
        ]

    def get_into(self, key: KeyLike, out: Any, expect: Layout | None) -> Layout | None:
        if is_device_tensor(out):
            return self.batched_get_into([key], [out], expect)[0]
        # One host destination (a loader's per-chunk call): straight to the one read, none
        # of a batch's lists, futures and thread hand-offs.
        text = self._t.key_text(key)
        view = writable_bytes(out)
        if self._wanted(text, expect, len(view)) is None:
            return None
        memory, _disk = self._claim_memory((text,), (len(view),))
        if memory:
            return self._copy_memory_hit(view, memory[0][1])
        start = time.perf_counter()
        layout = self._read_now(text, view, self._split(1))
        if layout is not None:
            self._t.bandwidth.record("disk", layout.nbytes, time.perf_counter() - start)
        return layout

    def batched_get_into(
        self, keys: Sequence[KeyLike], outs: Sequence[Any], expect: Layout | None
    ) -> list[Layout | None]:
        if len(keys) != len(outs):
            raise InvalidValueError(f"{len(keys)} keys but {len(outs)} outs")
        texts = [self._t.key_text(key) for key in keys]
        targets: list[Any] = []
        for out in outs:  # every destination is checked before anything is read
            if is_device_tensor(out):
                targets.append(out)
            else:
                targets.append(writable_bytes(out))
        sized: list[Any] = []
        for text, target in zip(texts, targets, strict=True):
            nbytes = _tensor_nbytes(target) if is_device_tensor(target) else len(target)
            sized.append(target if self._wanted(text, expect, nbytes) is not None else None)
        return self._fill(texts, sized)

    def _fill(self, texts: list[str], targets: list[Any]) -> list[Layout | None]:
        """Fill each target (a host memoryview, a device tensor, or None: skip) with its
        key's payload; the layout read per target, None on a miss or damage."""
        got: list[Layout | None] = [None] * len(texts)
        host = [i for i, t in enumerate(targets) if t is not None and not is_device_tensor(t)]
        by_device: dict[str, list[int]] = collections.defaultdict(list)
        for i, target in enumerate(targets):
            if target is not None and is_device_tensor(target):
                by_device[str(target.device)].append(i)
        for device, indexes in by_device.items():
            copier = self._t.host.copier(device)
            filled = self.fill_staged(
                copier, [texts[i] for i in indexes], [targets[i] for i in indexes]
            )
            for i, layout in zip(indexes, filled, strict=True):
                got[i] = layout
        if host:
            filled = self._fill_host([texts[i] for i in host], [targets[i] for i in host])
            for i, layout in zip(host, filled, strict=True):
                got[i] = layout
        return got

    def _claim_memory(
        self, texts: Sequence[str], sizes: Sequence[int | None]
    ) -> tuple[list[tuple[int, MemoryEntry]], list[int]]:
        """Split a batch into memory hits (marked as being read) and the rest, to be read
        from disk; entries whose size is None are skipped."""
        t = self._t
        memory: list[tuple[int, MemoryEntry]] = []
        disk: list[int] = []
        with t.lock:
            for i, (text, nbytes) in enumerate(zip(texts, sizes, strict=True)):
                if nbytes is None:
                    continue
                entry = t.memory.index.get(text, touch=True)
                if entry is not None and entry.layout.nbytes == nbytes:
                    entry.readers += 1
                    memory.append((i, entry))
                else:
                    disk.append(i)
        return memory, disk

    def _copy_memory_hit(self, view: memoryview, entry: MemoryEntry) -> Layout:
        """Copy a claimed memory-tier entry into ``view``, then let the entry go."""
        t = self._t
        copy_start = time.perf_counter()
        try:
            # In parallel only into pages already resident (recycled result pages, an
            # engine's preallocated buffer); fresh ones are populated in one call first:
            # threads faulting fresh pages in at once contend on the page tables.
            copy_into(np.frombuffer(view, dtype=np.uint8), entry.buffer)
        finally:
            self._release(entry)
        seconds = time.perf_counter() - copy_start
        t.op_stats.record("get", "memory", seconds, len(view), "hit")
        t.bandwidth.record("memory", len(view), seconds)
        return entry.layout

    def _release(self, entry: MemoryEntry) -> None:
        with self._t.lock:
            entry.readers -= 1

    def _read_disk(self, text: str, view: memoryview, parts: int = 1) -> Layout | None:
        """One timed disk read (on a reader thread, or on the caller's in ``parts`` reads
        at once on the reader threads). The destination's pages are not prepared: those
        not yet touched fault in inside the reads, as in any ``read`` into fresh memory.
        Populating first would walk the range under the process's memory-map lock, which
        stalls the batch's other reads and any allocation in the process meanwhile."""
        t = self._t
        if t.disk is None:
            t.op_stats.record("get", "", 0.0, 0, "miss")
            return None
        start = time.perf_counter()
        executor = self._readers() if parts > 1 else None
        with self._disk_reading():
            layout = t.disk.read_into(text, view, executor=executor, parts=parts)
        seconds = time.perf_counter() - start
        t.op_stats.record(
            "get", "disk", seconds, len(view) if layout else 0, "hit" if layout else "miss"
        )
        return layout

    def _split(self, batch: int) -> bool:
        """Whether a batch of ``batch`` disk reads is read one value at a time, each split
        into parts read at once: when it has too few values to keep ``read_threads`` reads
        in flight (fewer than half as many). Otherwise each value is read whole by one
        reader thread, up to ``read_threads`` at once: sequential reads of whole files,
        which the kernel reads ahead of, where parts of one file read at once are several
        streams over one file."""
        return self.read_threads > 1 and batch * 2 <= self.read_threads

    def _submit(self, text: str, view: memoryview, split: bool) -> Future[Layout | None]:
        """Start one disk read; or, with ``split`` (or no reader threads), do it now on this
        thread, in parts of at least :data:`SPLIT_BYTES` read by the reader threads at once."""
        executor = self._readers()
        if executor is not None and not split:  # beside the batch's other reads
            return executor.submit(self._read_disk, text, view)
        done: Future[Layout | None] = Future()
        try:
            done.set_result(self._read_now(text, view, split))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def _read_now(self, text: str, view: memoryview, split: bool) -> Layout | None:
        """One disk read on this thread; with ``split``, in parts of at least
        :data:`SPLIT_BYTES` read by the reader threads at once."""
        parts = min(self.read_threads, len(view) // SPLIT_BYTES) if split else 1
        return self._read_disk(text, view, parts)

    def _fill_host(
        self, texts: list[str], views: Sequence[memoryview | None]
    ) -> list[Layout | None]:
        t = self._t
        got: list[Layout | None] = [None] * len(texts)
        memory, disk = self._claim_memory(texts, [len(v) if v is not None else None for v in views])
        start = time.perf_counter()
        futures: list[tuple[int, Future[Layout | None]]] = []
        split = self._split(len(disk))
        try:
            for i in disk if not split else ():  # in flight while this thread copies
                view = views[i]
                assert view is not None
                futures.append((i, self._submit(texts[i], view, split=False)))
            for i, entry in memory:
                view = views[i]
                assert view is not None
                got[i] = self._copy_memory_hit(view, entry)
            if split:
                start = time.perf_counter()
                for i in disk:  # one value at a time, each in parts read at once
                    view = views[i]
                    assert view is not None
                    futures.append((i, self._submit(texts[i], view, split=True)))
        finally:
            got_bytes = _gather(futures, got)
        if got_bytes:
            t.bandwidth.record("disk", got_bytes, time.perf_counter() - start)
        return got

    def fill_staged(
        self, copier: DeviceCopier, texts: Sequence[str], outs: Sequence[Any]
    ) -> list[Layout | None]:
        """Fill tensors on ``copier``'s device: memory hits in one batch of asynchronous
        copies up, disk hits read (``read_threads`` at a time) into staging buffers that go
        up in order as their reads complete. An out is written only when its read
        succeeded. Returns once the copies are issued; work the caller queues on its
        current stream afterwards sees the data. (With a ``cpu`` copier the same pipeline
        runs into CPU tensors: that is how it is tested without a GPU.)"""
        t = self._t
        got: list[Layout | None] = [None] * len(texts)
        memory, disk = self._claim_memory(texts, [_tensor_nbytes(out) for out in outs])
        if memory:
            start = time.perf_counter()
            try:
                copier.to_device(
                    [entry.buffer for _i, entry in memory], [outs[i] for i, _e in memory]
                )
            finally:
                for _i, entry in memory:
                    self._release(entry)
            seconds = time.perf_counter() - start
            for i, entry in memory:
                t.op_stats.record(
                    "get", "memory", seconds / len(memory), entry.layout.nbytes, "hit"
                )
                got[i] = entry.layout
        if not disk:
            return got
        window = max(1, self.read_threads)
        pending: collections.deque[tuple[int, np.ndarray, Future[Layout | None]]] = (
            collections.deque()
        )
        start = time.perf_counter()
        got_bytes = 0
        split = self._split(len(disk))
        try:
            for i in disk:
                while len(pending) >= window:
                    got_bytes += self._send_up(copier, pending.popleft(), outs, got)
                buffer = copier.host_buffer(_tensor_nbytes(outs[i]))
                read = self._submit(texts[i], buffer.data, split)
                pending.append((i, buffer, read))
            while pending:
                got_bytes += self._send_up(copier, pending.popleft(), outs, got)
        finally:  # never let a staging buffer go while a reader still fills it
            for _i, _buffer, future in pending:
                future.exception()
        if got_bytes:
            t.bandwidth.record("disk", got_bytes, time.perf_counter() - start)
        return got

    @staticmethod
    def _send_up(
        copier: DeviceCopier,
        item: tuple[int, np.ndarray, Future[Layout | None]],
        outs: Sequence[Any],
        got: list[Layout | None],
    ) -> int:
        i, buffer, future = item
        layout = future.result()
        if layout is None:
            return 0
        copier.to_device([buffer], [outs[i]])
        got[i] = layout
        return buffer.nbytes

    def shared_location(
        self, key: KeyLike, expect: Layout | None, count: bool = True
    ) -> SharedLocation | None:
        t = self._t
        if t.pool is None:
            return None
        text = t.key_text(key)
        with t.lock:
            entry = t.memory.index.get(text, touch=count)
            if entry is None or not self.layout_ok(entry.layout, expect):
                return None
            found = t.pool.locate(entry.buffer)
        if found is None:
            return None
        if count:
            t.op_stats.record("get", "memory", 0.0, entry.layout.nbytes, "hit")
        return SharedLocation(entry.layout, found[0], found[1])

    def memory_payload(self, key: KeyLike, expect: Layout | None) -> MemoryPayload | None:
        t = self._t
        text = t.key_text(key)
        with t.lock:
            entry = t.memory.index.get(text, touch=True)
            if entry is None or not self.layout_ok(entry.layout, expect):
                return None
            found = MemoryPayload(entry.layout, entry.checksum, entry.buffer)
        t.op_stats.record("get", "memory", 0.0, found.layout.nbytes, "hit")
        return found

    def touch(self, keys: Sequence[KeyLike]) -> int:
        t = self._t
        texts = [t.key_text(key) for key in keys]
        sizes: list[int] = []
        with t.lock:
            for text in texts:
                entry = t.memory.index.get(text, touch=True)
                if entry is not None:
                    sizes.append(entry.layout.nbytes)
        for nbytes in sizes:
            t.op_stats.record("get", "memory", 0.0, nbytes, "hit")
        return len(sizes)

    def layout_ok(self, layout: Layout, expect: Layout | None) -> bool:
        if expect is None or layout.matches(expect):
            return True
        self._t.op_stats.count("layout_mismatches")
        return False

    def layout_of(self, text: str) -> Layout | None:
        t = self._t
        with t.lock:
            entry = t.memory.index.get(text)
            if entry is not None:
                return entry.layout
            if t.disk is not None:
                disk_entry = t.disk.entry(text)
                if disk_entry is not None:
                    return disk_entry.layout
        return None

    def prefetch(self, keys: Sequence[KeyLike]) -> int:
        t = self._t
        in_memory = 0
        for key in keys:
            text = t.key_text(key)
            with t.lock:
                if text in t.memory.index:
                    in_memory += 1
                    continue
                entry = t.disk.entry(text) if t.disk is not None else None
            if entry is None or not t.memory.fits(entry.layout.nbytes):
                continue
            buffer = t.memory_buffer(entry.layout.nbytes)
            assert t.disk is not None
            with self._disk_reading():
                layout = t.disk.read_into(text, buffer.data)
            if layout is None:
                continue
            with t.lock:
                inserted, evicted = t.memory.insert(
                    text, layout, buffer, entry.checksum, entry.parent, dirty=False
                )
            self._write_back(evicted)
            in_memory += inserted or text in t.memory.index
        t.op_stats.count("prefetched", in_memory)
        return in_memory


__all__ = ["MemoryPayload", "Reads", "SharedLocation"]
