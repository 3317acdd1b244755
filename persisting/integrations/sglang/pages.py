"""A host pool's pages as byte views, for reads and writes straight to and from them.

SGLang's zero-copy interface names the pages to move by token indices in the host pool;
``get_page_buffer_meta(indices)`` turns them into addresses and sizes: each page is one
or more parts (K and V in a page-first layout, K and V of every layer in a layer-first
one, one part for MLA). This module finds each address inside one of the pool's own
tensors and hands out a writable view of exactly those bytes: a page is written to its
payload file from those views and read back into them, with nothing copied between. An
address outside the pool's tensors (a pool this backend does not know) is refused, never
dereferenced. Nothing here imports SGLang.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Attributes of SGLang's host pools that hold KV (the first that exist are mapped).
POOL_TENSORS = ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer")


class PageShapeError(ValueError):
    """The pool's addresses or sizes do not make whole pages this backend can map."""


@dataclass(frozen=True)
class _Region:
    start: int
    array: np.ndarray  # uint8 view sharing the tensor's memory


class HostPages:
    """Byte views of a host pool's pages, from the pool's own buffer metadata."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.page_size = int(pool.page_size)
        regions: dict[int, _Region] = {}
        for name in POOL_TENSORS:
            tensor = getattr(pool, name, None)
            if tensor is None or not hasattr(tensor, "data_ptr") or not tensor.numel():
                continue
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                continue
            array = tensor.detach().reshape(-1).view(_uint8()).numpy()
            regions.setdefault(tensor.data_ptr(), _Region(tensor.data_ptr(), array))
        if not regions:
            raise PageShapeError(f"{type(pool).__name__} has no contiguous CPU KV tensor")
        self._regions = sorted(regions.values(), key=lambda r: r.start)
        self._starts = [r.start for r in self._regions]
        first = self.page_parts(_indices(range(self.page_size)))[0]
        #: Bytes of each part of one page, in the pool's order.
        self.part_bytes: tuple[int, ...] = tuple(len(p) for p in first)

    def page_parts(self, indices: Any) -> list[list[memoryview]]:
        """One list of writable part views per page of ``indices`` (token indices, whole
        pages); PageShapeError if the pool's metadata does not make whole, mapped pages."""
        count = len(indices)
        if count % self.page_size:
            raise PageShapeError(f"{count} token indices are not whole pages of {self.page_size}")
        pages = count // self.page_size
        if not pages:
            return []
        ptrs, sizes = self.pool.get_page_buffer_meta(indices)
        if len(ptrs) != len(sizes) or len(ptrs) % pages:
            raise PageShapeError(f"{len(ptrs)} buffers for {pages} pages")
        per_page = len(ptrs) // pages
        views = [self._view(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]
        return [views[i * per_page : (i + 1) * per_page] for i in range(pages)]

    def _view(self, address: int, size: int) -> memoryview:
        at = bisect.bisect_right(self._starts, address) - 1
        if at >= 0 and size > 0:
            region = self._regions[at]
            offset = address - region.start
            if offset + size <= region.array.nbytes:
                return region.array[offset : offset + size].data
        raise PageShapeError(f"{size} bytes at {address:#x} are outside the host pool")


def _uint8() -> Any:
    import torch

    return torch.uint8


def _indices(values: Sequence[int] | range) -> Any:
    import torch

    return torch.tensor(list(values), dtype=torch.int64)


def pool_geometry(pool: Any) -> dict[str, int]:
    """The pool's dimensions that decide a page's bytes (whichever the pool has)."""
    names = (
        "layer_num",
        "head_num",
        "head_dim",
        "v_head_dim",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "kv_cache_dim",
        "start_layer",
        "end_layer",
    )
    return {n: int(v) for n in names if isinstance(v := getattr(pool, n, None), int)}


__all__ = ["POOL_TENSORS", "HostPages", "PageShapeError", "pool_geometry"]
