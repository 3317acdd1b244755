"""The L2 adapter's chunk I/O: LMCache MemoryObjs into the Persisting store and back.

A chunk is stored as its tensor with its real shape, dtype and memory format (raw bytes
for an object of several layer groups), so a load can refuse a chunk whose layout is not
the destination's: a miss, never wrong bytes. Loads read straight into the destination
object's buffer and the disk tier verifies the chunk's checksum on the way.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import MemoryObj

from persisting.errors import PersistingError
from persisting.integrations.lmcache.compat import is_plain_tensor_object
from persisting.kv import Layout
from persisting.kv.api import KVApi
from persisting.kv.layout import dtype_name

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # pragma: no cover - Python 3.10
    from typing_extensions import assert_never


class Stored(NamedTuple):
    """A chunk a store task handled."""

    key: ObjectKey
    text: str  # its key string
    nbytes: int  # payload bytes
    written: bool  # written now (False: it was stored already)


#: Told of a chunk that could not be stored or loaded, with the error.
OnFailure = Callable[[str, BaseException], None]
#: What a load of one chunk found.
LoadOutcome = Literal["hit", "absent", "layout_mismatch", "miss", "failed"]


@dataclass
class L2Counters:
    """What the adapter counts, by name (``report_status`` reads the same fields, so a
    renamed outcome or counter is a type error, never a figure stuck at 0)."""

    evictions: int = 0
    store_failures: int = 0
    load_failures: int = 0
    #: Chunks never stored, evicted or dropped as damaged (``absent``), and those
    #: evicted or damaged while being read (``miss``).
    load_misses: int = 0
    layout_mismatches: int = 0

    def count_load(self, outcome: LoadOutcome) -> None:
        """Count a load that found ``outcome`` (a hit is not counted here)."""
        if outcome == "hit":
            return
        if outcome == "failed":
            self.load_failures += 1
        elif outcome == "absent" or outcome == "miss":
            self.load_misses += 1
        elif outcome == "layout_mismatch":
            self.layout_mismatches += 1
        else:
            assert_never(outcome)


def value_of(obj: MemoryObj) -> Any:
    """The object's bytes as Persisting stores them: its tensor with its real shape and
    dtype, or raw bytes for an object of several layer groups."""
    meta = obj.metadata
    if meta.shapes is None or len(meta.shapes) <= 1:
        tensor = obj.tensor
        if tensor is None:
            raise PersistingError("MemoryObj was invalidated")
        return tensor
    return torch.frombuffer(obj.byte_array, dtype=torch.uint8)


def layout_of(obj: MemoryObj) -> Layout:
    """The layout a chunk stored from ``obj`` has (and a chunk loaded into it must have).

    The same shape, dtype, format and size that :func:`encode_value` records when the
    chunk is stored. Every load asks it, so a plain one-group ``TensorMemoryObj`` is
    answered from its metadata alone: each torch call lets go of the GIL and, with the
    loading threads all wanting it back, waits its turn (the tensor views cost a load of
    4 MiB chunks several times the time of the checks themselves). Any other object is
    read from its tensor view (no byte view, no contiguity check).
    """
    meta = obj.metadata
    if (
        is_plain_tensor_object(obj)  # its tensor is meta's shape and dtype
        and obj.is_valid()
        and (meta.shapes is None or len(meta.shapes) <= 1)
        and meta.dtype is not None
    ):
        shape = tuple(meta.shape)
        nbytes = obj.get_size()
        if math.prod(shape) * meta.dtype.itemsize == nbytes:
            return Layout(shape, dtype_name(meta.dtype), meta.fmt.name, nbytes, "torch")
    value = value_of(obj)
    return Layout(
        tuple(int(x) for x in value.shape),
        dtype_name(value.dtype),
        obj.metadata.fmt.name,
        value.numel() * value.element_size(),
        "torch",
    )


def store_objects(
    store: KVApi, items: list[tuple[ObjectKey, str, MemoryObj]], failed: OnFailure
) -> tuple[bool, list[Stored]]:
    """Store ``(key, key string, object)`` items, one batch per memory format (one by one
    if a batch is refused). Returns whether all were stored, and what was."""
    ok = True
    stored: list[Stored] = []
    groups: dict[str, list[tuple[ObjectKey, str, Any, str | None]]] = {}
    last_of_row: dict[tuple[str, int, int, str], str] = {}
    for key, text, obj in items:
        row = (key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)
        parent = last_of_row.get(row)  # the chunk before it in the same request row
        last_of_row[row] = text
        try:
            value = value_of(obj)
        except PersistingError as exc:
            failed(text, exc)
            ok = False
            continue
        groups.setdefault(obj.metadata.fmt.name, []).append((key, text, value, parent))
    for fmt, group in groups.items():
        ok = _put_group(store, fmt, group, stored, failed) and ok
    return ok, stored


def _put_group(
    store: KVApi,
    fmt: str,
    items: list[tuple[ObjectKey, str, Any, str | None]],
    stored: list[Stored],
    failed: OnFailure,
) -> bool:
    # Stored last chunk first, so the store's LRU order ends with a request's first chunk as
    # the most recent one (LMCache's policies read a batch the same way): a prefix outlives
    # its suffix. Prefix-aware eviction uses the parents instead.
    ordered = items[::-1]
    try:
        results = store.batched_put(
            [text for _k, text, _v, _p in ordered],
            [value for _k, _t, value, _p in ordered],
            fmt=fmt,
            parents=[parent for *_, parent in ordered],
            check_shape=False,  # LMCache owns its layouts: they are kept as they are
        )
    except PersistingError as exc:
        if len(items) == 1:
            failed(items[0][1], exc)
            return False
        before = len(stored)
        ok = all([_put_group(store, fmt, [item], stored, failed) for item in ordered])
        stored[before:] = stored[before:][::-1]  # reported in request order
        return ok
    for (key, text, value, _p), result in zip(items, results[::-1], strict=True):
        stored.append(Stored(key, text, value.numel() * value.element_size(), result.stored))
    return True


def load_object(store: KVApi, text: str, obj: MemoryObj, failed: OnFailure) -> LoadOutcome:
    """Read the chunk stored under ``text`` into ``obj``, if its layout is ``obj``'s.

    One call into the store on a hit (the layout check rides along with the read); only a
    miss asks again, to say what kind of miss it was.
    """
    try:
        expected = layout_of(obj)
        if store.get_into(text, obj.byte_array.cast("B"), expect=expected) is not None:
            return "hit"
        stored = store.layout(text)
    except Exception as exc:
        failed(text, exc)
        return "failed"
    if stored is None:
        return "absent"  # never stored, evicted, or damaged (the store dropped it)
    if not stored.matches(expected):
        return "layout_mismatch"
    return "miss"  # evicted or damaged while being read, then stored again meanwhile


__all__ = [
    "L2Counters",
    "LoadOutcome",
    "OnFailure",
    "Stored",
    "layout_of",
    "load_object",
    "store_objects",
    "value_of",
]
