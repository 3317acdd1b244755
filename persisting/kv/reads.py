"""The read paths of a KV store: gets, reads into a caller's buffer, shared-pool places,
and prefetch from disk into memory.

A value is read from the memory tier when it is there (one copy, outside the lock, while
the entry is marked as being read so it cannot be evicted), else from the disk tier (one
positioned read into the destination, then a checksum check). A layout other than the one
the reader expects is a miss.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from persisting.errors import InvalidValueError
from persisting.kv.index import MemoryEntry
from persisting.kv.layout import Layout, decode_value, writable_bytes
from persisting.kv.tiers import KeyLike, Tiers
from persisting.shm import RecycledBuffers, aligned_buffer, copy_bytes


@dataclass(frozen=True, slots=True)
class SharedLocation:
    """A memory-tier value in the store's shared pool: its layout, byte offset in the
    pool file, and the generation the reader must still see after copying it."""

    layout: Layout
    offset: int
    generation: int


class Reads:
    """Gets over the tiers; ``write_back`` takes the dirty entries a prefetch evicts."""

    def __init__(
        self,
        tiers: Tiers,
        results: RecycledBuffers | None,
        write_back: Callable[[list[tuple[str, MemoryEntry]]], None],
    ):
        self._t = tiers
        self._results = results
        self._write_back = write_back

    def _result_buffer(self, nbytes: int) -> np.ndarray:
        """Room for a value :meth:`batched_get` returns: reused pages while any are free."""
        buffer = self._results.take(nbytes) if self._results is not None else None
        return buffer if buffer is not None else aligned_buffer(nbytes)

    def batched_get(self, keys: Sequence[KeyLike], expect: Layout | None) -> list[Any]:
        out: list[Any] = []
        for key in keys:
            text = self._t.key_text(key)
            layout = self.layout_of(text)
            if layout is None or not self.layout_ok(layout, expect):
                self._t.op_stats.record("get", "", 0.0, 0, "miss")
                out.append(None)
                continue
            buffer = self._result_buffer(layout.nbytes)
            got = self._read(text, memoryview(buffer))
            out.append(decode_value(got, buffer) if got is not None else None)
        return out

    def get_into(self, key: KeyLike, out: Any, expect: Layout | None) -> Layout | None:
        text = self._t.key_text(key)
        view = writable_bytes(out)
        layout = self.layout_of(text)
        if layout is None or not self.layout_ok(layout, expect):
            self._t.op_stats.record("get", "", 0.0, 0, "miss")
            return None
        if layout.nbytes != len(view):
            raise InvalidValueError(
                f"get_into needs a buffer of {layout.nbytes} bytes for {text}, got {len(view)}"
            )
        return self._read(text, view)

    def shared_location(self, key: KeyLike, expect: Layout | None) -> SharedLocation | None:
        t = self._t
        if t.pool is None:
            return None
        text = t.key_text(key)
        with t.lock:
            entry = t.memory.index.get(text, touch=True)
            if entry is None or not self.layout_ok(entry.layout, expect):
                return None
            found = t.pool.locate(entry.buffer)
        if found is None:
            return None
        t.op_stats.record("get", "memory", 0.0, entry.layout.nbytes, "hit")
        return SharedLocation(entry.layout, found[0], found[1])

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

    def _read(self, text: str, view: memoryview) -> Layout | None:
        t = self._t
        start = time.perf_counter()
        with t.lock:
            entry = t.memory.index.get(text, touch=True)
            if entry is not None:
                entry.readers += 1
        if entry is not None:
            try:
                copy_bytes(np.frombuffer(view, dtype=np.uint8), entry.buffer)
            finally:
                with t.lock:
                    entry.readers -= 1
            t.op_stats.record("get", "memory", time.perf_counter() - start, len(view), "hit")
            return entry.layout
        if t.disk is None:
            t.op_stats.record("get", "", 0.0, 0, "miss")
            return None
        layout = t.disk.read_into(text, view)
        if layout is None:
            t.op_stats.record("get", "disk", time.perf_counter() - start, 0, "miss")
            return None
        t.op_stats.record("get", "disk", time.perf_counter() - start, len(view), "hit")
        return layout

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
            layout = t.disk.read_into(text, memoryview(buffer))
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


__all__ = ["Reads", "SharedLocation"]
