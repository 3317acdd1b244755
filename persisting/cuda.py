"""Pinned host memory and host<->device copies: the one module of Persisting that uses CUDA.

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

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import mmap
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import numpy as np

from persisting.errors import ConfigError, InvalidValueError, StorageIOError
from persisting.shm import PageAllocator, aligned_buffer, owning_array, round_to_page

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
        self._pages = PageAllocator(None, 0, self.capacity)
        self.registration = HostRegistration(self._map) if pin else None

    @property
    def pinned(self) -> bool:
        return self.registration is not None and self.registration.active

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
        start = np.frombuffer(self._map, np.uint8, count=1).ctypes.data
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


# -- copies --------------------------------------------------------------------------------


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _host_tensor(source: Any) -> Any:
    """A flat uint8 CPU tensor over ``source`` (an array or a CPU tensor), no copy."""
    import torch

    if isinstance(source, torch.Tensor):
        if source.device.type != "cpu" or not source.is_contiguous():
            raise InvalidValueError("host sources must be contiguous CPU tensors or arrays")
        return source.reshape(-1).view(torch.uint8)
    array = np.asarray(source).reshape(-1).view(np.uint8)
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():  # read-only (a read-only pool mapping): we only read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class _Done:
    """The event of a copy that completed when it was issued (host lane)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostLane:
    """Copies into and out of CPU tensors: each one is done when issued."""

    def begin(self) -> None:
        pass

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def keep(self, tensor: Any) -> None:
        pass

    def mark(self) -> Any:
        return _Done()

    def publish(self, event: Any) -> None:
        pass


class _CudaLane:
    """A side stream of one device, ordered against the caller's current stream."""

    def __init__(self, device: Any):
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        """Copies issued after this see everything the caller queued before (the tensors
        it produced, and its last uses of the memory we are about to overwrite)."""
        self.stream.wait_stream(self._torch.cuda.current_stream(self.device))

    def context(self) -> contextlib.AbstractContextManager[Any]:
        return self._torch.cuda.stream(self.stream)

    def keep(self, tensor: Any) -> None:
        """A caller's device tensor is used on the side stream: its memory must not be
        reused (by torch's caching allocator) before the side stream is done with it."""
        tensor.record_stream(self.stream)

    def mark(self) -> Any:
        event = self._torch.cuda.Event()
        event.record(self.stream)
        return event

    def publish(self, event: Any) -> None:
        """Work the caller queues from now on runs after the copies (no host wait)."""
        self._torch.cuda.current_stream(self.device).wait_event(event)


class DeviceCopier:
    """Host<->device copies for one device (``cuda[:i]``, or ``cpu``), through ``staging``.

    Thread-safe. Host buffers come from ``staging`` (pinned where CUDA is) while it has
    room, else from pageable memory (counted in :attr:`counters`; slower, still correct).
    """

    def __init__(self, device: Any = "cuda", *, staging: PinnedRegion | None = None):
        import torch

        self.device = torch.device(device)
        self._lane: _HostLane | _CudaLane
        if self.device.type == "cuda":
            if not cuda_available():
                raise InvalidValueError(f"device {self.device} needs CUDA, which is absent here")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._lane = _CudaLane(self.device)
        elif self.device.type == "cpu":
            self._lane = _HostLane()
        else:
            raise InvalidValueError(f"unsupported device {self.device} (cuda or cpu)")
        self.staging = staging
        #: Copies not known to be complete: (event, what must outlive the copy).
        self._inflight: collections.deque[tuple[Any, tuple[Any, ...]]] = collections.deque()
        self._lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()

    # -- bookkeeping ----------------------------------------------------------------------

    def _count(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.counters[name] += nbytes

    def _track(self, event: Any, *keep: Any) -> None:
        with self._lock:
            self._inflight.append((event, keep))

    def _reap(self) -> None:
        """Drop what completed copies held (their staging ranges go back)."""
        with self._lock:
            while self._inflight and self._inflight[0][0].query():
                self._inflight.popleft()

    def _wait_oldest(self) -> bool:
        """Wait for the oldest copy in flight and drop what it held; False if none."""
        with self._lock:
            if not self._inflight:
                return False
            event, _keep = self._inflight.popleft()
        event.synchronize()
        return True

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        """Staging room for ``nbytes``, waiting for copies in flight to give some back;
        pageable memory when the value is larger than the staging region, or it is held."""
        if self.staging is not None and nbytes <= self.staging.capacity:
            while True:
                buffer = self.staging.allocate(nbytes)
                if buffer is not None:
                    self._count("staged_bytes", nbytes)
                    return buffer
                if not self._wait_oldest():
                    break
        self._count("pageable_bytes", nbytes)
        return aligned_buffer(nbytes)

    def _check_device(self, tensor: Any) -> None:
        if tensor.device != self.device:
            raise InvalidValueError(f"tensor on {tensor.device}, copier for {self.device}")

    # -- host to device -----------------------------------------------------------------

    def _copy_up(self, source: Any, out: Any) -> Any:
        """Issue the copy of the host bytes ``source`` into ``out``; returns its event."""
        import torch

        host = _host_tensor(source)
        if host.numel() != _nbytes(out):
            raise InvalidValueError(f"{host.numel()} bytes cannot fill a {_nbytes(out)}-byte out")
        self._lane.keep(out)
        with self._lane.context():
            if out.is_contiguous():
                out.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
                temp = None
            else:  # land contiguous on the device, then scatter there
                temp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
                temp.view(-1).view(torch.uint8).copy_(host, non_blocking=True)
                out.copy_(temp)
        event = self._lane.mark()
        self._track(event, source, host, temp)
        return event

    def to_device(self, sources: Sequence[Any], outs: Sequence[Any]) -> None:
        """Copy each host buffer (array or CPU tensor: its bytes) into the device tensor of
        the same byte size. Returns once issued: work the caller queues on its current
        stream afterwards sees the data; the sources are kept alive until copied."""
        if len(sources) != len(outs):
            raise InvalidValueError(f"{len(sources)} sources but {len(outs)} outs")
        for out in outs:
            self._check_device(out)
        self._reap()
        self._lane.begin()
        last = None
        for source, out in zip(sources, outs, strict=True):
            last = self._copy_up(source, out)
            self._count("h2d_bytes", _nbytes(out))
        if last is not None:
            self._lane.publish(last)

    def upload(
        self, reads: Sequence[Callable[[np.ndarray], bool]], outs: Sequence[Any]
    ) -> list[bool]:
        """For each i, ``reads[i](buffer)`` fills a staging buffer of ``outs[i]``'s byte size
        and returns whether it could (False: a miss or damage); the buffer then goes up to
        ``outs[i]`` while ``reads[i+1]`` runs. ``outs[i]`` is written only when its read
        succeeded. Returns once the copies are issued, ordered before the caller's later
        work as in :meth:`to_device`."""
        if len(reads) != len(outs):
            raise InvalidValueError(f"{len(reads)} reads but {len(outs)} outs")
        for out in outs:
            self._check_device(out)
        self._reap()
        self._lane.begin()
        done: list[bool] = []
        last = None
        for read, out in zip(reads, outs, strict=True):
            nbytes = _nbytes(out)
            buffer = self._host_buffer(nbytes)
            if not read(buffer):
                done.append(False)
                continue
            last = self._copy_up(buffer, out)
            self._count("h2d_bytes", nbytes)
            done.append(True)
        if last is not None:
            self._lane.publish(last)
        return done

    # -- device to host -----------------------------------------------------------------

    def _copy_down(self, tensor: Any, buffer: np.ndarray) -> Any:
        import torch

        self._lane.keep(tensor)
        with self._lane.context():
            source = tensor.detach()
            if not source.is_contiguous():
                source = source.contiguous()  # on the device, in the side stream
            host = torch.from_numpy(buffer)
            host.copy_(source.reshape(-1).view(torch.uint8), non_blocking=True)
        return self._lane.mark(), source

    def to_host(
        self,
        tensors: Iterable[Any],
        allocate: Callable[[int], np.ndarray | None] | None = None,
    ) -> Iterator[np.ndarray]:
        """Each tensor's bytes in a host uint8 array, yielded in order as each lands; the
        copies of later tensors run while the caller works on earlier ones.

        Buffers come from ``allocate(nbytes)`` (default: the staging region); when it has
        no room, the earliest copies are handed over first so the caller can free them,
        and only when none is left in flight does a copy land in pageable memory.
        Non-contiguous tensors are made contiguous on the device.
        """
        allocate = allocate or (self.staging.allocate if self.staging is not None else None)
        pending: collections.deque[tuple[Any, np.ndarray, Any]] = collections.deque()
        try:
            for tensor in tensors:
                self._check_device(tensor)
                # Per tensor: a lazy iterable may have just queued the work producing it.
                self._lane.begin()
                nbytes = _nbytes(tensor)
                buffer = allocate(nbytes) if allocate is not None else None
                while buffer is None and pending:
                    yield self._landed(pending.popleft())
                    buffer = allocate(nbytes) if allocate is not None else None
                if buffer is None:
                    self._count("pageable_bytes", nbytes)
                    buffer = aligned_buffer(nbytes)
                event, source = self._copy_down(tensor, buffer)
                pending.append((event, buffer, source))
            while pending:
                yield self._landed(pending.popleft())
        finally:
            # Abandoned midway: never let a buffer go back while a copy still writes it.
            for event, _buffer, _source in pending:
                event.synchronize()

    def _landed(self, entry: tuple[Any, np.ndarray, Any]) -> np.ndarray:
        event, buffer, _source = entry
        event.synchronize()
        self._count("d2h_bytes", buffer.nbytes)
        return buffer

    # -- lifecycle ------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every copy this copier issued."""
        while self._wait_oldest():
            pass

    def close(self) -> None:
        """Wait for the copies in flight, then release the staging region."""
        self.synchronize()
        if self.staging is not None:
            self.staging.close()


#: A staging region of this size serves one chunk of a 32B-class model (64 MiB) four deep.
DEFAULT_STAGING_BYTES = 256 << 20

_shared: dict[tuple[str, str, int], DeviceCopier] = {}
_shared_lock = threading.Lock()


def shared_copier(
    device: Any = "cuda", *, pinned_memory: str = "auto", staging_bytes: int = DEFAULT_STAGING_BYTES
) -> DeviceCopier:
    """One copier per device and setting for the whole process (pinning is costly to set
    up, so it is done once), made on first use."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and cuda_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), pinned_memory, staging_bytes)
    with _shared_lock:
        copier = _shared.get(key)
        if copier is None:
            mode = pinned_memory if dev.type == "cuda" else "off"
            copier = DeviceCopier(dev, staging=open_region(staging_bytes, mode))
            _shared[key] = copier
        return copier


__all__ = [
    "DEFAULT_STAGING_BYTES",
    "PINNED_MODES",
    "DeviceCopier",
    "HostRegistration",
    "PinnedMode",
    "PinnedRegion",
    "cuda_available",
    "open_region",
    "register_host_memory",
    "resolve_pinned",
    "shared_copier",
]
