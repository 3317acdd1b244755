"""Page-locked host memory: the ``pinned_memory`` setting, one pinned region carved into
page-aligned arrays, and the registration of mappings that exist already.

Part of :mod:`persisting.cuda` (see its docstring).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
from typing import Any, Literal

import numpy as np

from persisting.errors import ConfigError, InvalidValueError, StorageIOError
from persisting.shm import PageAllocator, owning_array, round_to_page

log = logging.getLogger(__name__)

PinnedMode = Literal["auto", "on", "off"]
PINNED_MODES: tuple[str, ...] = ("auto", "on", "off")

#: cudaHostRegisterPortable: the range counts as pinned in every CUDA context.
_REGISTER_PORTABLE = 0x01
#: cudaHostRegisterReadOnly: the mapping is read-only (the device only reads it).
_REGISTER_READ_ONLY = 0x08
#: cudaErrorHostMemoryAlreadyRegistered: someone else pinned the range; leave it to them.
_ALREADY_REGISTERED = 712


def cuda_available() -> bool:
    """Whether torch is installed with CUDA and sees a device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_pinned(mode: str, *, cuda: bool | None = None) -> bool:
    """Whether host buffers are to be page-locked: ``auto`` when CUDA is present, ``on``
    always (an error without CUDA), ``off`` never. ``cuda`` overrides the probe."""
    if mode not in PINNED_MODES:
        raise ConfigError(f"pinned_memory must be one of {', '.join(PINNED_MODES)}, not {mode!r}")
    if mode == "off":
        return False
    have = cuda_available() if cuda is None else cuda
    if mode == "on" and not have:
        raise ConfigError("pinned_memory='on' needs CUDA, and torch sees no CUDA device here")
    return have


# -- page-locking ------------------------------------------------------------------------


def _loaded_cudart_path() -> str | None:
    """The CUDA runtime library this process has loaded (torch's), from /proc/self/maps."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rsplit("/", 1)[-1].startswith("libcudart.so"):
                return parts[5].strip()
    return None


def _clear_last_cuda_error() -> None:
    """Reset the runtime's per-thread "last error" after a failed call we handled.

    A failed ``cudaHostRegister`` leaves its error behind, and torch's next kernel-launch
    check (``cudaGetLastError``) would raise it as if that kernel had failed. Reading it
    through the same runtime library resets it.
    """
    path = _loaded_cudart_path()
    if path is None:
        log.warning("could not find libcudart to clear a handled CUDA error")
        return
    ctypes.CDLL(path).cudaGetLastError()


class HostRegistration:
    """``nbytes`` of an existing buffer (an mmap, an array) page-locked for DMA until
    :meth:`unregister`. The buffer must stay mapped until then: unregister first, then
    unmap (the registration keeps a reference, but ``mmap.close()`` would still unmap)."""

    def __init__(
        self, buffer: Any, *, offset: int = 0, nbytes: int | None = None, read_only: bool = False
    ):
        if not cuda_available():
            raise ConfigError("page-locking host memory needs CUDA, and torch sees no device")
        import torch

        array = np.frombuffer(buffer, dtype=np.uint8, offset=offset)
        if nbytes is not None:
            array = array[:nbytes]
        if array.nbytes == 0:
            raise InvalidValueError("nothing to register: the range is empty")
        self.address = int(array.ctypes.data)
        self.nbytes = int(array.nbytes)
        flags = _REGISTER_PORTABLE | (
            _REGISTER_READ_ONLY if read_only or not array.flags.writeable else 0
        )
        error = int(torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, flags))
        if error not in (0, _ALREADY_REGISTERED):
            _clear_last_cuda_error()
            raise StorageIOError(
                f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {error}"
            )
        if error == _ALREADY_REGISTERED:
            _clear_last_cuda_error()
        #: False when the range was registered by someone else (and is theirs to release).
        self.owned = error == 0
        self._buffer: Any = buffer

    @property
    def active(self) -> bool:
        return self._buffer is not None

    def unregister(self) -> None:
        """Unlock the range (idempotent). No copy from or to it may still be running."""
        if self._buffer is None:
            return
        self._buffer = None
        if not self.owned:
            return
        import torch

        error = int(torch.cuda.cudart().cudaHostUnregister(self.address))
        if error != 0:
            _clear_last_cuda_error()
            log.warning("cudaHostUnregister failed with CUDA error %d", error)


def register_host_memory(
    buffer: Any, *, offset: int = 0, nbytes: int | None = None, read_only: bool = False
) -> HostRegistration | None:
    """Page-lock an existing buffer for DMA; None on a host without CUDA, or when the
    driver refuses (the memory then stays usable, only copies from it are slower)."""
    if not cuda_available():
        return None
    try:
        return HostRegistration(buffer, offset=offset, nbytes=nbytes, read_only=read_only)
    except StorageIOError as exc:
        log.warning("host memory stays pageable: %s", exc)
        return None


class PinnedRegion:
    """One host allocation of ``capacity`` bytes, page-locked when ``pin``, carved into
    page-aligned uint8 arrays. An array's range returns to the region once the array and
    every view or tensor made from it are garbage (:func:`~persisting.shm.owning_array`).

    Pinned pages are committed up front, so size the region for what it holds.
    """

    def __init__(self, capacity: int, *, pin: bool):
        if capacity <= 0:
            raise InvalidValueError(f"a region needs a positive capacity, not {capacity}")
        self.capacity = round_to_page(capacity)
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._start = 0
        self._pages = PageAllocator(None, 0, self.capacity)
        self._parent: PinnedRegion | None = None
        self.registration = HostRegistration(self._map) if pin else None

    @property
    def pinned(self) -> bool:
        if self._parent is not None:
            return self._parent.pinned
        return self.registration is not None and self.registration.active

    def carve(self, nbytes: int) -> PinnedRegion | None:
        """A part of ``nbytes`` (page-rounded) of this region with an allocator of its own,
        or None when there is no room: the same pinned pages, under a separate budget (the
        store carves its memory tier and its staging ring out of one pinned region, so
        neither can starve the other). The part's range never returns to this region."""
        got = self._pages.allocate(nbytes)
        if got is None:
            return None
        part = PinnedRegion.__new__(PinnedRegion)
        part.capacity = got[1]
        part._map = self._map
        part._start = got[0]
        part._pages = PageAllocator(None, got[0], got[0] + got[1])
        part._parent = self
        part.registration = None
        return part

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A buffer of ``nbytes`` from the region, or None when it has no room (or closed)."""
        got = self._pages.allocate(nbytes)
        if got is None:
            return None
        return owning_array(self._map, got[0], nbytes, self._pages.free, *got)

    @property
    def free_bytes(self) -> int:
        return self._pages.free_bytes

    def owns(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies in this region."""
        start = np.frombuffer(self._map, np.uint8, count=1).ctypes.data + self._start
        return start <= array.ctypes.data < start + self.capacity

    def close(self) -> None:
        """Stop allocating and unlock the pages; buffers handed out stay valid (pageable).
        No copy from or to the region may still be running."""
        self._pages.close()
        if self.registration is not None:
            self.registration.unregister()


def open_region(capacity: int, mode: str) -> PinnedRegion | None:
    """A region for ``kv.pinned_memory = mode``: pinned where asked and possible; with
    ``auto``, plain memory when the driver refuses to pin; None for ``capacity == 0``."""
    if capacity <= 0:
        return None
    pin = resolve_pinned(mode)
    try:
        return PinnedRegion(capacity, pin=pin)
    except StorageIOError:
        if mode == "on":
            raise
        log.warning("pinned_memory=auto: %d bytes could not be pinned; using pageable", capacity)
        return PinnedRegion(capacity, pin=False)
