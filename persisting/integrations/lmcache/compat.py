"""Translation between LMCache's types and Persisting's: keys, layouts, and which fit.

Keys of the in-process plugin travel by their string form, which both sides spell
identically (``model@world@worker@hash@dtype[@layer][@tag%value]``). LMCache describes a
chunk by ``(shape, torch dtype, MemoryFormat)``; Persisting stores ``Layout(shape, dtype
name, fmt name, nbytes)`` with the same dtype and format names, so the mapping is by name.

A stored chunk is only served when it is what this engine would have written under the
key: the key names the KV dtype, and chunks in the engine's own whole-chunk format must have
the engine's kv size, layer count and hidden size (a same-named model run with another
configuration must never load its tensors here). Per-layer and free-form layouts (as in
LMCache's own tests and I/O benchmark) are checked on dtype only.

This is also the only module that reads LMCache's private attributes (a memory object's
``_used_size_override``, the L2 interface's usage counters). Each such read is guarded by
:data:`PRIVATE_API_TESTED`: on an LMCache release other than the one they were read from,
the callers take the public (slower) path instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata as distributions
from typing import TYPE_CHECKING

import torch
from lmcache.utils import (
    TORCH_DTYPE_TO_STR_DTYPE,
    CacheEngineKey,
    LayerCacheEngineKey,
    parse_cache_key,
)
from lmcache.v1.memory_management import MemoryFormat, MemoryObj, TensorMemoryObj

from persisting.errors import ConfigError, InvalidValueError
from persisting.kv import ChunkKey, Layout, parse_key
from persisting.kv.keys import key_string

if TYPE_CHECKING:
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.metadata import LMCacheMetadata


def _release(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


#: The LMCache release whose private attributes this module reads (pyproject pins
#: ``lmcache>=0.5.6,<0.6``): the 0.5 series.
LMCACHE_RELEASE = _release(distributions.version("lmcache"))
PRIVATE_API_TESTED = LMCACHE_RELEASE == (0, 5)


def is_plain_tensor_object(obj: MemoryObj) -> bool:
    """Whether ``obj``'s tensor is its metadata's shape and dtype: a ``TensorMemoryObj``
    whose ``tensor`` property is not overridden by a subclass and whose used size is not
    narrowed to a byte count (LMCache 0.5's private ``_used_size_override``). False on
    any other LMCache release: the caller then reads the object's tensor view."""
    return (
        PRIVATE_API_TESTED
        and type(obj).tensor is TensorMemoryObj.tensor
        and getattr(obj, "_used_size_override", 0) is None
    )


def seed_adapter_usage(adapter: L2AdapterInterface, by_salt: Mapping[str, int]) -> None:
    """Set an L2 adapter's usage counters (kept by LMCache's base class) to what a store
    reopened holds, before any listener is registered: no store is announced for chunks an
    earlier process stored. LMCache 0.5 keeps them in private attributes under its
    ``_usage_lock``. On another release this refuses (ConfigError) rather than guess: a
    wrong usage figure would quietly switch LMCache's eviction off or on."""
    if PRIVATE_API_TESTED:
        with adapter._usage_lock:
            adapter._total_bytes_used = sum(by_salt.values())
            adapter._bytes_by_cache_salt = dict(by_salt)
        return
    raise ConfigError(
        f"seeding the usage of an L2 adapter is written for LMCache 0.5, not "
        f"{'.'.join(map(str, LMCACHE_RELEASE))}: see persisting/integrations/lmcache/compat.py"
    )


#: Formats whose payload is opaque bytes: the key's dtype says nothing about them.
_BYTE_FORMATS = frozenset({"BINARY", "binary", "BINARY_BUFFER"})


def chunk_key_of(key: CacheEngineKey) -> ChunkKey:
    """The Persisting key of an LMCache key (a ``LayerChunkKey`` for a layer key)."""
    return parse_key(key.to_string())


def cache_engine_key_of(key: ChunkKey | str) -> CacheEngineKey:
    """The LMCache key of a Persisting key or key string (layer keys stay layer keys)."""
    return parse_cache_key(key_string(key))


def format_name(fmt: MemoryFormat) -> str:
    """The Persisting format name of an LMCache ``MemoryFormat`` (they share names)."""
    return fmt.name


_MEMORY_FORMATS: dict[str, MemoryFormat] = {
    **MemoryFormat.__members__,
    "binary": MemoryFormat.BINARY,
}


def memory_format(name: str) -> MemoryFormat | None:
    """The LMCache ``MemoryFormat`` of a stored format name, or None if LMCache has none."""
    return _MEMORY_FORMATS.get(name)


def key_dtype_name(key: CacheEngineKey) -> str:
    """The dtype name LMCache writes into the key's string form (``bfloat16``, ``half``...)."""
    return TORCH_DTYPE_TO_STR_DTYPE[key.dtype]


def tensor_of(obj: MemoryObj) -> torch.Tensor:
    """A zero-copy tensor view of ``obj``'s payload with its logical shape and dtype.

    Raises InvalidValueError for objects Persisting cannot describe with one layout
    (several kv-layer groups of different shapes in one object).
    """
    meta = obj.metadata
    if meta.shapes is not None and len(meta.shapes) > 1:
        raise InvalidValueError(
            f"MemoryObj with {len(meta.shapes)} layer groups cannot be stored as one layout"
        )
    tensor = obj.tensor
    if tensor is None:
        raise InvalidValueError("MemoryObj has no tensor payload (invalidated, or a byte buffer)")
    return tensor


class LayoutGuard:
    """Decides whether a stored layout is what this engine asks for under a key."""

    def __init__(self, metadata: LMCacheMetadata | None) -> None:
        # (fmt, kv size, layers, hidden) of the engine's whole-chunk objects, when known.
        self._engine: tuple[str, int, int, int] | None = None
        if metadata is not None and metadata.get_num_groups() == 1:
            kv_size, layers, _tokens, hidden = (int(d) for d in metadata.get_shapes(1)[0])
            fmt = "KV_MLA_FMT" if metadata.use_mla else "KV_2LTD"
            self._engine = (fmt, kv_size, layers, hidden)

    def accepts(self, key: CacheEngineKey, layout: Layout) -> bool:
        """True if ``layout`` may be loaded for ``key`` by this engine."""
        if memory_format(layout.fmt) is None:
            return False
        if layout.fmt not in _BYTE_FORMATS and layout.dtype != key_dtype_name(key):
            return False
        engine = self._engine
        if engine is None or isinstance(key, LayerCacheEngineKey) or layout.fmt != engine[0]:
            return True
        shape = layout.shape
        return len(shape) == 4 and (shape[0], shape[1], shape[3]) == engine[1:] and shape[2] > 0


__all__ = [
    "LMCACHE_RELEASE",
    "PRIVATE_API_TESTED",
    "LayoutGuard",
    "cache_engine_key_of",
    "chunk_key_of",
    "format_name",
    "is_plain_tensor_object",
    "key_dtype_name",
    "memory_format",
    "seed_adapter_usage",
    "tensor_of",
]
