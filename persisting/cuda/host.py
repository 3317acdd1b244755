"""The host memory of one KV store as devices see it: pinned where CUDA is, one copier per
device.

Part of :mod:`persisting.cuda`. A store makes one :class:`StoreHostMemory`; it decides
once, from ``kv.pinned_memory``, whether host buffers are page-locked, and then:

- the memory tier's buffers (a private tier) and the staging ring are carved out of ONE
  pinned region, each part under its own budget (a full tier never starves the ring);
- a shared-pool memory tier (``service.shared_memory_tier``) is registered with CUDA as it
  is, so copies from it, by the store or by a same-host client, run at DMA speed;
- :meth:`copier` hands out the :class:`~persisting.cuda.DeviceCopier` of a device, made on
  first use, staging through the ring.

On a host without CUDA (or with ``off``) nothing is pinned and no region is made up front:
the memory tier's buffers are allocated as before, and a copier (only for ``cpu``, or a
device with pinning off) stages through plain memory, made on first use.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from persisting.cuda.copies import DeviceCopier
from persisting.cuda.pinned import (
    HostRegistration,
    PinnedRegion,
    open_region,
    register_host_memory,
    resolve_pinned,
)
from persisting.shm import SharedPool, loaded_torch, round_to_page

log = logging.getLogger(__name__)


def _cuda_may_exist(mode: str) -> bool:
    """Whether probing for CUDA is worth importing torch: with ``auto`` on a host without
    an NVIDIA driver the answer is no, and numpy-only users never load torch."""
    if mode != "auto" or loaded_torch() is not None:
        return True
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")


class StoreHostMemory:
    """Pinned memory and device copiers of one store. Thread-safe."""

    def __init__(
        self,
        *,
        mode: str,
        memory_bytes: int,
        staging_bytes: int,
        pool: SharedPool | None = None,
    ):
        #: Whether this store's host buffers are page-locked (``mode`` resolved here).
        self.pin = resolve_pinned(mode, cuda=None if _cuda_may_exist(mode) else False)
        self.mode = mode
        self.staging_bytes = staging_bytes
        self._region: PinnedRegion | None = None
        self._memory: PinnedRegion | None = None
        self._staging: PinnedRegion | None = None
        self._pool_registration: HostRegistration | None = None
        self._copiers: dict[str, DeviceCopier] = {}
        self._lock = threading.Lock()
        if not self.pin:
            return
        private_tier = round_to_page(memory_bytes) if pool is None and memory_bytes > 0 else 0
        staging = round_to_page(staging_bytes) if staging_bytes > 0 else 0
        if private_tier + staging:
            self._region = open_region(private_tier + staging, mode)
            if self._region is not None:
                self._memory = self._region.carve(private_tier) if private_tier else None
                self._staging = self._region.carve(staging) if staging else None
        if pool is not None:
            self._pool_registration = register_host_memory(
                pool.mapping, offset=pool.data_offset, nbytes=pool.size - pool.data_offset
            )

    @property
    def pinned(self) -> bool:
        """Whether the memory tier's buffers (or its shared pool) are page-locked now."""
        if self._pool_registration is not None:
            return self._pool_registration.active
        return self._region is not None and self._region.pinned

    def memory_buffer(self, nbytes: int) -> np.ndarray | None:
        """Room for a memory-tier value in the pinned region; None when there is none (no
        pinning here, or the part is full: the caller falls back to plain memory)."""
        return self._memory.allocate(nbytes) if self._memory is not None else None

    def copier(self, device: Any) -> DeviceCopier:
        """The copier of ``device`` (``cuda:i`` or ``cpu``), made on first use."""
        import torch

        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        name = str(dev)
        with self._lock:
            copier = self._copiers.get(name)
            if copier is None:
                staging = self._staging
                if staging is None and self.staging_bytes > 0:
                    # Not pinned here: plain memory staged the same way (made on first use).
                    staging = open_region(self.staging_bytes, "off")
                    self._staging = staging
                copier = DeviceCopier(dev, staging=staging)
                self._copiers[name] = copier
            return copier

    def close(self) -> None:
        """Wait for every copy in flight, then unlock the pages (before the pool is unmapped).
        Buffers handed out stay valid, as plain memory."""
        with self._lock:
            copiers = list(self._copiers.values())
            self._copiers.clear()
        for copier in copiers:
            copier.synchronize()
        if self._pool_registration is not None:
            self._pool_registration.unregister()
        for region in (self._staging, self._memory, self._region):
            if region is not None:
                region.close()


__all__ = ["StoreHostMemory"]
