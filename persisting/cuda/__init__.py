"""Pinned host memory and host<->device copies: the one package of Persisting that uses CUDA.

Everything else deals in page-aligned uint8 arrays. This module makes such memory DMA-able
and moves bytes between it and a device:

- :func:`resolve_pinned` turns the ``kv.pinned_memory`` setting (``auto``/``on``/``off``)
  into a yes or no for this host;
- :class:`PinnedRegion`: ONE anonymous mapping, page-locked once (``cudaHostRegister``),
  carved by :class:`~persisting.shm.PageAllocator` into arrays that give their range back
  when garbage. Pinning per value (``torch.empty(..., pin_memory=True)``) is slow to
  allocate and rounds every size up to a power of two;
- :class:`HostRegistration`: page-locks memory that exists already (the same-host shared
  pool, an mmap), so copies from it to a device run at DMA speed too;
- :class:`StoreHostMemory`: what one KV store uses of all this (its memory tier and staging
  ring carved from one pinned region, its shared pool registered, a copier per device);
- :class:`DeviceCopier`: device-to-host copies into pinned buffers and host-to-device copies
  out of them, on a side stream ordered against the caller's stream by events, and a
  staging ring (:meth:`DeviceCopier.upload`) in which chunk i+1 is read from disk while
  chunk i is on its way up.

On a host without CUDA, :func:`resolve_pinned` says no, a region is plain memory, and a
copier exists only for ``device="cpu"`` (same pipeline, copies done when issued), so callers
keep today's behaviour. torch is imported lazily: numpy-only users never load it.

Lifetimes, the subtle part: an asynchronous copy reads or writes its host buffer after the
call returns. The copier keeps every host buffer (and device temporary) of a copy alive
until the copy's event has completed, so a buffer's range cannot go back to its allocator,
and be handed out again, while the DMA still runs; device tensors used on the side stream
are marked with ``record_stream`` for torch's caching allocator.
"""

from persisting.cuda.copies import DEFAULT_STAGING_BYTES, DeviceCopier, shared_copier
from persisting.cuda.host import StoreHostMemory
from persisting.cuda.pinned import (
    PINNED_MODES,
    HostRegistration,
    PinnedMode,
    PinnedRegion,
    cuda_available,
    open_region,
    register_host_memory,
    resolve_pinned,
)

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "PINNED_MODES",
    "DeviceCopier",
    "HostRegistration",
    "PinnedMode",
    "PinnedRegion",
    "StoreHostMemory",
    "cuda_available",
    "open_region",
    "register_host_memory",
    "resolve_pinned",
    "shared_copier",
]
